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

import torch

from .. import compat
from .architectures import ARCHITECTURES

# the fingerprint of a cache made while a graph is traced (torch.compile / torch.export): the weights are
# symbolic there (FakeTensors, no bytes to hash), so such a state names no model and no model accepts it
TRACED_FINGERPRINT = ""

# model_type -> architecture (SeRpEnt-Mamba: hf_statecompose.models.serpent, one Mamba-1 state per layer and
# branch; COFFEE: hf_statecompose.models.coffee, one flattened state per layer); what each architecture's
# states hold: .architectures
SUPPORTED_MODEL_TYPES = {name: name for name in ARCHITECTURES}

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


def base_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The backbone (``model.backbone`` for the LM classes, the model itself for the bare ones) of a Mamba,
    Mamba-2 or SeRpEnt-Mamba model."""
    # peft wraps the model: PeftModel.base_model (LoraModel).model is the transformers model
    inner = model
    for _ in range(3):
        if hasattr(inner, "backbone") and hasattr(inner.backbone, "layers"):
            return inner.backbone
        if hasattr(inner, "layers") and hasattr(inner, "embeddings"):
            return inner
        inner = getattr(inner, "base_model", None) if getattr(inner, "base_model", None) is not inner else None
        if inner is None:
            break
        inner = getattr(inner, "model", inner)
    raise TypeError(
        f"{type(model).__name__} is not a Mamba, Mamba-2, SeRpEnt-Mamba or COFFEE model (no `.backbone.layers`); "
        "pass a MambaForCausalLM, Mamba2ForCausalLM, SeRpEntMambaForCausalLM, CoffeeForCausalLM or their bare models"
    )


def architecture_of(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            "hf_statecompose supports transformers' Mamba, Mamba-2 and FalconMamba models and its own SeRpEnt-Mamba and "
            f"COFFEE (model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))}), got model_type {model_type!r} "
            f"({type(model).__name__})"
        )
    return SUPPORTED_MODEL_TYPES[model_type]


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

    It exists because the cache key cannot rely on ``_version``: ``p.data.copy_(w)``, ``p.data[i] = x``
    and ``p.data.mul_(s)`` go through ``.data``, whose version counter is not the parameter's, and a
    ``.to()`` round trip may land on a reused address. A change to one element shows in its row's sum
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
            parts.append(_float_bits(rows.sum(-1) if rows.dtype.is_floating_point else rows.sum(-1, dtype=torch.float64)))
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


def _weights_key(model):
    """What the cached fingerprint is valid for: the config, each tensor's identity (name, address,
    version, shape, dtype, device) and a content checksum of all of them (see :func:`_content_checksum`)."""
    named = list(_state_shaping_tensors(model))
    identity = tuple(
        (name, t.data_ptr(), t._version, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in named
    )
    config = json.dumps(config_summary(model.config), sort_keys=True)
    return config, identity, _content_checksum([t for _, t in named])


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
        data = data.contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module, *, cache: bool = True) -> str:
    """Hex digest identifying the model (architecture, state-shaping config, every state-shaping weight's
    bytes) for state compatibility.

    The full hash reads every weight (about 1 s for a 130M model on a CPU), so it is cached on the model
    and recomputed when the key changes: the config, any tensor's address / version / shape / dtype /
    device, or a cheap checksum of the weights' contents (a sum and a strided sample per tensor, one
    pass over the weights: about 25 ms for 130M fp32 weights on a CPU), which catches edits through
    ``.data`` that leave ``_version`` alone. ``cache=False`` always hashes everything.
    """
    architecture = architecture_of(model)
    if not cache:
        return _full_fingerprint(model, architecture)
    key = _weights_key(model)
    cached = getattr(model, "_hf_statecompose_fingerprint", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    fingerprint = _full_fingerprint(model, architecture)
    try:
        object.__setattr__(model, "_hf_statecompose_fingerprint", (key, fingerprint))
    except Exception:  # a frozen wrapper: just do not cache
        pass
    return fingerprint


def new_state_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint an empty cache of ``model`` carries: :func:`model_fingerprint`, eagerly. While a graph is
    traced (``torch.compile`` / ``torch.export`` of a forward with ``use_cache``) the weights have no bytes to
    hash, so the cache gets :data:`TRACED_FINGERPRINT` and the graph holds no hashing, as stock Mamba's cache
    holds none; states meant for composition are encoded eagerly (``hsc.encode``)."""
    if compat.is_tracing(next(base_model_of(model).parameters(), None)):
        return TRACED_FINGERPRINT
    return model_fingerprint(model)
