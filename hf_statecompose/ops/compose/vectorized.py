"""Fused composition x = Σ_k W_k ⊙ x_k of n SSM states, the weights computed from the states' decays.

The contract shared by :func:`compose_ssm_torch` (here, any device, differentiable) and
``compose_ssm_triton`` (``triton_wrapper.py``, around the kernel ``compose`` in
``kernels/torch-ext/hf_statecompose_kernels``; CUDA, inference) and checked by ``compose_ssm_ref`` (``reference.py``):

* ``ssm_states``: list of n tensors, each ``[B, D, N]`` (Mamba-1) or ``[B, H, P, N]`` (Mamba-2);
* ``delta_sums``: ``[n, B, D]`` / ``[n, B, H]``, each state's ΣΔ;
* ``A``: ``[D, N]`` / ``[H]``. Log decay of state k: ``ΣΔ[k, b, d] · A[d, m]`` per element (Mamba-1) or
  ``ΣΔ[k, b, h] · A[h]`` per head (Mamba-2);
* ``method``: ``soup``, ``weighted`` (with ``weights`` [n]), ``caso``, ``picaso_s``, ``picaso_r``; the
  weights are those of :mod:`hf_statecompose.composition.weights`.

The torch version works on blocks of D (or H) rows, so that the weights of a block stay small: for
Mamba-1 no weight tensor the size of the states is ever formed, and each block of each state is read once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .methods import METHODS
from .reference import _check_inputs
from .weights import method_weights

_TORCH_BLOCK_ELEMENTS = 1 << 18  # elements of one state per block in compose_ssm_torch


def compose_ssm_torch(ssm_states, delta_sums, A, method, weights=None) -> torch.Tensor:
    """Pure-torch :func:`compose_ssm_triton` (same contract), blockwise over rows so the weights stay small.

    Computes in float32 (float64 for float64 inputs) and returns the states' dtype. Differentiable.
    """
    states, n, mamba1 = _check_inputs(ssm_states, delta_sums, A, method, weights)
    first = states[0]
    compute = torch.promote_types(torch.promote_types(first.dtype, torch.float32), delta_sums.dtype)
    rows = first.shape[1]
    row_size = first[:, :1].numel()  # elements of one row (D or H) over the batch
    block = max(1, _TORCH_BLOCK_ELEMENTS // max(1, row_size))
    out = torch.empty_like(first)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*states, delta_sums, A, *([weights] if torch.is_tensor(weights) else []))
    )
    spec = METHODS[method]
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        blocks = [s[:, r0:r1] for s in states]
        if spec.fixed_weights == "uniform":
            W: Sequence[float | torch.Tensor] = [1.0 / n] * n
        elif spec.user_weights:
            W = weights.to(device=first.device, dtype=compute).unbind(0)
            W = W if needs_grad else [float(w) for w in W]
        else:
            delta = delta_sums[:, :, r0:r1].to(compute)
            if mamba1:
                log_decay = delta[..., None] * A[r0:r1].to(compute)  # [n, B, rows, N]
            else:
                log_decay = (delta * A[r0:r1].to(compute))[..., None, None]  # [n, B, rows, 1, 1]
            W = method_weights(spec, log_decay).unbind(0)
        if needs_grad:  # out of place, so that autograd sees every step
            acc = blocks[0].to(compute) * W[0]
            for k in range(1, n):
                acc = acc + blocks[k].to(compute) * W[k]
            out[:, r0:r1] = acc.to(first.dtype)
            continue
        # inference: one fused multiply-add pass per state, accumulated in place (straight into `out`
        # when the states are in the compute dtype)
        direct = first.dtype == compute
        acc = out[:, r0:r1] if direct else torch.empty(blocks[0].shape, dtype=compute, device=first.device)
        torch.mul(blocks[0], W[0], out=acc)
        for k in range(1, n):
            w = W[k]
            if isinstance(w, torch.Tensor):
                acc.addcmul_(blocks[k], w)
            else:
                acc.add_(blocks[k], alpha=w)
        if not direct:
            out[:, r0:r1] = acc.to(first.dtype)
    return out
