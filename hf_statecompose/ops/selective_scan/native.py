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
SOURCE = (
    _native.MATH
    + r"""
#define W 32
#define W2 16

static inline __attribute__((always_inline)) void block(
    const int nw, long T, long D, long N, long d0,
    const float* u, long u_st, const float* dt, long dt_st, const float* dt_bias, int softplus,
    const float* A_t, const float* Bm, long B_st, const float* Cm, long C_st,
    const float* Dskip, const float* z, long z_st, const float* mask,
    float* h, float* y, float* dsum, float* hb)
{
    float bias[W], skip[W], dsv[W], dtv[W], dtu[W], acc[W];
    for (int i = 0; i < nw; i++) {
        bias[i] = dt_bias ? dt_bias[d0 + i] : 0.0f;
        skip[i] = Dskip ? Dskip[d0 + i] : 0.0f;
        dsv[i] = 0.0f;
    }
    for (long n = 0; n < N; n++)
        for (int i = 0; i < nw; i++) hb[n * W + i] = h[(d0 + i) * N + n];
    for (long t = 0; t < T; t++) {
        const float mk = mask ? mask[t] : 1.0f;
        const float* ur = u + t * u_st + d0;
        const float* dr = dt + t * dt_st + d0;
        for (int i = 0; i < nw; i++) {
            float v = dr[i] + bias[i];
            v = softplus ? hsc_softplus(v) : v;
            v = v * mk;
            dsv[i] += v;
            dtv[i] = v;
            dtu[i] = v * ur[i];
            acc[i] = 0.0f;
        }
        const float* Br = Bm + t * B_st;
        const float* Cr = Cm + t * C_st;
        for (long n = 0; n < N; n++) {
            const float b = Br[n], c = Cr[n];
            const float* a = A_t + n * D + d0;
            float* hn = hb + n * W;
            for (int i = 0; i < nw; i++) {
                float hv = hsc_exp(dtv[i] * a[i]) * hn[i] + dtu[i] * b;
                hn[i] = hv;
                acc[i] += c * hv;
            }
        }
        float* yr = y + t * D + d0;
        const float* zr = z ? z + t * z_st + d0 : 0;
        for (int i = 0; i < nw; i++) {
            float o = acc[i] + skip[i] * ur[i];
            yr[i] = zr ? o * hsc_silu(zr[i]) : o;
        }
    }
    for (long n = 0; n < N; n++)
        for (int i = 0; i < nw; i++) h[(d0 + i) * N + n] = hb[n * W + i];
    for (int i = 0; i < nw; i++) dsum[d0 + i] = dsv[i];
}

/* u, dt, z: [B, T, D] (unit channel stride); B, C: [B, T, N] (unit state stride); A_t: [N, D];
   mask: [B, T] contiguous; h: [B, D, N] contiguous, in: initial state, out: final state;
   y: [B, T, D] contiguous; dsum: [B, D]. */
void hsc_selective_scan(long batch, long T, long D, long N,
    const float* u, long u_sb, long u_st, const float* dt, long dt_sb, long dt_st,
    const float* dt_bias, int softplus, const float* A_t,
    const float* Bm, long B_sb, long B_st, const float* Cm, long C_sb, long C_st,
    const float* Dskip, const float* z, long z_sb, long z_st, const float* mask,
    float* h, float* y, float* dsum, int nthreads)
{
    long nblk = (D + W - 1) / W;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long job = 0; job < batch * nblk; job++) {
        long b = job / nblk, d0 = (job % nblk) * W;
        float hb[N * W];
        const float* ub = u + b * u_sb; const float* db = dt + b * dt_sb;
        const float* Bb = Bm + b * B_sb; const float* Cb = Cm + b * C_sb;
        const float* zb = z ? z + b * z_sb : 0; const float* mb = mask ? mask + b * T : 0;
        float* hb_out = h + b * D * N; float* yb = y + b * T * D; float* sb = dsum + b * D;
        if (d0 + W <= D) {
            block(W, T, D, N, d0, ub, u_st, db, dt_st, dt_bias, softplus, A_t, Bb, B_st, Cb, C_st,
                  Dskip, zb, z_st, mb, hb_out, yb, sb, hb);
            continue;
        }
        long d = d0;
        for (; d + W2 <= D; d += W2)
            block(W2, T, D, N, d, ub, u_st, db, dt_st, dt_bias, softplus, A_t, Bb, B_st, Cb, C_st,
                  Dskip, zb, z_st, mb, hb_out, yb, sb, hb);
        for (; d < D; d++)
            block(1, T, D, N, d, ub, u_st, db, dt_st, dt_bias, softplus, A_t, Bb, B_st, Cb, C_st,
                  Dskip, zb, z_st, mb, hb_out, yb, sb, hb);
    }
}
"""
)

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
