"""Triton selective scan (Mamba-1) with initial state and final state; forward and backward.

:func:`selective_scan` runs the recurrence on a discretised Δ (the Triton part of
``hf_statecompose.ops.selective_scan(..., backend="triton")``, whose wrapper discretises Δ and adds the D and z
terms in torch under autograd)::

    u, dt : [B, D, T]    A : [D, N]    B, C : [B, N, T]    initial_state : [B, D, N] | None (zeros)
    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t,   h_0 = initial_state (or 0)
    -> (y [B, D, T] float32 with y_t = ⟨C_t, h_t⟩, h_T [B, D, N] float32)

The O(T·D·N) recurrence is a ``torch.autograd.Function`` whose forward and backward are Triton kernels,
grid ``(B, cdiv(D, BLOCK_D))``: each program keeps the state tile ``[BLOCK_D, BLOCK_N]`` in registers (fp32)
and walks the tokens in order. The forward stores the state at every chunk start (``[B, n_chunks, D, N]``);
the backward walks the chunks from last to first, recomputes a chunk's states forward from its checkpoint
into a scratch buffer ``[B, CHUNK, D, N]`` and then walks that chunk in reverse with the adjoint state
``g_t = dL/dh_t``. Nothing is ever divided by a decay. The reductions over channels (dB, dC) and over the
batch (dA) are written as per-program partials and summed in torch: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DEFAULT_CHUNK", "selective_scan"]

DEFAULT_CHUNK = 64  # tokens between two forward checkpoints; the backward's scratch holds this many states


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _scan_fwd_kernel(
    u_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    h0_ptr,  # inputs
    y_ptr,
    hT_ptr,
    ckpt_ptr,  # outputs: y_raw [B, D, T], h_T [B, D, N], checkpoints [B, NC, D, N] (contiguous)
    T,
    D,
    N,
    n_chunks,
    s_u_b,
    s_u_d,
    s_u_t,
    s_dt_b,
    s_dt_d,
    s_dt_t,
    s_A_d,
    s_A_n,
    s_B_b,
    s_B_n,
    s_B_t,
    s_C_b,
    s_C_n,
    s_C_t,
    s_h0_b,
    s_h0_d,
    s_h0_n,
    HAS_H0: tl.constexpr,
    STORE_CKPT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < D
    mn = offs_n < N
    mdn = md[:, None] & mn[None, :]

    A = tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mdn, other=0.0).to(tl.float32)
    if HAS_H0:
        h = tl.load(
            h0_ptr + pid_b * s_h0_b + offs_d[:, None] * s_h0_d + offs_n[None, :] * s_h0_n, mask=mdn, other=0.0
        ).to(tl.float32)
    else:
        h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)

    u_base = u_ptr + pid_b * s_u_b + offs_d * s_u_d
    dt_base = dt_ptr + pid_b * s_dt_b + offs_d * s_dt_d
    B_base = B_ptr + pid_b * s_B_b + offs_n * s_B_n
    C_base = C_ptr + pid_b * s_C_b + offs_n * s_C_n
    y_base = y_ptr + pid_b * D * T + offs_d * T
    dn_offs = offs_d[:, None] * N + offs_n[None, :]  # [D, N] offsets inside a contiguous [.., D, N] buffer

    for c in range(n_chunks):
        if STORE_CKPT:  # state entering token c * CHUNK
            tl.store(ckpt_ptr + (pid_b * n_chunks + c) * D * N + dn_offs, h, mask=mdn)
        for j in range(CHUNK):
            t = c * CHUNK + j
            # tokens past T (last chunk) load Δ = 0: decay 1, no input, state unchanged
            mdt = md & (tl.full((BLOCK_D,), t, tl.int32) < T)
            mnt = mn & (tl.full((BLOCK_N,), t, tl.int32) < T)
            dt = tl.load(dt_base + t * s_dt_t, mask=mdt, other=0.0).to(tl.float32)
            u = tl.load(u_base + t * s_u_t, mask=mdt, other=0.0).to(tl.float32)
            Bt = tl.load(B_base + t * s_B_t, mask=mnt, other=0.0).to(tl.float32)
            Ct = tl.load(C_base + t * s_C_t, mask=mnt, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
            y = tl.sum(h * Ct[None, :], axis=1)
            tl.store(y_base + t, y, mask=mdt)

    tl.store(hT_ptr + pid_b * D * N + dn_offs, h, mask=mdn)


@triton.jit
def _scan_bwd_kernel(
    u_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    ckpt_ptr,
    dy_ptr,
    dhT_ptr,  # inputs (ckpt contiguous)
    du_ptr,
    ddt_ptr,
    dA_ptr,
    dB_ptr,
    dC_ptr,
    dh0_ptr,
    scratch_ptr,  # outputs / scratch (all contiguous)
    T,
    D,
    N,
    n_chunks,
    n_dblocks,
    s_u_b,
    s_u_d,
    s_u_t,
    s_dt_b,
    s_dt_d,
    s_dt_t,
    s_A_d,
    s_A_n,
    s_B_b,
    s_B_n,
    s_B_t,
    s_C_b,
    s_C_n,
    s_C_t,
    s_dy_b,
    s_dy_d,
    s_dy_t,
    s_dhT_b,
    s_dhT_d,
    s_dhT_n,
    HAS_DHT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # du [B, D, T], ddt [B, D, T], dA partial [B, D, N] (summed over B in torch), dB / dC partials
    # [B, n_dblocks, N, T] (summed over the channel blocks in torch), dh0 [B, D, N], scratch [B, CHUNK, D, N].
    pid_b = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < D
    mn = offs_n < N
    mdn = md[:, None] & mn[None, :]
    dn_offs = offs_d[:, None] * N + offs_n[None, :]

    A = tl.load(A_ptr + offs_d[:, None] * s_A_d + offs_n[None, :] * s_A_n, mask=mdn, other=0.0).to(tl.float32)
    if HAS_DHT:
        g = tl.load(
            dhT_ptr + pid_b * s_dhT_b + offs_d[:, None] * s_dhT_d + offs_n[None, :] * s_dhT_n, mask=mdn, other=0.0
        ).to(tl.float32)
    else:
        g = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)  # g = dL/dh_t from the tokens after t
    dA_acc = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)

    u_base = u_ptr + pid_b * s_u_b + offs_d * s_u_d
    dt_base = dt_ptr + pid_b * s_dt_b + offs_d * s_dt_d
    B_base = B_ptr + pid_b * s_B_b + offs_n * s_B_n
    C_base = C_ptr + pid_b * s_C_b + offs_n * s_C_n
    dy_base = dy_ptr + pid_b * s_dy_b + offs_d * s_dy_d
    dud_base = pid_b * D * T + offs_d * T  # du and ddt are contiguous [B, D, T]
    dBC_base = (pid_b * n_dblocks + pid_d) * N * T + offs_n * T
    scratch_base = scratch_ptr + pid_b * CHUNK * D * N + dn_offs

    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        t0 = c * CHUNK
        # 1. recompute the chunk's states forward from its checkpoint; scratch[j] = h_{t0 + j - 1}
        h = tl.load(ckpt_ptr + (pid_b * n_chunks + c) * D * N + dn_offs, mask=mdn, other=0.0)
        for j in range(CHUNK):
            t = t0 + j
            mdt = md & (tl.full((BLOCK_D,), t, tl.int32) < T)
            mnt = mn & (tl.full((BLOCK_N,), t, tl.int32) < T)
            tl.store(scratch_base + j * D * N, h, mask=mdn)
            dt = tl.load(dt_base + t * s_dt_t, mask=mdt, other=0.0).to(tl.float32)
            u = tl.load(u_base + t * s_u_t, mask=mdt, other=0.0).to(tl.float32)
            Bt = tl.load(B_base + t * s_B_t, mask=mnt, other=0.0).to(tl.float32)
            h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        tl.debug_barrier()  # scratch written by every thread before any thread reads it back
        # 2. walk the chunk in reverse
        for jj in range(CHUNK):
            j = CHUNK - 1 - jj
            t = t0 + j
            # tokens past T: Δ = u = B = C = dy = 0, so g passes through unchanged
            mdt = md & (tl.full((BLOCK_D,), t, tl.int32) < T)
            mnt = mn & (tl.full((BLOCK_N,), t, tl.int32) < T)
            h_prev = tl.load(scratch_base + j * D * N, mask=mdn, other=0.0)
            dt = tl.load(dt_base + t * s_dt_t, mask=mdt, other=0.0).to(tl.float32)
            u = tl.load(u_base + t * s_u_t, mask=mdt, other=0.0).to(tl.float32)
            Bt = tl.load(B_base + t * s_B_t, mask=mnt, other=0.0).to(tl.float32)
            Ct = tl.load(C_base + t * s_C_t, mask=mnt, other=0.0).to(tl.float32)
            dy = tl.load(dy_base + t * s_dy_t, mask=mdt, other=0.0).to(tl.float32)
            a = tl.exp(dt[:, None] * A)
            dtu = dt * u
            h_t = a * h_prev + dtu[:, None] * Bt[None, :]
            G = g + dy[:, None] * Ct[None, :]  # dL/dh_t, total
            GB = tl.sum(G * Bt[None, :], axis=1)
            Gah = G * a * h_prev
            tl.store(du_ptr + dud_base + t, dt * GB, mask=mdt)
            tl.store(ddt_ptr + dud_base + t, tl.sum(Gah * A, axis=1) + u * GB, mask=mdt)
            dA_acc += Gah * dt[:, None]
            tl.store(dB_ptr + dBC_base + t, tl.sum(G * dtu[:, None], axis=0), mask=mnt)
            tl.store(dC_ptr + dBC_base + t, tl.sum(h_t * dy[:, None], axis=0), mask=mnt)
            g = a * G
        tl.debug_barrier()  # every thread done reading scratch before the next chunk overwrites it

    tl.store(dh0_ptr + pid_b * D * N + dn_offs, g, mask=mdn)
    tl.store(dA_ptr + pid_b * D * N + dn_offs, dA_acc, mask=mdn)


# --------------------------------------------------------------------------------------------- launch
def _block_sizes(channels: int, state_size: int, block_d: int | None):
    block_n = max(2, triton.next_power_of_2(state_size))
    if block_d is None:
        # ~512 fp32 state entries per program: many programs along D, a few registers per thread
        block_d = min(triton.next_power_of_2(max(channels, 1)), max(2, 512 // block_n))
    if block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"block_d must be a power of two, got {block_d}")
    num_warps = max(1, min(4, (block_d * block_n) // 128))
    return block_d, block_n, num_warps


def _chunk_for(length: int, chunk_size: int) -> int:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # at most the next power of two above the sequence: few wasted (masked) steps when T < chunk, and at
    # most log2(chunk_size) + 1 compiled variants for short sequences instead of one per length
    return max(1, min(chunk_size, triton.next_power_of_2(max(1, length))))


def _scan_forward(u, dt, A, B, C, h0, chunk, block_d, store_ckpt):
    batch, channels, length = u.shape
    state_size = A.shape[1]
    block_d, block_n, num_warps = _block_sizes(channels, state_size, block_d)
    n_chunks = triton.cdiv(length, chunk)
    dev = u.device
    y = torch.empty((batch, channels, length), device=dev, dtype=torch.float32)
    hT = torch.empty((batch, channels, state_size), device=dev, dtype=torch.float32)
    ckpt = (
        torch.empty((batch, n_chunks, channels, state_size), device=dev, dtype=torch.float32)
        if store_ckpt
        else hT  # never written (STORE_CKPT=False)
    )
    h0_arg = h0 if h0 is not None else hT
    h0_strides = h0.stride() if h0 is not None else (0, 0, 0)
    grid = (batch, triton.cdiv(channels, block_d))
    if batch > 0 and channels > 0:
        _scan_fwd_kernel[grid](
            u,
            dt,
            A,
            B,
            C,
            h0_arg,
            y,
            hT,
            ckpt,
            length,
            channels,
            state_size,
            n_chunks,
            *u.stride(),
            *dt.stride(),
            *A.stride(),
            *B.stride(),
            *C.stride(),
            *h0_strides,
            HAS_H0=h0 is not None,
            STORE_CKPT=store_ckpt,
            CHUNK=chunk,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return y, hT, (ckpt if store_ckpt else None)


def _scan_backward(u, dt, A, B, C, ckpt, dy, dhT, chunk, block_d):
    batch, channels, length = u.shape
    state_size = A.shape[1]
    block_d, block_n, num_warps = _block_sizes(channels, state_size, block_d)
    n_chunks = ckpt.shape[1]
    n_dblocks = triton.cdiv(channels, block_d)
    dev = u.device
    f32 = dict(device=dev, dtype=torch.float32)
    du = torch.empty((batch, channels, length), **f32)
    ddt = torch.empty((batch, channels, length), **f32)
    dA_part = torch.empty((batch, channels, state_size), **f32)
    dB_part = torch.empty((batch, n_dblocks, state_size, length), **f32)
    dC_part = torch.empty((batch, n_dblocks, state_size, length), **f32)
    dh0 = torch.empty((batch, channels, state_size), **f32)
    scratch = torch.empty((batch, chunk, channels, state_size), **f32)
    dhT_arg = dhT if dhT is not None else dh0
    dhT_strides = dhT.stride() if dhT is not None else (0, 0, 0)
    if batch > 0 and channels > 0:  # (an empty batch or channel dim leaves only empty gradients)
        _scan_bwd_kernel[(batch, n_dblocks)](
            u,
            dt,
            A,
            B,
            C,
            ckpt,
            dy,
            dhT_arg,
            du,
            ddt,
            dA_part,
            dB_part,
            dC_part,
            dh0,
            scratch,
            length,
            channels,
            state_size,
            n_chunks,
            n_dblocks,
            *u.stride(),
            *dt.stride(),
            *A.stride(),
            *B.stride(),
            *C.stride(),
            *dy.stride(),
            *dhT_strides,
            HAS_DHT=dhT is not None,
            CHUNK=chunk,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return du, ddt, dA_part.sum(0), dB_part.sum(1), dC_part.sum(1), dh0


class _SelectiveScanFn(torch.autograd.Function):
    """(u, Δ, A, B, C, h0) -> (y_raw[b, d, t] = ⟨C_t, h_t[d]⟩, h_T), both float32."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, h0, chunk, block_d):
        ctx.set_materialize_grads(False)  # unused outputs give None: no zero tensors to allocate and read
        y, hT, ckpt = _scan_forward(u, dt, A, B, C, h0, chunk, block_d, store_ckpt=True)
        ctx.save_for_backward(u, dt, A, B, C, ckpt)
        ctx.chunk, ctx.block_d = chunk, block_d
        ctx.h0_meta = None if h0 is None else h0.dtype
        return y, hT

    @staticmethod
    def backward(ctx, dy, dhT):
        u, dt, A, B, C, ckpt = ctx.saved_tensors
        if dy is None:  # only h_T was used: a stride-0 zero, nothing allocated
            dy = torch.zeros((), device=u.device, dtype=torch.float32).expand(u.shape)
        du, ddt, dA, dB, dC, dh0 = _scan_backward(u, dt, A, B, C, ckpt, dy, dhT, ctx.chunk, ctx.block_d)
        need = ctx.needs_input_grad
        return (
            du.to(u.dtype) if need[0] else None,
            ddt.to(dt.dtype) if need[1] else None,
            dA.to(A.dtype) if need[2] else None,
            dB.to(B.dtype) if need[3] else None,
            dC.to(C.dtype) if need[4] else None,
            dh0.to(ctx.h0_meta) if (ctx.h0_meta is not None and need[5]) else None,
            None,
            None,
        )


# --------------------------------------------------------------------------------------------- public
def selective_scan(u, dt, A, B, C, initial_state=None, chunk_size: int | None = None, block_d: int | None = None):
    """The scan on a discretised Δ: ``(y [B, D, T], h_T [B, D, N])``, float32, y without the D and z terms.

    ``u, dt [B, D, T]``, ``A [D, N]``, ``B, C [B, N, T]``, ``initial_state [B, D, N]`` or None (zeros); the
    caller checks shapes and dtypes (float32 / bfloat16 / float16; ``dt`` float32). Differentiable in every
    input (a ``torch.autograd.Function`` whose backward is Triton). ``chunk_size``: tokens between two
    forward checkpoints (None: ``DEFAULT_CHUNK``); ``block_d``: the channel block (None: the heuristic).
    """
    chunk = _chunk_for(u.shape[2], DEFAULT_CHUNK if chunk_size is None else chunk_size)
    tensors = (u, dt, A, B, C, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _SelectiveScanFn.apply(u, dt, A, B, C, initial_state, chunk, block_d)
    y, h, _ = _scan_forward(u, dt, A, B, C, initial_state, chunk, block_d, store_ckpt=False)
    return y, h
