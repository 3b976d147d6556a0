"""Mamba-2 mixer forward on a ``ComposableMambaCache``.

Same contract as the Mamba-1 one: continue from the cached state for any input length, left padding
inert (Δ = 0 after the clamp, conv window continued per row), ΣΔ accumulated per head. Δ is computed
exactly as the mixer does: ``clamp(softplus(dt + dt_bias), *time_step_limit)``.

The hybrid models' Mamba-2 style mixers do the same maths under other config field names, and run this forward as
it is: Bamba's ``BambaMixer``, GraniteMoeHybrid's ``GraniteMoeHybridMambaLayer``, NemotronH's ``NemotronHMamba2Mixer``
and Zamba2's ``Zamba2MambaMixer`` (NemotronH and Zamba2 with ``time_step_limit = (time_step_min, inf)``; all with the
group-wise gated norm, ``group_size = intermediate_size // n_groups``). ``tests/test_hybrid_mixers_2.py`` checks them.
"""

from __future__ import annotations

import torch

from ..ops import backends


def mamba2_mixer_forward(mixer, hidden_states: torch.Tensor, cache, mask: torch.Tensor | None):
    """hidden_states [B, T, hidden] -> [B, T, hidden]; updates layer ``mixer.layer_idx`` of ``cache``."""
    dtype = hidden_states.dtype
    if mask is not None:
        hidden_states = hidden_states * mask[:, :, None].to(dtype)
    y, gate = mamba2_ssm(mixer, mixer.in_proj(hidden_states), cache, mask)
    # like the stock mixer: gated norm on the float32 scan output, then cast for out_proj
    y = backends.gated_rms_norm(mixer.norm, y, gate, backend=getattr(mixer, "_hsc_backend", "auto"))
    return mixer.out_proj(y.to(dtype))


def mamba2_ssm(mixer, projected: torch.Tensor, cache, mask: torch.Tensor | None):
    """The SSM of a Mamba-2 style mixer from its input projection ``projected`` ``[B, T, I + conv_dim + H]``
    (gate, x·B·C, dt): the causal conv continuing the cached window, the SSD scan from the cached state, Δ clamped
    to ``mixer.time_step_limit`` (None: no clamp), and layer ``mixer.layer_idx`` of ``cache`` advanced (state,
    window, ΣΔ). Returns ``(y [B, T, I] float32, gate [B, T, I])``; what surrounds it (input multipliers, the
    norm) is the caller's (:func:`mamba2_mixer_forward`, :func:`.falcon_h1.falcon_h1_mixer_forward`)."""
    layer_idx = mixer.layer_idx
    batch, length, _ = projected.shape
    layer = cache.layers[layer_idx]
    has_state = layer.filled
    backend = getattr(mixer, "_hsc_backend", "auto")
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    xBC, conv_window = backends.causal_conv1d(
        xBC.transpose(1, 2),
        mixer.conv1d.weight.squeeze(1),
        # the conv's own bias (None when it has none), as every stock Mamba-2 style mixer passes it: Zamba2's conv
        # always has one and uses it, whatever its `use_conv_bias` (config.use_conv_bias) says
        mixer.conv1d.bias,
        conv_state=layer.conv_state if has_state else None,
        mask=mask,
        activation=mixer.activation,
        backend=backend,
    )
    xBC = xBC.transpose(1, 2)
    if mask is not None:
        xBC = xBC * mask[:, :, None].to(xBC.dtype)
    group_state = mixer.n_groups * mixer.ssm_state_size
    x, B, C = torch.split(xBC, [mixer.intermediate_size, group_state, group_state], dim=-1)
    A = -torch.exp(mixer.A_log.float())  # [H]
    limit = mixer.time_step_limit
    y, ssm_state, delta_sum = backends.ssd_scan(
        x.reshape(batch, length, mixer.num_heads, mixer.head_dim),
        dt,
        A,
        B.reshape(batch, length, mixer.n_groups, mixer.ssm_state_size),
        C.reshape(batch, length, mixer.n_groups, mixer.ssm_state_size),
        D=mixer.D,
        dt_bias=mixer.dt_bias,
        dt_softplus=True,
        dt_limit=tuple(limit) if limit is not None else None,
        initial_state=layer.ssm_state if has_state else None,
        mask=mask,
        backend=backend,
        chunk_size=min(mixer.chunk_size, 64),
    )
    cache.advance_layer(layer_idx, ssm_state=ssm_state, conv_state=conv_window, delta_sum=delta_sum, A=A)
    return y.reshape(batch, length, -1), gate
