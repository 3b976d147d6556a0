"""Triton diagonal linear recurrence returning the whole trajectory, forward and backward.

:func:`linear_recurrence` is the Triton backend of ``hf_statecompose.ops.linear_recurrence`` (whose wrapper
checks the arguments)::

    a, b [B, L, C] (float32 / bfloat16 / float16)   initial_state [B, C] | None (zeros)   ->   h [B, L, C]
    h_k = a_k ⊙ h_{k-1} + b_k   (h_{-1} = initial_state), h in the dtype of b

A first-order recurrence is sequential in k but independent across channels, so each program owns one
batch row and a block of BLOCK_C contiguous channels and walks k = 0 .. L-1 with its state in registers
(float32), reading a_k, b_k and writing h_k once: one pass over the data, coalesced along C.

Forward: one kernel, grid (B, cdiv(C, BLOCK_C)). Backward: one kernel on the same grid walking k from L-1
down to 0 with the adjoint g_k = ∂ℓ/∂h_k + a_{k+1} g_{k+1} in registers, writing ∂ℓ/∂b_k = g_k and
∂ℓ/∂a_k = g_k h_{k-1} (h_{k-1} read back from the forward's output, h_{-1} = initial_state) and, at the
end, ∂ℓ/∂h_{-1} = a_0 g_0. No extra memory beyond the gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["linear_recurrence"]


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _recurrence_fwd_kernel(
    a_ptr,
    b_ptr,
    h0_ptr,
    h_ptr,  # a, b, h [B, L, C] contiguous; h0 [B, C] float32 contiguous
    L,
    C,
    BLOCK_C: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    h = tl.load(h0_ptr + pid_b * C + c, mask=cm, other=0.0)
    offs = pid_b * L * C + c
    for _ in range(L):
        a = tl.load(a_ptr + offs, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=cm, other=0.0).to(tl.float32)
        h = a * h + b
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=cm)
        offs += C


@triton.jit
def _adjoint_step(a_ptr, dh_ptr, da_ptr, db_ptr, offs, cm, g, a_next, h_prev):
    """Step k (at offs) of the adjoint: g_k = dh_k + a_{k+1} g_{k+1}; writes da_k, db_k; returns (g_k, a_k)."""
    g = tl.load(dh_ptr + offs, mask=cm, other=0.0).to(tl.float32) + a_next * g
    tl.store(da_ptr + offs, (g * h_prev).to(da_ptr.dtype.element_ty), mask=cm)
    tl.store(db_ptr + offs, g.to(db_ptr.dtype.element_ty), mask=cm)
    return g, tl.load(a_ptr + offs, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _recurrence_bwd_kernel(
    a_ptr,
    h_ptr,
    h0_ptr,
    dh_ptr,  # a, h, dh [B, L, C] contiguous; h0 [B, C] float32
    da_ptr,
    db_ptr,
    dh0_ptr,  # outputs: da, db [B, L, C] (dtypes of a, b); dh0 [B, C] float32
    L,
    C,
    BLOCK_C: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    g = tl.zeros([BLOCK_C], dtype=tl.float32)
    a_next = tl.zeros([BLOCK_C], dtype=tl.float32)  # a_{k+1}; a_L = 0
    h0 = tl.load(h0_ptr + pid_b * C + c, mask=cm, other=0.0)
    offs = pid_b * L * C + (L - 1) * C + c
    for _ in range(L - 1):  # k = L-1 .. 1: h_{k-1} from the forward's output
        h_prev = tl.load(h_ptr + offs - C, mask=cm, other=0.0).to(tl.float32)
        g, a_next = _adjoint_step(a_ptr, dh_ptr, da_ptr, db_ptr, offs, cm, g, a_next, h_prev)
        offs -= C
    g, a_next = _adjoint_step(a_ptr, dh_ptr, da_ptr, db_ptr, offs, cm, g, a_next, h0)  # k = 0: h_{-1} = h0
    tl.store(dh0_ptr + pid_b * C + c, a_next * g, mask=cm)


# --------------------------------------------------------------------------------------------- launch
def _blocks(channels: int) -> tuple[int, int]:
    """BLOCK_C up to 256 channels and its warps (2 channels per thread at most: a handful of registers)."""
    block_c = min(256, max(32, triton.next_power_of_2(max(channels, 1))))
    return block_c, max(1, min(4, block_c // 64))


class _LinearRecurrenceTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, h0):
        batch, length, channels = b.shape
        block_c, warps = _blocks(channels)
        h = torch.empty_like(b)
        grid = (batch, triton.cdiv(channels, block_c))
        _recurrence_fwd_kernel[grid](a, b, h0, h, length, channels, BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(a, h0, h)
        ctx.b_dtype = b.dtype
        return h

    @staticmethod
    def backward(ctx, dh):
        a, h0, h = ctx.saved_tensors
        batch, length, channels = h.shape
        block_c, warps = _blocks(channels)
        dh = dh.contiguous()
        da = torch.empty_like(a)
        db = torch.empty(h.shape, device=h.device, dtype=ctx.b_dtype)
        dh0 = torch.empty_like(h0)
        grid = (batch, triton.cdiv(channels, block_c))
        _recurrence_bwd_kernel[grid](a, h, h0, dh, da, db, dh0, length, channels, BLOCK_C=block_c, num_warps=warps)
        return da, db, dh0


def linear_recurrence(a, b, initial_state=None):
    """h_k = a_k · h_{k-1} + b_k over ``[B, L, C]`` (module docstring); differentiable, float32 inside.

    ``a, b [B, L, C]`` of one shape (float32 / bfloat16 / float16), ``initial_state [B, C]`` or None (zeros);
    the caller checks the arguments. ``h`` in the dtype of b.
    """
    batch, length, channels = b.shape
    if initial_state is None:
        h0 = torch.zeros((batch, channels), device=b.device, dtype=torch.float32)
    else:
        h0 = initial_state.float().contiguous()  # autograd casts its gradient back
    if length == 0:
        return b.new_zeros((batch, 0, channels))
    return _LinearRecurrenceTriton.apply(a.contiguous(), b.contiguous(), h0)
