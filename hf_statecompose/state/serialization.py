"""States on disk: safetensors tensors + JSON metadata. No pickle, atomic writes, checked reads.

A state file holds, per state layer ``l``: ``ssm.l``, ``conv.l``, ``delta_sum.l``, ``A.l``, and the extra
tensors of the architecture (SeRpEnt-Mamba: ``resample.clock.l``, ``resample.inputs.l``,
``resample.times.l``, ``resample.valid.l``, ``resample.last_output.l``; see :mod:`.architectures`); plus
``num_tokens`` and optionally ``token_ids``. A hybrid's state (:mod:`.hybrid_cache`) also holds, per attention
layer (model layer ``i``, attention or both): ``attn.keys.i``, ``attn.values.i`` (``[B, kv heads, L, head dim]``) and
``attn.positions.i`` (``[B, L]`` int64, -1 for left padding); which model layers these are follows from the
recorded config (its layer kinds), and the keys' and values' dtype is recorded as ``keys_dtype`` (the model
dtype, or bfloat16 / float16 when saved with ``keys_dtype=``; loading converts them back to the model dtype).
The safetensors header's ``__metadata__`` holds one JSON document under
``hf_statecompose`` (format version, architecture, fingerprint, model dtype, model info) and a
blake2b digest of all tensor bytes, so a file whose data was damaged after writing is refused.
Writes go to a temporary file in the same folder, are fsynced, then renamed over the target: a crash
mid-write leaves the old file (or none), never half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import types

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .architectures import ARCHITECTURES, architecture
from .files import atomic_write

FORMAT_VERSION = 1
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """On the CPU with standard strides. ``contiguous()`` is not enough: a size-1 dimension may keep any
    stride (SeRpEnt's clock ``[1]`` is a column of a ``[1, T]`` tensor), which a byte view refuses."""
    tensor = tensor.detach().cpu()
    return (
        tensor
        if tensor.stride() == torch.empty(tensor.shape, device="meta").stride()
        else tensor.new_empty(tensor.shape).copy_(tensor)
    )


def _digest(tensors: dict) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = _dense(tensors[name])
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_KEYS_DTYPES = (torch.bfloat16, torch.float16)


def _keys_dtype(state, keys_dtype) -> torch.dtype:
    """The dtype a hybrid state's keys and values are written in: the model dtype (``keys_dtype=None``), or
    ``keys_dtype`` (bfloat16 / float16, or the model dtype itself)."""
    if keys_dtype is None:
        return state.model_dtype
    if not isinstance(keys_dtype, torch.dtype):
        raise TypeError(
            f"keys_dtype must be a torch dtype (torch.bfloat16 or torch.float16) or None, got {type(keys_dtype).__name__} {keys_dtype!r:.40}"
        )
    if not architecture(state.architecture).is_hybrid:
        raise ValueError(
            f"keys_dtype applies to the attention keys of a hybrid model's state; this {state.architecture!r} state has none (leave keys_dtype=None)"
        )
    if keys_dtype not in _KEYS_DTYPES + (state.model_dtype,):
        raise ValueError(
            f"keys_dtype must be torch.bfloat16, torch.float16 or the model dtype {state.model_dtype}, got {keys_dtype}"
        )
    return keys_dtype


def attention_tensor_names(index: int) -> tuple[str, str, str]:
    """The file names of model layer ``index``'s keys, values and positions (a hybrid's attention layer)."""
    return f"attn.keys.{index}", f"attn.values.{index}", f"attn.positions.{index}"


def state_to_tensors(state, keys_dtype=None) -> dict:
    """The tensors of ``state``'s file; a hybrid's keys and values in ``keys_dtype`` (default: as held, the model dtype)."""
    tensors = {}
    for i in range(state.num_layers):
        tensors[f"ssm.{i}"] = state.ssm_states[i]
        tensors[f"conv.{i}"] = state.conv_states[i]
        tensors[f"delta_sum.{i}"] = state.delta_sums[i]
        tensors[f"A.{i}"] = state.A[i]
        for extra in architecture(state.architecture).extras:
            tensors[f"{extra.file_key}.{i}"] = getattr(state, extra.attribute)[i]
    for i, layer in zip(getattr(state, "attention_layer_indices", ()), getattr(state, "attention_layers", ())):
        keys, values, positions = attention_tensor_names(i)
        tensors[keys] = layer.keys.to(keys_dtype) if keys_dtype is not None else layer.keys
        tensors[values] = layer.values.to(keys_dtype) if keys_dtype is not None else layer.values
        tensors[positions] = layer.positions
    if state.num_tokens is not None:
        tensors["num_tokens"] = state.num_tokens
    if state.token_ids is not None:
        tensors["token_ids"] = state.token_ids
    out, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = _dense(tensor)
        if (
            tensor.numel()
        ):  # safetensors refuses tensors that share memory (a hybrid's layers share one positions tensor)
            storage = tensor.untyped_storage().data_ptr()
            tensor = tensor.clone() if storage in storages else tensor
            storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def serialize_state(state, keys_dtype=None) -> bytes:
    """The bytes of a state file for ``state`` (what :func:`save_state` writes)."""
    from .validation import all_finite, check_is_state, check_state_once

    check_is_state(state, "state")
    check_state_once(state, where="state to save")
    hybrid = architecture(state.architecture).is_hybrid
    keys_dtype = _keys_dtype(state, keys_dtype) if hybrid or keys_dtype is not None else None
    tensors = state_to_tensors(state, keys_dtype)
    for name, tensor in tensors.items():  # float16's range is 65504: a key beyond it would load as inf
        if name.startswith("attn.") and not all_finite(tensor):
            raise ValueError(
                f"the state's {name} overflow {keys_dtype} (values beyond its range); save with keys_dtype=torch.bfloat16 or None"
            )
    meta = {
        "format_version": FORMAT_VERSION,
        "architecture": state.architecture,
        "fingerprint": state.fingerprint,
        "model_dtype": str(state.model_dtype),
        "model_info": state.model_info,
        "num_layers": state.num_layers,
        "config": state.config.to_dict(),
        "tensor_digest": _digest(tensors),
    }
    if hybrid:
        meta["keys_dtype"] = str(keys_dtype)
    return save(tensors, metadata={"hf_statecompose": json.dumps(meta, default=repr)})


def save_state(state, path, keys_dtype=None) -> None:
    """Write ``state`` to ``path`` atomically. A state that would not load back (wrong dtypes, shapes,
    NaN, negative ΣΔ, ...) is refused here already. ``keys_dtype`` (hybrid states only: ``torch.bfloat16`` or
    ``torch.float16``) stores the attention layers' keys and values in that dtype (half the bytes of float32
    keys, rounded: docs/guides/hybrids.md says what it costs); ``None`` stores them in the model dtype."""
    path = _check_path(path, "path")
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path} is a folder: give a file name for the state (e.g. {os.path.join(path, 'context.safetensors')})"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"cannot save the state to {path}: the folder {folder} does not exist (create it first)"
        )
    atomic_write(path, serialize_state(state, keys_dtype))


