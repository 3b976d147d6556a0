/* Fused composition x = Σ_k W_k ⊙ x_k of SSM states: the CPU kernel of hf_statecompose/ops/compose/native.py (its docstring says what and why).
   Compiled at run time by hf_statecompose/ops/_native.py. */
#include "statecompose_math.h"

#include <stdlib.h>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define HSC_FTZ 1
#endif

enum { SOUP = 0, WEIGHTED = 1, CASO = 2, PICASO_S = 3, PICASO_R = 4 };

/* exp(x) for log decays (x <= 0 in use), cheaper than hsc_exp (15 vector instructions instead of ~24):
   Cody–Waite reduction x = k ln2 + r with k rounded by the 1.5 * 2^23 shifter (whose low bits then hold k),
   a degree-6 minimax polynomial for exp(r) on [-ln2/2, ln2/2] (relative error 2e-8 with its float32
   coefficients; about 1 ulp in all, as hsc_exp), and one power-of-two scale instead of two. Results
   below float32's smallest normal number come out 0 or as a denormal that the kernel's flush-to-zero
   turns into 0 (x <= -88 and -inf give exactly 0); +inf from x >= 88.38 (exp(88.72) is float32's
   largest; log decays are never positive); NaN for NaN (the clamps let it through). */
/* The clamps' bounds live in (non-const) globals, read once per function into lo, hi: with constants, gcc
   sinks the clamps past the polynomial (their results are constants) as 4 compares and 2 blends; with
   values it cannot see it emits one max and one min (whose operand order lets NaN through). */
float hsc_decay_lo = -88.0f, hsc_decay_hi = 89.0f;
#define EXP_BOUNDS const float lo = hsc_decay_lo, hi = hsc_decay_hi;
static inline float exp_decay(float x, float lo, float hi) {
    float xc = x < lo ? lo : x;     /* -88: k >= -127, a scale of +0.0 */
    xc = xc > hi ? hi : xc;         /* 89: k <= 128, a scale of +inf */
    const float t = xc * 1.44269504088896341f + 12582912.0f;
    const float k = t - 12582912.0f;
    float r = xc - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.3893843861e-3f;
    p = p * r + 8.3763878793e-3f;
    p = p * r + 4.1667141020e-2f;
    p = p * r + 1.6666400433e-1f;
    p = p * r + 4.9999997020e-1f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* the shifter's bits are 0x4B400000 + k; << 23 drops the 0x4B400000: the bits of 2^k */
    return p * hsc_as_float((int32_t)((uint32_t)(hsc_as_int(t) + 127) << 23));
}

/* 1 - exp(x) for x <= 0 (-inf allowed), accurate near 0 (Taylor series for x > -0.35), as the Triton kernel */
static inline float neg_expm1(float x, float lo, float hi) {
    float xs = x > -0.35f ? x : -0.35f;
    float s = 1.0f / 40320.0f;
    s = s * xs + 1.0f / 5040.0f;
    s = s * xs + 1.0f / 720.0f;
    s = s * xs + 1.0f / 120.0f;
    s = s * xs + 1.0f / 24.0f;
    s = s * xs + 1.0f / 6.0f;
    s = s * xs + 0.5f;
    s = s * xs + 1.0f;
    return x > -0.35f ? -(s * xs) : 1.0f - exp_decay(x, lo, hi);
}

/* V lanes: Mamba-1 V consecutive state elements of one channel; Mamba-2 V heads. V is a compile-time
   constant, so every lane loop is one or two SIMD registers, without alias checks. */
#define V 16
/* vectorise each lane loop as is (gcc would otherwise unroll it fully and then fail to vectorise it) */
#define LANES _Pragma("omp simd") for (int l = 0; l < V; l++)

/* PICASO-S weights of V lanes from the decays d[k * V + l]: W_k = Σ_q w_q Π_{i≠k} f_i(t_q),
   f_i = 1 - t + t a_i, Π_{i≠k} = prefix_k · suffix_k (p: a buffer of n * V) */
