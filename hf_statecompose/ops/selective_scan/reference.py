"""Mamba-1 selective scan: the plain per-token reference (the oracle of every fast path) and the
argument checks and discretisation every path shares. Shapes and recurrence: see vectorized.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _discretize_delta(delta, delta_bias, delta_softplus, mask, compute_dtype):
    delta = delta.to(compute_dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(compute_dtype)[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    if mask is not None:
        delta = delta * mask[:, None, :].to(compute_dtype)
    return delta


def _check_shapes(u, delta, A, B, C, initial_state, mask):
    if u.dim() != 3 or delta.shape != u.shape:
        raise ValueError(f"u and delta must both be [B, D, T], got {tuple(u.shape)} and {tuple(delta.shape)}")
    batch, channels, length = u.shape
    if A.shape[0] != channels or A.dim() != 2:
        raise ValueError(f"A must be [D, N] with D={channels}, got {tuple(A.shape)}")
    state_size = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (batch, state_size, length):
            raise ValueError(f"{name} must be [B, N, T] = {(batch, state_size, length)}, got {tuple(t.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, channels, state_size):
        raise ValueError(
            f"initial_state must be [B, D, N] = {(batch, channels, state_size)}, got {tuple(initial_state.shape)}"
        )
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"mask must be [B, T] = {(batch, length)}, got {tuple(mask.shape)}")


def _finish(y, u, D, z, compute_dtype):
    if D is not None:
        y = y + u.to(compute_dtype) * D.to(compute_dtype)[None, :, None]
    if z is not None:
        y = y * F.silu(z.to(compute_dtype))
    return y


def selective_scan_ref(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, mask=None
):
    """Plain per-token recurrence. Returns ``(y [B, D, T], final_state [B, D, N], delta_sum [B, D])``.

    Computes in float32 (float64 if any input is float64); ``y`` is returned in that compute dtype.
    """
    _check_shapes(u, delta, A, B, C, initial_state, mask)
    compute_dtype = torch.promote_types(torch.promote_types(u.dtype, A.dtype), torch.float32)
    batch, channels, length = u.shape
    dt = _discretize_delta(delta, delta_bias, delta_softplus, mask, compute_dtype)
    A = A.to(compute_dtype)
    uc, Bc, Cc = u.to(compute_dtype), B.to(compute_dtype), C.to(compute_dtype)
    h = (
        initial_state.to(compute_dtype)
        if initial_state is not None
        else u.new_zeros((batch, channels, A.shape[1]), dtype=compute_dtype)
    )
    ys = []
    for t in range(length):
        h = torch.exp(dt[:, :, t, None] * A) * h + dt[:, :, t, None] * Bc[:, None, :, t] * uc[:, :, t, None]
        ys.append((h * Cc[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else uc.new_zeros((batch, channels, 0))
    return _finish(y, u, D, z, compute_dtype), h, dt.sum(-1)
