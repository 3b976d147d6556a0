/* Branch-free float32 math shared by the CPU kernels (hf_statecompose/ops/_native.py), so that loops over it
   vectorise (no libm calls, no -ffast-math). Cephes' expf / logf polynomials: about 1 ulp, like the vectorised
   ones torch uses. Each kernel's .c file includes it; _native.read_source inlines it before compiling. */
#ifndef STATECOMPOSE_MATH_H
#define STATECOMPOSE_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float hsc_as_float(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline int32_t hsc_as_int(float f) { int32_t i; memcpy(&i, &f, 4); return i; }

/* exp(x) = 2^k exp(r), |r| <= ln2 / 2; 2^k applied in two halves so that results down to the
   denormals and up to overflow come out right. */
static inline float hsc_exp(float x) {
    float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    float k = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t ki = (int32_t)k;
    int32_t k1 = ki >> 1, k2 = ki - (ki >> 1);
    return p * hsc_as_float((k1 + 127) << 23) * hsc_as_float((k2 + 127) << 23);
}

/* log(x) for finite x > 0 (normal) */
static inline float hsc_log(float x) {
    int32_t i = hsc_as_int(x);
    float e = (float)(((i >> 23) & 0xff) - 126);
    float m = hsc_as_float((i & 0x007fffff) | 0x3f000000); /* [0.5, 1) */
    int small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y = y - 2.12194440e-4f * e;
    y = y - 0.5f * z;
    return m + y + 0.693359375f * e;
}

/* softplus as torch computes it (beta 1, threshold 20); log1p(e) = log(1 + e) * e / ((1 + e) - 1)
   keeps full relative accuracy for small e */
static inline float hsc_softplus(float x) {
    float e = hsc_exp(x);
    float u = 1.0f + e;
    float d = u - 1.0f;
    float l = hsc_log(u) * (e / (d == 0.0f ? 1.0f : d));
    l = d == 0.0f ? e : l;
    return x > 20.0f ? x : l;
}

/* x sigmoid(x), with exp(-|x|) so that nothing overflows */
static inline float hsc_silu(float x) {
    float e = hsc_exp(-fabsf(x));
    float s = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
    return x * s;
}

#endif /* STATECOMPOSE_MATH_H */
