"""Diagonal linear recurrence h_k = a_k ⊙ h_{k-1} + b_k returning the whole trajectory: reference, torch, Triton.

The inner solve of the parallel (DEER / Newton) forward of the COFFEE mixer, and its adjoint.
"""

from __future__ import annotations

import logging

import torch

from ... import compat
from .._triton import triton_unavailable_reason as _triton_unavailable_reason
from .reference import linear_recurrence_reference
from .vectorized import linear_recurrence_torch

__all__ = ["BACKENDS", "linear_recurrence", "linear_recurrence_reference", "linear_recurrence_torch"]

BACKENDS = ("auto", "torch", "triton", "reference")
logger = logging.getLogger("hf_statecompose")
_logged: set = set()


def _resolve(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        # not while torch.compile / torch.export trace (the torch scan traces on every device)
        usable = (
            device.type == "cuda"
            and dtype != torch.float64
            and not compat.is_tracing()
            and _triton_unavailable_reason(device) is None
        )
        choice = "triton" if usable else "torch"
        key = (device.type, dtype, choice)
        if key not in _logged:
            _logged.add(key)
            logger.info(
                "hf_statecompose: backend='auto' runs linear_recurrence on %s %s with %r", device.type, dtype, choice
            )
        return choice
    if backend == "triton":
        reason = _triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run linear_recurrence: {reason}")
    return backend


def linear_recurrence(a, b, initial_state=None, backend: str = "auto"):
    """h_k = a_k ⊙ h_{k-1} + b_k for k = 0 .. L-1 (h_{-1} = ``initial_state``, zeros if None).

    Args:
        a, b: ``[B, L, C]`` of one shape, any float dtype (half types are computed in float32, float64 in
            float64).
        initial_state: ``[B, C]`` or None.
        backend: ``"auto"`` (Triton on CUDA for non-float64 inputs when importable, else torch; logged once),
            ``"torch"`` (two-level doubling scan, no loop over L), ``"triton"`` (one kernel, sequential in L,
            parallel over channels; raises where it cannot run) or ``"reference"`` (the plain loop).

    Returns:
        h ``[B, L, C]`` in the dtype of ``b``; differentiable w.r.t. a, b and initial_state (the backward
        is the adjoint recurrence g_k = ∂ℓ/∂h_k + a_{k+1} g_{k+1}, run backward in time).
    """
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dim() != 3 or a.shape != b.shape:
        raise ValueError(
            f"a and b must be [B, L, C] tensors of one shape, got "
            f"{tuple(getattr(a, 'shape', ()))} and {tuple(getattr(b, 'shape', ()))}"
        )
    if not (a.is_floating_point() and b.is_floating_point()):
        raise TypeError(f"a and b must be floating point, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} and b on {b.device}; move both to one device")
    batch, _, channels = b.shape
    if initial_state is not None and tuple(initial_state.shape) != (batch, channels):
        raise ValueError(f"initial_state must be [B, C] = {(batch, channels)}, got {tuple(initial_state.shape)}")
    choice = _resolve(backend, b.device, b.dtype)
    if choice == "triton":
        from .triton_wrapper import linear_recurrence_triton  # imports Triton only when it runs

        return linear_recurrence_triton(a, b, initial_state)
    if choice == "reference":
        return linear_recurrence_reference(a, b, initial_state)
    return linear_recurrence_torch(a, b, initial_state)
