"""Fused composition x = Σ_k W_k ⊙ x_k as one C loop nest (CPU inference, float32), built by ``ops/_native.py``.

Why: on a CPU the eager torch path costs several passes per state (the weights are formed, then each
state is multiplied in), one Python-dispatched op each, and ``exp`` of very negative log decays (long
contexts) falls into the slow denormal path; the composition is then 5–50× its memory floor (reading the
n states once). Here every row (Mamba-1: a channel ``d``, its ``N`` state elements; Mamba-2: a head,
its ``P·N`` elements) computes its weights in a small buffer (Mamba-1: one per element and state; Mamba-2:
one scalar per state) and then reads each state's row once, accumulating in the output. Rows run on
torch's OpenMP threads. Denormals are flushed to zero inside the kernel (x86): a decay product below
float32's smallest normal number (1.2e-38) contributes less than rounding anyway, and denormal
arithmetic is ~100× slower.

The weights are those of :mod:`.weights`, same formulas and same stability (no division by a decay, no
overflowing product, ``-inf`` log decays are decays of 0); PICASO-S uses prefix and suffix products of the
``f_i = 1 - t + t a_i`` per Gauss–Legendre node instead of dividing the full product by ``f_k``.

Same contract as :func:`.vectorized.compose_ssm_torch` for float32 states, ΣΔ and ``A`` (others are
converted), contiguous states, no autograd. :func:`compose_ssm_native` returns None when the kernel cannot
be built (no C compiler); the caller then uses the torch path.
"""
from __future__ import annotations

import ctypes
import math

import torch

from .. import _native
from .reference import _check_inputs
from .weights import MODEL_FREE_METHODS, _gauss_legendre_01

