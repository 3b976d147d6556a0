/* Mamba-1 selective scan: the CPU kernel of hf_statecompose/ops/selective_scan/native.py (its docstring says what and why).
   Compiled at run time by hf_statecompose/ops/_native.py. */
#include "statecompose_math.h"

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
