"""Checks that turn bad input into a clear error naming the problem and the fix."""
from __future__ import annotations

import torch


def _describe(cache) -> str:
    info = cache.model_info
    return (
        f"{info.get('model_type', cache.architecture)} model with {info.get('num_hidden_layers', cache.num_layers)} "
        f"layers, hidden {info.get('hidden_size', '?')} (fingerprint {cache.fingerprint[:12]})"
    )


def check_is_state(state, where: str = "past_states"):
    from .cache import ComposableMambaCache

    if not isinstance(state, ComposableMambaCache):
        raise TypeError(
            f"{where} must hold ComposableMambaCache objects (from ComposableMambaCache.encode or .load), "
            f"got {type(state).__name__}"
        )
    if not state.layers or not state.is_filled():
        raise ValueError(f"{where} holds a ComposableMambaCache with no state; encode a context into it first")


def check_finite(state, where: str = "state"):
    for i in range(state.num_layers):
        for name, tensor in (
            ("SSM state", state.ssm_states[i]),
            ("conv window", state.conv_states[i]),
            ("ΣΔ", state.delta_sums[i]),
        ):
            if not torch.isfinite(tensor).all():
                raise ValueError(
                    f"{where}: layer {i} {name} contains NaN or inf; the state is corrupted, re-encode the context"
                )


def check_compatible(states, *, same_batch: bool = True, where: str = "past_states"):
    """All states come from one model and agree in layers, shapes, dtypes, devices (and batch)."""
    if isinstance(states, (str, bytes)) or not hasattr(states, "__len__"):
        raise TypeError(f"{where} must be a list of ComposableMambaCache, got {type(states).__name__}")
    if len(states) == 0:
        raise ValueError(f"{where} is empty: pass at least one state to compose")
    for k, state in enumerate(states):
        check_is_state(state, f"{where}[{k}]")
    first = states[0]
    for k, state in enumerate(states[1:], start=1):
        if state.num_layers != first.num_layers:
            raise ValueError(f"{where}[{k}] has {state.num_layers} layers, {where}[0] has {first.num_layers}")
        if same_batch and state.batch_size != first.batch_size:
            raise ValueError(
                f"{where}[{k}] has batch size {state.batch_size}, {where}[0] has {first.batch_size}; "
                "states composed together must have the same batch (or pass one list per row)"
            )
        if state.model_dtype != first.model_dtype:
            raise ValueError(
                f"{where}[{k}] was encoded in {state.model_dtype}, {where}[0] in {first.model_dtype}; "
                "encode all contexts with the model in one dtype"
            )
        if state.fingerprint != first.fingerprint:
            raise ValueError(
                f"{where}[{k}] was encoded by a different model ({_describe(state)}) than {where}[0] "
                f"({_describe(first)}); encode every context with the same model"
            )
        for i in range(first.num_layers):
            for name, a, b in (
                ("SSM state", state.ssm_states[i], first.ssm_states[i]),
                ("conv window", state.conv_states[i], first.conv_states[i]),
            ):
                if a.shape[1:] != b.shape[1:]:
                    raise ValueError(
                        f"{where}[{k}] layer {i} {name} has shape {tuple(a.shape)}, {where}[0] has {tuple(b.shape)}"
                    )
                if a.dtype != b.dtype:
                    raise ValueError(f"{where}[{k}] layer {i} {name} is {a.dtype}, {where}[0] is {b.dtype}")
                if a.device != b.device:
                    raise ValueError(
                        f"{where}[{k}] is on {a.device}, {where}[0] on {b.device}; move them with .to(device)"
                    )


def expected_state_shapes(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-row shapes of (SSM state, conv window) for one layer of a model with this config."""
    if config.model_type == "mamba":
        return (config.intermediate_size, config.state_size), (config.intermediate_size, config.conv_kernel)
    intermediate = int(config.expand * config.hidden_size)
    conv_dim = intermediate + 2 * config.n_groups * config.state_size
    return (config.num_heads, config.head_dim, config.state_size), (conv_dim, config.conv_kernel)


def check_against_model(state, model, fingerprint: str, where: str = "past_states"):
    """The state was encoded by this very model, in its dtype, on its device, with its shapes."""
    parameter = next(model.parameters())
    if state.model_dtype != parameter.dtype:
        raise ValueError(
            f"{where} was encoded with the model in {state.model_dtype}, the model is now {parameter.dtype}; "
            "re-encode the contexts in this dtype, or convert the state with state.to(dtype=...) if you accept the rounding"
        )
    if state.device != parameter.device:
        raise ValueError(f"{where} is on {state.device}, the model on {parameter.device}; use state.to(device)")
    if state.num_layers != model.config.num_hidden_layers:
        raise ValueError(
            f"{where} has {state.num_layers} layers, the model {model.config.num_hidden_layers}; "
            "the state belongs to another model: re-encode the contexts with this model"
        )
    ssm_shape, conv_shape = expected_state_shapes(model.config)
    for i in range(state.num_layers):
        for name, tensor, shape in (("SSM state", state.ssm_states[i], ssm_shape), ("conv window", state.conv_states[i], conv_shape)):
            if tuple(tensor.shape[1:]) != shape:
                raise ValueError(
                    f"{where} layer {i} {name} has per-row shape {tuple(tensor.shape[1:])}, this model expects {shape}; "
                    "the state belongs to another model: re-encode the contexts with this model"
                )
    if state.fingerprint != fingerprint:
        raise ValueError(
            f"{where} was encoded by {_describe(state)}, but this model has fingerprint {fingerprint[:12]} "
            f"({model.config.model_type}, {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}); "
            "states only fit the exact model (architecture, config and weights) that encoded them: "
            "re-encode the contexts with this model"
        )


def check_left_padded_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of the shape of ``input_ids``, left padded, with a token in every row; as int64."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (token)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "hf_statecompose needs left padding (Mamba caches continue from the last token): "
            "set tokenizer.padding_side = 'left'"
        )
    if (mask.sum(-1) == 0).any():
        raise ValueError("a row of attention_mask is all padding: every context needs at least one token")
    return mask