NAME = "compose_ssm"
_METHOD_IDS = {name: i for i, name in enumerate(MODEL_FREE_METHODS)}
SOURCE = _native.MATH + r"""
#include <stdlib.h>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define HSC_FTZ 1
#endif

enum { SOUP = 0, WEIGHTED = 1, CASO = 2, PICASO_S = 3, PICASO_R = 4 };

/* 1 - exp(x) for x <= 0 (-inf allowed), accurate near 0 (Taylor series for x > -0.35), as the Triton kernel */
static inline float neg_expm1(float x) {
    float xs = x > -0.35f ? x : -0.35f;
    float s = 1.0f / 40320.0f;
    s = s * xs + 1.0f / 5040.0f;
    s = s * xs + 1.0f / 720.0f;
    s = s * xs + 1.0f / 120.0f;
    s = s * xs + 1.0f / 24.0f;
    s = s * xs + 1.0f / 6.0f;
    s = s * xs + 0.5f;
    s = s * xs + 1.0f;
    return x > -0.35f ? -(s * xs) : 1.0f - hsc_exp(x);
}

/* The weights of V lanes and n states, W[k * V + l], from the log decays ld[k * V + l] (Mamba-1: V
   consecutive state elements of one channel; Mamba-2: V heads). V is a compile-time constant, so every
   lane loop is one or two SIMD registers, without alias checks. */
#define V 16
/* vectorise each lane loop as is (gcc would otherwise unroll it fully and then fail to vectorise it) */
#define LANES _Pragma("omp simd") for (int l = 0; l < V; l++)
static void lane_weights(int method, long n, const float* restrict ld,
                         const float* restrict gl_t, const float* restrict gl_w, long G,
                         float* restrict W, float* restrict d, float* restrict p) {
    float s[V], om[V], pre[V];
    if (method == CASO) {  /* W_k = exp(Σ_{j>k} log a_j) */
        LANES s[l] = 0.0f;
        for (long k = n - 1; k >= 0; k--)
            LANES { W[k * V + l] = hsc_exp(s[l]); s[l] += ld[k * V + l]; }
        return;
    }
    for (long k = 0; k < n; k++) LANES d[k * V + l] = hsc_exp(ld[k * V + l]);
    if (method == PICASO_R) {
        /* S_{n-1} = 1 + Σ_{m>=1} Π_{j<m} a_j;  S_k = (1 - P) + a_{k+1} S_{k+1};  W_k = S_k / n */
        LANES { s[l] = 0.0f; pre[l] = 1.0f; }
        for (long k = 0; k < n; k++) LANES s[l] += ld[k * V + l];
        LANES { om[l] = neg_expm1(s[l]); s[l] = 1.0f; }
        for (long k = 0; k < n - 1; k++)
            LANES { pre[l] *= d[k * V + l]; s[l] += pre[l]; }
        const float inv_n = 1.0f / (float)n;
        LANES W[(n - 1) * V + l] = s[l] * inv_n;
        for (long k = n - 2; k >= 0; k--)
            LANES { s[l] = om[l] + d[(k + 1) * V + l] * s[l]; W[k * V + l] = s[l] * inv_n; }
        return;
    }
    /* PICASO_S: W_k = Σ_q w_q Π_{i≠k} f_i(t_q), f_i = 1 - t + t a_i, Π_{i≠k} = prefix_k · suffix_k */
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

/* nl layers, each: n inputs of B * R rows of M contiguous elements; input k of layer i starts at
   ptrs[i * n + k], its output at outs[i]; row r = b * R + rr. For the decay-based methods the ΣΔ of input k
   of layer i is dptrs[i * n + k] ([B, R]) and A is aptrs[i] (per_element ? [R, M] : [R]).
   per_element (Mamba-1): rows are cut into pieces of V elements, each with its own weights.
   Otherwise (Mamba-2) a first pass computes one weight per row and input, V rows at a time, into rw.
   Returns 1 if an output holds NaN or inf (x - x is 0 exactly for finite x), else 0. */
int hsc_compose(long nl, const int64_t* ptrs, const int64_t* outs, const int64_t* dptrs, const int64_t* aptrs,
                long n, long B, long R, long M, int per_element, int method, const float* uw,
                const float* gl_t, const float* gl_w, long G, float* rw, int nthreads) {
    const long rows = B * R;
    const int needs_weights = method != SOUP && method != WEIGHTED;
    const int row_weights = needs_weights && !per_element;
    const long chunks = per_element ? (M + V - 1) / V : 1;
    const long pieces = nl * rows * chunks;
    const long groups = (rows + V - 1) / V;
    int nonfinite = 0;
    #pragma omp parallel num_threads(nthreads) reduction(|:nonfinite)
    {
#ifdef HSC_FTZ
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);  /* flush-to-zero | denormals-are-zero */
#endif
        float* buf = needs_weights ? (float*)malloc(sizeof(float) * 4 * n * V) : NULL;
        float *W = buf, *d = buf + n * V, *p = buf + 2 * n * V, *ld = buf + 3 * n * V;
        if (row_weights) {  /* rw[(layer * n + k) * rows + r] */
            #pragma omp for schedule(static)
            for (long lg = 0; lg < nl * groups; lg++) {
                const long layer = lg / groups, r0 = (lg % groups) * V;
                const float* A = (const float*)(intptr_t)aptrs[layer];
                for (long k = 0; k < n; k++) {
                    const float* dk = (const float*)(intptr_t)dptrs[layer * n + k];
                    for (int l = 0; l < V; l++) ld[k * V + l] = r0 + l < rows ? dk[r0 + l] * A[(r0 + l) % R] : 0.0f;
                }
                lane_weights(method, n, ld, gl_t, gl_w, G, W, d, p);
                for (long k = 0; k < n; k++)
                    for (int l = 0; l < V && r0 + l < rows; l++) rw[(layer * n + k) * rows + r0 + l] = W[k * V + l];
            }  /* the implicit barrier: every row weight is ready before the sums */
        }
        #pragma omp for schedule(static)
        for (long pc = 0; pc < pieces; pc++) {
            const long layer = pc / (rows * chunks), rc = pc % (rows * chunks);
            const long r = rc / chunks, j0 = (rc % chunks) * V, rr = r % R;
            const long m = per_element ? (M - j0 < V ? M - j0 : V) : M;  /* elements in this piece */
            const long off = r * M + j0;
            float* o = (float*)(intptr_t)outs[layer] + off;
            const int64_t* xp = ptrs + layer * n;
            int bad = 0;  /* an integer OR vectorises; a float sum would be one long dependency chain */
            if (per_element && needs_weights) {
                const float* A = (const float*)(intptr_t)aptrs[layer] + rr * M + j0;
                for (long k = 0; k < n; k++) {
                    const float dk = ((const float*)(intptr_t)dptrs[layer * n + k])[r];
                    LANES ld[k * V + l] = l < m ? dk * A[l] : 0.0f;
                }
                lane_weights(method, n, ld, gl_t, gl_w, G, W, d, p);
                float acc[V];
                LANES acc[l] = 0.0f;
                if (m == V) {
                    for (long k = 0; k < n; k++) {
                        const float* x = (const float*)(intptr_t)xp[k] + off;
                        LANES acc[l] += W[k * V + l] * x[l];
                    }
                } else {
                    for (long k = 0; k < n; k++) {
                        const float* x = (const float*)(intptr_t)xp[k] + off;
                        for (long j = 0; j < m; j++) acc[j] += W[k * V + j] * x[j];
                    }
                }
                for (long j = 0; j < m; j++) o[j] = acc[j];
            } else {
                for (long k = 0; k < n; k++) {
                    const float* x = (const float*)(intptr_t)xp[k] + off;
                    const float w = row_weights ? rw[(layer * n + k) * rows + r] : (method == SOUP ? 1.0f / (float)n : uw[k]);
                    if (k == 0) for (long j = 0; j < m; j++) o[j] = w * x[j];
                    else for (long j = 0; j < m; j++) o[j] += w * x[j];
                }
            }
            for (long j = 0; j < m; j++) bad |= !(o[j] - o[j] == 0.0f);
            nonfinite |= bad;
        }
        free(buf);
#ifdef HSC_FTZ
        _mm_setcsr(csr);
#endif
    }
    return nonfinite ? 1 : 0;
}
"""

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _library():
    lib = _native.load(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_hsc_typed", False):
        lib.hsc_compose.restype = _I
        lib.hsc_compose.argtypes = [_L, _P, _P, _P, _P, _L, _L, _L, _L, _I, _I, _P, _P, _P, _L, _P, _I]
        lib._hsc_typed = True
    return lib


def available() -> bool:
    """Whether the kernel is built (or can be): native kernels on and a C compiler found."""
    return _library() is not None


def applicable(ssm_states, delta_sums, A, weights=None) -> bool:
    """Whether :func:`compose_ssm_native` may run: CPU float32 states, no autograd, native kernels on."""
    if not _native.enabled() or not ssm_states:
        return False
    first = ssm_states[0]
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return False
    tensors = [*ssm_states, delta_sums, A] + ([weights] if torch.is_tensor(weights) else [])
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def compose_layers_native(inputs, method, weights=None, delta_sums=None, A=None, per_element=False):
    """The kernel over many layers in one call: ``inputs[i]`` is layer i's list of n float32 contiguous CPU
    tensors, all of one shape (``[B, R, *row]`` for the decay-based methods; any for ``soup`` /
    ``weighted``); ``delta_sums[i]`` the n ΣΔ ``[B, R]`` and ``A[i]`` the layer's A (only for the
    decay-based methods). Trusts its caller (no checks: the composer validated
    the states). Returns (outputs, all_finite), or None if the kernel cannot be built."""
    lib = _library()
    if lib is None:
        return None
    n, first = len(inputs[0]), inputs[0][0]
    outs = [torch.empty_like(first) for _ in inputs]
    if first.numel() == 0:
        return outs, True
    needs_weights = method not in ("soup", "weighted")
    if needs_weights:
        batch, rows, row_elems = first.shape[0], first.shape[1], first[0, 0].numel()
    else:  # one weight per input: the tensors are flat vectors, whatever their shape
        batch, rows, row_elems = 1, 1, first.numel()
    flat = [t for layer in inputs for t in layer]
    dptrs = _pointers([d for layer in delta_sums for d in layer]) if needs_weights else _pointers(flat[:1])
    aptrs = _pointers(A) if needs_weights else dptrs
    user_w = weights.to(torch.float32).contiguous() if weights is not None else torch.zeros(1)
    if method == "picaso_s":
        t, w = _gauss_legendre_01(math.ceil(n / 2))
        nodes, node_w = t.to(torch.float32), w.to(torch.float32)
    else:
        nodes = node_w = torch.zeros(1)
    # the pointer tables and buffers must outlive the call: named, not temporaries
    in_ptrs, out_ptrs = _pointers(flat), _pointers(outs)
    row_w = torch.empty(len(inputs) * n * batch * rows if needs_weights and not per_element else 1)
    bad = lib.hsc_compose(
        len(inputs), in_ptrs.data_ptr(), out_ptrs.data_ptr(), dptrs.data_ptr(), aptrs.data_ptr(),
        n, batch, rows, row_elems, int(per_element and needs_weights), _METHOD_IDS[method], user_w.data_ptr(),
        nodes.data_ptr(), node_w.data_ptr(), nodes.numel(), row_w.data_ptr(), torch.get_num_threads(),
    )
    return outs, not bad


@torch.no_grad()
def compose_ssm_native(ssm_states, delta_sums, A, method, weights=None) -> torch.Tensor | None:
    """Same contract as :func:`.vectorized.compose_ssm_torch` (float32, CPU, no autograd); None if the
    kernel cannot be built."""
    states, n, mamba1 = _check_inputs(ssm_states, delta_sums, A, method, weights)
    # no copy for the usual contiguous states; the ΣΔ and A conversions are a few KB
    states = [s.contiguous() for s in states]
    delta = delta_sums.to(torch.float32).contiguous()
    done = compose_layers_native(
        [states], method, weights=weights, delta_sums=[list(delta.unbind(0))],
        A=[A.to(torch.float32).contiguous()], per_element=mamba1,
    )
    return None if done is None else done[0][0]
