/* Mamba-2 SSD scan: the CPU kernel of hf_statecompose/ops/ssd/native.py (its docstring says what and why).
   Compiled at run time by hf_statecompose/ops/_native.py. */
#include "statecompose_math.h"

#define W 64
#define W2 16

static inline __attribute__((always_inline)) void block(
    const int nw, long T, long N, long p0,
    const float* x, long x_st, const float* dt, long dt_st, float bias, int softplus,
    int clamp, float lo, float hi, float A, const float* Bm, long B_st, const float* Cm, long C_st,
    float skip, const float* mask, float* h, float* y, long y_st, float* dsum, float* hb)
{
    float bx[W], a0[W], a1[W], a2[W], a3[W];
    float ds = 0.0f;
    for (long n = 0; n < N; n++)
        for (int i = 0; i < nw; i++) hb[n * W + i] = h[(p0 + i) * N + n];
    for (long t = 0; t < T; t++) {
        float v = dt[t * dt_st] + bias;
        v = softplus ? hsc_softplus(v) : v;
        v = clamp ? (v < lo ? lo : (v > hi ? hi : v)) : v;
        v = mask ? v * mask[t] : v;
        ds += v;
        const float decay = hsc_exp(v * A);
        const float* xr = x + t * x_st + p0;
        const float* Br = Bm + t * B_st;
        const float* Cr = Cm + t * C_st;
        for (int i = 0; i < nw; i++) { bx[i] = v * xr[i]; a0[i] = 0.0f; a1[i] = 0.0f; a2[i] = 0.0f; a3[i] = 0.0f; }
        long n = 0;
        for (; n + 4 <= N; n += 4) {
            float* h0 = hb + n * W;
            const float b0 = Br[n], b1 = Br[n + 1], b2 = Br[n + 2], b3 = Br[n + 3];
            const float c0 = Cr[n], c1 = Cr[n + 1], c2 = Cr[n + 2], c3 = Cr[n + 3];
            for (int i = 0; i < nw; i++) {
                float v0 = decay * h0[i] + bx[i] * b0;
                float v1 = decay * h0[W + i] + bx[i] * b1;
                float v2 = decay * h0[2 * W + i] + bx[i] * b2;
                float v3 = decay * h0[3 * W + i] + bx[i] * b3;
                h0[i] = v0; h0[W + i] = v1; h0[2 * W + i] = v2; h0[3 * W + i] = v3;
                a0[i] += c0 * v0; a1[i] += c1 * v1; a2[i] += c2 * v2; a3[i] += c3 * v3;
            }
        }
        for (; n < N; n++) {
            float* hn = hb + n * W;
            const float b0 = Br[n], c0 = Cr[n];
            for (int i = 0; i < nw; i++) {
                float v0 = decay * hn[i] + bx[i] * b0;
                hn[i] = v0;
                a0[i] += c0 * v0;
            }
        }
        float* yr = y + t * y_st + p0;
        for (int i = 0; i < nw; i++) yr[i] = ((a0[i] + a1[i]) + (a2[i] + a3[i])) + skip * xr[i];
    }
    for (long n = 0; n < N; n++)
        for (int i = 0; i < nw; i++) h[(p0 + i) * N + n] = hb[n * W + i];
    *dsum = ds;
}

/* x: [B, T, H, P]; dt: [B, T, H]; B, C: [B, T, G, N] (unit stride on the last dim, any other strides);
   A, D, dt_bias: [H]; mask: [B, T]; h: [B, H, P, N] contiguous, in: initial state, out: final state;
   y: [B, T, H, P] contiguous; dsum: [B, H]. Optional pointers may be NULL. */
void hsc_ssd_scan(long batch, long T, long H, long P, long G, long N,
    const float* x, long x_sb, long x_st, long x_sh, const float* dt, long dt_sb, long dt_st, long dt_sh,
    const float* A, const float* Bm, long B_sb, long B_st, long B_sg, const float* Cm, long C_sb, long C_st, long C_sg,
    const float* Dskip, const float* dt_bias, int softplus, int clamp, float lo, float hi,
    const float* mask, float* h, float* y, float* dsum, int nthreads)
{
    long nblk = (P + W - 1) / W, per_group = H / G;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long job = 0; job < batch * H * nblk; job++) {
        long b = job / (H * nblk), hd = (job / nblk) % H, p0 = (job % nblk) * W;
        long g = hd / per_group;
        float hb[N * W];
        float ds;
        const float* xb = x + b * x_sb + hd * x_sh;
        const float* db = dt + b * dt_sb + hd * dt_sh;
        const float* Bb = Bm + b * B_sb + g * B_sg;
        const float* Cb = Cm + b * C_sb + g * C_sg;
        const float* mb = mask ? mask + b * T : 0;
        float* hh = h + (b * H + hd) * P * N;
        float* yb = y + b * T * H * P + hd * P;
        float bias = dt_bias ? dt_bias[hd] : 0.0f, skip = Dskip ? Dskip[hd] : 0.0f;
        if (p0 + W <= P) {
            block(W, T, N, p0, xb, x_st, db, dt_st, bias, softplus, clamp, lo, hi, A[hd], Bb, B_st, Cb, C_st,
                  skip, mb, hh, yb, H * P, &ds, hb);
        } else {
            long p = p0;
            for (; p + W2 <= P; p += W2)
                block(W2, T, N, p, xb, x_st, db, dt_st, bias, softplus, clamp, lo, hi, A[hd], Bb, B_st, Cb, C_st,
                      skip, mb, hh, yb, H * P, &ds, hb);
            for (; p < P; p++)
                block(1, T, N, p, xb, x_st, db, dt_st, bias, softplus, clamp, lo, hi, A[hd], Bb, B_st, Cb, C_st,
                      skip, mb, hh, yb, H * P, &ds, hb);
        }
        if (p0 == 0) dsum[b * H + hd] = ds;
    }
}

/* The Mamba-2 gated RMS norm, as transformers' MambaRMSNormGated: g = y silu(z); per group of
   group_size: g / sqrt(mean(g^2) + eps); times weight. y: [rows, width] contiguous; z: rows with
   stride z_st (unit inner stride); out: [rows, width] contiguous. One pass per row instead of six. */
void hsc_gated_rms_norm(long rows, long width, long group_size, const float* y, const float* z, long z_st,
    const float* weight, float eps, float* out, int nthreads)
{
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float* yr = y + r * width;
        const float* zr = z + r * z_st;
        float* orow = out + r * width;
        for (long g0 = 0; g0 < width; g0 += group_size) {
            float part[W2];
            for (int i = 0; i < W2; i++) part[i] = 0.0f;
            long c = g0;
            for (; c + W2 <= g0 + group_size; c += W2)
                for (int i = 0; i < W2; i++) {
                    float v = yr[c + i] * hsc_silu(zr[c + i]);
                    orow[c + i] = v;
                    part[i] += v * v;
                }
            for (; c < g0 + group_size; c++) {
                float v = yr[c] * hsc_silu(zr[c]);
                orow[c] = v;
                part[0] += v * v;
            }
            float total = 0.0f;
            for (int i = 0; i < W2; i++) total += part[i];
            float scale = 1.0f / sqrtf(total / (float)group_size + eps);
            for (c = g0; c < g0 + group_size; c++) orow[c] = weight[c] * (orow[c] * scale);
        }
    }
}