static void picaso_s_weights(long n, const float* restrict d, const float* restrict gl_t,
                             const float* restrict gl_w, long G, float* restrict W, float* restrict p) {
    float s[V];
    for (long i = 0; i < n * V; i++) W[i] = 0.0f;
    for (long q = 0; q < G; q++) {
        const float t = gl_t[q], one_t = 1.0f - gl_t[q], wq = gl_w[q];
        LANES s[l] = 1.0f;
        for (long k = 0; k < n; k++)  /* p[k] = Π_{i<k} f_i */
            LANES { p[k * V + l] = s[l]; s[l] *= one_t + t * d[k * V + l]; }
        LANES s[l] = wq;  /* w_q · Π_{i>k} f_i */
        for (long k = n - 1; k >= 0; k--)
            LANES { W[k * V + l] += p[k * V + l] * s[l]; s[l] *= one_t + t * d[k * V + l]; }
    }
}

/* The weights of V lanes and n states, W[k * V + l], from the log decays ld[k * V + l] (Mamba-2 rows) */
static void lane_weights(int method, long n, const float* restrict ld,
                         const float* restrict gl_t, const float* restrict gl_w, long G,
                         float* restrict W, float* restrict d, float* restrict p) {
    float s[V], om[V], pre[V];
    EXP_BOUNDS

    if (method == CASO) {  /* W_k = exp(Σ_{j>k} log a_j) */
        LANES s[l] = 0.0f;
        for (long k = n - 1; k >= 0; k--)
            LANES { W[k * V + l] = exp_decay(s[l], lo, hi); s[l] += ld[k * V + l]; }
        return;
    }
    for (long k = 0; k < n; k++) LANES d[k * V + l] = exp_decay(ld[k * V + l], lo, hi);
    if (method == PICASO_R) {
        /* S_{n-1} = 1 + Σ_{m>=1} Π_{j<m} a_j;  S_k = (1 - P) + a_{k+1} S_{k+1};  W_k = S_k / n */
        LANES { s[l] = 0.0f; pre[l] = 1.0f; }
        for (long k = 0; k < n; k++) LANES s[l] += ld[k * V + l];
        LANES { om[l] = neg_expm1(s[l], lo, hi); s[l] = 1.0f; }
        for (long k = 0; k < n - 1; k++)
            LANES { pre[l] *= d[k * V + l]; s[l] += pre[l]; }
        const float inv_n = 1.0f / (float)n;
        LANES W[(n - 1) * V + l] = s[l] * inv_n;
        for (long k = n - 2; k >= 0; k--)
            LANES { s[l] = om[l] + d[(k + 1) * V + l] * s[l]; W[k * V + l] = s[l] * inv_n; }
        return;
    }
    picaso_s_weights(n, d, gl_t, gl_w, G, W, p);
}

/* Row k of a Mamba-1 piece: the state's m <= V elements at off, zero-padded to V lanes in pad if m < V */
static inline const float* lanes_of(const int64_t* xp, long k, long nl, long off, long m, float* pad) {
    const float* x = (const float*)(intptr_t)xp[k * nl] + off;
    if (m == V) return x;
    for (int l = 0; l < V; l++) pad[l] = l < m ? x[l] : 0.0f;
    return pad;
}

/* One Mamba-1 piece (V lanes, zero-padded): acc = Σ_k W_k x_k with W from the log decays dk(k) * a[l].
   dp: the ΣΔ pointers of this layer (stride nl), r the row; xp: the inputs (stride nl). */
