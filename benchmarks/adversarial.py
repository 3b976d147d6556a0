"""Adversarial trial (issue 21): crafted state files, in-memory misuse, API misuse, store damage and kill -9
trials on both store backends, and CLI user errors, generated from a fixed seed; each case runs in its own
forked process with a timeout and is classified by an oracle.

    python benchmarks/adversarial.py [--seed 0] [--scale full|ci] [--json PATH] [--case ID]

Outcomes (one per case):

* ``clear``: refused with ValueError / TypeError / KeyError / IndexError / FileNotFoundError / PermissionError /
  IsADirectoryError / NotADirectoryError / TimeoutError / NotImplementedError (or a subclass), a one-line message of at most 400 characters, raised by a ``raise``
  statement in an hf_statecompose frame (the innermost frame of the traceback is in the package and its line is
  a ``raise``: a deliberate refusal, not a torch / safetensors / lancedb / Python error passing through); a
  TypeError of Python's own argument binding at the call site counts too. CLI: exit status 2 and one stderr
  line ``hf-statecompose: error: ...`` (no traceback).
* ``handled``: no error, and the case's oracle verified the result (a loaded state bitwise equal to the
  original, logits / generated tokens equal to the reference, a repeated write left one copy, ...).
* ``unclear``: any other exception (type, origin, several lines, longer than 400 characters), a child that died
  without an answer, a CLI traceback or another exit status.
* ``silent``: no error, but the oracle found the result wrong (a mutated file accepted as another state,
  logits changed by a corrupted state, duplicates, files outside the store changed, an invalid argument
  accepted where no valid reading exists).
* ``hang``: the case ran past its timeout (killed).
* ``lost`` (store cases, kill trials): a committed entry missing or unreadable (or different) after reopening,
  the store unopenable after a kill, or a killed multi-id ``delete`` half applied.

The models are tiny random ones built here (as tests/helpers.py does); nothing downloads. JSON (default
benchmarks/results/adversarial.json): the table per category and in total, and every non-clean case (silent,
unclear, hang, lost) with a one-line repro (``--case ID`` reruns one case in this process and prints its
traceback). ``--scale ci`` is the representative subset the test runs (tests/adversarial/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer

PKG_DIR = os.path.dirname(os.path.abspath(hsc.__file__)) + os.sep
THIS_FILE = os.path.abspath(__file__)
OUTCOMES = ("clear", "handled", "unclear", "silent", "hang", "lost")
CLEAR_TYPES = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    TimeoutError,
    NotImplementedError,
)
CATEGORIES = {
    "a": "crafted state files",
    "b": "in-memory state misuse",
    "c": "API misuse",
    "d": "store (folder + lance)",
    "e": "CLI",
    "f": "Ray encode_corpus args",
}
ARCHS = ("mamba", "mamba2", "serpent_mamba", "coffee", "falcon_mamba")
VOCAB = 61
CASE_TIMEOUT = 30.0
PROG_ERROR = "hf-statecompose: error: "


# ================================================================================================ models
def build_model(arch: str, seed: int = 0):
    """A tiny random model of ``arch``, enabled, whose states matter for its logits."""
    from transformers import (
        FalconMambaConfig,
        FalconMambaForCausalLM,
        Mamba2Config,
        Mamba2ForCausalLM,
        MambaConfig,
        MambaForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if arch in ("mamba", "falcon_mamba"):
        cls, model_cls = (
            (MambaConfig, MambaForCausalLM) if arch == "mamba" else (FalconMambaConfig, FalconMambaForCausalLM)
        )
        model = model_cls(cls(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, **common))
    elif arch == "mamba2":
        model = Mamba2ForCausalLM(
            Mamba2Config(
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                expand=2,
                num_heads=8,
                head_dim=8,
                n_groups=2,
                chunk_size=16,
                conv_kernel=4,
                **common,
            )
        )
    elif arch == "serpent_mamba":
        model = hsc.SeRpEntMambaForCausalLM(
            hsc.SeRpEntMambaConfig(
                hidden_size=24,
                num_hidden_layers=2,
                state_size=4,
                resample_window=3,
                num_gaussians=4,
                tie_word_embeddings=False,
                initializer_range=1.0,
                time_step_min=0.01,
                time_step_max=0.5,
                **common,
            )
        )
    elif arch == "coffee":
        model = hsc.CoffeeForCausalLM(
            hsc.CoffeeConfig(
                hidden_size=16,
                num_hidden_layers=2,
                state_size=4,
                tie_word_embeddings=False,
                initializer_range=0.1,
                **common,
            )
        )
    else:
        raise ValueError(arch)
    if getattr(model, "lm_head", None) is not None and not getattr(model.config, "tie_word_embeddings", True):
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = None  # fixed-length generations
    model.generation_config.pad_token_id = 0
    return hsc.enable(model.eval())


def ids_of(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class CharTokenizer:
    """One token per character (ids 3..VOCAB-1), as tests/store_helpers.py."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [3 + ord(c) % (VOCAB - 3) for c in text]
        if return_tensors == "pt":
            return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + (int(i) - 3) % 95) for i in ids)


class BagOfWords:
    """Hashed word counts, as tests/store_helpers.py: deterministic, instant."""

    name = "adversarial-bag-of-words"

    def __call__(self, texts):
        import hashlib
        import re

        out = torch.zeros(len(texts), 64)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1
        return out + 1e-3


STORE_TEXTS = [
    "the red fox jumps over the fence",
    "a quiet river runs to the sea",
    "copper and tin make bronze",
    "the mountain town is known for wool",
    "bees make honey in the summer",
    "iron ships sail across the bay",
]
NEW_TEXTS = [
    "glass is made from sand and heat",
    "owls hunt at night in the forest",
    "salt water freezes later",
    "clocks tick in the old tower",
    "wheat grows in the valley",
    "a comet crossed the winter sky",
]


# ================================================================================================ state helpers
def state_dict_of(state) -> dict:
    """Every tensor of a state plus its identity fields (what 'identical' compares)."""
    from hf_statecompose.state.serialization import state_to_tensors

    out = {k: v.clone() for k, v in state_to_tensors(state).items()}
    return {
        "tensors": out,
        "architecture": state.architecture,
        "fingerprint": state.fingerprint,
        "model_dtype": str(state.model_dtype),
        "type": type(state).__name__,
    }


def same_state(a: dict, b: dict) -> str | None:
    """None if equal, else what differs."""
    for key in ("architecture", "fingerprint", "model_dtype", "type"):
        if a[key] != b[key]:
            return f"{key} {a[key]!r} != {b[key]!r}"
    ta, tb = a["tensors"], b["tensors"]
    if set(ta) != set(tb):
        return f"tensor names differ: {sorted(set(ta) ^ set(tb))[:4]}"
    for name in sorted(ta):
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
            return f"{name}: {x.dtype}{tuple(x.shape)} != {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x, y) and not (
            x.is_floating_point()
            and torch.equal(torch.isnan(x), torch.isnan(y))
            and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))
        ):
            return f"{name} values differ"
    return None


def logits_of(model, query, states, composition="picaso_r", **kwargs):
    with torch.no_grad():
        return model(query, past_states=states, composition=composition, **kwargs).logits


def logits_of_positional(model, query, states):
    with torch.no_grad():
        return model(query, torch.ones_like(query), past_states=states).logits


def generate_of(model, query, states, composition="picaso_r", new=3, **kwargs):
    with torch.no_grad():
        out = model.generate(
            query, past_states=states, composition=composition, max_new_tokens=new, do_sample=False, **kwargs
        )
    return out[:, query.shape[1] :]


def handled(detail="verified"):
    return {"outcome": "handled", "detail": detail}


def silent(detail):
    return {"outcome": "silent", "detail": detail}


def lost(detail):
    return {"outcome": "lost", "detail": detail}


def accepted_invalid(what):
    return silent(f"accepted: {what}")


def compare_logits(actual, expected, what="logits") -> dict:
    if actual.shape == expected.shape and torch.equal(actual, expected):
        return handled(f"{what} equal to the reference")
    return silent(
        f"{what} differ from the reference (max |diff| "
        f"{float((actual.float() - expected.float()).abs().nan_to_num(float('inf')).max()) if actual.shape == expected.shape else 'shape'})"
    )


# ================================================================================================ classification
def classify_exception(error: BaseException) -> dict:
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    kind = type(error).__name__
    origin = f"{os.path.relpath(last.filename, ROOT) if last else '?'}:{last.lineno if last else '?'}"
    deliberate = bool(last) and last.filename.startswith(PKG_DIR) and (last.line or "").lstrip().startswith("raise")
    binding = isinstance(error, TypeError) and bool(last) and last.filename == THIS_FILE and "argument" in message
    one_line = "\n" not in message.strip() and 0 < len(message) <= 400
    detail = f"{kind} at {origin}: {' | '.join(message.splitlines())[:300]}"
    if isinstance(error, CLEAR_TYPES) and (deliberate or binding) and one_line:
        return {"outcome": "clear", "detail": detail}
    why = (
        "not a clear type"
        if not isinstance(error, CLEAR_TYPES)
        else "not raised by hf_statecompose"
        if not (deliberate or binding)
        else f"message of {len(message)} chars / {len(message.splitlines())} lines"
    )
    return {"outcome": "unclear", "detail": f"{detail} ({why})"}


def expect_error(fn, accept=None):
    """Run ``fn``; an exception is classified by the caller's wrapper. No exception: ``accept(result)`` is the
    oracle (returns handled / silent); without one, accepting was wrong."""
    result = fn()
    if accept is None:
        return accepted_invalid(f"returned {type(result).__name__} instead of refusing")
    return accept(result)


# ================================================================================================ process runner
def _write_all(fd, data: bytes):
    while data:
        written = os.write(fd, data)
        data = data[written:]


