"""Mamba-1 selective scan as one C loop nest (CPU inference, float32), built by ``ops/_native.py``.

Per block of 16 channels, per token: Δ = softplus(δ + bias) (masked), ΣΔ, then for every state n
``h[n] = exp(Δ A[:, n]) h[n] + (Δ u) B_t[n]`` and ``y += C_t[n] h[n]``, then the skip ``D u`` and the
gate ``silu(z)``, all in registers / L1; channel blocks run on torch's OpenMP threads. The state is
vectorised over channels (``A`` is read as ``[N, D]``), so the read-out over n needs no horizontal
sums. Everything is read tokens-first (``[B, T, X]`` with unit channel stride, the layout of the mixers'
projections): the transposed ``[B, D, T]`` views the Mamba-1 mixer passes cost no copies, and ``y`` is
returned as a ``[B, D, T]`` view of a tokens-first tensor, so the mixer's transpose back is free.

Same contract as :func:`hf_statecompose.ops.selective_scan_ref`, for float32 inputs without autograd.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _native
from .reference import _check_shapes

NAME = "selective_scan"
SOURCE = _native.read_source(NAME)  # csrc/<NAME>.c

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _library():
    lib = _native.load(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_hsc_typed", False):
        lib.hsc_selective_scan.restype = None
        lib.hsc_selective_scan.argtypes = [
            _L,
            _L,
            _L,
            _L,
            _P,
            _L,
            _L,
            _P,
            _L,
            _L,
            _P,
            _I,
            _P,
            _P,
            _L,
            _L,
            _P,
            _L,
            _L,
            _P,
            _P,
            _L,
            _L,
            _P,
            _P,
            _P,
            _P,
            _I,
        ]
        lib._hsc_typed = True
    return lib


def applicable(u, delta, A, B, C, initial_state=None, mask=None, **_) -> bool:
    """CPU float32 inference (no autograd) on a machine where the kernel builds."""
    return _native.runs_on(NAME, (u, delta, A, B, C, initial_state))


def available() -> bool:
    return _library() is not None


def _unit_stride(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` itself when ``dim`` has unit stride (a tokens-first layout seen transposed), else a copy that has."""
    if t.stride(dim) == 1:
        return t
    return t.movedim(dim, -1).contiguous().movedim(-1, dim)


def _ptr(t):
    return None if t is None else t.data_ptr()


def selective_scan_native(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, mask=None
):
    """Same contract as :func:`hf_statecompose.ops.selective_scan_ref`; None if the kernel cannot be built."""
    lib = _library()
    if lib is None:
        return None
    _check_shapes(u, delta, A, B, C, initial_state, mask)
    batch, channels, length = u.shape
    state_size = A.shape[1]
    u, delta, B, C = (_unit_stride(t, 1) for t in (u, delta, B, C))
    z = _unit_stride(z.to(torch.float32), 1) if z is not None else None
    A_t = A.to(torch.float32).t().contiguous()
    bias = delta_bias.to(torch.float32).contiguous() if delta_bias is not None else None
    skip = D.to(torch.float32).contiguous() if D is not None else None
    mask_f = mask.to(torch.float32).contiguous() if mask is not None else None
    if initial_state is not None:
        h = initial_state.to(torch.float32, copy=True).contiguous()
    else:
        h = u.new_zeros((batch, channels, state_size), dtype=torch.float32)
    y = u.new_empty((batch, length, channels), dtype=torch.float32)
    delta_sum = u.new_empty((batch, channels), dtype=torch.float32)
    if length > 0:
        lib.hsc_selective_scan(
            batch,
            length,
            channels,
            state_size,
            u.data_ptr(),
            u.stride(0),
            u.stride(2),
            delta.data_ptr(),
            delta.stride(0),
            delta.stride(2),
            _ptr(bias),
            int(bool(delta_softplus)),
            A_t.data_ptr(),
            B.data_ptr(),
            B.stride(0),
            B.stride(2),
            C.data_ptr(),
            C.stride(0),
            C.stride(2),
            _ptr(skip),
            _ptr(z),
            z.stride(0) if z is not None else 0,
            z.stride(2) if z is not None else 0,
            _ptr(mask_f),
            h.data_ptr(),
            y.data_ptr(),
            delta_sum.data_ptr(),
            torch.get_num_threads(),
        )
    else:
        delta_sum.zero_()
    return y.transpose(1, 2), h, delta_sum
