"""The on-disk format shared by both store backends: ids, sealed JSON, checksums, the tokenizer record,
the header checks, :class:`StoreEntry`. No I/O beyond reading one sealed file (:func:`unseal`).

Importing it does not import torch (``hf-statecompose stats`` reads a store's files without it): torch is imported by
the functions that need it, and :data:`STORAGE_DTYPES` (names -> torch dtypes) on first access (PEP 562)."""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:
    import torch

    from ..state.cache import ComposableMambaCache

    STORAGE_DTYPES: dict[str, torch.dtype]

FORMAT_VERSION = 2
# the names of STORAGE_DTYPES, without torch
STORAGE_DTYPE_NAMES = ("fp32", "bf16")


def __getattr__(name: str):
    if name == "STORAGE_DTYPES":  # name -> torch dtype, made (and torch imported) on first use
        import torch

        value = {"fp32": torch.float32, "bf16": torch.bfloat16}
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# one pattern for every id the store makes (uuid4 hex: 16 digits for entries, 32 for shards)
_ID_PATTERN = re.compile(r"[0-9a-f]{16}(?:[0-9a-f]{16})?")
_ID_LENGTH = {"entry": 16, "shard": 32}
CHECKSUM_PATTERN = re.compile(r"[0-9a-f]{32}")
# a fixed text that exercises a tokenizer's normalisation, byte fallback and merges: two tokenizers that
# split it differently are not interchangeable for a store
_TOKENIZER_PROBE = "The quick brown fox, 1234567890! ¿Qué? naïve café — 東京 😀\n\ttabs  and  spaces {x: [1, 2]}"


@dataclass
class StoreEntry:
    """One stored context. ``state`` is filled by :meth:`StateStore.retrieve` (and ``score``)."""

    id: str
    text: str
    metadata: dict = field(default_factory=dict)
    num_tokens: int = 0
    score: float | None = None
    state: ComposableMambaCache | None = None


def check_id(value, kind: str = "entry") -> str:
    """``value`` if it is a well-formed ``kind`` id (``"entry"`` or ``"shard"``), else a clear error."""
    if not isinstance(value, str):
        raise TypeError(
            f"{kind} ids are str (as StateStore.add returns them), got {type(value).__name__}: {value!r:.60}"
        )
    if len(value) != _ID_LENGTH[kind] or not _ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{value!r:.60} is not a store {kind} id: those are {_ID_LENGTH[kind]} lowercase hex digits, as StateStore.add returns them"
        )
    return value


def is_id(value, kind: str) -> bool:
    return isinstance(value, str) and len(value) == _ID_LENGTH[kind] and bool(_ID_PATTERN.fullmatch(value))


def check_count(value, name: str, minimum: int) -> int:
    # bool is an int to Python but never a count the caller meant
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def checked_json(value, what: str):
    """``value`` if it survives JSON unchanged (else a TypeError naming ``what``)."""
    try:
        same = json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{what} cannot be stored as JSON ({error}); use str/int/float/bool/None, lists and str-keyed dicts"
        ) from None
    if not same:
        raise TypeError(f"{what} would change when stored as JSON (non-str keys or tuples?); use str keys and lists")
    check_utf8(value, what)
    return value


def _unencodable(value, path: tuple = ()):
    """``(key path, string)`` of the first string (a dict key or a value, nested) that UTF-8 cannot encode (a lone
    surrogate such as ``"\\ud800"``), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, value
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        if isinstance(key, str) and _unencodable(key) is not None:
            return (*path, key), key
        found = _unencodable(item, (*path, key))
        if found is not None:
            return found
    return None


def check_utf8(value, what: str) -> None:
    """Every string in ``value`` (nested dict keys and values, list items) encodes as UTF-8, as the store writes its
    JSON; else a ValueError naming ``what`` and the key that holds the string (a lone surrogate)."""
    try:  # one encode in the common case; the walk only names the culprit
        (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    found = _unencodable(value)
    if found is None:
        return
    path, text = found
    if len(path) == 1 and isinstance(path[0], str):
        where = f" key {path[0]!r}"
    else:
        where = f" at {''.join(f'[{key!r}]' for key in path)}" if path else ""
    bad = next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    raise ValueError(
        f"{what}{where} holds a lone surrogate ({bad!a} in {text!a:.60}), which UTF-8 cannot encode: the store writes "
        "UTF-8 JSON; decode the text properly (e.g. bytes.decode('utf-8', errors='replace')) or drop the character"
    )


# ------------------------------------------------------------------------------------ sealed JSON
def content_id(text: str, metadata: dict) -> str:
    """The entry id ``add`` gives a text and its metadata: 16 hex digits of the blake2b of their
    canonical JSON, so adding the same text and metadata again finds the entry already stored."""
    return hashlib.blake2b(canonical([text, metadata]), digest_size=8).hexdigest()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def seal(obj: dict) -> bytes:
    """Canonical JSON of ``obj`` plus ``digest``: the blake2b of the rest, so any changed byte shows."""
    body = {k: v for k, v in obj.items() if k != "digest"}
    return canonical({**body, "digest": hashlib.blake2b(canonical(body), digest_size=16).hexdigest()})


@overload
def unseal(path: Path, what: str, missing_ok: Literal[False] = False) -> dict: ...
@overload
def unseal(path: Path, what: str, missing_ok: bool) -> dict | None: ...
def unseal(path: Path, what: str, missing_ok: bool = False) -> dict | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ValueError(f"{path}: the store's {what} is missing (files removed by hand?)") from None
    except OSError as error:
        raise ValueError(f"{path}: the store's {what} is unreadable ({error})") from None
    return unseal_bytes(data, path, what)


def unseal_bytes(data: bytes, path, what: str) -> dict:
    """The body of sealed JSON ``data`` (see :func:`seal`); a clear error naming ``path`` if it is damaged."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path}: the store's {what} is corrupted (not JSON: {error}); restore it from a backup"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("digest"), str):
        raise ValueError(
            f"{path}: the store's {what} is corrupted or from an older hf_statecompose (no digest); rebuild the store"
        )
    body = {k: v for k, v in obj.items() if k != "digest"}
    try:
        expected = hashlib.blake2b(canonical(body), digest_size=16).hexdigest()
    except ValueError:  # NaN / inf smuggled into the JSON
        expected = None
    if obj["digest"] != expected:
        raise ValueError(
            f"{path}: the store's {what} does not match its digest (corrupted or edited by hand); restore it from a backup"
        )
    return body


