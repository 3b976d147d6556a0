"""Causal depthwise conv (+ activation) continuing a window, as one C loop nest (CPU inference, float32),
built by ``ops/_native.py``.

Reads ``x`` tokens-first (``[B, T, C]`` with unit channel stride: the transposed views the mixers pass
cost no copy) and writes the output tokens-first, returned as a ``[B, C, T]`` view, so the mixers'
transpose back (the input of ``x_proj`` / the SSD scan) is free. Left padding (``mask``) as in
:func:`hf_statecompose.ops.causal_conv1d_ref`: row b's real tokens see that row's window directly before
them; padded positions are written as 0 (the caller masks them anyway).

Same contract as :func:`hf_statecompose.ops.causal_conv1d_ref`, for float32 inputs without autograd.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _native
from .reference import _activation

NAME = "causal_conv1d"
SOURCE = _native.read_source(NAME)  # csrc/<NAME>.c

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_NATIVE_ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}


def _library():
    lib = _native.load(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_hsc_typed", False):
        lib.hsc_causal_conv1d.restype = None
        lib.hsc_causal_conv1d.argtypes = [_L, _L, _L, _L, _P, _L, _L, _P, _P, _P, _P, _I, _P, _P, _I]
        lib._hsc_typed = True
    return lib


def applicable(x, weight, bias=None, conv_state=None, mask=None, activation=None) -> bool:
    """CPU float32 inference (no autograd) with a supported activation, where the kernel builds."""
    return activation in _NATIVE_ACTIVATIONS and _native.runs_on(NAME, (x, weight, bias, conv_state))


def causal_conv1d_native(x, weight, bias=None, conv_state=None, mask=None, activation=None):
    """Same contract as :func:`hf_statecompose.ops.causal_conv1d_ref`; None if the kernel cannot be built."""
    lib = _library()
    if lib is None:
        return None
    _activation(activation)  # the same error as the other paths for an unknown name
    batch, channels, length = x.shape
    kernel = weight.shape[-1]
    if tuple(weight.shape) != (channels, kernel):
        raise ValueError(f"weight must be [C, K] with C={channels}, got {tuple(weight.shape)}")
    if conv_state is not None and tuple(conv_state.shape) != (batch, channels, kernel):
        raise ValueError(f"conv window must be [B, C, K] = {(batch, channels, kernel)}, got {tuple(conv_state.shape)}")
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"mask must be [B, T] = {(batch, length)}, got {tuple(mask.shape)}")
    if x.stride(1) != 1:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w_t = weight.t().contiguous()
    bias = bias.contiguous() if bias is not None else None
    window = conv_state.contiguous() if conv_state is not None else None
    mask_f = mask.to(torch.float32).contiguous() if mask is not None else None
    out = x.new_empty((batch, length, channels))
    new_window = x.new_empty((batch, channels, kernel))
    lib.hsc_causal_conv1d(
        batch,
        length,
        channels,
        kernel,
        x.data_ptr(),
        x.stride(0),
        x.stride(2),
        w_t.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if window is None else window.data_ptr(),
        None if mask_f is None else mask_f.data_ptr(),
        _NATIVE_ACTIVATIONS[activation],
        out.data_ptr(),
        new_window.data_ptr(),
        torch.get_num_threads(),
    )
    return out.transpose(1, 2), new_window