def _check_path(path, name: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a file path (str or os.PathLike), got {type(path).__name__}")
    return os.fspath(path)


# pickle protocols 2-5 start with PROTO (0x80) then the protocol number; torch.save's default format
# is a zip archive (local file header "PK\x03\x04")
_PICKLE_PROTOCOLS = {bytes([0x80, n]) for n in range(2, 6)}
_ZIP_MAGIC = b"PK\x03\x04"
_NOT_A_PICKLE_HINT = (
    "hf_statecompose never unpickles (it can run code): only state files written by ComposableMambaCache.save "
    "(safetensors) are accepted"
)


def _check_layout(path) -> None:
    """Tell a safetensors file from a pickle / torch.save file by its layout, not by one byte.

    A safetensors file starts with its header's length (8 bytes, little endian) followed by the
    header's ``{``. Any first byte is possible there (a header of 0x80 + 256·k bytes starts with 0x80,
    as a pickle does), so the layout is checked first and pickle / zip signatures only name what a
    non-safetensors file is.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        header_length = int.from_bytes(head[:8], "little")
        if 8 + header_length > size:
            raise ValueError(
                f"{path} is truncated or corrupted: its safetensors header claims {header_length} bytes, "
                f"the file has {size}; re-encode the context or restore the file"
            )
        return
    if head[:2] in _PICKLE_PROTOCOLS or head[:4] == _ZIP_MAGIC:
        raise ValueError(f"{path} looks like a pickle / torch.save file; {_NOT_A_PICKLE_HINT}")
    raise ValueError(
        f"{path} is not a safetensors state file (truncated or corrupted?: no safetensors header); "
        f"re-encode the context or restore the file. {_NOT_A_PICKLE_HINT}"
    )


def _read_metadata(path) -> dict:
    _check_layout(path)
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError, Exception) as error:
        raise ValueError(
            f"{path} is not a readable safetensors state file (truncated or corrupted?): {error}; "
            "re-encode the context or restore the file"
        ) from None
    if "hf_statecompose" not in metadata:
        raise ValueError(f"{path} is a safetensors file but not an hf_statecompose state (no metadata)")
    try:
        meta = json.loads(metadata["hf_statecompose"])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: state metadata is corrupted ({error})") from None
    _check_metadata(meta, path)
    return meta


_METADATA_TYPES = {
    "format_version": int,
    "architecture": str,
    "fingerprint": str,
    "model_dtype": str,
    "model_info": dict,
    "num_layers": int,
    "config": dict,
    "tensor_digest": str,
}


def _check_metadata(meta, path) -> None:
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: state metadata is a JSON {type(meta).__name__}, not an object (corrupted file)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: unsupported state format version {meta.get('format_version')!r} "
            f"(this hf_statecompose reads version {FORMAT_VERSION}); re-encode the context"
        )
    for key, kind in _METADATA_TYPES.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"{path}: state metadata {key!r} must be a {kind.__name__}, got {type(value).__name__} "
                "(corrupted or hand-made file); re-encode the context"
            )
    if meta["architecture"] not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unknown architecture {meta['architecture']!r} (expected one of {', '.join(map(repr, ARCHITECTURES))})"
        )
    if meta["model_dtype"] not in _DTYPES:
        raise ValueError(f"{path}: unknown model dtype {meta['model_dtype']!r} (expected one of {sorted(_DTYPES)})")
    hybrid = ARCHITECTURES[meta["architecture"]].is_hybrid
    keys_dtype = meta.get("keys_dtype")
    if hybrid and keys_dtype is None:
        raise ValueError(
            f"{path}: a {meta['architecture']!r} state file records no keys_dtype (written before hybrid state files held "
            "their attention keys, or by hand); re-encode the context"
        )
    if hybrid and keys_dtype not in {meta["model_dtype"], *map(str, _KEYS_DTYPES)}:
        raise ValueError(
            f"{path}: keys_dtype {keys_dtype!r} is not the model dtype {meta['model_dtype']} nor one of "
            f"{[str(d) for d in _KEYS_DTYPES]} (corrupted or hand-made file); re-encode the context"
        )
    if not hybrid and "keys_dtype" in meta:
        raise ValueError(
            f"{path}: a {meta['architecture']!r} state has no keys, but its metadata records keys_dtype (hand-made file); re-encode the context"
        )
    if meta["num_layers"] < 1:
        raise ValueError(f"{path}: num_layers is {meta['num_layers']}, a state has at least one layer")
    model_type = meta["config"].get("model_type")
    if model_type != meta["architecture"]:
        raise ValueError(
            f"{path}: the recorded config is for model_type {model_type!r}, the metadata says {meta['architecture']!r}"
        )
    try:  # the config's number of state layers (SeRpEnt: layers x branches), read from the JSON itself
        expected = ARCHITECTURES[meta["architecture"]].num_state_layers(types.SimpleNamespace(**meta["config"]))
    except (AttributeError, TypeError, ValueError):
        expected = meta["config"].get("num_hidden_layers")
    if expected != meta["num_layers"]:
        raise ValueError(f"{path}: the recorded config has {expected!r} layers, the metadata says {meta['num_layers']}")


def _check_tensor_names(
    tensors: dict, num_layers: int, path, architecture_name: str = "mamba", attention_layers=()
) -> None:
    kinds = ("ssm", "conv", "delta_sum", "A") + tuple(e.file_key for e in architecture(architecture_name).extras)
    expected = {f"{kind}.{i}" for kind in kinds for i in range(num_layers)}
    expected |= {name for i in attention_layers for name in attention_tensor_names(i)}
    missing = sorted(expected - set(tensors))
    unknown = sorted(set(tensors) - expected - {"num_tokens", "token_ids"})
    if missing:
        raise ValueError(
            f"{path}: missing tensors {missing[:4]}{'…' if len(missing) > 4 else ''}; re-encode the context"
        )
    if unknown:
        raise ValueError(
            f"{path}: unexpected tensors {unknown[:4]}{'…' if len(unknown) > 4 else ''} for a {num_layers}-layer state "
            "(another format or a hand-made file); re-encode the context"
        )


def load_state(path, model=None, device=None):
    """Read a state file written by :func:`save_state`; nothing in the file is trusted.

    The layout must be safetensors (pickles and torch.save files are refused, never opened), the
    metadata well formed, the tensor bytes must match the recorded digest, and every tensor must fit the
    schema (:func:`~.validation.check_state`: names, dtypes, shapes consistent with the recorded config,
    the metadata and each other, finite values, ``ΣΔ >= 0``, ``A <= 0``). With ``model``, the shapes come
    from the model's config, each layer's ``A`` must be the model's ``-exp(A_log)``, and fingerprint,
    dtype and device must match (:func:`~.validation.check_against_model`).

    Dtypes are never converted: a file whose conv windows are not in its recorded ``model_dtype`` is
    refused, and so is loading a state into the model in another dtype than the one that encoded it
    (its fingerprint differs); re-encode the contexts with the model in the dtype it runs in.
    ``device`` (default: the model's device, else where the tensors are read, the CPU) places the state.
    """
    from transformers import AutoConfig

    from .fingerprint import architecture_of
    from .validation import check_against_model, check_state_once

    path = _check_path(path, "path")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no state file at {path}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"device={device!r} is not a torch device ({str(error).splitlines()[0][:120]}); use e.g. 'cpu' or 'cuda:0'"
            ) from None
    meta = _read_metadata(path)
    if model is not None and architecture_of(model) != meta["architecture"]:
        raise ValueError(
            f"{path} holds a state of a {meta['architecture']!r} model, this model is {architecture_of(model)!r}: "
            "the state belongs to another model; re-encode the context with this model"
        )
    layout = ARCHITECTURES[meta["architecture"]]
    try:
        tensors = load_file(path)
    except Exception as error:
        raise ValueError(f"{path} is truncated or corrupted ({error}); re-encode the context") from None
    if _digest(tensors) != meta["tensor_digest"]:
        raise ValueError(
            f"{path}: tensor data does not match its recorded digest (corrupted file); re-encode the context"
        )
    num_layers = meta["num_layers"]
    if model is not None:
        config = model.config
    else:
        config_dict = dict(meta["config"])
        model_type = config_dict.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **config_dict)
        except Exception as error:
            raise ValueError(
                f"{path}: the recorded model config cannot be rebuilt ({error}); re-encode the context"
            ) from None
    state = layout.cache_class()(
        config,
        architecture=meta["architecture"],
        fingerprint=meta["fingerprint"],
        model_dtype=_DTYPES[meta["model_dtype"]],
        model_info=meta["model_info"],
    )
    if state.num_layers != num_layers:
        raise ValueError(
            f"{path} holds {num_layers} layers, the model has {state.num_layers}; "
            "the state belongs to another model: re-encode the context with this model"
        )
    attention_layers = tuple(getattr(state, "attention_layer_indices", ()))
    if layout.is_hybrid:
        stored = tuple(
            sorted(
                {
                    int(name.rsplit(".", 1)[1])
                    for name in tensors
                    if name.startswith("attn.keys.") and name.rsplit(".", 1)[1].isdigit()
                }
            )
        )
        if stored != attention_layers:
            owner = "the model has" if model is not None else "its recorded config has"
            raise ValueError(
                f"{path} holds attention keys for model layers {list(stored)}, {owner} attention layers {list(attention_layers)}; "
                + (
                    "the state belongs to another model: re-encode the context with this model"
                    if model is not None
                    else "the file was altered: re-encode the context"
                )
            )
    _check_tensor_names(tensors, num_layers, path, meta["architecture"], attention_layers)
    if model is not None:
        device = device if device is not None else next(model.parameters()).device
    to = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    for i in range(num_layers):
        state.set_layer(
            i,
            ssm_state=to(tensors[f"ssm.{i}"]),
            conv_state=to(tensors[f"conv.{i}"]),
            delta_sum=to(tensors[f"delta_sum.{i}"]),
            A=to(tensors[f"A.{i}"]),
        )
        for extra in layout.extras:
            getattr(state, extra.attribute)[i] = to(tensors[f"{extra.file_key}.{i}"])
    for i in attention_layers:
        keys, values, positions = (tensors[name] for name in attention_tensor_names(i))
        for name, tensor in (("keys", keys), ("values", values)):
            if str(tensor.dtype) != meta["keys_dtype"]:
                raise ValueError(
                    f"{path}: layer {i} (attention) {name} are {tensor.dtype}, its metadata records keys_dtype "
                    f"{meta['keys_dtype']} (corrupted or hand-made file); re-encode the context"
                )
        # back in the model dtype: the model's attention concatenates its new keys to these
        state.layers[i].fill_keys(to(keys.to(state.model_dtype)), to(values.to(state.model_dtype)), to(positions))
    state.num_tokens = to(tensors["num_tokens"]) if "num_tokens" in tensors else None
    state.token_ids = to(tensors["token_ids"]) if "token_ids" in tensors else None
    if model is not None:
        from .fingerprint import model_fingerprint

        # first: a state of another model is named as such, not as a damaged file
        check_against_model(state, model, model_fingerprint(model), where=path)
    check_state_once(state, where=path)  # with a model, check_against_model checked it already (remembered)
    return state