#define DK(k) (((const float*)(intptr_t)dp[(k) * nl])[r])
static void piece_decay(int method, long n, long nl, const int64_t* xp, const int64_t* dp, long r,
                        long off, long m, const float* restrict a, const float* gl_t, const float* gl_w,
                        long G, float* restrict buf, float* restrict acc) {
    EXP_BOUNDS
    float pad[V];
    float *W = buf, *d = buf + n * V, *p = buf + 2 * n * V, *dks = buf + 3 * n * V;
    /* the n ΣΔ first, into a buffer: read through the pointer table inside the loops below, gcc would
       fetch two states' at once with a (slow) gather */
    for (long k = 0; k < n; k++) dks[k] = DK(k);
    if (method == CASO) {  /* the fold in context order: acc = a_k acc + x_k */
        const float* x = lanes_of(xp, 0, nl, off, m, pad);
        LANES acc[l] = x[l];
        for (long k = 1; k < n; k++) {
            const float dk = dks[k];
            x = lanes_of(xp, k, nl, off, m, pad);
            LANES acc[l] = acc[l] * exp_decay(dk * a[l], lo, hi) + x[l];
        }
        return;
    }
    if (method == PICASO_R) {
        /* forward: the decays, Σ log a, and S_{n-1} = 1 + Σ_{m>=1} Π_{j<m} a_j; backward:
           S_k = (1 - Π a) + a_{k+1} S_{k+1}, acc = Σ_k S_k x_k; the weights are S_k / n */
        float s[V], pre[V], sum[V], om[V];
        LANES { s[l] = 1.0f; pre[l] = 1.0f; sum[l] = 0.0f; }
        for (long k = 0; k < n; k++) {
            const float dk = dks[k];
            LANES { const float ld = dk * a[l]; d[k * V + l] = exp_decay(ld, lo, hi); sum[l] += ld; }
            if (k < n - 1) {
                LANES { pre[l] *= d[k * V + l]; s[l] += pre[l]; }
            }
        }
        LANES om[l] = neg_expm1(sum[l], lo, hi);
        const float* x = lanes_of(xp, n - 1, nl, off, m, pad);
        LANES acc[l] = s[l] * x[l];
        for (long k = n - 2; k >= 0; k--) {
            x = lanes_of(xp, k, nl, off, m, pad);
            LANES { s[l] = om[l] + d[(k + 1) * V + l] * s[l]; acc[l] += s[l] * x[l]; }
        }
        const float inv_n = 1.0f / (float)n;
        LANES acc[l] *= inv_n;
        return;
    }
    /* PICASO_S */
    for (long k = 0; k < n; k++) {
        const float dk = dks[k];
        LANES d[k * V + l] = exp_decay(dk * a[l], lo, hi);
    }
    picaso_s_weights(n, d, gl_t, gl_w, G, W, p);
    LANES acc[l] = 0.0f;
    for (long k = 0; k < n; k++) {
        const float* x = lanes_of(xp, k, nl, off, m, pad);
        LANES acc[l] += W[k * V + l] * x[l];
    }
}

#define FLAT_CHUNK 2048

/* One call for n inputs of nl layers. Inputs are state-major: input k of layer i is at table[k * nl + i].
   Decay-weighted SSM group (method CASO, PICASO_S or PICASO_R; none for another method): inputs in[],
   outputs out[i], of B * R rows of M contiguous elements (row r = b * R + rr); the ΣΔ dptrs[] ([B, R]),
   A aptrs[i] (per_element ? [R, M] : [R]). per_element (Mamba-1): rows are cut into pieces of V elements,
   each with its own weights; otherwise (Mamba-2) a first pass computes one weight per row and input.
   Flat groups g < nflat: flat_numel[g] elements per tensor, inputs flat_in[g * n * nl + k * nl + i],
   output flat_out[g * nl + i] = Σ_k flat_w[g * n + k] · input k.
   Returns 1 if an output holds NaN or inf (x - x is 0 exactly for finite x), 2 if out of memory, else 0. */
