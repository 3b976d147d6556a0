"""What every family of the adversarial trial shares: the tiny models, the state helpers, the classifying oracle,
the forking runner and the context built once before the cases fork."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch

import hf_statecompose as hsc

PKG_DIR = os.path.dirname(os.path.abspath(hsc.__file__)) + os.sep
BENCH_DIR = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep
)  # the families: a TypeError of argument binding in a case
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
    binding = (
        isinstance(error, TypeError) and bool(last) and last.filename.startswith(BENCH_DIR) and "argument" in message
    )
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


def _state_case(ctx, params):
    """What a memory or API case starts from: its architecture, mutation, seeded rng, model, references, fresh
    copies of the two reference states and the query."""
    arch = params["arch"]
    ref = ctx.refs[arch]
    s1, s2 = (s.clone() for s in ctx.states[arch])
    return arch, params["mutation"], random.Random(params["seed"]), ctx.models[arch], ref, s1, s2, ref["query"]


# ================================================================================================ issue 29 helpers
def close_logits(actual, expected, tol=1e-4, what="logits") -> dict:
    """``handled`` when ``actual`` is within ``tol`` (relative to the reference's largest magnitude) of ``expected``,
    else ``silent``: for results that are equal in exact arithmetic but computed by different paths."""
    if actual.shape != expected.shape:
        return silent(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    error = float((actual.double() - expected.double()).abs().nan_to_num(float("inf")).max())
    scale = float(expected.double().abs().max().clamp_min(1e-30))
    if error <= tol * scale:
        return handled(f"{what} within {tol:g} of the reference")
    return silent(f"{what} differ from the reference (max |diff| {error:.3g}, scale {scale:.3g})")


# the tiny hybrids' shared config (Bamba here, the delta-rule hybrids in round5.py): as tests/architectures.py's SMALL
SMALL_HYBRID = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def build_hybrid(seed: int = 0, attention_first: bool = True):
    """A tiny random Bamba (partial RoPE, theta 10000) in float32, enabled: Mamba-2 layers and one attention layer
    (first, so that key positions move the logits from the first layer on)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "bamba",
        **SMALL_HYBRID,
        num_hidden_layers=3,
        attn_layer_indices=[0] if attention_first else [1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper attention than a random init's near-uniform one: key positions matter
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    return hsc.enable(model)


def refused_or(fn, accept) -> dict:
    """Run ``fn``: an exception is classified by the caller's wrapper (clear / unclear); a result goes to ``accept``."""
    return accept(fn())
