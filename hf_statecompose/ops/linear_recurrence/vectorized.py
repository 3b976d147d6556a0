"""Diagonal linear recurrence, vectorised torch: a two-level doubling scan, no Python loop over L.

Same contract as :func:`.reference.linear_recurrence_reference` (``a, b [B, L, C]``, ``initial_state [B, C]``
or None → ``h [B, L, C]``, ``h_k = a_k h_{k-1} + b_k``).

Forward. The pairs (a_k, b_k) compose associatively, (a, b) then (a', b') = (a' a, a' b + b'), so:

1. split L into chunks of T ≤ 64 steps and run a Hillis–Steele doubling scan inside every chunk at once
   (log2 T passes): P_k = Π_{i≤k} a_i and H_k = the chunk's trajectory from a zero state;
2. run the same doubling scan over the n = L / T chunk ends (log2 n passes), the initial state folded
   into the first chunk's end: E_j = P_j E_{j-1} + H_j, E_{-1} = initial_state;
3. h = H + P ⊙ E_{j-1} (E_{-1} = initial_state) for every step of chunk j.

Work O(L (log T + 1) + n log n), depth O(log L). Only products and sums of a are formed, never a quotient
by a cumulative product, so exact zeros in a (a reset) and tiny decays are handled exactly as by the loop;
fp32 rounding errors grow like log L rather than L. (Where |a| > 1 the products may overflow long before
h itself does, exactly as h would overflow in the loop only if b did not cancel it: keep Π|a| finite.)

Backward (implicit in the recurrence, not autograd through the passes): the adjoint
g_k = ∂ℓ/∂h_k + a_{k+1} g_{k+1} (g_{L-1} = ∂ℓ/∂h_{L-1}) is the same recurrence run backward in time, so it
reuses the forward on flipped inputs; then ∂ℓ/∂b_k = g_k, ∂ℓ/∂a_k = g_k h_{k-1}, ∂ℓ/∂h_{-1} = a_0 g_0.
The backward calls the same autograd Function, so it is differentiable again (double backward works).

float16 / bfloat16 inputs are computed in float32; float64 stays float64; h has the dtype of b.
"""

from __future__ import annotations

import torch

from .reference import compute_dtype

__all__ = ["linear_recurrence_torch"]

CHUNK = 64


def _doubling_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan along dim -2 of [..., T, C]: (Π_{i≤k} a_i, trajectory from a zero state)."""
    length = a.shape[-2]
    shift = 1
    while shift < length:
        # element k absorbs element k - shift: (a_k, b_k) ∘ (a_{k-s}, b_{k-s})
        b = torch.cat([b[..., :shift, :], torch.addcmul(b[..., shift:, :], a[..., shift:, :], b[..., :-shift, :])], -2)
        a = torch.cat([a[..., :shift, :], a[..., shift:, :] * a[..., :-shift, :]], -2)
        shift *= 2
    return a, b


def _scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """h [B, L, C] for a, b [B, L, C] and h0 [B, C] (all in the compute dtype), L ≥ 1."""
    batch, length, channels = b.shape
    chunk = min(CHUNK, 1 << (length - 1).bit_length())
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length
    if pad:  # trailing steps never influence earlier ones: pad with (1, 0) and drop them after
        a = torch.cat([a, a.new_ones((batch, pad, channels))], 1)
        b = torch.cat([b, b.new_zeros((batch, pad, channels))], 1)
    prod, local = _doubling_scan(a.view(batch, n_chunks, chunk, channels), b.view(batch, n_chunks, chunk, channels))
    if n_chunks == 1:
        h = torch.addcmul(local, prod, h0[:, None, None, :])
    else:
        # chunk ends from the true initial state: E_j = P_j E_{j-1} + H_j, E_{-1} = h0
        end_a, end_b = prod[:, :, -1], local[:, :, -1].clone()  # [B, n, C]
        end_b[:, 0] = torch.addcmul(end_b[:, 0], end_a[:, 0], h0)
        _, ends = _doubling_scan(end_a, end_b)
        carry = torch.cat([h0[:, None], ends[:, :-1]], 1)  # state entering each chunk [B, n, C]
        h = torch.addcmul(local, prod, carry[:, :, None, :])
    return h.reshape(batch, n_chunks * chunk, channels)[:, :length]


class _LinearRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, h0):
        h = _scan(a, b, h0)
        ctx.save_for_backward(a, h0, h)
        return h

    @staticmethod
    def backward(ctx, dh):
        a, h0, h = ctx.saved_tensors
        # g_k = dh_k + a_{k+1} g_{k+1}: the forward recurrence on the time-reversed (a_{k+1}, dh_k)
        a_next = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], 1)
        g = _LinearRecurrence.apply(a_next.flip(1), dh.flip(1), torch.zeros_like(h0)).flip(1)
        h_prev = torch.cat([h0[:, None], h[:, :-1]], 1)
        grad_h0 = a[:, 0] * g[:, 0] if ctx.needs_input_grad[2] else None
        return g * h_prev, g, grad_h0


def linear_recurrence_torch(a, b, initial_state=None):
    """h_k = a_k · h_{k-1} + b_k over [B, L, C] without a loop over L (module docstring); differentiable."""
    batch, length, channels = b.shape
    dtype = compute_dtype(b.dtype)
    if length == 0:
        return b.new_zeros((batch, 0, channels))
    if initial_state is None:
        h0 = b.new_zeros((batch, channels), dtype=dtype)
    else:
        h0 = initial_state.to(dtype)
    return _LinearRecurrence.apply(a.to(dtype), b.to(dtype), h0).to(b.dtype)