def run_forked(fn, timeout: float, quiet: bool = True) -> dict:
    """Run ``fn()`` in a forked child (its result or classified exception comes back as JSON through a pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            if quiet:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            try:
                result = fn()
            except BaseException as error:  # noqa: BLE001 (the oracle classifies everything)
                result = classify_exception(error)
            if not isinstance(result, dict) or result.get("outcome") not in OUTCOMES:
                result = {"outcome": "unclear", "detail": f"harness: case returned {result!r:.100}"}
            _write_all(w, json.dumps(result, default=str).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"outcome": "hang", "detail": f"no answer within {timeout:.0f} s (killed)"}
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks).decode())
    except ValueError:
        return {"outcome": "unclear", "detail": f"child died without an answer (wait status {status})"}


# ================================================================================================ context
class Context:
    """What every case reads (built once, before forking: children inherit it)."""

    def __init__(self, workdir: str, seed: int):
        self.workdir = workdir
        self.seed = seed
        self.models, self.others, self.states, self.files, self.refs = {}, {}, {}, {}, {}
        for n, arch in enumerate(ARCHS):
            model = build_model(arch, seed=seed)
            self.models[arch] = model
            self.others[arch] = build_model(arch, seed=seed + 1000)
            with torch.no_grad():
                s1 = hsc.encode(model, ids_of(9, seed=10 + n))
                s2 = hsc.encode(model, ids_of(6, seed=20 + n))
            self.states[arch] = (s1, s2)
            path = os.path.join(workdir, f"valid-{arch}.safetensors")
            s1.save(path)
            with open(path, "rb") as handle:
                self.files[arch] = handle.read()
            query = ids_of(5, seed=30 + n)
            other_path = os.path.join(workdir, f"other-{arch}.safetensors")
            with torch.no_grad():
                hsc.encode(self.others[arch], ids_of(9, seed=10 + n)).save(other_path)
            with open(other_path, "rb") as handle:
                other_bytes = handle.read()
            self.refs[arch] = {
                "query": query,
                "s1": state_dict_of(s1),
                "s2": state_dict_of(s2),
                "logits2": logits_of(model, query, [s1, s2]),
                "logits1": logits_of(model, query, [s1]),
                "plain": model(query).logits.detach(),
                "gen2": generate_of(model, query, [s1, s2]),
                "other_file": other_bytes,
            }
        self.store_refs = {}

    # ---------------------------------------------------------------------------------------- stores
    def build_base_stores(self, backends):
        """One base store per backend (mamba2, 6 entries in 2 shards / commits) and the reference states of its
        entries; built in a child process (the parent never opens a Lance connection before forking)."""
        if "lance" in backends:  # imported (never connected) here, once, rather than in every child
            from hf_statecompose.store.lance import import_lancedb

            import_lancedb()
        for backend in backends:
            path = os.path.join(self.workdir, f"base-{backend}")
            ref_path = os.path.join(self.workdir, f"base-{backend}.ref.safetensors")

            def build(path=path, ref_path=ref_path, backend=backend):
                from safetensors.torch import save_file

                store = open_store(self, backend, path)
                ids = store.add(STORE_TEXTS[:3], show_progress=False) + store.add(STORE_TEXTS[3:], show_progress=False)
                tensors = {}
                for entry_id, state in zip(ids, store.get(ids)):
                    for name, t in state_dict_of(state)["tensors"].items():
                        tensors[f"{entry_id}.{name}"] = t.contiguous()
                save_file(tensors, ref_path, metadata={"ids": json.dumps(ids)})
                return handled("built")

            result = run_forked(build, 300, quiet=False)
            if result["outcome"] != "handled":
                raise RuntimeError(f"could not build the base {backend} store: {result}")
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(ref_path, "pt") as handle:
                ids = json.loads(handle.metadata()["ids"])
            flat = load_file(ref_path)
            refs = {i: {name[len(i) + 1 :]: t for name, t in flat.items() if name.startswith(i + ".")} for i in ids}
            self.store_refs[backend] = {"path": path, "ids": ids, "texts": dict(zip(ids, STORE_TEXTS)), "tensors": refs}


def open_store(ctx, backend, path, model=None, **kwargs):
    store_cls = hsc.StateStore
    kw = {"backend": "lance"} if backend == "lance" else {}
    kw.update(kwargs)
    return store_cls(
        path, model if model is not None else ctx.models["mamba2"], CharTokenizer(), retriever=BagOfWords(), **kw
    )


# ================================================================================================ category a: files
def _split_file(data: bytes):
    header_len = int.from_bytes(data[:8], "little")
    return header_len, json.loads(data[8 : 8 + header_len])


def _resave(tensors: dict, meta: dict | str | None, recompute_digest: bool = True) -> bytes:
    from safetensors.torch import save

    from hf_statecompose.state.serialization import _digest

    if isinstance(meta, dict) and recompute_digest:
        meta = dict(meta, tensor_digest=_digest(tensors))
    metadata = None if meta is None else {"hf_statecompose": meta if isinstance(meta, str) else json.dumps(meta)}
    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)


def _parsed(data: bytes):
    from safetensors.torch import load

    _, header = _split_file(data)
    meta = json.loads(header["__metadata__"]["hf_statecompose"])
    return load(data), meta


BYTE_MUTATIONS = (
    "flip_header",
    "flip_data",
    "flip_any",
    "truncate",
    "empty",
    "garbage",
    "pickle",
    "zip",
    "append",
    "huge_header_len",
    "zero_header_len",
)
META_MUTATIONS = (
    "format_version",
    "architecture",
    "fingerprint_garbage",
    "fingerprint_other",
    "model_dtype",
    "num_layers",
    "config_model_type",
    "digest_wrong",
    "drop_key",
    "meta_not_json",
    "meta_list",
    "no_metadata",
    "model_info_list",
)
TENSOR_MUTATIONS = (
    "negative_delta",
    "nan_ssm",
    "inf_ssm",
    "nan_conv",
    "nan_delta",
    "A_scaled",
    "A_positive",
    "dtype_ssm_f64",
    "dtype_conv_f16",
    "dtype_delta_int",
    "shape_ssm",
    "shape_conv",
    "batch2_one_tensor",
    "missing_tensor",
    "extra_tensor",
    "num_tokens_negative",
    "num_tokens_mismatch",
    "token_ids_oov",
    "token_ids_negative",
    "token_ids_float",
    "empty_state_tensor",
)
SERPENT_MUTATIONS = (
    "valid_all_false_clock",
    "times_not_strict",
    "times_decreasing",
    "times_after_clock",
    "clock_negative",
    "valid_not_right_aligned",
    "window_inputs_nan",
    "last_output_inf",
    "clock_int32",
    "valid_as_int",
)
OTHER_FILE_MUTATIONS = ("other_architecture", "other_model_same_arch", "fingerprint_swapped", "foreign_safetensors")


def gen_files(rng, scale):
    """full: every mutation on every architecture (random ones several times); ci: each mutation once, on the
    architectures in turn (byte flips twice)."""
    cases = []
    kinds = [("file_bytes", k) for k in BYTE_MUTATIONS] + [
        ("file_struct", k) for k in META_MUTATIONS + TENSOR_MUTATIONS + OTHER_FILE_MUTATIONS
    ]
    for n, (runner, kind) in enumerate(kinds):
        randomised = (
            kind.startswith("flip")
            or kind == "truncate"
            or kind in ("garbage", "negative_delta", "nan_ssm", "A_scaled")
        )
        if scale == "full":
            plan = [
                (arch, 12 if kind.startswith("flip") else 4 if randomised else 1 if kind in OTHER_FILE_MUTATIONS else 2)
                for arch in ARCHS
            ]
        else:
            plan = [(ARCHS[n % len(ARCHS)], 2 if kind.startswith("flip") else 1)]
        for arch, reps in plan:
            for _ in range(reps):
                cases.append(("a", runner, {"arch": arch, "mutation": kind, "seed": rng.randrange(1 << 30)}))
    for kind in SERPENT_MUTATIONS:
        for _ in range(3 if scale == "full" else 1):
            cases.append(
                ("a", "file_struct", {"arch": "serpent_mamba", "mutation": kind, "seed": rng.randrange(1 << 30)})
            )
    return cases


def _mutate_bytes(data: bytes, kind: str, rng: random.Random) -> bytes:
    header_len = int.from_bytes(data[:8], "little")
    buf = bytearray(data)
    if kind in ("flip_header", "flip_data", "flip_any"):
        lo, hi = {
            "flip_header": (8, 8 + header_len),
            "flip_data": (8 + header_len, len(data)),
            "flip_any": (0, len(data)),
        }[kind]
        pos = rng.randrange(lo, hi)
        buf[pos] ^= rng.randrange(1, 256)
        return bytes(buf)
    if kind == "truncate":
        return bytes(buf[: rng.randrange(0, len(data))])
    if kind == "empty":
        return b""
    if kind == "garbage":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4096)))
    if kind == "pickle":
        return b"\x80\x04\x95" + bytes(rng.randrange(256) for _ in range(200))
    if kind == "zip":
        return b"PK\x03\x04" + bytes(rng.randrange(256) for _ in range(200))
    if kind == "append":
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == "huge_header_len":
        return (2**40).to_bytes(8, "little") + data[8:]
    if kind == "zero_header_len":
        return (0).to_bytes(8, "little") + data[8:]
    raise ValueError(kind)


def _pick_layer_tensor(tensors, prefix, rng):
    names = sorted(n for n in tensors if n.startswith(prefix + "."))
    return rng.choice(names)


def _mutate_struct(ctx, arch, data: bytes, kind: str, rng: random.Random) -> bytes:
    tensors, meta = _parsed(data)
    tensors = {k: v.clone() for k, v in tensors.items()}
    if kind == "format_version":
        meta["format_version"] = rng.choice([0, 2, "1", None, 1.0])
    elif kind == "architecture":
        meta["architecture"] = rng.choice([a for a in ARCHS if a != arch] + ["gpt2", ""])
    elif kind == "fingerprint_garbage":
        meta["fingerprint"] = rng.choice(["", "0" * 64, meta["fingerprint"][::-1], "x"])
    elif kind == "fingerprint_other":
        meta["fingerprint"] = hsc.model_fingerprint(ctx.others[arch])
    elif kind == "model_dtype":
        meta["model_dtype"] = rng.choice(["torch.float16", "torch.bfloat16", "torch.float64", "torch.int8", "float32"])
    elif kind == "num_layers":
        meta["num_layers"] = meta["num_layers"] + rng.choice([1, -1, 100, -meta["num_layers"]])
    elif kind == "config_model_type":
        meta["config"]["model_type"] = rng.choice([a for a in ARCHS if a != arch])
    elif kind == "digest_wrong":
        return _resave(tensors, dict(meta, tensor_digest="0" * 32), recompute_digest=False)
    elif kind == "drop_key":
        meta.pop(rng.choice(sorted(meta)))
    elif kind == "meta_not_json":
        return _resave(tensors, "{not json" + rng.choice(["", "}", "]"]))
    elif kind == "meta_list":
        return _resave(tensors, json.dumps([meta]))
    elif kind == "no_metadata":
        return _resave(tensors, None)
    elif kind == "model_info_list":
        meta["model_info"] = [1, 2]
    elif kind in ("negative_delta", "nan_delta"):
        name = _pick_layer_tensor(tensors, "delta_sum", rng)
        flat = tensors[name].view(-1)
        flat[rng.randrange(flat.numel())] = -rng.uniform(0.01, 5.0) if kind == "negative_delta" else float("nan")
    elif kind in ("nan_ssm", "inf_ssm", "nan_conv"):
        name = _pick_layer_tensor(tensors, "conv" if kind == "nan_conv" else "ssm", rng)
        flat = tensors[name].view(-1)
        if flat.numel() == 0:  # COFFEE has no conv window: poison the SSM state instead
            name = _pick_layer_tensor(tensors, "ssm", rng)
            flat = tensors[name].view(-1)
        flat[rng.randrange(flat.numel())] = float("nan") if "nan" in kind else rng.choice([float("inf"), float("-inf")])
    elif kind == "A_scaled":
        name = _pick_layer_tensor(tensors, "A", rng)
        tensors[name] = tensors[name] * rng.choice([2.0, 0.5, 1.0001])
    elif kind == "A_positive":
        name = _pick_layer_tensor(tensors, "A", rng)
        tensors[name] = -tensors[name]
    elif kind == "dtype_ssm_f64":
        name = _pick_layer_tensor(tensors, "ssm", rng)
        tensors[name] = tensors[name].double()
    elif kind == "dtype_conv_f16":
        name = _pick_layer_tensor(tensors, "conv", rng)
        tensors[name] = tensors[name].half()
    elif kind == "dtype_delta_int":
        name = _pick_layer_tensor(tensors, "delta_sum", rng)
        tensors[name] = tensors[name].round().long()
    elif kind in ("shape_ssm", "shape_conv"):
        name = _pick_layer_tensor(tensors, "ssm" if kind == "shape_ssm" else "conv", rng)
        t = tensors[name]
        tensors[name] = (
            torch.cat([t, t[..., :1]], dim=-1) if rng.random() < 0.5 or t.shape[-1] < 2 else t[..., :-1].contiguous()
        )
    elif kind == "batch2_one_tensor":
        name = _pick_layer_tensor(tensors, rng.choice(["ssm", "conv", "delta_sum"]), rng)
        tensors[name] = torch.cat([tensors[name], tensors[name]])
    elif kind == "missing_tensor":
        tensors.pop(rng.choice(sorted(n for n in tensors if n not in ("num_tokens", "token_ids"))))
    elif kind == "extra_tensor":
        tensors[rng.choice(["ssm.99", "evil", "A.-1", "token_ids_2"])] = torch.zeros(1)
    elif kind == "num_tokens_negative":
        tensors["num_tokens"] = torch.tensor([-rng.randrange(1, 10)])
    elif kind == "num_tokens_mismatch":
        tensors["num_tokens"] = tensors["num_tokens"] + rng.choice([1, 3, -2])
    elif kind == "token_ids_oov":
        tensors["token_ids"][0, rng.randrange(tensors["token_ids"].shape[1])] = VOCAB + rng.randrange(1, 1000)
    elif kind == "token_ids_negative":
        tensors["token_ids"][0, -1] = -rng.randrange(2, 100)
    elif kind == "token_ids_float":
        tensors["token_ids"] = tensors["token_ids"].float()
    elif kind == "empty_state_tensor":
        name = _pick_layer_tensor(tensors, "ssm", rng)
        tensors[name] = tensors[name][:0]
    elif kind in SERPENT_MUTATIONS:
        v = rng.randrange(meta["num_layers"])
        clock, times, valid = (
            tensors[f"resample.clock.{v}"],
            tensors[f"resample.times.{v}"],
            tensors[f"resample.valid.{v}"],
        )
        if kind == "valid_all_false_clock":
            valid.zero_()
            clock.clamp_(min=1)
        elif kind == "times_not_strict":
            valid.fill_(True)
            times.copy_(torch.full_like(times, int(clock.max()) // 2))
        elif kind == "times_decreasing":
            valid.fill_(True)
            times.copy_(
                torch.arange(times.shape[1], 0, -1).expand_as(times) * max(1, int(clock.max()) // (times.shape[1] + 1))
            )
        elif kind == "times_after_clock":
            times[:, -1] = clock + rng.randrange(1, 1 << 20)
        elif kind == "clock_negative":
            clock.copy_(-clock.abs() - 1)
        elif kind == "valid_not_right_aligned":
            valid.fill_(True)
            valid[:, -1] = False
        elif kind == "window_inputs_nan":
            tensors[f"resample.inputs.{v}"].view(-1)[0] = float("nan")
        elif kind == "last_output_inf":
            tensors[f"resample.last_output.{v}"].view(-1)[0] = float("inf")
        elif kind == "clock_int32":
            tensors[f"resample.clock.{v}"] = clock.int()
        elif kind == "valid_as_int":
            tensors[f"resample.valid.{v}"] = valid.long()
    else:
        raise ValueError(kind)
    return _resave(tensors, meta)


def run_file_case(ctx, params):
    arch, kind = params["arch"], params["mutation"]
    rng = random.Random(params["seed"])
    data = ctx.files[arch]
    model = ctx.models[arch]
    original = ctx.refs[arch]["s1"]
    if params.get("_kind") == "file_bytes":
        crafted = _mutate_bytes(data, kind, rng)
    elif kind == "other_architecture":
        crafted = ctx.files[rng.choice([a for a in ARCHS if a != arch])]
    elif kind == "other_model_same_arch":
        crafted = ctx.refs[arch]["other_file"]
    elif kind == "fingerprint_swapped":
        # this model's file under the other model's fingerprint (digest recomputed), loaded by this model: refused. (Loaded
        # by the other model it is a self-consistent forgery of that model's state, undetectable when both models share
        # A (the tiny models' A_log is the deterministic S4D init), so that variant is not a case.)
        tensors, meta = _parsed(data)
        meta["fingerprint"] = hsc.model_fingerprint(ctx.others[arch])
        crafted = _resave(tensors, meta)
    elif kind == "foreign_safetensors":
        from safetensors.torch import save

        crafted = save(
            {"weight": torch.randn(4, 4), "ssm.0": torch.randn(2)}, metadata=rng.choice([None, {"format": "pt"}])
        )
    else:
        crafted = _mutate_struct(ctx, arch, data, kind, rng)
    path = os.path.join(tempfile.mkdtemp(dir=ctx.workdir), "state.safetensors")
    with open(path, "wb") as handle:
        handle.write(crafted)
    loaded = ComposableMambaCache.load(path, model=model)
    if crafted == data and model is ctx.models[arch]:
        problem = same_state(state_dict_of(loaded), original)
        return (
            handled("unchanged bytes, loaded identical")
            if problem is None
            else silent(f"unchanged file loaded differently: {problem}")
        )
    problem = same_state(state_dict_of(loaded), original)
    if problem is None:
        return handled("loaded a state identical to the original")
    return silent(f"a crafted file was accepted as a different state ({problem})")


# ================================================================================================ category b: in memory
MEMORY_KINDS = (
    "negative_delta",
    "nan_ssm",
    "inf_conv",
    "nan_delta",
    "shape_ssm",
    "shape_delta",
    "dtype_ssm",
    "dtype_conv",
    "dtype_delta",
    "meta_device",
    "A_inplace",
    "clone_A_inplace",
    "clone_ssm_inplace",
    "select_float",
    "select_float_tensor",
    "select_out_of_range",
    "select_duplicate_rows",
    "getitem_str",
    "other_model_state",
    "other_arch_state",
    "compose_mixed_models",
    "num_tokens_negative",
    "extras_missing",
    "batch_mismatch_states",
    "detach_shares",
    "repeat_interleave_bad",
)


def gen_memory(rng, scale):
    cases = []
    for n, kind in enumerate(MEMORY_KINDS):
        reps = (
            3
            if kind
            in ("negative_delta", "nan_ssm", "A_inplace", "clone_A_inplace", "select_float", "other_model_state")
            else 1
        )
        plan = [(arch, reps) for arch in ARCHS] if scale == "full" else [(ARCHS[n % len(ARCHS)], 1)]
        for arch, r in plan:
            for _ in range(r):
                cases.append(("b", "memory", {"arch": arch, "mutation": kind, "seed": rng.randrange(1 << 30)}))
    return cases


def _state_case(ctx, params):
    """What a memory or API case starts from: its architecture, mutation, seeded rng, model, references, fresh
    copies of the two reference states and the query."""
    arch = params["arch"]
    ref = ctx.refs[arch]
    s1, s2 = (s.clone() for s in ctx.states[arch])
    return arch, params["mutation"], random.Random(params["seed"]), ctx.models[arch], ref, s1, s2, ref["query"]


def run_memory_case(ctx, params):
    arch, kind, rng, model, ref, s1, s2, query = _state_case(ctx, params)
    layer = rng.randrange(s1.num_layers)

    def use_and_compare(states=None):
        return compare_logits(logits_of(model, query, states or [s1, s2]), ref["logits2"])

    if kind == "negative_delta":
        flat = s1.delta_sums[layer].view(-1)
        flat[rng.randrange(flat.numel())] = -rng.uniform(0.1, 5.0)
        return use_and_compare()
    if kind == "nan_ssm":
        s1.ssm_states[layer].view(-1)[rng.randrange(s1.ssm_states[layer].numel())] = float("nan")
        return use_and_compare()
    if kind == "inf_conv":
        target = s1.conv_states[layer] if s1.conv_states[layer].numel() else s1.ssm_states[layer]
        target.view(-1)[0] = float("inf")
        return use_and_compare()
    if kind == "nan_delta":
        s1.delta_sums[layer].view(-1)[0] = float("nan")
        return use_and_compare()
    if kind in ("shape_ssm", "shape_delta"):
        if kind == "shape_ssm":
            s1.ssm_states[layer] = s1.ssm_states[layer][..., :-1]
        else:
            s1.delta_sums[layer] = torch.cat([s1.delta_sums[layer], s1.delta_sums[layer][:, :1]], dim=1)
        return use_and_compare()
    if kind in ("dtype_ssm", "dtype_conv", "dtype_delta"):
        attr = {"dtype_ssm": "ssm_states", "dtype_conv": "conv_states", "dtype_delta": "delta_sums"}[kind]
        original = getattr(s1, attr)[layer]
        converted = original.to(rng.choice([torch.float64, torch.float16, torch.bfloat16]))
        # the reference: the same (rounded) values in the right dtype; a library that refuses, or that computes with
        # the values it was given, is right; anything else changed the result
        rounded = s1.clone()
        getattr(rounded, attr)[layer] = converted.to(original.dtype)
        getattr(s1, attr)[layer] = converted
        return compare_logits(
            logits_of(model, query, [s1, s2]),
            logits_of(model, query, [rounded, s2]),
            f"logits (vs the rounded values in {original.dtype})",
        )
    if kind == "meta_device":
        s1.ssm_states[layer] = torch.empty_like(s1.ssm_states[layer], device="meta")
        return use_and_compare()
    if kind == "A_inplace":
        s1.A[layer].mul_(rng.choice([2.0, 0.5]))
        return use_and_compare()
    if kind in ("clone_A_inplace", "clone_ssm_inplace"):
        original = ctx.states[arch][0]
        copy_ = original.clone()
        (copy_.A if kind == "clone_A_inplace" else copy_.ssm_states)[layer].mul_(2.0).add_(0.5)
        problem = same_state(state_dict_of(original), ref["s1"])
        if problem is not None:
            return silent(f"editing a clone() in place changed the original ({problem})")
        return compare_logits(
            logits_of(model, query, [original, ctx.states[arch][1]]), ref["logits2"], "the original's logits"
        )
    if kind in (
        "select_float",
        "select_float_tensor",
    ):  # torch refuses float indices; truncating them picks a row by accident
        row = {"select_float": rng.choice([0.5, 0.0, 0.99]), "select_float_tensor": torch.tensor([0.0])}[kind]
        return expect_error(lambda: s1.select(row))
    if kind == "select_out_of_range":
        return expect_error(lambda: s1.select(rng.choice([1, 5, -2, [0, 3]])))
    if kind == "select_duplicate_rows":
        rows = s1.select([0, 0])

        def check(_):
            for r in (0, 1):
                if same_state(state_dict_of(rows.select(r)), ref["s1"]) is not None:
                    return silent("select([0, 0]) rows differ from the state")
            return handled("select([0, 0]) = two copies")

        return check(rows)
    if kind == "getitem_str":
        return expect_error(lambda: s1["0"])
    if kind == "other_model_state":
        with torch.no_grad():
            foreign = hsc.encode(ctx.others[arch], ids_of(7, seed=params["seed"] % 1000))
        return use_and_compare([foreign, s2])
    if kind in ("other_arch_state", "compose_mixed_models"):
        other_arch = rng.choice([a for a in ARCHS if a != arch])
        foreign = ctx.states[other_arch][0].clone()
        if kind == "other_arch_state":
            return use_and_compare([s1, foreign])
        return expect_error(lambda: StateComposer("soup").compose([s1, foreign]))
    if kind == "num_tokens_negative":
        s1.num_tokens = torch.tensor([-5])
        return use_and_compare()
    if kind == "extras_missing":
        if arch != "serpent_mamba":
            s1.token_ids = torch.tensor(
                [[VOCAB + 7] * 3]
            )  # out-of-vocabulary context ids: refuse or leave the result unchanged
            return use_and_compare()
        s1.clocks[layer] = None
        return use_and_compare()
    if kind == "batch_mismatch_states":
        return expect_error(lambda: StateComposer("soup").compose([s1, ComposableMambaCache.stack([s2, s2])]))
    if kind == "detach_shares":
        detached = s1.detach()
        detached.ssm_states[layer].add_(1.0)
        problem = same_state(state_dict_of(s1), ref["s1"])
        return (
            handled("detach() copies")
            if problem is None
            else handled(f"detach() shares storage as torch's does ({problem})")
        )
    if kind == "repeat_interleave_bad":
        return expect_error(lambda: s1.repeat_interleave(rng.choice([-1, 1.5, "2"])))
    raise ValueError(kind)


# ================================================================================================ category c: API misuse
API_KINDS = (
    "past_states_empty",
    "past_states_single",
    "past_states_none_item",
    "past_states_tensor_item",
    "past_states_str_item",
    "past_states_nested_ok",
    "past_states_nested_wrong_len",
    "past_states_dict",
    "composition_unknown",
    "composition_int",
    "composition_none",
    "weights_negative",
    "weights_sum",
    "weights_len",
    "weights_nan",
    "weights_str",
    "weights_missing",
    "conv_unknown",
    "backend_unknown",
    "ids_float",
    "ids_1d",
    "ids_3d",
    "ids_empty",
    "ids_oov",
    "ids_negative",
    "ids_batch2",
    "mask_right_padding",
    "mask_all_zero",
    "mask_shape",
    "mask_float_half",
    "mask_value_2",
    "both_cache",
    "positional_states",
    "encode_str",
    "encode_list",
    "encode_float",
    "encode_3d",
    "encode_empty",
    "encode_oov",
    "encode_negative",
    "encode_right_padding",
    "encode_pad_no_mask",
    "encode_not_model",
    "encode_backend",
    "compose_empty",
    "compose_non_state",
    "compose_method_unknown",
    "compose_concat_no_model",
    "compose_weights_nan",
    "enable_not_model",
    "set_backend_unknown",
    "fingerprint_not_model",
    "save_to_dir",
    "save_missing_dir",
    "save_not_state",
    "load_dir",
    "load_none",
    "load_model_str",
    "load_device_bad",
    "generate_right_padding",
)


def gen_api(rng, scale):
    cases = []
    for kind in API_KINDS:
        archs = ARCHS if scale == "full" else (ARCHS[API_KINDS.index(kind) % len(ARCHS)],)
        for arch in archs:
            cases.append(("c", "api", {"arch": arch, "mutation": kind, "seed": rng.randrange(1 << 30)}))
    return cases


def run_api_case(ctx, params):
    _arch, kind, rng, model, ref, s1, s2, query = _state_case(ctx, params)
    fwd = lambda states=None, q=query, **kw: logits_of(model, q, [s1, s2] if states is None else states, **kw)

    if kind == "past_states_empty":
        return expect_error(
            lambda: fwd([]), lambda out: compare_logits(out, ref["plain"], "logits (as without states)")
        )
    if kind == "past_states_single":
        return expect_error(lambda: fwd(s1), lambda out: compare_logits(out, ref["logits1"]))
    if kind in ("past_states_none_item", "past_states_tensor_item", "past_states_str_item"):
        bad = {
            "past_states_none_item": None,
            "past_states_tensor_item": torch.zeros(3),
            "past_states_str_item": "state",
        }[kind]
        return expect_error(lambda: fwd([s1, bad]))
    if kind == "past_states_nested_ok":
        return expect_error(lambda: fwd([[s1, s2]]), lambda out: compare_logits(out, ref["logits2"]))
    if kind == "past_states_nested_wrong_len":
        return expect_error(lambda: fwd([[s1], [s2]]))
    if kind == "past_states_dict":
        return expect_error(lambda: fwd({"a": s1}))
    if kind in ("composition_unknown", "composition_int"):
        return expect_error(
            lambda: fwd(composition=rng.choice(["nope", "PICASO_R", ""]) if kind == "composition_unknown" else 3)
        )
    if kind == "composition_none":
        return expect_error(
            lambda: fwd(composition=None),
            lambda out: compare_logits(out, ref["logits2"], "logits (default composition)"),
        )
    if kind.startswith("weights_"):
        weights = {
            "weights_negative": [1.5, -0.5],
            "weights_sum": [0.2, 0.2],
            "weights_len": [0.2, 0.3, 0.5],
            "weights_nan": [float("nan"), 1.0],
            "weights_str": ["a", "b"],
            "weights_missing": None,
        }[kind]
        return expect_error(lambda: fwd(composition=StateComposer("weighted", weights=weights)))
    if kind == "conv_unknown":
        return expect_error(lambda: StateComposer("soup", conv=rng.choice(["nope", 1, "Mean"])))
    if kind == "backend_unknown":
        return expect_error(lambda: StateComposer("soup", backend=rng.choice(["nope", "cuda", None])))
    if kind == "ids_float":
        return expect_error(lambda: fwd(q=query.float()))
    if kind == "ids_1d":
        return expect_error(
            lambda: fwd(q=query[0]), lambda out: compare_logits(out.reshape(ref["logits2"].shape), ref["logits2"])
        )
    if kind == "ids_3d":
        return expect_error(lambda: fwd(q=query[None]))
    if kind == "ids_empty":
        return expect_error(lambda: fwd(q=query[:, :0]))
    if kind in ("ids_oov", "ids_negative"):
        q = query.clone()
        q[0, rng.randrange(q.shape[1])] = VOCAB + rng.randrange(0, 100) if kind == "ids_oov" else -rng.randrange(1, 5)
        return expect_error(lambda: fwd(q=q))
    if kind == "ids_batch2":

        def check(out):
            ok = out.shape[0] == 2 and all(torch.equal(out[r : r + 1], ref["logits2"]) for r in range(2))
            return (
                handled("each row equals the reference")
                if ok
                else silent("a 2-row query with 1-row states: rows differ")
            )

        return expect_error(lambda: fwd(q=query.repeat(2, 1)), check)
    if kind.startswith("mask_"):
        mask = torch.ones_like(query)
        if kind == "mask_right_padding":
            q = torch.cat([query, torch.zeros(1, 2, dtype=torch.long)], 1)
            mask = torch.cat([mask, torch.zeros(1, 2, dtype=torch.long)], 1)
            return expect_error(
                lambda: fwd(q=q, attention_mask=mask),
                lambda out: compare_logits(out[:, : query.shape[1]], ref["logits2"], "logits of the real tokens"),
            )
        if kind == "mask_all_zero":
            mask.zero_()
        elif kind == "mask_shape":
            mask = torch.ones(1, query.shape[1] + 2, dtype=torch.long)
        elif kind == "mask_float_half":
            mask = torch.full(query.shape, 0.5)
        elif kind == "mask_value_2":
            mask = mask * 2
        return expect_error(lambda: fwd(attention_mask=mask))
    if kind == "generate_right_padding":
        q = torch.cat([query, torch.zeros(1, 2, dtype=torch.long)], 1)
        mask = torch.cat([torch.ones_like(query), torch.zeros(1, 2, dtype=torch.long)], 1)

        def check(out):
            return (
                handled("right-padded query generates as unpadded")
                if torch.equal(out, ref["gen2"])
                else silent("right padding accepted: generated tokens differ from the unpadded query's")
            )

        return expect_error(lambda: generate_of(model, q, [s1, s2], attention_mask=mask), check)
    if kind == "both_cache":
        from hf_statecompose.state.cache import ComposableMambaCache as C

        return expect_error(lambda: model(query, past_states=[s1], cache_params=C.empty_for(model)))
    if kind == "positional_states":
        # the attention mask by position, the states by name: refused ("by name") or the same logits
        return expect_error(
            lambda: logits_of_positional(model, query, [s1, s2]), lambda out: compare_logits(out, ref["logits2"])
        )
    # ------------------------------------------------------------------ encode
    ids = ids_of(7, seed=params["seed"] % 1000)
    with torch.no_grad():
        if kind == "encode_str":
            return expect_error(lambda: hsc.encode(model, "some text"))
        if kind == "encode_list":
            return expect_error(
                lambda: hsc.encode(model, ids[0].tolist()), lambda st: _state_check(st, hsc.encode(model, ids))
            )
        if kind == "encode_float":
            return expect_error(lambda: hsc.encode(model, ids.float()))
        if kind == "encode_3d":
            return expect_error(lambda: hsc.encode(model, ids[None]))
        if kind == "encode_empty":
            return expect_error(lambda: hsc.encode(model, ids[:, :0]))
        if kind in ("encode_oov", "encode_negative"):
            bad = ids.clone()
            bad[0, rng.randrange(bad.shape[1])] = VOCAB + 3 if kind == "encode_oov" else -2
            return expect_error(lambda: hsc.encode(model, bad))
        if kind == "encode_right_padding":
            padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
            mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=torch.long)], 1)
            return expect_error(
                lambda: hsc.encode(model, padded, attention_mask=mask),
                lambda st: _state_check(st, hsc.encode(model, ids)),
            )
        if kind == "encode_pad_no_mask":
            padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
            return expect_error(lambda: hsc.encode(model, padded), lambda st: _state_check(st, hsc.encode(model, ids)))
        if kind == "encode_not_model":
            return expect_error(lambda: hsc.encode(rng.choice([None, "mamba", torch.nn.Linear(2, 2)]), ids))
        if kind == "encode_backend":
            return expect_error(lambda: hsc.encode(model, ids, backend=rng.choice(["nope", 3])))
    # ------------------------------------------------------------------ composer / setup
    if kind == "compose_empty":
        return expect_error(lambda: StateComposer("picaso_r").compose([]))
    if kind == "compose_non_state":
        return expect_error(lambda: StateComposer("soup").compose([s1, rng.choice([None, 3, torch.zeros(2)])]))
    if kind == "compose_method_unknown":
        return expect_error(lambda: hsc.compose_states([s1, s2], method=rng.choice(["nope", 7, None])))
    if kind == "compose_concat_no_model":
        return expect_error(lambda: StateComposer("concat").compose([s1, s2]))
    if kind == "compose_weights_nan":
        return expect_error(lambda: StateComposer("weighted", weights=[float("inf"), 0.0]).compose([s1, s2]))
    if kind == "enable_not_model":
        return expect_error(lambda: hsc.enable(rng.choice([None, "model", torch.nn.Linear(2, 2)])))
    if kind == "set_backend_unknown":
        return expect_error(lambda: hsc.set_backend(model, rng.choice(["nope", "cuda", 1])))
    if kind == "fingerprint_not_model":
        return expect_error(lambda: hsc.model_fingerprint(rng.choice([None, "m", torch.nn.Linear(2, 2)])))
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    if kind == "save_to_dir":
        return expect_error(lambda: s1.save(tmp))
    if kind == "save_missing_dir":
        return expect_error(lambda: s1.save(os.path.join(tmp, "missing", "x.safetensors")))
    if kind == "save_not_state":
        from hf_statecompose.state.serialization import save_state

        return expect_error(lambda: save_state(rng.choice([None, {"ssm": 1}, torch.zeros(2)]), os.path.join(tmp, "x")))
    path = os.path.join(tmp, "s.safetensors")
    s1.save(path)
    if kind == "load_dir":
        return expect_error(lambda: ComposableMambaCache.load(tmp, model=model))
    if kind == "load_none":
        return expect_error(lambda: ComposableMambaCache.load(None, model=model))
    if kind == "load_model_str":
        return expect_error(lambda: ComposableMambaCache.load(path, model="mamba"))
    if kind == "load_device_bad":
        return expect_error(lambda: ComposableMambaCache.load(path, model=model, device=rng.choice(["nope", 3.5])))
    raise ValueError(kind)


def _state_check(actual, expected):
    a, b = state_dict_of(actual), state_dict_of(expected)
    for name in sorted(b["tensors"]):
        x, y = a["tensors"].get(name), b["tensors"][name]
        if x is None or x.shape != y.shape or x.dtype != y.dtype:
            return silent(f"state differs from encoding the real tokens alone ({name} shape/dtype)")
        if name.startswith(("resample.clock", "resample.times")):
            if int((x - y).abs().max()) > 64:
                return silent(f"state differs from encoding the real tokens alone ({name})")
        elif x.is_floating_point():
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5):
                return silent(f"state differs from encoding the real tokens alone ({name})")
        elif not torch.equal(x, y):
            return silent(f"state differs from encoding the real tokens alone ({name})")
    return handled("equal to encoding the real tokens alone")


# ================================================================================================ category d: stores
STORE_KINDS = (
    "control",
    "flip",
    "truncate",
    "symlink_store",
    "symlink_shards",
    "symlink_deleted",
    "forged_manifest",
    "path_is_file",
    "parent_is_file",
    "add_bad",
    "readd",
    "readd_ids",
    "bad_ids",
    "get_A_inplace",
    "get_ssm_inplace",
    "concurrent_same",
    "concurrent_disjoint",
    "readonly",
    "wrong_model",
    "header_missing",
    "delete_compact",
    "kill_add",
    "kill_delete",
    "kill_compact",
)
ADD_BAD = (
    "None",
    "[None]",
    "[blank]",
    "str",
    "metadata_dict",
    "metadata_obj",
    "batch0",
    "batch_bool",
    "[bytes]",
    "[int]",
    "[]",
)
BAD_IDS = (
    "get_short",
    "get_int",
    "get_empty_list",
    "get_absent",
    "delete_absent",
    "delete_empty",
    "delete_traversal",
    "entries_bad",
    "retrieve_k_negative",
    "retrieve_k_str",
    "retrieve_empty",
    "retrieve_exclude_str",
    "retrieve_none",
    "get_upper",
)
FOLDER_ONLY = ("symlink_shards", "symlink_deleted", "forged_manifest", "header_missing")
LANCE_ONLY = ("readd_ids",)


def gen_store(rng, scale, backends):
    counts = {
        "flip": 12,
        "truncate": 6,
        "add_bad": len(ADD_BAD),
        "bad_ids": len(BAD_IDS),
        "kill_add": 10,
        "kill_delete": 14,
        "kill_compact": 10,
        "concurrent_same": 3,
        "concurrent_disjoint": 2,
        "forged_manifest": 3,
    }
    ci = {
        "flip": 4,
        "truncate": 2,
        "add_bad": 4,
        "bad_ids": 5,
        "kill_add": 3,
        "kill_delete": 4,
        "kill_compact": 3,
        "concurrent_same": 1,
        "concurrent_disjoint": 1,
        "forged_manifest": 1,
    }
    cases = []
    for backend in backends:
        for kind in STORE_KINDS:
            if (kind in FOLDER_ONLY and backend != "folder") or (kind in LANCE_ONLY and backend != "lance"):
                continue
            n = (counts if scale == "full" else ci).get(kind, 1)
            for i in range(n):
                params = {"backend": backend, "mutation": kind, "seed": rng.randrange(1 << 30)}
                if kind == "add_bad":
                    params["variant"] = ADD_BAD[i % len(ADD_BAD)] if scale == "full" else rng.choice(ADD_BAD)
                if kind == "bad_ids":
                    params["variant"] = BAD_IDS[i % len(BAD_IDS)] if scale == "full" else rng.choice(BAD_IDS)
                cases.append(("d", "store", params))
    return cases


def _copy_store(ctx, backend):
    dst = os.path.join(tempfile.mkdtemp(dir=ctx.workdir), "store")
    shutil.copytree(ctx.store_refs[backend]["path"], dst, symlinks=True)
    return dst


def _verify_store(ctx, backend, path, expect_ids=None, gone=(), extra=None, model=None) -> dict:
    """Reopen and read every entry: texts, states and retrieval against the reference. Returns handled / silent
    (for a case without a kill) with what differs; an exception propagates (classified)."""
    ref = ctx.store_refs[backend]
    store = open_store(ctx, backend, path, model=model)
    expect_ids = set(ref["ids"]) - set(gone) if expect_ids is None else set(expect_ids)
    have = set(store.ids())
    missing = sorted(expect_ids - have)
    if missing:
        return {"outcome": "missing", "detail": f"{len(missing)} entries missing after reopening ({missing[:2]})"}
    reappeared = sorted(set(gone) & have)
    if reappeared:
        return {"outcome": "wrong", "detail": f"deleted entries present: {reappeared[:2]}"}
    known = [i for i in sorted(expect_ids) if i in ref["tensors"]]
    for entry_id, state, entry in zip(known, store.get(known), store.entries(known)):
        if entry.text != ref["texts"][entry_id]:
            return {"outcome": "wrong", "detail": f"entry {entry_id} text differs"}
        tensors = state_dict_of(state)["tensors"]
        for name, t in ref["tensors"][entry_id].items():
            if name not in tensors or not torch.equal(tensors[name], t):
                return {"outcome": "wrong", "detail": f"entry {entry_id} tensor {name} differs"}
    for entry_id in known[:2]:
        top = store.retrieve(ref["texts"][entry_id], k=1, load_states=False)
        if not top or top[0].id != entry_id:
            return {"outcome": "wrong", "detail": f"retrieve(text of {entry_id}) did not return it"}
    extra_ids = sorted(have - expect_ids)
    if extra is not None:
        return extra(store, have)
    if extra_ids:
        return {"outcome": "wrong", "detail": f"{len(extra_ids)} unexpected entries"}
    return {"outcome": "ok", "detail": f"{len(have)} entries verified"}


def _as_case(verdict: dict, bad="silent") -> dict:
    if verdict["outcome"] == "ok":
        return handled(verdict["detail"])
    return {"outcome": bad, "detail": verdict["detail"]}


def _store_files(path):
    out = []
    for root, _, files in os.walk(path):
        for name in files:
            if name != ".lock":
                out.append(os.path.join(root, name))
    return sorted(out)


def _snapshot(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                out[os.path.relpath(os.path.join(root, name), folder)] = handle.read()
    return out


def run_store_case(ctx, params):
    backend, kind = params["backend"], params["mutation"]
    rng = random.Random(params["seed"])
    ref = ctx.store_refs[backend]
    if kind.startswith("kill_"):
        return run_kill_trial(ctx, backend, kind, rng)
    if kind.startswith("concurrent_"):
        return run_concurrent(ctx, backend, kind, rng)
    if kind == "readonly":
        return run_readonly(ctx, backend)
    path = _copy_store(ctx, backend)
    if kind == "control":
        return _as_case(_verify_store(ctx, backend, path))
    if kind in ("flip", "truncate"):
        target = rng.choice(_store_files(path))
        with open(target, "rb") as handle:
            data = bytearray(handle.read())
        if kind == "flip" and data:
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        else:
            data = data[: rng.randrange(len(data))] if data else data
        with open(target, "wb") as handle:
            handle.write(bytes(data))
        params["target"] = os.path.relpath(target, path)
        verdict = _verify_store(ctx, backend, path)
        if verdict["outcome"] == "ok":
            return handled(f"{params['target']} damaged: " + verdict["detail"])
        return silent(f"{params['target']} damaged and accepted: {verdict['detail']}")
    if kind == "symlink_store":
        link = path + "-link"
        os.symlink(path, link)
        return _as_case(_verify_store(ctx, backend, link))
    if kind in ("symlink_shards", "symlink_deleted"):
        sub = "shards" if kind == "symlink_shards" else "deleted"
        outside = os.path.join(os.path.dirname(path), "outside")
        shutil.copytree(os.path.join(path, sub), outside)
        shutil.rmtree(os.path.join(path, sub))
        os.symlink(outside, os.path.join(path, sub))
        sentinels = (
            [("0" * 32) + ".safetensors", ".tmp-user-notes", "notes.txt"]
            if sub == "shards"
            else ["0123456789abcdef", ".tmp-user", "notes.txt"]
        )
        for name in sentinels:
            with open(os.path.join(outside, name), "wb") as handle:
                handle.write(b"user data outside the store")
        before = {k: v for k, v in _snapshot(outside).items() if k in sentinels}
        store = open_store(ctx, backend, path)
        store.delete([ref["ids"][0]])
        store.compact()
        after = _snapshot(outside)
        changed = [k for k in before if after.get(k) != before[k]]
        if changed:
            return silent(f"{sub}/ is a symlink: compaction removed or changed files outside the store: {changed}")
        return _as_case(_verify_store(ctx, backend, path, gone=[ref["ids"][0]]))
    if kind == "forged_manifest":
        from hf_statecompose.store.format import seal as _seal
        from hf_statecompose.store.format import unseal as _unseal

        shards = sorted(p for p in os.listdir(os.path.join(path, "shards")) if p.endswith(".json"))
        victim, donor = rng.sample(shards, 2)
        manifest = _unseal(Path(path, "shards", donor), "manifest")
        import uuid

        forged = uuid.uuid4().hex
        shutil.copy(
            os.path.join(path, "shards", donor[:-5] + ".safetensors"),
            os.path.join(path, "shards", forged + ".safetensors"),
        )
        # a self-consistent manifest (sealed) for a copy of the donor shard, with all its entries, that claims to
        # supersede the donor and the victim: the victim's entries were neither deleted nor copied into it
        manifest.update(shard=forged, supersedes=sorted([victim[:-5], donor[:-5]]))
        with open(os.path.join(path, "shards", forged + ".json"), "wb") as handle:
            handle.write(_seal(manifest))
        store = open_store(ctx, backend, path)
        victims = [i for i in ref["ids"] if i not in store.ids()]
        store.compact()
        gone = [i for i in ref["ids"] if i not in open_store(ctx, backend, path).ids()]
        if gone:
            return silent(
                f"a forged manifest superseding shard {victim[:8]} made {len(gone)} entries vanish without an error "
                f"(before compaction: {len(victims)})"
            )
        return handled("forged manifest without effect")
    if kind == "path_is_file":
        file_path = os.path.join(os.path.dirname(path), "a_file")
        with open(file_path, "w") as handle:
            handle.write("x")
        return expect_error(lambda: open_store(ctx, backend, file_path))
    if kind == "parent_is_file":
        file_path = os.path.join(os.path.dirname(path), "a_file")
        with open(file_path, "w") as handle:
            handle.write("x")
        return expect_error(lambda: open_store(ctx, backend, os.path.join(file_path, "store")))
    store = open_store(ctx, backend, path)
    if kind == "add_bad":
        variant = params["variant"]
        call = {
            "None": lambda: store.add(None, show_progress=False),
            "[None]": lambda: store.add([None], show_progress=False),
            "[blank]": lambda: store.add(["   "], show_progress=False),
            "str": lambda: store.add("some text", show_progress=False),
            "metadata_dict": lambda: store.add(["new text"], metadata={"a": 1}, show_progress=False),
            "metadata_obj": lambda: store.add(["new text"], metadata=[{"a": object()}], show_progress=False),
            "batch0": lambda: store.add(["new text"], batch_size=0, show_progress=False),
            "batch_bool": lambda: store.add(["new text"], batch_size=True, show_progress=False),
            "[bytes]": lambda: store.add([b"bytes"], show_progress=False),
            "[int]": lambda: store.add([123], show_progress=False),
            "[]": lambda: store.add([], show_progress=False),
        }[variant]
        if variant == "[]":
            return expect_error(
                call,
                lambda ids: (
                    _as_case(_verify_store(ctx, backend, path)) if ids == [] else silent(f"add([]) returned {ids}")
                ),
            )
        return expect_error(call)
    if kind in ("readd", "readd_ids"):
        n = rng.randrange(1, 4)
        chosen = ref["ids"][:n]
        texts = [ref["texts"][i] for i in chosen]
        kwargs = {"ids": chosen} if kind == "readd_ids" else {}

        def check(ids):
            again = open_store(ctx, backend, path)
            stored = [e.text for e in again.entries(again.ids())]
            dup = sorted(t for t in set(stored) if stored.count(t) > 1)
            if dup or len(again) != len(ref["ids"]):
                return silent(f"re-adding {n} stored texts left {len(again)} entries (duplicates: {len(dup)})")
            return _as_case(_verify_store(ctx, backend, path))

        return expect_error(lambda: store.add(texts, show_progress=False, **kwargs), check)
    if kind == "bad_ids":
        variant = params["variant"]
        absent = "0123456789abcdef"
        calls = {
            "get_short": (lambda: store.get("zz"), None),
            "get_int": (lambda: store.get(5), None),
            "get_empty_list": (
                lambda: store.get([]),
                lambda out: handled() if out == [] else silent(f"get([]) -> {out!r:.40}"),
            ),
            "get_absent": (lambda: store.get([absent]), None),
            "delete_absent": (lambda: store.delete([absent]), None),
            "delete_empty": (lambda: store.delete([]), lambda _: _as_case(_verify_store(ctx, backend, path))),
            "delete_traversal": (lambda: store.delete(["../../../etc/passwd"]), None),
            "entries_bad": (lambda: store.entries(["x" * 16]), None),
            "retrieve_k_negative": (lambda: store.retrieve("fox", k=-1), None),
            "retrieve_k_str": (lambda: store.retrieve("fox", k="2"), None),
            "retrieve_empty": (
                lambda: store.retrieve("", k=1),
                lambda out: handled("empty query answered") if isinstance(out, list) else silent("?"),
            ),
            "retrieve_exclude_str": (
                lambda: store.retrieve("red fox", k=1, exclude=ref["ids"][0]),
                lambda out: (
                    handled("a str exclude read as one id")
                    if out and out[0].id != ref["ids"][0]
                    else silent("exclude=<one id as str> did not exclude it")
                ),
            ),
            "retrieve_none": (lambda: store.retrieve(None), None),
            "get_upper": (lambda: store.get(ref["ids"][0].upper()), None),
        }
        fn, accept = calls[variant]
        return expect_error(fn, accept)
    if kind in ("get_A_inplace", "get_ssm_inplace"):
        first, second = ref["ids"][0], ref["ids"][1]
        state = store.get(first)
        (state.A if kind == "get_A_inplace" else state.ssm_states)[0].mul_(2.0).add_(0.25)
        for entry_id in (first, second):
            again = state_dict_of(store.get(entry_id))["tensors"]
            for name, t in ref["tensors"][entry_id].items():
                if not torch.equal(again[name], t):
                    return silent(
                        f"editing a get() state's {'A' if kind == 'get_A_inplace' else 'ssm'} in place changed what "
                        f"get({'the same' if entry_id == first else 'another'} id) returns ({name})"
                    )
        return _as_case(_verify_store(ctx, backend, path))
    if kind == "wrong_model":
        return expect_error(lambda: open_store(ctx, backend, path, model=ctx.others["mamba2"]))
    if kind == "header_missing":
        os.remove(os.path.join(path, "store.json"))
        return expect_error(lambda: open_store(ctx, backend, path))
    if kind == "delete_compact":
        gone = rng.sample(ref["ids"], 2)
        store.delete(gone)
        store.compact()
        return _as_case(_verify_store(ctx, backend, path, gone=gone), bad="lost")
    raise ValueError(kind)


def run_readonly(ctx, backend):
    """The store (folder and files) read-only, opened and read by an unprivileged user (root ignores modes)."""
    path = _copy_store(ctx, backend)
    for folder in (ctx.workdir, os.path.dirname(path)):
        os.chmod(folder, 0o755)
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o555)
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    return _as_case(_verify_store(ctx, backend, path))


def run_concurrent(ctx, backend, kind, rng):
    """Two processes add at the same time: the same texts (and, on Lance, the same ids) or different ones."""
    path = _copy_store(ctx, backend)
    import uuid

    same = kind == "concurrent_same"
    texts = [rng.sample(NEW_TEXTS, 3)] * 2 if same else [NEW_TEXTS[:3], NEW_TEXTS[3:]]
    ids = [uuid.uuid4().hex[:16] for _ in range(3)]
    start = time.time() + 1.5  # both open first, then add at once

    def writer(n):
        def fn():
            store = open_store(ctx, backend, path)
            time.sleep(max(0.0, start - time.time()))
            kwargs = {"ids": ids if same else [uuid.uuid4().hex[:16] for _ in range(3)]} if backend == "lance" else {}
            out = store.add(texts[n], show_progress=False, **kwargs)
            return {"outcome": "handled", "detail": json.dumps(out)}

        return fn

    results = [None, None]
    import threading

    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, run_forked(writer(n), 60))) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if r["outcome"] != "handled"]
    written = [json.loads(r["detail"]) for r in results if r["outcome"] == "handled"]

    def extra(store, have):
        entries = store.entries(sorted(have))
        stored = [e.text for e in entries]
        for out in written:
            if any(i not in have for i in out):
                return {"outcome": "missing", "detail": "an id returned by add() is missing"}
        expected_new = (
            len(texts[0]) if same else sum(len(t) for t, r in zip(texts, results) if r["outcome"] == "handled")
        )
        if len(have) != len(ctx.store_refs[backend]["ids"]) + expected_new or len(set(stored)) != len(stored):
            return {
                "outcome": "wrong",
                "detail": f"{len(have) - len(ctx.store_refs[backend]['ids'])} new entries for "
                f"{expected_new} texts (duplicates: {len(stored) - len(set(stored))})",
            }
        return {"outcome": "ok", "detail": "one copy of each text"}

    def check():
        try:
            return _verdict_case(_verify_store(ctx, backend, path, extra=extra))
        except Exception as error:  # noqa: BLE001
            return lost(f"store unreadable after two concurrent writers: {classify_exception(error)['detail']}")

    verdict = run_forked(check, 60)
    if verdict["outcome"] != "handled":
        return verdict
    # the store is right; a writer that was refused is judged by its error (a clear "busy" is fine)
    return min(errors, key=lambda r: r["outcome"] == "clear") if errors else verdict


def _verdict_case(verdict):
    return {"ok": handled, "missing": lost, "wrong": silent}[verdict["outcome"]](verdict["detail"])


def run_kill_trial(ctx, backend, kind, rng):
    """Fork a writer, SIGKILL it after a random delay during its operation, then reopen and check that no
    committed entry is lost and a multi-id delete is all or nothing."""
    path = _copy_store(ctx, backend)
    ref = ctx.store_refs[backend]
    op = kind[len("kill_") :]
    to_delete = rng.sample(ref["ids"], 3)
    if op == "compact":  # something to compact: delete two first (committed before the trial)
        pre = rng.sample(ref["ids"], 2)
        run_forked(lambda: (open_store(ctx, backend, path).delete(pre), handled())[1], 60)
    else:
        pre = []
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            store = open_store(ctx, backend, path)
            _write_all(w, b"S\n")
            if op == "add":
                for text in NEW_TEXTS:
                    out = store.add([text], show_progress=False)
                    _write_all(w, ("A" + json.dumps(out) + "\n").encode())
            elif op == "delete":
                store.delete(to_delete)
                _write_all(w, b"D\n")
            else:
                store.compact()
                _write_all(w, b"C\n")
            _write_all(w, b"E\n")
        finally:
            os._exit(0)
    os.close(w)
    buffer = b""
    deadline = time.monotonic() + 60
    delay = {"add": rng.uniform(0, 0.6), "delete": rng.uniform(0, 0.03), "compact": rng.uniform(0, 0.3)}[op]
    started = None
    while time.monotonic() < deadline:
        timeout = 0.005 if started is not None else deadline - time.monotonic()
        ready, _, _ = select.select([r], [], [], max(0.0, timeout))
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buffer += chunk
            if started is None and b"S\n" in buffer:
                started = time.monotonic()
        if started is not None and time.monotonic() - started >= delay:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with contextlib.suppress(BlockingIOError, OSError):
        os.set_blocking(r, False)
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buffer += chunk
    os.close(r)
    lines = buffer.decode(errors="replace").splitlines()
    added = [i for line in lines if line.startswith("A") for i in json.loads(line[1:])]
    delete_done = "D" in lines

    def check():
        store_ids_expected = set(ref["ids"]) - set(pre) | set(added)
        if op == "delete":
            try:
                store = open_store(ctx, backend, path)
            except Exception as error:  # noqa: BLE001
                return lost(f"store unopenable after kill -9 during delete: {classify_exception(error)['detail']}")
            have = set(store.ids())
            present = [i for i in to_delete if i in have]
            if delete_done and present:
                return lost(f"delete returned but {len(present)} of 3 entries are still present")
            if 0 < len(present) < 3:
                return lost(f"kill -9 during delete([a, b, c]): half applied ({3 - len(present)} of 3 deleted)")
            gone = [] if len(present) == 3 else to_delete
            verdict = _verify_store(ctx, backend, path, expect_ids=set(ref["ids"]) - set(gone), gone=gone)
        else:
            try:
                verdict = _verify_store(
                    ctx,
                    backend,
                    path,
                    expect_ids=store_ids_expected,
                    gone=pre,
                    extra=(lambda s, have: {"outcome": "ok", "detail": f"{len(have)} entries"})
                    if op == "add"
                    else None,
                )
            except Exception as error:  # noqa: BLE001
                return lost(
                    f"store unopenable / unreadable after kill -9 during {op}: {classify_exception(error)['detail']}"
                )
        if verdict["outcome"] == "ok":
            return handled(
                f"killed after {delay * 1000:.0f} ms ({'done' if 'E' in lines else 'mid-operation'}): {verdict['detail']}"
            )
        return lost(f"after kill -9 during {op} ({delay * 1000:.0f} ms): {verdict['detail']}")

    return run_forked(check, 60)


# ================================================================================================ category e: CLI
CLI_KINDS = (
    "no_command",
    "unknown_command",
    "build_missing_input",
    "build_store_is_file",
    "build_bad_jsonl",
    "build_blank_input",
    "build_bad_model",
    "build_bad_batch",
    "query_no_store",
    "query_empty_text",
    "query_k_negative",
    "query_bad_composition",
    "query_corrupt_header",
    "query_flipped_manifest",
    "stats_on_file",
    "stats_not_store",
    "delete_bad_id",
    "delete_absent_id",
    "compact_not_store",
    "migrate_dest_is_file",
    "migrate_src_missing",
    "encode_corpus_missing_input",
    "build_latin1",
    "query_ok",
    "stats_ok",
    "subprocess_no_args",
    "subprocess_bad_k",
    "subprocess_help",
)
CLI_CI = (
    "no_command",
    "build_store_is_file",
    "build_bad_jsonl",
    "query_no_store",
    "query_corrupt_header",
    "stats_on_file",
    "delete_bad_id",
    "delete_absent_id",
    "migrate_dest_is_file",
    "query_ok",
    "subprocess_no_args",
    "subprocess_bad_k",
)


def gen_cli(rng, scale):
    kinds = CLI_KINDS if scale == "full" else CLI_CI
    reps = 2 if scale == "full" else 1
    return [
        ("e", "cli", {"mutation": k, "seed": rng.randrange(1 << 30)})
        for k in kinds
        for _ in range(reps if k.startswith("query_flip") else 1)
    ]


def cli_setup(ctx):
    """A store built by the CLI with the embedded demo model (once, in a subprocess)."""
    folder = os.path.join(ctx.workdir, "cli")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "passages.jsonl"), "w") as handle:
        handle.write("".join(json.dumps({"text": t}) + "\n" for t in STORE_TEXTS[:3]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_statecompose",
            "build",
            os.path.join(folder, "store"),
            os.path.join(folder, "passages.jsonl"),
            "--model",
            "demo",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if done.returncode != 0:
        raise RuntimeError(f"CLI setup failed: {done.stderr[-2000:]}")
    ctx.cli_store = os.path.join(folder, "store")


def _cli_outcome(code, err, out, expect_ok=None) -> dict:
    lines = err.strip().splitlines()
    if (
        code == 2
        and len(lines) == 1
        and lines[0].startswith(PROG_ERROR)
        and "Traceback" not in err
        and len(lines[0]) <= 400 + len(PROG_ERROR)
    ):
        return {"outcome": "clear", "detail": lines[0][:300]}
    if code == 0:
        if expect_ok is None:
            return silent(f"exit 0 for a user error (stdout {out.strip()[:80]!r})")
        return expect_ok(out)
    return {"outcome": "unclear", "detail": f"exit {code}, {len(lines)} stderr lines: {' | '.join(lines[-2:])[:300]}"}


def run_cli_case(ctx, params):
    kind = params["mutation"]
    rng = random.Random(params["seed"])
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    a_file = os.path.join(tmp, "a_file")
    with open(a_file, "w") as handle:
        handle.write("x")
    good = os.path.join(ctx.workdir, "cli", "passages.jsonl")
    store = os.path.join(tmp, "store")
    shutil.copytree(ctx.cli_store, store)
    if kind.startswith("subprocess_"):
        argv = {
            "subprocess_no_args": [],
            "subprocess_bad_k": ["query", store, "fox", "-k", "-3"],
            "subprocess_help": ["--help"],
        }[kind]
        done = subprocess.run(
            [sys.executable, "-m", "hf_statecompose", *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        return _cli_outcome(
            done.returncode,
            done.stderr,
            done.stdout,
            (lambda out: handled("help printed") if "usage" in out else silent("no help"))
            if kind == "subprocess_help"
            else None,
        )
    bad_jsonl = os.path.join(tmp, "bad.jsonl")
    with open(bad_jsonl, "w") as handle:
        handle.write('{"text": "fine"}\n{oops\n')
    blank = os.path.join(tmp, "blank.txt")
    with open(blank, "w") as handle:
        handle.write("\n\n  \n")
    latin1 = os.path.join(tmp, "latin1.txt")
    with open(latin1, "wb") as handle:
        handle.write("caf\xe9 au lait\n".encode("latin-1"))
    expect_ok = None
    if kind in ("query_corrupt_header", "query_flipped_manifest"):
        target = (
            os.path.join(store, "store.json")
            if kind == "query_corrupt_header"
            else os.path.join(
                store,
                "shards",
                rng.choice([n for n in os.listdir(os.path.join(store, "shards")) if n.endswith(".json")]),
            )
        )
        data = bytearray(Path(target).read_bytes())
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        Path(target).write_bytes(bytes(data))
    argv = {
        "no_command": [],
        "unknown_command": ["frobnicate"],
        "build_missing_input": ["build", os.path.join(tmp, "new"), os.path.join(tmp, "missing.jsonl")],
        "build_store_is_file": ["build", a_file, good, "--model", "demo"],
        "build_bad_jsonl": ["build", os.path.join(tmp, "new"), bad_jsonl, "--model", "demo"],
        "build_blank_input": ["build", os.path.join(tmp, "new"), blank, "--model", "demo"],
        "build_bad_model": ["build", os.path.join(tmp, "new"), good, "--model", tmp],
        "build_bad_batch": ["build", os.path.join(tmp, "new"), good, "--batch-size", "0"],
        "build_latin1": ["build", os.path.join(tmp, "new"), latin1, "--model", "demo"],
        "query_no_store": ["query", os.path.join(tmp, "nowhere"), "fox"],
        "query_empty_text": ["query", store, "  "],
        "query_k_negative": ["query", store, "fox", "-k", "-1"],
        "query_bad_composition": ["query", store, "fox", "--composition", "nope"],
        "query_corrupt_header": ["query", store, "red fox", "--max-new-tokens", "2"],
        "query_flipped_manifest": ["query", store, "red fox", "--max-new-tokens", "2"],
        "stats_on_file": ["stats", a_file],
        "stats_not_store": ["stats", tmp],
        "delete_bad_id": ["delete", store, "../../etc"],
        "delete_absent_id": ["delete", store, "0123456789abcdef"],
        "compact_not_store": ["compact", tmp],
        "migrate_dest_is_file": ["store", "migrate", store, a_file],
        "migrate_src_missing": ["store", "migrate", os.path.join(tmp, "nope"), os.path.join(tmp, "dst")],
        "encode_corpus_missing_input": ["encode-corpus", os.path.join(tmp, "dst"), os.path.join(tmp, "missing.jsonl")],
        "query_ok": ["query", store, "red fox", "-k", "1", "--max-new-tokens", "2", "--json"],
        "stats_ok": ["stats", store],
    }[kind]
    if kind == "query_ok":
        expect_ok = lambda out: (
            handled("query answered") if json.loads(out).get("passages") or json.loads(out) else silent("empty answer")
        )
    elif kind == "stats_ok":
        expect_ok = lambda out: (
            handled("stats") if json.loads(out).get("entries") == 3 else silent(f"stats: {out[:80]}")
        )
    elif kind == "query_flipped_manifest":
        expect_ok = None
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT)
            fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            from hf_statecompose.cli import main

            try:
                code = main(argv) or 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
            except BaseException:  # noqa: BLE001 (an uncaught error: its traceback, as the interpreter would print it)
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"outcome": "hang", "detail": "CLI call ran past 120 s"}
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    err = Path(err_path).read_text(errors="replace")
    out = Path(out_path).read_text(errors="replace")
    if kind in ("query_corrupt_header", "query_flipped_manifest") and code == 0:
        return (
            handled("a flipped byte without effect on the answer")
            if "red fox" in out or out
            else silent("empty answer")
        )
    return _cli_outcome(code, err, out, expect_ok)


# ================================================================================================ category f: encode_corpus
RAY_KINDS = (
    "passages_none",
    "passages_dict",
    "passages_int_item",
    "passages_missing_field",
    "passages_blank",
    "passages_missing_file",
    "passages_duplicate_ids",
    "passages_bad_metadata",
    "batch_zero",
    "cpus_zero",
    "model_path_int",
    "retriever_not_callable",
    "text_field_missing",
)
RAY_CI = ("passages_none", "passages_blank", "passages_duplicate_ids")


def gen_ray(rng, scale):
    return [
        ("f", "ray", {"mutation": k, "seed": rng.randrange(1 << 30)})
        for k in (RAY_KINDS if scale == "full" else RAY_CI)
    ]


def run_ray_case(ctx, params):
    """Argument misuse of ``encode_corpus``: refused before Ray starts (no cluster is started for these)."""
    from hf_statecompose.distributed import encode_corpus

    kind = params["mutation"]
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    store = os.path.join(tmp, "store")
    passages, kwargs = ["a fine passage", "another one"], {}
    if kind == "passages_none":
        passages = None
    elif kind == "passages_dict":
        passages = {"text": "x"}
    elif kind == "passages_int_item":
        passages = ["x", 5]
    elif kind == "passages_missing_field":
        passages = [{"body": "x"}]
    elif kind == "passages_blank":
        passages = ["fine", "   "]
    elif kind == "passages_missing_file":
        passages = os.path.join(tmp, "missing.jsonl")
    elif kind == "passages_duplicate_ids":
        passages = [{"text": "a", "id": "same"}, {"text": "b", "id": "same"}]
    elif kind == "passages_bad_metadata":
        passages = [{"text": "a", "when": float("nan")}]
    elif kind == "batch_zero":
        kwargs = {"batch_size": 0}
    elif kind == "cpus_zero":
        kwargs = {"cpus_per_actor": 0}
    elif kind == "model_path_int":
        return expect_error(lambda: encode_corpus(passages, 3, store, show_progress=False))
    elif kind == "retriever_not_callable":
        kwargs = {"retriever": "minilm"}
    elif kind == "text_field_missing":  # dicts without the named field (plain strings would be read as that field)
        passages, kwargs = [{"text": "a"}, {"text": "b"}], {"text_field": "body"}
    return expect_error(lambda: encode_corpus(passages, "demo", store, show_progress=False, **kwargs))


# ================================================================================================ driver
RUNNERS = {
    "file_bytes": run_file_case,
    "file_struct": run_file_case,
    "memory": run_memory_case,
    "api": run_api_case,
    "store": run_store_case,
    "cli": None,
    "ray": run_ray_case,
}
IN_PARENT = ("store", "cli")  # these fork their own children (writers, kills, CLI)


def generate_cases(seed: int, scale: str, backends) -> list[dict]:
    rng = random.Random(seed)
    raw = (
        gen_files(rng, scale)
        + gen_memory(rng, scale)
        + gen_api(rng, scale)
        + gen_store(rng, scale, backends)
        + gen_cli(rng, scale)
        + gen_ray(rng, scale)
    )
    cases = []
    for n, (category, kind, params) in enumerate(raw):
        label = params.get("arch") or params.get("backend") or kind
        variant = f"/{params['variant']}" if "variant" in params else ""
        cases.append(
            {
                "id": f"{category}{n:04d}",
                "category": category,
                "kind": kind,
                "name": f"{label}:{params['mutation']}{variant}",
                "params": params,
            }
        )
    return cases


def run_case(ctx, case, quiet=True) -> dict:
    params = dict(case["params"], _kind=case["kind"])
    kind = case["kind"]
    started = time.monotonic()
    if kind == "cli":
        result = run_forked(lambda: run_cli_case(ctx, params), 200, quiet=quiet)
    elif kind == "store":
        timeout = 180 if params["mutation"].startswith(("kill", "concurrent", "forged", "symlink")) else 90
        result = run_forked(lambda: run_store_case(ctx, params), timeout, quiet=quiet)
    else:
        result = run_forked(lambda: RUNNERS[kind](ctx, params), 120 if kind == "ray" else CASE_TIMEOUT, quiet=quiet)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def table(results, cases) -> dict:
    out = {}
    for category in list(CATEGORIES) + ["total"]:
        row = dict.fromkeys(OUTCOMES, 0)
        for case, result in zip(cases, results):
            if category == "total" or case["category"] == category:
                row[result["outcome"]] += 1
        row["cases"] = sum(row[o] for o in OUTCOMES)
        out[category] = row
    return out


def format_table(summary) -> str:
    head = f"{'category':<26}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'cases':>8}"
    lines = [head, "-" * len(head)]
    for category, row in summary.items():
        label = f"{category} {CATEGORIES[category]}" if category in CATEGORIES else "total"
        lines.append(f"{label:<26}" + "".join(f"{row[o]:>9}" for o in OUTCOMES) + f"{row['cases']:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", choices=("full", "ci"), default="full")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "adversarial.json"))
    parser.add_argument(
        "--case", default=None, help="run one case id in this process and print its outcome and traceback"
    )
    parser.add_argument("--backends", default="folder,lance", help="store backends (default: folder,lance)")
    parser.add_argument("--categories", default="abcdef", help="categories to run (default: all)")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(
        1
    )  # one thread: forking after torch's thread pool started would be unsafe, and cases are tiny
    warnings.filterwarnings("ignore")
    backends = tuple(b for b in args.backends.split(",") if b)
    cases = generate_cases(args.seed, args.scale, backends)
    cases = [c for c in cases if c["category"] in args.categories]
    if args.case:
        cases = [c for c in cases if c["id"] == args.case]
        if not cases:
            parser.error(f"no case {args.case!r} at --seed {args.seed} --scale {args.scale}")
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="hsc-adversarial-")
    try:
        ctx = Context(workdir, args.seed)
        if any(c["category"] == "d" for c in cases):
            ctx.build_base_stores(backends)
        if any(c["category"] == "e" for c in cases):
            cli_setup(ctx)
        setup_seconds = time.time() - started
        if args.case:
            case = cases[0]
            print(json.dumps(case, default=str))
            params = dict(case["params"], _kind=case["kind"])
            runner = {"cli": run_cli_case, "store": run_store_case}.get(case["kind"], RUNNERS.get(case["kind"]))
            try:
                print(json.dumps(runner(ctx, params), default=str))
            except BaseException as error:  # noqa: BLE001
                traceback.print_exc()
                print(json.dumps(classify_exception(error)))
            return 0
        results = []
        for case in cases:
            results.append(run_case(ctx, case))
            if results[-1]["outcome"] not in ("clear", "handled"):
                print(
                    f"  {case['id']} {case['name']}: {results[-1]['outcome']}: {results[-1]['detail'][:200]}",
                    flush=True,
                )
        summary = table(results, cases)
        elapsed = time.time() - started
        print(format_table(summary))
        print(
            f"{len(cases)} cases, seed {args.seed}, scale {args.scale}, backends {','.join(backends)}: {elapsed:.0f} s "
            f"(setup {setup_seconds:.0f} s)"
        )
        backend_flag = "" if backends == ("folder", "lance") else f" --backends {','.join(backends)}"
        report = {
            "seed": args.seed,
            "scale": args.scale,
            "backends": list(backends),
            "cases": len(cases),
            "seconds": round(elapsed, 1),
            "setup_seconds": round(setup_seconds, 1),
            "torch": torch.__version__,
            "table": summary,
            "non_clean": [
                {
                    "id": c["id"],
                    "category": c["category"],
                    "case": c["name"],
                    "outcome": r["outcome"],
                    "detail": r["detail"],
                    "repro": f"python benchmarks/adversarial.py --seed {args.seed} --scale {args.scale}{backend_flag} --case {c['id']}",
                }
                for c, r in zip(cases, results)
                if r["outcome"] not in ("clear", "handled")
            ],
            "by_case": [
                {"id": c["id"], "case": c["name"], "outcome": r["outcome"], "seconds": r["seconds"]}
                for c, r in zip(cases, results)
            ],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1, default=str)
        print(f"wrote {args.json}")
        if args.plot:
            from _plot import plot_docs

            plot_docs(args.json, "adversarial.json")
        return 0
    finally:
        for root, dirs, _ in os.walk(
            workdir
        ):  # the read-only cases left read-only folders (a non-root user cannot remove them)
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, name), 0o755)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
