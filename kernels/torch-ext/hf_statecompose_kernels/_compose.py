"""Fused composition of n SSM states in one pass: x = Σ_k W_k ⊙ x_k, weights computed on the fly.

    ssm_states : n tensors [B, D, N] (Mamba-1) or [B, H, P, N] (Mamba-2), same shape / dtype / device
    delta_sums : [n, B, D] (Mamba-1) or [n, B, H] (Mamba-2), each state's ΣΔ
    A          : [D, N] (Mamba-1) or [H] (Mamba-2)
    log a_k    = ΣΔ[k, b, d] · A[d, m]  (Mamba-1, per element)   or   ΣΔ[k, b, h] · A[h]  (Mamba-2, per head)
    -> Σ_k W_k ⊙ x_k, same shape and dtype as one state (accumulated in float32)

The weights W_k are those of ``hf_statecompose.ops.compose.weights`` (same formulas, same stability:
no division by a decay, no overflowing product; ``-inf`` log decays are decays of exactly 0). The method is
the constexpr ``METHOD`` (:data:`METHOD_IDS`):

* ``soup``: 1/n;  ``weighted``: the user's w_k;
* ``caso``: W_k = exp(Σ_{j>k} log a_j), the suffix sum walked from the newest state to the oldest;
* ``picaso_r``: W_k = S_k / n, S_{n-1} = 1 + Σ_{m≥1} Π_{j<m} a_j, S_{k} = (1 - P) + a_{k+1} S_{k+1},
  1 - P = -expm1(Σ_i log a_i);
* ``picaso_s``: W_k = Σ_q w_q Π_i f_i(t_q) / f_k(t_q), f_i(t) = 1 - t + t a_i, with the ⌈n/2⌉
  Gauss–Legendre nodes t_q, weights w_q on (0, 1), passed in by the caller (the package's
  ``_gauss_legendre_01``).

:func:`compose_layers` composes L layers of one shape in one launch (grid axis 2 over layers × rows, an
``[L, n + 1]`` table of the states' and the outputs' data pointers): per-layer launches from Python cost more than the composition itself on a GPU.

:func:`compose` (the Triton part of ``hf_statecompose.ops.compose_ssm(..., backend="triton")``, whose wrapper
checks the arguments) is one Triton kernel, grid ``(cdiv(M, BLOCK), G, B)`` with ``M`` the elements of
one row (Mamba-1: D·N with G = 1; Mamba-2: P·N with G = H). A program loops over the states k, reads its
block of x_k once and accumulates W_k ⊙ x_k in float32 registers; the weights live only in registers
(Mamba-1: one per element of the block; Mamba-2: one scalar per program). The decays are re-derived from
ΣΔ and A (a few bytes per row) in the passes that need them, so the states are the only large reads. The
n states are passed as an int64 tensor of their data pointers, cast to pointers in the kernel: no stack,
no copy. There is no backward (the torch composer handles training).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["METHOD_IDS", "compose", "compose_layers"]

# the kernel's METHOD constexpr per composition method (the package's dispatch passes the same ids)
METHOD_IDS = {"soup": 0, "weighted": 1, "caso": 2, "picaso_s": 3, "picaso_r": 4}


# --------------------------------------------------------------------------------------------- kernel
@triton.jit
def _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask):
    # the k-th state's data pointer, typed like the first state's pointer (int -> pointer cast)
    base = tl.load(ptrs_ptr + k).to(x0_ptr.dtype)
    return tl.load(base + row_off + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef):
    ds = tl.load(delta_ptr + k * stride_dk + d_off, mask=wmask, other=0.0)
    return ds * a_coef


@triton.jit
def _neg_expm1(x):
    # 1 - exp(x) = -expm1(x) for x <= 0 (-inf allowed), accurate near 0 where 1 - exp(x) cancels: Taylor
    # series (degree 8, truncation < 1e-9 relative) for x > -0.35, 1 - exp(x) >= 0.29 below. No libdevice
    # (the interpreter has none) and no log (GPU logs are approximate near 1).
    xs = tl.maximum(x, -0.35)
    series = 1.0 / 40320.0
    series = series * xs + 1.0 / 5040.0
    series = series * xs + 1.0 / 720.0
    series = series * xs + 1.0 / 120.0
    series = series * xs + 1.0 / 24.0
    series = series * xs + 1.0 / 6.0
    series = series * xs + 0.5
    series = series * xs + 1.0
    return tl.where(x > -0.35, -(series * xs), 1.0 - tl.exp(x))


@triton.jit
def _compose_kernel(
    ptrs_ptr,  # int64 [L, n + 1]: per layer the data pointers of the n (contiguous) states, then of its output
    x0_ptr,  # the first state (gives the element type of the pointers)
    out_ptr,  # the first layer's output [B, G, M] contiguous, dtype of the states (gives the output's type)
    delta_ptr,  # float32 [n, B, G_delta]
    A_ptr,  # float32, Mamba-1 [D, N] contiguous, Mamba-2 [H]
    w_ptr,  # float32 [n]: user weights ("weighted")
    gl_ptr,  # float32 [2, Q_PAD]: Gauss–Legendre nodes then weights ("picaso_s"), zero padded
    n,
    M,
    N,
    stride_sb,
    stride_sg,  # of the states and the output (contiguous)
    stride_dk,
    stride_db,
    stride_dg,
    stride_ag,
    batch,  # B: program axis 2 runs over (layer, row) pairs, l = pid // B, b = pid % B
    stride_dl,  # ΣΔ's layer stride
    stride_al,  # A's layer stride
    METHOD: tl.constexpr,
    PER_ELEMENT: tl.constexpr,  # True: Mamba-1 (a decay per element), False: Mamba-2 (one per program)
    BLOCK: tl.constexpr,
    Q_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    pid_lb = tl.program_id(2)
    b = pid_lb % batch
    layer = (pid_lb // batch).to(tl.int64)
    # this layer's row of the [L, n + 1] pointer table (n states, then the output), its ΣΔ [n, B, G] and A
    ptrs_ptr += layer * (n + 1)
    delta_ptr += layer * stride_dl
    A_ptr += layer * stride_al
    out_base = tl.load(ptrs_ptr + n).to(out_ptr.dtype)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    row_off = b.to(tl.int64) * stride_sb + g.to(tl.int64) * stride_sg

    # decay coefficients: shape [BLOCK] (Mamba-1) or [1] (Mamba-2), broadcast against the state block
    if PER_ELEMENT:
        wmask = mask
        a_coef = tl.load(A_ptr + offs, mask=mask, other=0.0)  # flat index d * N + m of a contiguous [D, N]
        d_off = b * stride_db + (offs // N) * stride_dg
    else:
        zero = tl.zeros([1], dtype=tl.int32)
        wmask = zero == 0
        a_coef = tl.load(A_ptr + g * stride_ag + zero)
        d_off = b * stride_db + g * stride_dg + zero

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if METHOD == 0:  # soup (METHOD_IDS)
        inv_n = 1.0 / n
        for k in range(n):
            acc += inv_n * _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask)
    elif METHOD == 1:  # weighted
        for k in range(n):
            w_k = tl.load(w_ptr + k)
            acc += w_k * _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask)
    elif METHOD == 2:  # caso: W_k = exp(Σ_{j>k} log a_j), newest first
        suffix = tl.zeros_like(a_coef)
        for i in range(n):
            k = n - 1 - i
            acc += tl.exp(suffix) * _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask)
            suffix += _log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef)
    elif METHOD == 3:  # picaso_s: Gauss–Legendre on ∫_0^1 Π_{i≠k} (1 - t + t a_i) dt
        q = tl.arange(0, Q_PAD)
        t_q = tl.load(gl_ptr + q)[:, None]  # padded nodes: t = 0, w = 0 -> f = 1, no contribution
        w_q = tl.load(gl_ptr + Q_PAD + q)[:, None]
        full = tl.zeros([Q_PAD, 1], dtype=tl.float32) + tl.zeros_like(a_coef)[None, :] + 1.0
        for k in range(n):  # pass 1 (decays only): Π_i f_i(t_q)
            a_k = tl.exp(_log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef))
            full = full * (a_k[None, :] * t_q + (1.0 - t_q))
        for k in range(n):  # pass 2: leave-one-out, f_k >= 1 - t_q > 0
            a_k = tl.exp(_log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef))
            f_k = a_k[None, :] * t_q + (1.0 - t_q)
            w_k = tl.sum((w_q * full) / f_k, axis=0)
            acc += w_k * _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask)
    else:  # picaso_r: S_k = (1 - P) + a_{k+1} S_{k+1}, walked from k = n - 1 down
        total = _log_decay(delta_ptr, n - 1, stride_dk, d_off, wmask, a_coef)
        prefix = tl.zeros_like(a_coef) + 1.0
        s = tl.zeros_like(a_coef) + 1.0  # S_{n-1} = 1 + Σ_{m=1}^{n-1} Π_{j<m} a_j
        for k in range(n - 1):
            log_a = _log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef)
            total += log_a
            prefix = prefix * tl.exp(log_a)
            s += prefix
        one_minus_p = _neg_expm1(total)
        for i in range(n):
            k = n - 1 - i
            acc += (s / n) * _load_state(ptrs_ptr, x0_ptr, k, row_off, offs, mask)
            a_k = tl.exp(_log_decay(delta_ptr, k, stride_dk, d_off, wmask, a_coef))
            s = one_minus_p + a_k * s  # S_{k-1}

    tl.store(out_base + row_off + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- public
def compose(ssm_states, delta_sums, A, method_id: int, weights=None, quadrature=None) -> torch.Tensor:
    """Σ_k W_k ⊙ x_k in one Triton pass (module docstring); no autograd.

    ``ssm_states``: n tensors of one shape / dtype (float32, bfloat16 or float16) / device; ``delta_sums``
    ``[n, B, D | H]``; ``A`` ``[D, N]`` or ``[H]``; ``method_id``: a value of :data:`METHOD_IDS`; ``weights``:
    ``[n]`` for ``weighted``; ``quadrature``: float32 ``[2, Q]`` on the states' device for ``picaso_s``, the
    ⌈n/2⌉ Gauss–Legendre nodes on (0, 1) then their weights, zero padded to a power-of-two Q. The caller checks
    the arguments.
    """
    return compose_layers([ssm_states], delta_sums[None], A[None], method_id, weights, quadrature)[0]


def compose_layers(layer_states, delta_sums, A, method_id: int, weights=None, quadrature=None) -> list[torch.Tensor]:
    """:func:`compose` of L layers of one shape in one launch (grid axis 2 runs over layers × rows): returns L
    tensors (each its own storage), layer ``l`` composed from ``layer_states[l]`` (n tensors), ``delta_sums[l]``
    (``[n, B, ·]``) and ``A[l]``. ``delta_sums`` is ``[L, n, B, D | H]`` and ``A`` ``[L, D, N]`` or ``[L, H]``; every
    state of every layer has one shape / dtype / device. The caller checks the arguments."""
    layers = [[s.contiguous() for s in states] for states in layer_states]  # no-ops for contiguous states
    first = layers[0][0]
    n_layers, n, device = len(layers), len(layers[0]), first.device
    outs = [torch.empty_like(first) for _ in range(n_layers)]
    if first.numel() == 0:
        return outs
    mamba1 = first.dim() == 3
    batch, rows = first.shape[0], first.shape[1]
    if mamba1:
        groups, row_elems, n_state = 1, rows * first.shape[2], first.shape[2]
    else:
        groups, row_elems, n_state = rows, first.shape[2] * first.shape[3], first.shape[3]
    delta = delta_sums.to(device=device, dtype=torch.float32).contiguous()
    a_coef = A.to(device=device, dtype=torch.float32).contiguous()
    user_w = weights.to(device=device, dtype=torch.float32).contiguous() if weights is not None else delta
    # the [L, n + 1] table of data pointers (each layer's n states, then its output), one host-to-device copy
    table_rows = [[s.data_ptr() for s in states] + [out.data_ptr()] for states, out in zip(layers, outs)]
    ptrs = torch.tensor(table_rows, dtype=torch.int64, device=device)
    if method_id == METHOD_IDS["picaso_s"]:
        table = quadrature.to(device=device, dtype=torch.float32).contiguous()
        q_pad = table.shape[1]
        if q_pad & (q_pad - 1):
            raise ValueError(f"the quadrature table must have a power-of-two width, got {q_pad}")
    else:
        table, q_pad = delta, 1  # unused by the kernel
    # Mamba-1 picaso_s holds a [Q_PAD, BLOCK] product in registers: shrink the block as Q_PAD grows
    cap = max(64, 4096 // q_pad) if (mamba1 and method_id == METHOD_IDS["picaso_s"]) else 1024
    block = min(cap, triton.next_power_of_2(row_elems))
    grid = (triton.cdiv(row_elems, block), groups, batch * n_layers)
    _compose_kernel[grid](
        ptrs,
        first,
        outs[0],
        delta,
        a_coef,
        user_w,
        table,
        n,
        row_elems,
        n_state,
        groups * row_elems,
        row_elems,
        delta.stride(1),
        delta.stride(2),
        delta.stride(3),
        0 if mamba1 else a_coef.stride(1),
        batch,
        delta.stride(0),
        a_coef.stride(0),
        METHOD=int(method_id),
        PER_ELEMENT=mamba1,
        BLOCK=block,
        Q_PAD=q_pad,
        num_warps=4,
    )
    return outs