int hsc_compose(long nl, long n, int method, const int64_t* in, const int64_t* out, const int64_t* dptrs,
                const int64_t* aptrs, long B, long R, long M, int per_element, const float* gl_t,
                const float* gl_w, long G, long nflat, const int64_t* flat_in, const int64_t* flat_out,
                const int64_t* flat_numel, const float* flat_w, int nthreads) {
    const long rows = B * R;
    const int decay = method == CASO || method == PICASO_S || method == PICASO_R;
    const int row_weights = decay && !per_element;
    const long chunks = per_element ? (M + V - 1) / V : 1;
    const long pieces = decay ? nl * rows * chunks : 0;
    const long groups = (rows + V - 1) / V;
    float* rw = row_weights ? (float*)malloc(sizeof(float) * (size_t)(nl * n * rows)) : NULL;
    if (row_weights && rw == NULL) return 2;
    int nonfinite = 0, oom = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:nonfinite, oom)
    {
#ifdef HSC_FTZ
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush-to-zero | denormals-are-zero */
#endif
        float* buf = decay ? (float*)malloc(sizeof(float) * 4 * n * V) : NULL;
        const int have = !decay || buf != NULL;
        oom |= !have;
        float *W = buf, *d = buf + n * V, *p = buf + 2 * n * V, *ld = buf + 3 * n * V;
        if (row_weights) {  /* rw[(layer * n + k) * rows + r] */
            #pragma omp for schedule(static)
            for (long lg = 0; lg < nl * groups; lg++) {
                if (!have) continue;
                const long layer = lg / groups, r0 = (lg % groups) * V;
                const float* A = (const float*)(intptr_t)aptrs[layer];
                for (long k = 0; k < n; k++) {
                    const float* dk = (const float*)(intptr_t)dptrs[k * nl + layer];
                    for (int l = 0; l < V; l++) ld[k * V + l] = r0 + l < rows ? dk[r0 + l] * A[(r0 + l) % R] : 0.0f;
                }
                lane_weights(method, n, ld, gl_t, gl_w, G, W, d, p);
                for (long k = 0; k < n; k++)
                    for (int l = 0; l < V && r0 + l < rows; l++) rw[(layer * n + k) * rows + r0 + l] = W[k * V + l];
            }  /* the implicit barrier: every row weight is ready before the sums */
        }
        #pragma omp for schedule(static) nowait
        for (long pc = 0; pc < pieces; pc++) {
            if (!have) continue;
            const long layer = pc / (rows * chunks), rc = pc % (rows * chunks);
            const long r = rc / chunks, j0 = (rc % chunks) * V, rr = r % R;
            const long m = per_element ? (M - j0 < V ? M - j0 : V) : M;  /* elements in this piece */
            const long off = r * M + j0;
            float* o = (float*)(intptr_t)out[layer] + off;
            const int64_t* xp = in + layer;
            int bad = 0;  /* an integer OR vectorises; a float sum would be one long dependency chain */
            if (per_element) {
                const float* Ar = (const float*)(intptr_t)aptrs[layer] + rr * M + j0;
                float a[V], acc[V];
                for (int l = 0; l < V; l++) a[l] = l < m ? Ar[l] : 0.0f;
                piece_decay(method, n, nl, xp, dptrs + layer, r, off, m, a, gl_t, gl_w, G, buf, acc);
                for (long j = 0; j < m; j++) o[j] = acc[j];
            } else {
                for (long k = 0; k < n; k++) {
                    const float* x = (const float*)(intptr_t)xp[k * nl] + off;
                    const float w = rw[(layer * n + k) * rows + r];
                    if (k == 0) for (long j = 0; j < m; j++) o[j] = w * x[j];
                    else for (long j = 0; j < m; j++) o[j] += w * x[j];
                }
            }
            for (long j = 0; j < m; j++) bad |= !(o[j] - o[j] == 0.0f);
            nonfinite |= bad;
        }
        for (long g = 0; g < nflat; g++) {
            const long numel = flat_numel[g], fchunks = (numel + FLAT_CHUNK - 1) / FLAT_CHUNK;
            const int64_t* gin = flat_in + g * n * nl;
            const float* w = flat_w + g * n;
            #pragma omp for schedule(static) nowait
            for (long pc = 0; pc < nl * fchunks; pc++) {
                const long layer = pc / fchunks, off = (pc % fchunks) * FLAT_CHUNK;
                const long m = numel - off < FLAT_CHUNK ? numel - off : FLAT_CHUNK;
                float* o = (float*)(intptr_t)flat_out[g * nl + layer] + off;
                int bad = 0;
                for (long k = 0; k < n; k++) {
                    const float* x = (const float*)(intptr_t)gin[k * nl + layer] + off;
                    const float wk = w[k];
                    if (k == 0) for (long j = 0; j < m; j++) o[j] = wk * x[j];
                    else for (long j = 0; j < m; j++) o[j] += wk * x[j];
                }
                for (long j = 0; j < m; j++) bad |= !(o[j] - o[j] == 0.0f);
                nonfinite |= bad;
            }
        }
        free(buf);
#ifdef HSC_FTZ
        _mm_setcsr(csr);
#endif
    }
    free(rw);
    return oom ? 2 : (nonfinite ? 1 : 0);
}

