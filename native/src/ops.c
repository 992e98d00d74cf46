/*
 * The element-wise kernels of the native set (kf_ops_table in native/include/kvfence-kernels.h):
 * add, addBias, rmsnorm, rope, swiglu, swigluPar and the KV write, with the semantics of the
 * WebAssembly kernels of the same names (src/kernels/assembly/index.ts). Plain loops written so the
 * compiler vectorises them for each ISA level this file is built for (independent lanes in small
 * arrays rather than one serial sum; exp as the same Cephes polynomial the WebAssembly kernels use,
 * arithmetic only, so it vectorises too), except the KV write's rounding, whose branches the
 * compiler cannot vectorise: intrinsics on AVX-512, the scalar rounding elsewhere and for a row's
 * tail. The glue has checked every pointer and size.
 */
#include <math.h>
#include <string.h>

#include "kvfence-kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

void KF_FN(add)(float *out, const float *a, const float *b, int32_t n) {
  for (int32_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void KF_FN(add_bias)(float *out, const float *bias, int32_t rows, int32_t n) {
  for (int32_t r = 0; r < rows; r++) {
    float *o = out + (int64_t)r * n;
    for (int32_t i = 0; i < n; i++) o[i] += bias[i];
  }
}

void KF_FN(rmsnorm)(float *out, const float *x, const float *weight, int32_t n, double eps, int32_t rows) {
  for (int32_t r = 0; r < rows; r++) {
    const float *xr = x + (int64_t)r * n;
    float *o = out + (int64_t)r * n;
    float acc[16] = {0};
    int32_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; j++) acc[j] += xr[i + j] * xr[i + j];
    double s = 0;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += (double)xr[i] * xr[i];
    const float scale = (float)(1.0 / sqrt(s / n + eps));
    for (i = 0; i < n; i++) o[i] = xr[i] * scale * weight[i];
  }
}

void KF_FN(rope)(float *x, const int32_t *positions, const double *cos, const double *sin, int32_t rows,
                 int32_t num_heads, int32_t head_dim) {
  const int32_t half = head_dim / 2;
  for (int32_t r = 0; r < rows; r++) {
    const double *c = cos + (int64_t)positions[r] * half;
    const double *s = sin + (int64_t)positions[r] * half;
    for (int32_t h = 0; h < num_heads; h++) {
      float *p = x + ((int64_t)r * num_heads + h) * head_dim;
      for (int32_t i = 0; i < half; i++) {
        const double a = p[i], b = p[i + half];
        p[i] = (float)(a * c[i] - b * s[i]);
        p[i + half] = (float)(b * c[i] + a * s[i]);
      }
    }
  }
}

/* e^x, Cephes expf as the WebAssembly kernels' expv: clamp, reduce by ln 2, degree-6 polynomial. */
static inline float kf_exp(float x) {
  x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;
  /* round to nearest even through the 1.5·2^23 trick (arithmetic only, so the loop vectorises) */
  const float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t e = ((int32_t)fx + 127) << 23;
  float pow2n;
  memcpy(&pow2n, &e, 4);
  return y * pow2n;
}

void KF_FN(swiglu)(float *out, const float *gate, const float *up, int32_t n) {
  for (int32_t i = 0; i < n; i++) {
    const float g = gate[i];
    out[i] = g / (1.0f + kf_exp(-g)) * up[i];
  }
}

void KF_FN(swiglu_par)(float *out, const float *gate, const float *up, int32_t n, int32_t *counter, int32_t chunk) {
  const int32_t nc = (int32_t)(((int64_t)n + chunk - 1) / chunk);
  for (;;) {
    const int32_t c = __atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST);
    if (c >= nc) return;
    const int64_t s = (int64_t)c * chunk;
    const int32_t len = (int32_t)(n - s < chunk ? n - s : chunk);
    KF_FN(swiglu)(out + s, gate + s, up + s, len);
  }
}

/* The bf16 nearest to the f32 with bits b (ties to even); a NaN stays a quiet NaN. */
static inline uint16_t kf_bf16_bits(uint32_t b) {
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

/* The f16 nearest to the f32 with bits b (ties to even), saturating at ±65504; NaN stays NaN. */
static inline uint16_t kf_f16_bits(uint32_t b) {
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  const int32_t exp = (int32_t)(a >> 23) - 112;
  const uint32_t mant = a & 0x7fffffu;
  if (exp >= 31) return (uint16_t)(sign | 0x7bffu);
  if (exp <= 0) {
    const int32_t shift = 14 - exp;
    if (shift > 24) return (uint16_t)sign;
    const uint32_t full = mant | 0x800000u;
    uint32_t m = full >> shift;
    const uint32_t rem = full & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (m & 1) != 0)) m++;
    return (uint16_t)(sign | m);
  }
  uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1) != 0)) h++;
  if (h >= 0x7c00u) h = 0x7bffu;
  return (uint16_t)(sign | h);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_W 16
/* The lanes of 16 f32 bit patterns that are NaN. */
static inline __mmask16 kv_nan16(__m512i b) {
  return _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
}
/* kf_f16_bits of 16 values: vcvtps2ph (nearest, ties to even, subnormals exact), then what it
   writes as ±inf (an infinity, or past 65504) saturated to ±65504 and a NaN made sign | 0x7e00. */
static inline __m256i kv_f16x16(const float *p) {
  const __m512 v = _mm512_loadu_ps(p);
  const __m512i b = _mm512_castps_si512(v);
  const __m256i sign =
      _mm256_and_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)), _mm256_set1_epi16((short)0x8000));
  const __mmask16 nan = kv_nan16(b);
  __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 inf =
      _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), _mm256_set1_epi16(0x7c00));
  h = _mm256_mask_mov_epi16(h, inf, _mm256_or_si256(sign, _mm256_set1_epi16(0x7bff)));
  return _mm256_mask_mov_epi16(h, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)));
}
/* kf_bf16_bits of 16 values, in 32-bit lanes, then narrowed. */
static inline __m256i kv_bf16x16(const float *p) {
  const __m512i b = _mm512_loadu_si512((const void *)p);
  const __mmask16 nan = kv_nan16(b);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
#endif

/* The KV write: one row of n values rounded to the pool's dtype (kf_f16_bits, kf_bf16_bits; a
   vector of them at a time on AVX-512: the scalar rounding was 1 µs a 192-value row, 8% of a
   512-token prefill). */
void KF_FN(kv_store)(uint8_t *dst, const float *src, int32_t n, int kv_dtype) {
  if (kv_dtype == KF_KV_F32) {
    memmove(dst, src, (size_t)n * 4);
    return;
  }
  uint16_t *d = (uint16_t *)dst;
  const uint32_t *s = (const uint32_t *)src;
  int32_t i = 0;
#ifdef KV_W
  for (; i + KV_W <= n; i += KV_W) {
    const __m256i h = kv_dtype == KF_KV_F16 ? kv_f16x16(src + i) : kv_bf16x16(src + i);
    _mm256_storeu_si256((__m256i *)(d + i), h);
  }
#endif
  if (kv_dtype == KF_KV_F16) {
    for (; i < n; i++) d[i] = kf_f16_bits(s[i]);
  } else {
    for (; i < n; i++) d[i] = kf_bf16_bits(s[i]);
  }
}
