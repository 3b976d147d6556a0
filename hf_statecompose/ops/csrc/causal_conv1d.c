/* Causal depthwise conv continuing a window: the CPU kernel of hf_statecompose/ops/conv/native.py (its docstring says what and why).
   Compiled at run time by hf_statecompose/ops/_native.py. */
#include "statecompose_math.h"

#define W 16

static inline float src_at(long s, long p, long K, const float* x, long x_st, const float* win, long c) {
    /* input s of the row: a real token (s >= p) or the window entry directly before the real tokens */
    return s >= p ? x[s * x_st + c] : (win ? win[c * K + K + s - p] : 0.0f);
}

/* x: [B, T, C] (unit channel stride); w_t: [K, C]; bias: [C]; window: [B, C, K]; mask: [B, T];
   out: [B, T, C]; new_window: [B, C, K]. Optional pointers may be NULL. Each thread takes one contiguous
   range of channels and walks the tokens in order: rows are streamed, never strided through. */
void hsc_causal_conv1d(long batch, long T, long Cn, long K, const float* x, long x_sb, long x_st,
    const float* w_t, const float* bias, const float* window, const float* mask, int silu,
    float* out, float* new_window, int nthreads)
{
    long per = (Cn + nthreads - 1) / nthreads;
    per = (per + W - 1) / W * W;
    long nchunks = (Cn + per - 1) / per;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long job = 0; job < batch * nchunks; job++) {
        long b = job / nchunks, lo = (job % nchunks) * per;
        long hi = lo + per < Cn ? lo + per : Cn;
        const float* xb = x + b * x_sb;
        const float* wb = window ? window + b * Cn * K : 0;
        float* ob = out + b * T * Cn;
        long p = 0;
        if (mask) {
            float real = 0.0f;
            for (long t = 0; t < T; t++) real += mask[b * T + t];
            p = T - (long)(real + 0.5f);
        }
        for (long t = 0; t < T; t++) {
            float* orow = ob + t * Cn;
            if (t < p) {
                for (long c = lo; c < hi; c++) orow[c] = 0.0f;
            } else if (t < p + K - 1) { /* the first real tokens also read the window */
                for (long c = lo; c < hi; c++) {
                    float acc = bias ? bias[c] : 0.0f;
                    for (long j = 0; j < K; j++) acc += w_t[j * Cn + c] * src_at(t - (K - 1) + j, p, K, xb, x_st, wb, c);
                    orow[c] = silu ? hsc_silu(acc) : acc;
                }
            } else {
                long c0 = lo;
                for (; c0 + W <= hi; c0 += W) {
                    float acc[W];
                    #pragma omp simd
                    for (long i = 0; i < W; i++) acc[i] = bias ? bias[c0 + i] : 0.0f;
                    for (long j = 0; j < K; j++) {
                        const float* xr = xb + (t - (K - 1) + j) * x_st + c0;
                        const float* wr = w_t + j * Cn + c0;
                        #pragma omp simd
                        for (long i = 0; i < W; i++) acc[i] += wr[i] * xr[i];
                    }
                    #pragma omp simd
                    for (long i = 0; i < W; i++) orow[c0 + i] = silu ? hsc_silu(acc[i]) : acc[i];
                }
                for (long c = c0; c < hi; c++) {
                    float acc = bias ? bias[c] : 0.0f;
                    for (long j = 0; j < K; j++) acc += w_t[j * Cn + c] * xb[(t - (K - 1) + j) * x_st + c];
                    orow[c] = silu ? hsc_silu(acc) : acc;
                }
            }
        }
        float* nb = new_window + b * Cn * K;
        for (long c = lo; c < hi; c++)
            for (long k = 0; k < K; k++) nb[c * K + k] = src_at(T - K + k, p, K, xb, x_st, wb, c);
    }
}