/* The minimum arithmetic of the decay-based methods, for the benchmarks: exp(ΣΔ_k · A) for every state
   element and state (nl layers, ΣΔ and A as in hsc_compose), summed so that nothing is optimised away;
   no state is read. */
float hsc_exp_floor(long nl, long n, const int64_t* dptrs, const int64_t* aptrs, long B, long R, long M,
                    int per_element, int nthreads) {
    EXP_BOUNDS
    const long rows = B * R;
    /* Mamba-1: pieces of V elements of one row; Mamba-2: V rows (one weight each) */
    const long chunks = per_element ? (M + V - 1) / V : 1, per_layer = per_element ? rows * chunks : (rows + V - 1) / V;
    float total = 0.0f;
    int oom = 0;
    #pragma omp parallel num_threads(nthreads) reduction(+:total) reduction(|:oom)
    {
#ifdef HSC_FTZ
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#endif
        float* dks = (float*)malloc(sizeof(float) * n);
        oom |= dks == NULL;
        #pragma omp for schedule(static)
        for (long pc = 0; pc < nl * per_layer; pc++) {
            const long layer = pc / per_layer, rc = pc % per_layer;
            const float* A = (const float*)(intptr_t)aptrs[layer];
            float a[V], s[V], dl[V];
            long r = 0, r0 = 0;
            if (per_element) {
                const long j0 = (rc % chunks) * V, m = M - j0 < V ? M - j0 : V;
                r = rc / chunks;
                for (int l = 0; l < V; l++) a[l] = l < m ? A[(r % R) * M + j0 + l] : 0.0f;
            } else {
                r0 = rc * V;
                for (int l = 0; l < V; l++) a[l] = r0 + l < rows ? A[(r0 + l) % R] : 0.0f;
            }
            LANES s[l] = 0.0f;
            if (per_element) {
                if (dks == NULL) continue;
                for (long k = 0; k < n; k++) dks[k] = ((const float*)(intptr_t)dptrs[k * nl + layer])[r];
                for (long k = 0; k < n; k++) {
                    const float dk = dks[k];
                    LANES s[l] += exp_decay(dk * a[l], lo, hi);
                }
            } else {
                for (long k = 0; k < n; k++) {
                    const float* dk = (const float*)(intptr_t)dptrs[k * nl + layer];
                    for (int l = 0; l < V; l++) dl[l] = r0 + l < rows ? dk[r0 + l] : 0.0f;
                    LANES s[l] += exp_decay(dl[l] * a[l], lo, hi);
                }
            }
            float t = 0.0f;
            for (int l = 0; l < V; l++) t += s[l];
            total += t;
        }
        free(dks);
#ifdef HSC_FTZ
        _mm_setcsr(csr);
#endif
    }
    return oom ? NAN : total;
}
