"""FalconH1 mixer forward on a ``ComposableMambaCache``-style cache (the SSM half of each FalconH1 layer).

transformers' ``FalconH1Mixer`` is a Mamba-2 mixer (chunked SSD scan, ``[B, H, P, N]`` state, Δ per head) that
differs from ``Mamba2Mixer`` in what surrounds the scan, so this path runs the same kernels as
:func:`.mamba2.mamba2_mixer_forward` with FalconH1's maths around them:

* µP multipliers: the input is scaled by ``ssm_in_multiplier`` before ``in_proj`` and the projection by the
  ``mup_vector`` buffer (one multiplier per z / x / B / C / dt slice);
* the inner size is ``mamba_d_ssm`` (``mixer.intermediate_size``), not ``expand · hidden``;
* the gated RMS norm is optional (``config.mamba_rms_norm``): without it the output is ``y · silu(gate)``; with it
  ``FalconH1RMSNormGated`` (per group, gate before or after the norm as ``mamba_norm_before_gate`` says) is
  called as the stock mixer calls it;
* ``time_step_limit`` may be None (no clamp).

As for Mamba-2: the forward continues from the cached state for any input length, left padding is inert (Δ = 0,
conv window continued per row) and ΣΔ (``clamp(softplus(dt + dt_bias), *time_step_limit)`` summed over the real
tokens) is accumulated per head. The decoder layer multiplies the output by ``ssm_out_multiplier`` itself.
"""

from __future__ import annotations

import torch

from .mamba2 import mamba2_ssm


def falcon_h1_mixer_forward(mixer, hidden_states: torch.Tensor, cache, mask: torch.Tensor | None):
    """hidden_states [B, T, hidden] -> [B, T, hidden]; updates layer ``mixer.layer_idx`` of ``cache``."""
    dtype = hidden_states.dtype
    if mask is not None:
        hidden_states = hidden_states * mask[:, :, None].to(dtype)
    # µP: input multiplier, then one multiplier per slice of the projection (as the stock mixer applies them)
    projected = mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector
    y, gate = mamba2_ssm(mixer, projected, cache, mask)
    if mixer.mamba_rms_norm:
        # FalconH1RMSNormGated, called as the stock mixer calls it: its gate may come after the norm
        # (mamba_norm_before_gate), which the Mamba-2 gated-norm kernels do not do
        y = mixer.norm(y, gate)
    else:
        y = y * torch.nn.functional.silu(gate)
    return mixer.out_proj(y.to(dtype))
