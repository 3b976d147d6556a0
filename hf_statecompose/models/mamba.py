"""Mamba-1 mixer forward on a ``ComposableMambaCache``.

Stock transformers 5.23 runs its full-sequence scan from a zero state, so a multi-token input after a
cached state silently ignores the SSM state. This forward continues from the cached state for any
input length, keeps left padding inert (Δ = 0 and the conv window continued per row) and accumulates
ΣΔ. It computes Δ exactly as the mixer does: ``softplus(dt_proj(x) + bias)``; an adapter on ``dt_proj`` (PEFT's
LoRA) takes part and trains (:func:`time_step_projection`).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..ops import backends


def mamba_mixer_forward(mixer, hidden_states: torch.Tensor, cache, mask: torch.Tensor | None):
    """hidden_states [B, T, hidden] -> [B, T, hidden]; updates layer ``mixer.layer_idx`` of ``cache``."""
    layer_idx = mixer.layer_idx
    dtype = hidden_states.dtype
    _batch, _length, _ = hidden_states.shape
    layer = cache.layers[layer_idx]
    has_state = layer.filled
    backend = getattr(mixer, "_hsc_backend", "auto")
    if not _is_plain_linear(mixer.dt_proj):
        _refuse_adapted_dt_proj(mixer)
    if mask is not None:
        hidden_states = hidden_states * mask[:, :, None].to(dtype)

    projected = mixer.in_proj(hidden_states).transpose(1, 2)  # [B, 2D, T]
    x, gate = projected.chunk(2, dim=1)  # [B, D, T] each
    x, conv_window = backends.causal_conv1d(
        x,
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias if mixer.use_conv_bias else None,
        conv_state=layer.conv_state if has_state else None,
        mask=mask,
        activation=mixer.activation,
        backend=backend,
    )
    if mask is not None:
        x = x * mask[:, None, :].to(x.dtype)

    y, ssm_state, delta_sum, A = selective_ssm(mixer, x, gate, layer.ssm_state if has_state else None, mask, backend)
    cache.advance_layer(layer_idx, ssm_state=ssm_state, conv_state=conv_window, delta_sum=delta_sum, A=A)
    return mixer.out_proj(y.transpose(1, 2).to(dtype))


def selective_ssm(mixer, x: torch.Tensor, gate: torch.Tensor, initial_state, mask, backend: str):
    """The mixer's selective SSM on its conv output ``x`` ``[B, D, T]`` (gate ``[B, D, T]``): x_proj to
    (Δ, B, C), Δ exactly as the mixer computes it (``softplus(dt_proj(x) + bias)``, the bias added in the
    scan), then the scan from ``initial_state``. Returns ``(y [B, D, T], SSM state, ΣΔ, A)``; shared by the
    Mamba-1 path above (Mamba, FalconMamba and Jamba's ``JambaMambaMixer``) and SeRpEnt's branch SSMs."""
    ssm_parameters = mixer.x_proj(x.transpose(1, 2))  # [B, T, R + 2N]
    time_step, B, C = torch.split(
        ssm_parameters, [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1
    )
    if getattr(mixer, "dt_layernorm", None) is not None:
        # FalconMamba (weightless) and Jamba (with weights) RMS norms on the time step, B and C, applied where
        # their mixers apply them: after x_proj, before dt_proj
        time_step, B, C = mixer.dt_layernorm(time_step), mixer.b_layernorm(B), mixer.c_layernorm(C)
    # tokens-first [B, T, D] seen as [B, D, T]; the bias is added in the scan
    dt = time_step_projection(mixer.dt_proj, time_step).transpose(1, 2)
    A = -torch.exp(mixer.A_log.float())  # [D, N]
    y, ssm_state, delta_sum = backends.selective_scan(
        x,
        dt,
        A,
        B.transpose(1, 2),
        C.transpose(1, 2),
        D=mixer.D.float(),
        z=gate,
        delta_bias=mixer.dt_proj.bias.float() if mixer.dt_proj.bias is not None else None,
        delta_softplus=True,
        initial_state=initial_state,
        mask=mask,
        backend=backend,
    )
    return y, ssm_state, delta_sum, A


def time_step_projection(dt_proj: nn.Module, time_step: torch.Tensor) -> torch.Tensor:
    """``dt_proj(time_step)`` without its bias, ``[B, T, R] -> [B, T, D]``: the scan adds the bias (in float32, as
    the mixer's kernels do). A plain ``nn.Linear`` is read as its weight. Any other module (PEFT's LoRA ``Linear``
    wrapping the projection, a module with hooks) is *called*, so that what it adds to its base projection (LoRA's
    ``B A x · scaling``) takes part in Δ and trains: Δ gets ``module(x) - linear(x, weight, bias)`` added, which is
    exactly zero where the adapter adds zero (a fresh LoRA, ``B = 0``, gives the base model's results bit for bit)."""
    weight, bias = cast(torch.Tensor, dt_proj.weight), cast("torch.Tensor | None", dt_proj.bias)
    dt = torch.nn.functional.linear(time_step, weight)
    if _is_plain_linear(dt_proj):
        return dt
    base = torch.nn.functional.linear(time_step, weight, bias)
    return dt + (dt_proj(time_step) - base)


def _is_plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def _refuse_adapted_dt_proj(mixer) -> None:
    """transformers' own Mamba-1 / FalconMamba forward (any call without states, e.g. ``model(context + query)``)
    reads ``dt_proj.weight`` and so ignores an adapter on ``dt_proj``. This path would apply it: the two would
    disagree, and one state + query would no longer be context + query. Refuse, saying how to go on. (SeRpEnt's
    branch SSMs run only this path: there an adapter on ``dt_proj`` trains, see :func:`time_step_projection`.)"""
    raise ValueError(
        f"layer {mixer.layer_idx}'s dt_proj is wrapped ({type(mixer.dt_proj).__name__}, e.g. a LoRA adapter), but "
        f"transformers' {type(mixer).__name__.removeprefix('Composable')} ignores an adapter on dt_proj (it reads "
        "dt_proj.weight), so states would disagree with the model's own forward. Leave dt_proj out of the adapter's "
        "target_modules (x_proj, in_proj, out_proj train), or merge it first (peft: model.merge_and_unload())"
    )
