"""Model fingerprints: which model (architecture, config, weights) a state was encoded by.

States are only meaningful for the exact model that produced them. The fingerprint hashes the
architecture, the config entries that shape the states, and the bytes of every parameter and buffer
that shapes the states: embeddings, every layer (mixers, norms, adapters such as LoRA included).
Only the LM head and the final norm are left out: they act after the states. Random initialisation
gives identical ``A_log`` and ``D`` across seeds, so those alone would not tell models apart; hashing
every parameter does.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from typing import Any

import torch

from .. import _torch_compat, compat
from .architectures import ARCHITECTURES, supported_classes_text, supported_types_text

# the fingerprint of a cache made while a graph is traced (torch.compile / torch.export): the weights are
# symbolic there (FakeTensors, no bytes to hash), so such a state names no model and no model accepts it
TRACED_FINGERPRINT = ""

# model_type -> its row: the architecture table itself (.architectures), so that a row registered later is supported
SUPPORTED_MODEL_TYPES = ARCHITECTURES

# config entries that do not change the states (runtime flags, bookkeeping, generation defaults)
_CONFIG_KEYS_IGNORED = {
    "_name_or_path",
    "transformers_version",
    "architectures",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "torch_dtype",
    "dtype",
    "use_mambapy",
    "use_associative_scan",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "tokenizer_class",
}


def base_model_of(model: torch.nn.Module) -> Any:
    """The backbone (``model.backbone`` for the LM classes, the model itself for the bare ones, ``model.model`` for
    a hybrid's) of a model of the architecture table."""
    # peft wraps the model: PeftModel.base_model (LoraModel).model is the transformers model
    inner: Any = model  # modules reached through attributes (torch types them Tensor | Module)
    for _ in range(3):
        if hasattr(inner, "backbone") and hasattr(inner.backbone, "layers"):
            return inner.backbone
        if hasattr(inner, "layers") and (hasattr(inner, "embeddings") or hasattr(inner, "embed_tokens")):
            return inner  # Mamba's bare model, or a hybrid's (model.model)
        inner = getattr(inner, "base_model", None) if getattr(inner, "base_model", None) is not inner else None
        if inner is None:
            break
        inner = getattr(inner, "model", inner)
    raise TypeError(
        f"{type(model).__name__} is not a model hf_statecompose supports (no `.backbone.layers` / `.model.layers`); "
        f"pass one of {supported_classes_text()}"
    )


# hybrids whose states are refused, and why (docs/guides/hybrids.md)
_MULTIMODAL = (
    "this is the multimodal model (vision and text); its states are those of its text model: load that one "
    "({}.from_pretrained(...), model_type {!r}) for text contexts"
)
REFUSED_MODEL_TYPES = {
    "lfm2": "its recurrent layers are short gated convolutions without an SSM state or decay: there is nothing for the "
    "decay-weighted rules to weigh, only a window of the last few inputs",
    "qwen3_5": _MULTIMODAL.format("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen3_5_moe": _MULTIMODAL.format("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
    "bailing_hybrid": "its linear layers are Kimi delta attention (supported in Kimi Linear, not wired for this model "
    "yet) and its MLA attention caches keys rotated by interleaved RoPE (pairs of adjacent dims), which this release "
    "does not re-rotate when contexts are concatenated",
    "glm5_next_text": "its linear layers are Kimi delta attention (supported in Kimi Linear, not wired for this model "
    "yet) and its attention layers are indexed (sparse) attention with hyper-connections, whose cache this release "
    "does not compose",
    "qwen4_exp_text": "its gated DeltaNet layers are supported, but its attention layers are indexed (sparse) "
    "attention, whose cache this release does not compose",
    "lara_mini": "its gated DeltaNet layers are supported, but its sliding-window attention layers keep only a window "
    "of keys, which this release does not compose",
    "minimax": "its linear layers are lightning attention (a fixed per-head decay): not supported by this release",
}
REFUSED_MODEL_TYPES["lfm2_moe"] = REFUSED_MODEL_TYPES["lfm2"]


def architecture_of(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise TypeError(f"hf_statecompose does not compose {model_type!r} states: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in ARCHITECTURES:
        raise TypeError(
            f"hf_statecompose supports the model types {supported_types_text()}; got model_type {model_type!r} "
            f"({type(model).__name__})"
        )
    return model_type


def config_summary(config) -> dict:
    """The JSON-able config entries that shape the states, sorted."""
    summary = {}
    for key, value in sorted(config.to_dict().items()):
        if key in _CONFIG_KEYS_IGNORED or key.startswith("_"):
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        summary[key] = value
    return summary


def _state_shaping_tensors(model: torch.nn.Module):
    """``(name, tensor)`` for every tensor that shapes the states, as the forward uses it: a parametrized tensor
    (``torch.nn.utils.parametrize``) is computed through its parametrizations (``module.weight``, named as the
    plain tensor), not read from ``parametrizations.weight.original``: a parametrization's own Python state (a
    scale set after encoding) changes the weight the forward uses, so it changes the fingerprint."""
    named, _ = _collect(model)
    yield from named


def _collect(model: torch.nn.Module) -> tuple[list, frozenset]:
    """The state-shaping tensors (see :func:`_state_shaping_tensors`) and the names of those computed through a
    parametrization (a new tensor at each access: checked by their contents, never by identity)."""
    backbone = base_model_of(model)
    parametrized = [
        (prefix, module)
        for prefix, module in backbone.named_modules()
        if torch.nn.utils.parametrize.is_parametrized(module)
    ]
    hidden = tuple(f"{prefix}.parametrizations." if prefix else "parametrizations." for prefix, _ in parametrized)
    named = [
        (name, tensor)
        for name, tensor in list(backbone.named_parameters()) + list(backbone.named_buffers())
        if not name.startswith("norm_f.")  # acts after the last layer: does not shape the states
        and not (hidden and name.startswith(hidden))  # a parametrization's inputs: the computed tensor stands for them
    ]
    computed = []
    _refuse_meta(model, named)
    with torch.no_grad():
        for prefix, module in parametrized:
            if prefix == "norm_f" or prefix.startswith("norm_f."):
                continue
            for tensor_name in module.parametrizations:
                name = f"{prefix}.{tensor_name}" if prefix else tensor_name
                named.append((name, getattr(module, tensor_name).detach()))
                computed.append(name)
    return named, frozenset(computed)


def _refuse_meta(model, named: list) -> None:
    """Offloaded weights (accelerate's ``cpu_offload``, ``from_pretrained`` / ``dispatch_model`` with a
    ``device_map`` that offloads to ``"cpu"`` or ``"disk"``) sit on the meta device and are loaded by hooks at each
    forward: there are no bytes to hash, nor a device to put states on. Refused in one line, naming offload."""
    meta = [name for name, tensor in named if tensor.is_meta]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has weights on the meta device (no data: {meta[0]}"
            f"{f' and {len(meta) - 1} more' if len(meta) > 1 else ''}), as offloading leaves them (accelerate's "
            "cpu_offload, or a device_map that offloads to 'cpu' / 'disk'); hf_statecompose does not encode or compose "
            "states with offloaded weights (their bytes name the model): load the model without offload"
        )


# the content checksum's weights: w_j = 2·j·K + 1 (odd) for the j-th element of a chunk; the chunk starting at
# element c adds 2·c·K·Σx (so element i's weight is 2·i·K + 1 in the whole tensor, whichever chunk it is in)
_CHECKSUM_K = 0x2851F42D4C957F2D
_CHECKSUM_CHUNK = 1 << 20
_CHECKSUM_WEIGHTS: dict = {}  # device -> the int64 weights of one chunk (8 MB), made once
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _content_checksum(tensors) -> bytes:
    """An exact content checksum of ``tensors``, computed on their device in one pass over their bits (int64
    arithmetic, wrapping): per tensor, over each element's bit pattern ``x_i``, ``Σ x_i`` and ``Σ x_i · (2·i·K + 1)``
    (``K`` odd); hashed on the host.

    The cache's check for large tensors it cannot make copy-on-write or that lose it on every forward (shared
    memory, ``volatile``, parametrized ones, a torch without copy-on-write; see the comment above
    ``_ARMED_ABOVE``): ``p.data.copy_(w)``, ``p.data[i] = x`` and ``p.data.mul_(s)`` go through ``.data``, whose
    version counter is not the parameter's, so only the contents can tell. What it sees, whatever the values (no
    rounding: bit patterns, not float sums): a change to any one element (its weight is odd, so invertible modulo
    2^64) and, in tensors of 16- or 32-bit elements and fewer than 2^31 of them, a swap of any two elements (the
    plain sum is kept, the weighted one moves by (a - b)·2·(i - j)·K, which has fewer than 64 factors of two). Several changes at once
    go unseen only if they cancel modulo 2^64 in both sums: a deliberate construction, not an edit.
    ``model_fingerprint(model, cache=False)`` hashes every byte. Costs about ten times the old sampled checksum
    (row sums plus 64 sampled elements, which missed a swap within a row that spared the samples):
    ``benchmarks/fingerprint_speed.py``.
    """
    parts = []
    with torch.no_grad():
        for tensor in tensors:
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            bits = flat.view(_BITS[flat.element_size()]) if flat.dtype != torch.bool else flat.view(torch.uint8)
            weights = _CHECKSUM_WEIGHTS.get(flat.device)
            if weights is None:
                chunk = torch.arange(_CHECKSUM_CHUNK, dtype=torch.int64, device=flat.device)
                weights = _CHECKSUM_WEIGHTS[flat.device] = chunk * (2 * _CHECKSUM_K) + 1
            for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
                x = bits[start : start + _CHECKSUM_CHUNK].to(torch.int64)
                plain = x.sum()
                weighted = (x * weights[: x.numel()]).sum() + plain * _wrapped(2 * start * _CHECKSUM_K)
                parts.append(torch.stack([plain, weighted]))
    if not parts:
        return b""
    by_device: dict = {}
    for part in parts:  # one concatenation and one copy to the host per device (not one per tensor)
        by_device.setdefault(part.device, []).append(part)
    digest = hashlib.blake2b(digest_size=16)
    for device in sorted(by_device, key=str):
        digest.update(str(device).encode())
        digest.update(torch.cat(by_device[device]).cpu().numpy().tobytes())
    return digest.digest()


def _wrapped(value: int) -> int:
    """``value`` modulo 2^64 as a signed int64 (two's complement)."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _full_fingerprint(model, architecture: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(architecture.encode())
    digest.update(json.dumps(config_summary(model.config), sort_keys=True).encode())
    for name, tensor in _state_shaping_tensors(model):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        elif _torch_compat.is_copy_on_write(data):
            data = data.clone()  # numpy() asks for a writable pointer: it would end the cache's copy-on-write sentinel
        data = data.contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


# --------------------------------------------------------------------------------------- the per-model cache
# A cached fingerprint stays valid while nothing that shapes the states changed. Each query checks, per
# tensor, O(1) facts instead of reading the weights (the full hash reads every byte: ~1.5 s for 130M fp32
# weights on a CPU, the old content checksum ~70 ms, ~1.5 s per query at 2.7B):
#
# * the config summary, the list of tensor names, and per tensor the very same Python object (a weak
#   reference: replacing a parameter), its storage (``untyped_storage()``: ``p.data = t``, ``.to()``,
#   ``set_``), offset, shape, stride, dtype, device and ``_version`` (every in-place op on the tensor or a view
#   of it, under ``no_grad`` too: optimizer steps, ``load_state_dict``, ``init``);
# * writes through ``.data`` (``p.data.mul_(2)``, ``p.data[i] = x``, ``p.data.copy_(w)``: ``.data`` has its own
#   version counter, so ``_version`` misses them) are caught by a copy-on-write sentinel: after hashing, each
#   large tensor's storage is made lazily copy-on-write (``hf_statecompose._torch_compat``, the one module that
#   calls torch's privates: ``torch._lazy_clone``, whose clone is dropped at once, so nothing is copied and no
#   memory is held). PyTorch materializes such a storage on the first access that
#   may write it, through any alias (``.data``, ``detach()``, views, ``data_ptr()``, ``numpy()``), and a
#   materialized storage is no longer copy-on-write: ``torch._C._is_cow_tensor`` says whether anything could
#   have written the tensor since it was hashed. Reads (matmuls, embeddings) keep it. A tensor found
#   materialized triggers the full hash (the bytes might be the same: a read that asked for a writable
#   pointer, e.g. ``numpy()`` or a save) and is armed again; one found materialized at two checks in a row is
#   checked by the content checksum from then on (``volatile``), so a kernel that takes writable pointers to a
#   weight on every forward costs the checksum of that weight per query, not a full hash;
# * small tensors (1-D ones and those of at most ``_ARMED_ABOVE`` elements: norms, biases, ``D``, Mamba-2's
#   ``A_log``; under 0.5% of the weights: 0.4 MB at 130M, a few MB at 2.7B) are not made copy-on-write (CPU
#   kernels ask for writable pointers to several of them on every forward): their exact bytes are compared
#   with a copy kept at the refresh, on their device, at every check;
# * storages that cannot be copy-on-write (shared memory: ``share_memory_()``; allocators without a plain
#   deleter; every storage on a torch without copy-on-write) fall back to the content checksum
#   (:func:`_content_checksum`, exact since issue 29: any one changed element, any two swapped ones) for that
#   tensor, as do volatile tensors;
# * parametrized tensors (``torch.nn.utils.parametrize``) are hashed as the forward uses them (computed through
#   their parametrizations, so a parametrization's Python state counts) and, being a new tensor at each access,
#   are computed again and checked by their contents (exact bytes when small, the checksum otherwise) at each
#   check;
# * offloaded weights (meta tensors loaded by hooks at each forward) are refused (:func:`_refuse_meta`).
#
# Blind spot (the full hash is the only remedy; ``refresh_fingerprint(model)`` runs it): writes that bypass
# PyTorch's tensor API into memory that was already reachable before the fingerprint was taken: a numpy array
# / DLPack capsule / raw ``data_ptr()`` of a weight obtained before the check and written through after it, a
# CUDA graph replay that writes weights. A parametrization whose output changes with no change to its inputs or
# Python state is computed again at each check, so it is seen too.
_ARMED_ABOVE = 4096
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Cached
_CACHE_LOCK = threading.Lock()
_REFRESH_LOCK = threading.Lock()  # one full hash + arming at a time (arming swaps storages' data pointers)


class _Cached:
    """A model's fingerprint and what it was computed from (see the comment above)."""

    __slots__ = (
        "architecture",
        "armed",
        "checked",
        "checksum",
        "computed",
        "config",
        "fingerprint",
        "identity",
        "lost",
        "names",
        "refs",
        "small",
        "small_bytes",
        "volatile",
    )

    def __init__(self, fingerprint, architecture, config, named, computed, identity, volatile, lost=frozenset()):
        self.fingerprint, self.architecture, self.config, self.volatile = fingerprint, architecture, config, volatile
        self.lost = lost  # armed tensors found materialized at the check that led to this refresh
        self.names = tuple(name for name, _ in named)
        self.computed = computed  # parametrized: a new tensor at each access, checked by its contents only
        # weak: a replaced parameter is freed as usual (a computed tensor's is dead at once, and never compared)
        self.refs = tuple(weakref.ref(t) for _, t in named)
        self.identity = identity
        self.small = [i for i, (_, t) in enumerate(named) if _is_small(t)]
        self.small_bytes = _exact_bytes([named[i][1] for i in self.small])
        self.armed, self.checked = [], []
        for i, (name, t) in enumerate(named):
            if _is_small(t):
                continue
            armable = name not in volatile and name not in computed
            (self.armed if armable and _torch_compat.make_copy_on_write(t) else self.checked).append(i)
        self.checksum = _content_checksum([named[i][1] for i in self.checked])

    def still_valid(self, architecture, config, named, computed) -> bool | None:
        """True when nothing changed; False when something did (or may have); None when an armed tensor
        was materialized with nothing else changed (it may have been written through ``.data``)."""
        if architecture != self.architecture or config != self.config or len(named) != len(self.names):
            return False
        if computed != self.computed:
            return False
        for (name, t), expected_name, ref, expected in zip(named, self.names, self.refs, self.identity):
            if name != expected_name:
                return False
            if name in computed:  # a parametrized tensor: its contents are checked below (small or checksum)
                if _identity(t, computed=True) != expected:
                    return False
                continue
            if ref() is not t or _identity(t) != expected:
                return False
        if not _same_bytes(_exact_bytes([named[i][1] for i in self.small]), self.small_bytes):
            return False
        if self.checked and _content_checksum([named[i][1] for i in self.checked]) != self.checksum:
            return False
        for i in self.armed:
            if not _torch_compat.is_copy_on_write(named[i][1]):
                return None
        return True


def _identity(t: torch.Tensor, computed: bool = False) -> tuple:
    """What identifies a tensor's contents without reading them; no access here materializes a copy-on-write
    storage (its storage object's address does not; ``data_ptr()`` would). A computed (parametrized) tensor is new
    at each access: only its shape, dtype and device."""
    if computed:
        return (tuple(t.shape), t.dtype, t.device)
    return (
        _torch_compat.storage_id(t),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device,
        _torch_compat.version(t),
    )


def _exact_bytes(tensors) -> dict:
    """The exact bytes of ``tensors``: one uint8 tensor per device (a copy, concatenated on the device)."""
    by_device: dict = {}
    for t in tensors:
        data = t.detach()
        if data.numel():
            by_device.setdefault(str(data.device), []).append(
                data.reshape(-1).view(torch.uint8) if data.dtype != torch.bool else data.reshape(-1).to(torch.uint8)
            )
    return {device: torch.cat(parts) for device, parts in by_device.items()}


def _same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[device], b[device]) for device in a)


def _is_small(t: torch.Tensor) -> bool:
    return t.dim() <= 1 or t.numel() <= _ARMED_ABOVE


def _lookup(model) -> _Cached | None:
    try:
        with _CACHE_LOCK:
            return _CACHE.get(model)
    except TypeError:  # not weak-referenceable / hashable: no cache
        return None


def model_fingerprint(model: torch.nn.Module, *, cache: bool = True) -> str:
    """Hex digest identifying the model (architecture, state-shaping config, every state-shaping weight's
    bytes) for state compatibility.

    The full hash reads every weight (about 1.5 s for a 130M model on a CPU), so it is cached per model
    (weakly: the cache keeps no model alive and travels with no copy or pickle) and recomputed only when
    something that shapes the states may have changed: the config, a tensor replaced or moved, an in-place
    edit (``_version``), a write through ``.data`` (a copy-on-write sentinel), or the exact bytes of the small
    tensors. A check costs O(number of tensors) plus a comparison of the small tensors' bytes (a few ms at
    130M on one CPU thread, against ~70 ms for a content checksum of all weights), not O(model bytes); the blind spot (writes through memory handed out before the check, e.g. a numpy array
    of a weight) is in the comment above ``_ARMED_ABOVE``, and :func:`refresh_fingerprint` covers it.
    ``cache=False`` always hashes everything (and leaves the cache alone).
    """
    if torch.compiler.is_compiling():  # a compiled forward with past_states: hash the real weights, eagerly
        return _torch_compat.call_eagerly(model_fingerprint, model, cache=cache)
    model = _torch_compat.unwrap_compiled(model)  # torch.compile(model): the weights are the wrapped model's
    architecture = architecture_of(model)
    if not cache:
        return _full_fingerprint(model, architecture)
    config = json.dumps(config_summary(model.config), sort_keys=True)
    named, computed = _collect(model)
    cached = _lookup(model)
    valid = cached.still_valid(architecture, config, named, computed) if cached is not None else False
    if cached is not None and valid:
        return cached.fingerprint
    return _refresh(model, architecture, config, named, computed, cached, materialized=valid is None)


def _refresh(model, architecture, config, named, computed, cached, materialized: bool) -> str:
    with _REFRESH_LOCK:
        current = _lookup(model)
        if current is not None and current is not cached and current.still_valid(architecture, config, named, computed):
            return current.fingerprint  # another thread refreshed it meanwhile
        volatile = set(cached.volatile) if cached is not None else set()
        lost: frozenset[str] = frozenset()
        if materialized:  # armed tensors that lost copy-on-write with nothing else changed: twice in a row (a kernel
            # that asks for writable pointers on every forward, not a one-off save or numpy()): checksum from now on
            lost = frozenset(cached.names[i] for i in cached.armed if not _torch_compat.is_copy_on_write(named[i][1]))
            volatile |= lost & cached.lost
        # before the hash: an edit during it shows at the next check
        identity = tuple(_identity(t, computed=name in computed) for name, t in named)
        fingerprint = _full_fingerprint(model, architecture)
        entry = _Cached(fingerprint, architecture, config, named, computed, identity, volatile, lost)
        try:
            with _CACHE_LOCK:
                _CACHE[model] = entry
        except TypeError:
            pass
        return fingerprint


def refresh_fingerprint(model: torch.nn.Module) -> str:
    """Forget ``model``'s cached fingerprint and hash every weight again: for writes the cache cannot see
    (memory of a weight written outside PyTorch's tensor API, e.g. through a numpy array taken earlier; see
    :func:`model_fingerprint`). Returns the new fingerprint."""
    try:
        with _CACHE_LOCK:
            _CACHE.pop(model, None)
    except TypeError:
        pass
    return model_fingerprint(model)


def new_state_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint an empty cache of ``model`` carries: :func:`model_fingerprint`, eagerly. While a graph is
    traced (``torch.compile`` / ``torch.export`` of a forward with ``use_cache``) the weights have no bytes to
    hash, so the cache gets :data:`TRACED_FINGERPRINT` and the graph holds no hashing, as stock Mamba's cache
    holds none; states meant for composition are encoded eagerly (``hsc.encode``)."""
    if compat.is_tracing(next(base_model_of(model).parameters(), None)):
        return TRACED_FINGERPRINT
    return model_fingerprint(model)