def tokenizer_record(tokenizer) -> dict:
    """What identifies a tokenizer for a store: its name, vocabulary size, a hash of its vocabulary
    (where it has ``get_vocab``) and a hash of how it splits a fixed probe text."""
    if not callable(tokenizer):
        raise TypeError(
            f"tokenizer must be callable (text -> {{'input_ids': [...]}}, as transformers' are), got {type(tokenizer).__name__}"
        )
    probe = [int(i) for i in tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]]
    vocab = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else None
    size: int | None
    if hasattr(type(tokenizer), "__len__"):
        size = len(tokenizer)
    else:
        size = getattr(tokenizer, "vocab_size", None)
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "vocab_size": int(size) if size is not None else None,
        "vocab_sha256": hashlib.sha256(canonical(sorted((str(k), int(v)) for k, v in vocab.items()))).hexdigest()
        if vocab
        else None,
        "probe_sha256": hashlib.sha256(canonical(probe)).hexdigest(),
    }


def check_opened_header(
    header: dict, where, fingerprint: str, retriever_name: str, tokenizer_info: dict, storage_dtype: str | None
) -> None:
    """Refuse to open a store (its ``header``) with another model, storage dtype, retriever or tokenizer."""
    if header["fingerprint"] != fingerprint:
        raise ValueError(
            f"the store at {where} was built with another model ({header['model_type']}, "
            f"{header['num_hidden_layers']} layers, hidden {header['hidden_size']}, fingerprint "
            f"{header['fingerprint'][:12]}…) than the one given (fingerprint {fingerprint[:12]}…): its states "
            "would be silently wrong for this model. Open it with the model that built it, or build a new store."
        )
    if storage_dtype is not None and storage_dtype != header["storage_dtype"]:
        raise ValueError(
            f"the store at {where} stores {header['storage_dtype']} states; got storage_dtype={storage_dtype!r}"
        )
    if header["retriever"] != retriever_name:
        raise ValueError(
            f"the store at {where} was indexed with the retriever {header['retriever']!r}, not "
            f"{retriever_name!r}: their embeddings are not comparable. Pass the same retriever."
        )
    recorded = header["tokenizer"]
    differs = [
        key for key in ("vocab_size", "vocab_sha256", "probe_sha256") if recorded.get(key) != tokenizer_info[key]
    ]
    if differs:
        raise ValueError(
            f"the store at {where} was built with the tokenizer {recorded.get('name_or_path')!r} (vocabulary "
            f"{recorded.get('vocab_size')}), not {tokenizer_info['name_or_path']!r} (vocabulary {tokenizer_info['vocab_size']}; "
            f"differs in {', '.join(differs)}): its token ids would be read wrongly. Pass the tokenizer that built it."
        )


# ------------------------------------------------------------------------------------ checksums
def checksum(tensors: dict) -> str:
    """SHA-256 (first 128 bits) over names, dtypes, shapes and raw bytes, hashed in place (no copy).
    SHA-256 rather than blake2b: CPUs with SHA extensions (x86 since about 2017-2019, ARMv8) hash it
    about twice as fast (1.2 vs 0.5 GB/s on the machine of benchmarks/store_read.py)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:32]


def all_finite(tensor: torch.Tensor) -> bool:
    # a NaN or inf anywhere makes the sum non-finite; a finite sum clears the tensor at a fraction of
    # isfinite(tensor).all()'s cost, which then only decides the rare overflowing sum
    import torch

    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
