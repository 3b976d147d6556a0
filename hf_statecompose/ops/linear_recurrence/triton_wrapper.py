"""The package side of the Triton linear recurrence: argument checks around the kernel's recurrence
(``linear_recurrence`` of the kernel module chosen by :func:`hf_statecompose.ops._triton.kernel_module`).
Contract of :func:`.reference.linear_recurrence_reference`.
"""

from __future__ import annotations

import torch

from .._triton import check_runnable, kernel_module

__all__ = ["linear_recurrence_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear_recurrence_triton(a, b, initial_state=None):
    """Triton h_k = a_k · h_{k-1} + b_k over [B, L, C]; differentiable, float32 inside, h in the dtype of b."""
    check_runnable(a, b, initial_state)
    if a.dim() != 3 or a.shape != b.shape:
        raise ValueError(f"a and b must be [B, L, C] of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if b.dtype not in _KERNEL_DTYPES or a.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"linear_recurrence_triton takes float32, bfloat16 or float16, got {a.dtype} and {b.dtype}; "
            "use backend='torch' for float64"
        )
    batch, _, channels = b.shape
    if initial_state is not None and tuple(initial_state.shape) != (batch, channels):
        raise ValueError(f"initial_state must be [B, C] = {(batch, channels)}, got {tuple(initial_state.shape)}")
    return kernel_module().linear_recurrence(a, b, initial_state)
