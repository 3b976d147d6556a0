"""Fused composition x = Σ_k W_k ⊙ x_k of n SSM states, the weights computed from the states' decays.

The contract shared by :func:`compose_ssm_torch` (here, any device, differentiable) and
``compose_ssm_triton`` (``kernels/compose.py``, CUDA, inference):

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

from typing import Sequence

import torch

from ..composition.weights import WEIGHT_FUNCTIONS

METHODS = ("soup", "weighted", "caso", "picaso_s", "picaso_r")
_TORCH_BLOCK_ELEMENTS = 1 << 18  # elements of one state per block in compose_ssm_torch


def _check_inputs(ssm_states, delta_sums, A, method, weights):
    """Validate the contract; returns (states list, n, is_mamba1)."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"unknown composition method {method!r}; choose one of {', '.join(METHODS)}")
    if torch.is_tensor(ssm_states) or not isinstance(ssm_states, Sequence) or len(ssm_states) == 0:
        raise ValueError("ssm_states must be a non-empty list of tensors [B, D, N] or [B, H, P, N]")
    states = list(ssm_states)
    n = len(states)
    first = states[0]
    if not all(torch.is_tensor(s) for s in states):
        raise TypeError("ssm_states must contain tensors")
    if first.dim() not in (3, 4):
        raise ValueError(f"a state must be [B, D, N] (Mamba-1) or [B, H, P, N] (Mamba-2), got {tuple(first.shape)}")
    for k, s in enumerate(states):
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                f"ssm_states[{k}] is {tuple(s.shape)} {s.dtype} on {s.device}, ssm_states[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: states must match"
            )
    if not first.is_floating_point():
        raise TypeError(f"states must be floating point, got {first.dtype}")
    mamba1 = first.dim() == 3
    rows = first.shape[1]  # D or H
    if not torch.is_tensor(delta_sums) or tuple(delta_sums.shape) != (n, first.shape[0], rows):
        got = tuple(delta_sums.shape) if torch.is_tensor(delta_sums) else type(delta_sums).__name__
        name = "D" if mamba1 else "H"
        raise ValueError(f"delta_sums must be [n, B, {name}] = {(n, first.shape[0], rows)}, got {got}")
    a_shape = (rows, first.shape[2]) if mamba1 else (rows,)
    if not torch.is_tensor(A) or tuple(A.shape) != a_shape:
        got = tuple(A.shape) if torch.is_tensor(A) else type(A).__name__
        raise ValueError(f"A must be {'[D, N]' if mamba1 else '[H]'} = {a_shape}, got {got}")
    if method == "weighted":
        if weights is None:
            raise ValueError("method='weighted' needs weights: a tensor [n] (non-negative, summing to 1)")
        if not torch.is_tensor(weights) or tuple(weights.shape) != (n,):
            got = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
            raise ValueError(f"weights must be a tensor [n] = [{n}], got {got}")
    elif weights is not None:
        raise ValueError(f"weights are only used by method='weighted', not by {method!r}")
    for name, t in (("delta_sums", delta_sums), ("A", A)):  # the n weights may live anywhere
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, the states on {first.device}: move them to one device")
    return states, n, mamba1



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
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        blocks = [s[:, r0:r1] for s in states]
        if method == "soup":
            W = [1.0 / n] * n
        elif method == "weighted":
            W = weights.to(device=first.device, dtype=compute).unbind(0)
            W = W if needs_grad else [float(w) for w in W]
        else:
            delta = delta_sums[:, :, r0:r1].to(compute)
            if mamba1:
                log_decay = delta[..., None] * A[r0:r1].to(compute)  # [n, B, rows, N]
            else:
                log_decay = (delta * A[r0:r1].to(compute))[..., None, None]  # [n, B, rows, 1, 1]
            W = WEIGHT_FUNCTIONS[method](log_decay).unbind(0)
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
            if torch.is_tensor(W[k]):
                acc.addcmul_(blocks[k], W[k])
            else:
                acc.add_(blocks[k], alpha=W[k])
        if not direct:
            out[:, r0:r1] = acc.to(first.dtype)
    return out
