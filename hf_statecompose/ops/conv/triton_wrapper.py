"""The package side of the Triton causal conv: argument checks and the mask as per-row left padding around the
kernel's conv (``causal_conv1d`` of the kernel module chosen by :func:`hf_statecompose.ops._triton.kernel_module`).
Contract of :func:`hf_statecompose.ops.causal_conv1d_ref`.
"""

from __future__ import annotations

import torch

from .._triton import check_runnable, kernel_module
from .reference import _activation

__all__ = ["causal_conv1d_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def causal_conv1d_triton(x, weight, bias=None, conv_state=None, mask=None, activation=None):
    """Triton :func:`hf_statecompose.ops.conv.causal_conv1d`: ``(out [B, C, T], new window [B, C, K])`` in the
    dtype of x; differentiable."""
    check_runnable(x, weight, bias, conv_state, mask)
    _activation(activation)  # ValueError for an unknown activation, as the torch op
    if x.dim() != 3:
        raise ValueError(f"x must be [B, C, T], got {tuple(x.shape)}")
    batch, channels, length = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, K] with C = {channels}, got {tuple(weight.shape)}")
    kernel = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must be [C] = [{channels}], got {tuple(bias.shape)}")
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"mask must be [B, T] = {(batch, length)}, got {tuple(mask.shape)}")
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"causal_conv1d_triton takes float32, bfloat16 or float16 x, got {x.dtype}; "
            "use hf_statecompose.ops.causal_conv1d for float64"
        )
    if conv_state is None:
        window = x.new_zeros((batch, channels, kernel))
    else:
        if tuple(conv_state.shape) != (batch, channels, kernel):
            raise ValueError(
                f"conv window must be [B, C, K] = {(batch, channels, kernel)}, got {tuple(conv_state.shape)}"
            )
        window = conv_state.to(x.dtype)  # as the torch op (autograd casts its gradient back)
    if mask is not None:
        pad = (length - mask.to(torch.int64).sum(-1)).to(torch.int32).contiguous()  # left padding per row
    else:
        pad = torch.zeros(batch, dtype=torch.int32, device=x.device)
    return kernel_module().causal_conv1d(x, weight, bias, window, pad, activation is not None)
