"""States on disk: safetensors tensors + JSON metadata. No pickle, atomic writes, checked reads.

A state file holds, per layer ``l``: ``ssm.l``, ``conv.l``, ``delta_sum.l``, ``A.l``; plus ``num_tokens``
and optionally ``token_ids``. The safetensors header's ``__metadata__`` holds one JSON document under
``hf_statecompose`` (format version, architecture, fingerprint, model dtype, model info) and a
blake2b digest of all tensor bytes, so a file whose data was damaged after writing is refused.
Writes go to a temporary file in the same folder, are fsynced, then renamed over the target: a crash
mid-write leaves the old file (or none), never half a file.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .files import atomic_write

FORMAT_VERSION = 1
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _digest(tensors: dict) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_to_tensors(state) -> dict:
    tensors = {}
    for i in range(state.num_layers):
        tensors[f"ssm.{i}"] = state.ssm_states[i]
        tensors[f"conv.{i}"] = state.conv_states[i]
        tensors[f"delta_sum.{i}"] = state.delta_sums[i]
        tensors[f"A.{i}"] = state.A[i]
    if state.num_tokens is not None:
        tensors["num_tokens"] = state.num_tokens
    if state.token_ids is not None:
        tensors["token_ids"] = state.token_ids
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_state(state, path) -> None:
    from .validation import check_finite, check_is_state

    check_is_state(state, "state")
    check_finite(state)
    tensors = state_to_tensors(state)
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
    payload = save(tensors, metadata={"hf_statecompose": json.dumps(meta, default=repr)})
    atomic_write(path, payload)


def _read_metadata(path) -> dict:
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise ValueError(
            f"{path} looks like a pickle / torch.save file; hf_statecompose never unpickles (it can run code): "
            "only state files written by ComposableMambaCache.save (safetensors) are accepted"
        )
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
        return json.loads(metadata["hf_statecompose"])
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: state metadata is corrupted ({error})") from None


def load_state(path, model=None, device=None):
    from transformers import AutoConfig

    from .cache import ComposableMambaCache
    from .validation import check_against_model, check_finite

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no state file at {path}")
    meta = _read_metadata(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported state format version {meta.get('format_version')!r}")
    try:
        tensors = load_file(path)
    except Exception as error:
        raise ValueError(f"{path} is truncated or corrupted ({error}); re-encode the context") from None
    if _digest(tensors) != meta.get("tensor_digest"):
        raise ValueError(f"{path}: tensor data does not match its recorded digest (corrupted file); re-encode the context")
    num_layers = meta["num_layers"]
    expected = {f"{kind}.{i}" for kind in ("ssm", "conv", "delta_sum", "A") for i in range(num_layers)}
    if not expected <= set(tensors):
        raise ValueError(f"{path}: missing tensors {sorted(expected - set(tensors))[:4]}…")
    config_dict = dict(meta["config"])
    model_type = config_dict.pop("model_type", meta["model_info"].get("model_type"))
    config = model.config if model is not None else AutoConfig.for_model(model_type, **config_dict)
    dtype = _DTYPES.get(meta["model_dtype"])
    if dtype is None:
        raise ValueError(f"{path}: unknown model dtype {meta['model_dtype']!r}")
    state = ComposableMambaCache(
        config,
        architecture=meta["architecture"],
        fingerprint=meta["fingerprint"],
        model_dtype=dtype,
        model_info=meta["model_info"],
    )
    if state.num_layers != num_layers:
        raise ValueError(
            f"{path} holds {num_layers} layers, the model has {state.num_layers}; "
            "the state belongs to another model: re-encode the context with this model"
        )
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
    state.num_tokens = to(tensors["num_tokens"]) if "num_tokens" in tensors else None
    state.token_ids = to(tensors["token_ids"]) if "token_ids" in tensors else None
    check_finite(state, path)
    if model is not None:
        from .fingerprint import model_fingerprint

        check_against_model(state, model, model_fingerprint(model), where=path)
    return state
