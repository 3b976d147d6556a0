"""Mamba-2 SSD scan: the plain per-token reference (the oracle of every fast path) and the argument
checks and discretisation every path shares. Shapes and recurrence: see vectorized.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, compute_dtype):
    """Δ exactly as the Mamba-2 mixer computes it: softplus(dt + bias), clamped to ``time_step_limit``."""
    dt = dt.to(compute_dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute_dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    if mask is not None:
        dt = dt * mask[:, :, None].to(compute_dtype)
    return dt


def _check_shapes(x, dt, A, B, C, initial_state, mask):
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, P], got {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, length, heads):
        raise ValueError(f"dt must be [B, T, H] = {(batch, length, heads)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,):
        raise ValueError(f"A must be [H] = ({heads},), got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length) or B.shape != C.shape or heads % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, head_dim, B.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, P, N] = {(batch, heads, head_dim, B.shape[-1])}, got {tuple(initial_state.shape)}"
        )
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"mask must be [B, T] = {(batch, length)}, got {tuple(mask.shape)}")


def ssd_scan_ref(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=None, initial_state=None, mask=None):
    """Plain per-token recurrence. Returns ``(y [B, T, H, P], final_state [B, H, P, N], delta_sum [B, H])``."""
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    compute_dtype = torch.promote_types(torch.promote_types(x.dtype, A.dtype), torch.float32)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, compute_dtype)
    A = A.to(compute_dtype)
    xc = x.to(compute_dtype)
    Bh = B.to(compute_dtype).repeat_interleave(heads // groups, dim=2)  # [B, T, H, N]
    Ch = C.to(compute_dtype).repeat_interleave(heads // groups, dim=2)
    h = (
        initial_state.to(compute_dtype)
        if initial_state is not None
        else xc.new_zeros((batch, heads, head_dim, state_size))
    )
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]  # [B, H, 1, 1]
        h = decay * h + (dt[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else xc.new_zeros((batch, 0, heads, head_dim))
    if D is not None:
        y = y + xc * D.to(compute_dtype)[:, None]
    return y, h, dt.sum(1)
