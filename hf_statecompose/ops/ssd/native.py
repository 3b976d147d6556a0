"""Mamba-2 SSD scan as one C loop nest, the per-token recurrence (CPU inference, float32), built by
``ops/_native.py``.

Per (batch row, head, block of 16 head channels p), per token: Δ = clamp(softplus(dt + bias)) (masked),
ΣΔ, the scalar decay ``exp(Δ A_h)``, then for every state n ``h[n, p] = decay h[n, p] + (Δ x_p) B_t[n]``
and ``y_p += C_t[n] h[n, p]``, then the skip ``D_h x``. The state block (``N × 16`` floats) stays in L1;
it is vectorised over p, so the read-out over n needs no horizontal sums (four partial sums over n break
the dependency chain). Blocks run on torch's OpenMP threads. The recurrence is the one of
:func:`hf_statecompose.ops.ssd_scan_ref` (no chunking: no exponent differences, no quadratic form), and
at 130M shapes it does fewer flops than the chunked matmul form. Inputs are read through their strides
(unit stride on the last dim): the split / reshape views the Mamba-2 mixer passes cost no copies.

Same contract as :func:`hf_statecompose.ops.ssd_scan_ref`, for float32 inputs without autograd.
"""

from __future__ import annotations

import ctypes
import math

import torch

from ... import compat
from .. import _native
from .reference import _check_shapes

NAME = "ssd_scan"
SOURCE = _native.read_source(NAME)  # csrc/<NAME>.c

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def _library():
    lib = _native.load(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_hsc_typed", False):
        lib.hsc_ssd_scan.restype = None
        lib.hsc_ssd_scan.argtypes = [_L] * 6 + [
            _P,
            _L,
            _L,
            _L,
            _P,
            _L,
            _L,
            _L,
            _P,
            _P,
            _L,
            _L,
            _L,
            _P,
            _L,
            _L,
            _L,
            _P,
            _P,
            _I,
            _I,
            _F,
            _F,
            _P,
            _P,
            _P,
            _P,
            _I,
        ]
        lib.hsc_gated_rms_norm.restype = None
        lib.hsc_gated_rms_norm.argtypes = [_L, _L, _L, _P, _P, _L, _P, _F, _P, _I]
        lib._hsc_typed = True
    return lib


def applicable(x, dt, A, B, C, initial_state=None, mask=None, **_) -> bool:
    """CPU float32 inference (no autograd) on a machine where the kernel builds."""
    return _native.runs_on(NAME, (x, dt, A, B, C, initial_state))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def ssd_scan_native(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=None,
    initial_state=None,
    mask=None,
    chunk_size: int = 64,
):
    """Same contract as :func:`hf_statecompose.ops.ssd_scan_ref` (``chunk_size`` is accepted and unused:
    there are no chunks); None if the kernel cannot be built."""
    lib = _library()
    if lib is None:
        return None
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    x, B, C = _unit_last(x), _unit_last(B), _unit_last(C)
    A = A.to(torch.float32).contiguous()
    skip = D.to(torch.float32).contiguous() if D is not None else None
    bias = dt_bias.to(torch.float32).contiguous() if dt_bias is not None else None
    mask_f = mask.to(torch.float32).contiguous() if mask is not None else None
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (-math.inf, math.inf)
    if initial_state is not None:
        h = initial_state.to(torch.float32, copy=True).contiguous()
    else:
        h = x.new_zeros((batch, heads, head_dim, state_size))
    y = x.new_empty((batch, length, heads, head_dim))
    delta_sum = x.new_zeros((batch, heads))
    if length > 0:
        lib.hsc_ssd_scan(
            batch,
            length,
            heads,
            head_dim,
            groups,
            state_size,
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            x.stride(2),
            dt.data_ptr(),
            dt.stride(0),
            dt.stride(1),
            dt.stride(2),
            A.data_ptr(),
            B.data_ptr(),
            B.stride(0),
            B.stride(1),
            B.stride(2),
            C.data_ptr(),
            C.stride(0),
            C.stride(1),
            C.stride(2),
            None if skip is None else skip.data_ptr(),
            None if bias is None else bias.data_ptr(),
            int(bool(dt_softplus)),
            int(dt_limit is not None),
            lo,
            hi,
            None if mask_f is None else mask_f.data_ptr(),
            h.data_ptr(),
            y.data_ptr(),
            delta_sum.data_ptr(),
            torch.get_num_threads(),
        )
    return y, h, delta_sum


def gated_rms_norm_native(norm, hidden_states, gate):
    """``norm(hidden_states, gate)`` for transformers' ``MambaRMSNormGated`` in one pass (CPU float32
    inference); None when that does not apply (other dtypes, autograd, another norm class, no kernel)."""
    weight = getattr(norm, "weight", None)
    group_size, eps = getattr(norm, "group_size", None), getattr(norm, "variance_epsilon", None)
    tensors = (hidden_states, gate, weight)
    if weight is None or group_size is None or eps is None or gate is None:
        return None
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if compat.is_tracing(hidden_states):
        return None  # torch.compile / torch.export: FakeTensors have no data for ctypes to read
    width = hidden_states.shape[-1]
    if gate.shape != hidden_states.shape or width % group_size or weight.shape != (width,):
        return None
    if not (_native.enabled() and _native.failure(NAME) is None):
        return None
    lib = _library()
    if lib is None:
        return None
    y = hidden_states.reshape(-1, width).contiguous()
    z = gate.reshape(-1, width)
    if z.stride(-1) != 1:
        z = z.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(y)
    lib.hsc_gated_rms_norm(
        y.shape[0],
        width,
        group_size,
        y.data_ptr(),
        z.data_ptr(),
        z.stride(0),
        weight.data_ptr(),
        float(eps),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out.view(hidden_states.shape)
