"""Diagonal first-order linear recurrence returning the whole trajectory: the plain reference (the oracle).

Shapes::

    a, b [B, L, C]   initial_state [B, C] | None (zeros)   ->   h [B, L, C]
    h_k = a_k ⊙ h_{k-1} + b_k   (k = 0 .. L-1, h_{-1} = initial_state)
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_recurrence_reference(a, b, initial_state=None):
    """h_k = a_k · h_{k-1} + b_k by a Python loop over k, in float32 (float64 for float64 inputs).

    Differentiable by autograd as written (w.r.t. a, b and initial_state). Returns h in the dtype of ``b``.
    """
    assert a.shape == b.shape and a.dim() == 3, (tuple(a.shape), tuple(b.shape))
    batch, length, channels = b.shape
    dtype = compute_dtype(b.dtype)
    if initial_state is None:
        h = b.new_zeros((batch, channels), dtype=dtype)
    else:
        assert tuple(initial_state.shape) == (batch, channels), tuple(initial_state.shape)
        h = initial_state.to(dtype)
    steps = []
    for k in range(length):
        h = a[:, k].to(dtype) * h + b[:, k].to(dtype)
        steps.append(h)
    if not steps:
        return b.new_zeros((batch, 0, channels))
    return torch.stack(steps, dim=1).to(b.dtype)
