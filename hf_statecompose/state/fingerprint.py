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

from .. import compat
from .architectures import ARCHITECTURES, supported_classes_text, supported_text

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
REFUSED_MODEL_TYPES = {
    "qwen3_next": "its linear layers are gated DeltaNet: the state transition (I - beta k k^T) is not diagonal, so a "
    "context's decay is a matrix, not the per-channel accumulated decay (ΣΔ) that the composition rules weigh by",
    "lfm2": "its recurrent layers are short gated convolutions without an SSM state or decay: there is nothing for the "
    "decay-weighted rules to weigh, only a window of the last few inputs",
}
REFUSED_MODEL_TYPES.update(
    {
        "qwen3_5": REFUSED_MODEL_TYPES["qwen3_next"],
        "qwen3_5_moe": REFUSED_MODEL_TYPES["qwen3_next"],
        "qwen3_next_moe": REFUSED_MODEL_TYPES["qwen3_next"],
        "lfm2_moe": REFUSED_MODEL_TYPES["lfm2"],
    }
)


def architecture_of(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise TypeError(f"hf_statecompose does not compose {model_type!r} states: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in ARCHITECTURES:
        raise TypeError(
            f"hf_statecompose supports {supported_text()}; got model_type {model_type!r} ({type(model).__name__})"
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
    backbone = base_model_of(model)
    for name, tensor in list(backbone.named_parameters()) + list(backbone.named_buffers()):
        if name.startswith("norm_f."):
            continue  # acts after the last layer: does not shape the states
        yield name, tensor


_SAMPLES_PER_TENSOR = 64
_EXACT_BELOW = 4096  # tensors this small (norms, biases, D, Mamba-2's A_log) enter the checksum whole


def _content_checksum(tensors) -> bytes:
    """A cheap content checksum of ``tensors``, computed on their device in one pass over the weights:
    small tensors whole, larger ones as one sum per row (first dimension) plus the exact bits of 64
    evenly strided elements; hashed on the host.

    The cache's check for large tensors whose storage cannot be copy-on-write (shared memory) or that lose
    it on every forward (``volatile``; see the comment above ``_ARMED_ABOVE``): ``p.data.copy_(w)``,
    ``p.data[i] = x`` and ``p.data.mul_(s)`` go through ``.data``, whose version counter is not the
    parameter's, so only the contents can tell. A change to one element shows in its row's sum
    unless it is below that sum's rounding (float32 rows: about 1e-7 of the row's sum, 16-bit rows:
    about 1/256, their sums stay in their dtype because CPU reductions of 16-bit tensors into float32
    are some 20 times slower); changes that keep every row sum (a permutation within a row, tiny
    roundings) are caught by the sample unless they spare every sampled element. Missing them would
    take a deliberate edit; ``model_fingerprint(model, cache=False)`` always hashes every byte.
    """
    parts = []
    with torch.no_grad():
        for tensor in tensors:
            data = tensor.detach()
            if data.numel() == 0:
                continue
            if data.numel() <= _EXACT_BELOW or data.dim() < 2:
                flat = data.reshape(-1)
                if data.numel() > _EXACT_BELOW:  # a long 1-D buffer: sum plus sample
                    parts.append(_float_bits(flat.sum().reshape(1)))
                    parts.append(_float_bits(flat[:: flat.numel() // _SAMPLES_PER_TENSOR][:_SAMPLES_PER_TENSOR]))
                else:
                    parts.append(_float_bits(flat))
                continue
            if data.dtype == torch.float16:
                # the same bits as bfloat16: fp16 reductions are slow on CPUs; a bijection loses nothing
                data = data.view(torch.bfloat16)
            rows = data.reshape(data.shape[0], -1)
            parts.append(
                _float_bits(rows.sum(-1) if rows.dtype.is_floating_point else rows.sum(-1, dtype=torch.float64))
            )
            flat = tensor.detach().reshape(-1)
            parts.append(_float_bits(flat[:: max(1, flat.numel() // _SAMPLES_PER_TENSOR)][:_SAMPLES_PER_TENSOR]))
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


def _float_bits(values: torch.Tensor) -> torch.Tensor:
    """``values`` as int32 bit patterns of float32 (exact for 16-bit floats; NaN equals NaN)."""
    if values.dtype == torch.float64 or not values.dtype.is_floating_point:
        values = values.to(torch.float64).view(torch.int64)
        return torch.stack([values & 0xFFFFFFFF, values >> 32], -1).reshape(-1).to(torch.int32)
    return values.to(torch.float32).view(torch.int32)


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
        elif _is_cow(data):
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
#   large tensor's storage is made lazily copy-on-write (``torch._lazy_clone``, whose clone is dropped at once,
#   so nothing is copied and no memory is held). PyTorch materializes such a storage on the first access that
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
#   deleter) fall back to the content checksum (:func:`_content_checksum`) for that tensor.
#
# Blind spot (the full hash is the only remedy; ``refresh_fingerprint(model)`` runs it): writes that bypass
# PyTorch's tensor API into memory that was already reachable before the fingerprint was taken: a numpy array
# / DLPack capsule / raw ``data_ptr()`` of a weight obtained before the check and written through after it, a
# CUDA graph replay that writes weights, another process writing a shared-memory weight (the checksum path:
# sums and samples, as before).
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

    def __init__(self, fingerprint, architecture, config, named, identity, volatile, lost=frozenset()):
        self.fingerprint, self.architecture, self.config, self.volatile = fingerprint, architecture, config, volatile
        self.lost = lost  # armed tensors found materialized at the check that led to this refresh
        self.names = tuple(name for name, _ in named)
        self.refs = tuple(weakref.ref(t) for _, t in named)  # weak: a replaced parameter is freed as usual
        self.identity = identity
        self.small = [i for i, (_, t) in enumerate(named) if _is_small(t)]
        self.small_bytes = _exact_bytes([named[i][1] for i in self.small])
        self.armed, self.checked = [], []
        for i, (name, t) in enumerate(named):
            if _is_small(t):
                continue
            (self.armed if name not in volatile and _arm(t) else self.checked).append(i)
        self.checksum = _content_checksum([named[i][1] for i in self.checked])

    def still_valid(self, architecture, config, named) -> bool | None:
        """True when nothing changed; False when something did (or may have); None when an armed tensor
        was materialized with nothing else changed (it may have been written through ``.data``)."""
        if architecture != self.architecture or config != self.config or len(named) != len(self.names):
            return False
        for (name, t), expected_name, ref, expected in zip(named, self.names, self.refs, self.identity):
            if name != expected_name or ref() is not t or _identity(t) != expected:
                return False
        if not _same_bytes(_exact_bytes([named[i][1] for i in self.small]), self.small_bytes):
            return False
        if self.checked and _content_checksum([named[i][1] for i in self.checked]) != self.checksum:
            return False
        for i in self.armed:
            if not _is_cow(named[i][1]):
                return None
        return True


def _identity(t: torch.Tensor) -> tuple:
    """What identifies a tensor's contents without reading them; no access here materializes a copy-on-write
    storage (``untyped_storage()`` and its ``_cdata`` do not; ``data_ptr()`` would)."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


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


def _is_cow(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is (still) lazily copy-on-write."""
    return bool(torch._C._is_cow_tensor(t))  # type: ignore[attr-defined]  # private: not in torch's type stubs


def _is_small(t: torch.Tensor) -> bool:
    return t.dim() <= 1 or t.numel() <= _ARMED_ABOVE


def _arm(t: torch.Tensor) -> bool:
    """Make ``t``'s storage lazily copy-on-write (nothing copied; see the comment above); False where the
    storage cannot be (shared memory, a custom allocator, a tensor subclass, a torch without it)."""
    if _is_cow(t):
        return True
    try:
        with torch.no_grad():
            torch._lazy_clone(t.detach())
        return _is_cow(t)
    except (RuntimeError, TypeError, NotImplementedError):  # "Expected storage != nullptr": not copy-on-write-able
        return False


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
    architecture = architecture_of(model)
    if not cache:
        return _full_fingerprint(model, architecture)
    config = json.dumps(config_summary(model.config), sort_keys=True)
    named = list(_state_shaping_tensors(model))
    cached = _lookup(model)
    valid = cached.still_valid(architecture, config, named) if cached is not None else False
    if cached is not None and valid:
        return cached.fingerprint
    return _refresh(model, architecture, config, named, cached, materialized=valid is None)


def _refresh(model, architecture, config, named, cached, materialized: bool) -> str:
    with _REFRESH_LOCK:
        current = _lookup(model)
        if current is not None and current is not cached and current.still_valid(architecture, config, named):
            return current.fingerprint  # another thread refreshed it meanwhile
        volatile = set(cached.volatile) if cached is not None else set()
        lost: frozenset[str] = frozenset()
        if materialized:  # armed tensors that lost copy-on-write with nothing else changed: twice in a row (a kernel
            # that asks for writable pointers on every forward, not a one-off save or numpy()): checksum from now on
            lost = frozenset(cached.names[i] for i in cached.armed if not _is_cow(named[i][1]))
            volatile |= lost & cached.lost
        identity = tuple(_identity(t) for _, t in named)  # before the hash: an edit during it shows at the next check
        fingerprint = _full_fingerprint(model, architecture)
        entry = _Cached(fingerprint, architecture, config, named, identity, volatile, lost)
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
