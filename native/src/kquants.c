/*
 * llama.cpp's k-quant weights (Q4_K, Q5_K, Q6_K; layouts in src/kernels/k-quants.ts and
 * docs/weights.md) for the native matmul: matmul.c's prepare/matmul_par hand dtypes KF_Q4_K..KF_Q6_K
 * here (kquants.h).
 *
 * Activations are quantised as ggml's `block_q8_K` (quantize_row_q8_K_ref): per 256 values of a
 * row, max = the value of largest |x| (the first of equals), iscale = −127/max, q = min(127,
 * round-to-nearest-even(iscale·x)), d = 1/iscale (an all-zero block: d = 0, q = 0), and the sums of
 * each 16 quants (bsums). The prepared buffer is the quants [rows][in_dim] int8, then d
 * [rows][in_dim/256] f32, then bsums [rows][in_dim/256][16] int16.
 *
 * A super-block's dot product is ggml's (vec_dot_q4_K_q8_K and its kin), in integers:
 *   Q4_K/Q5_K: d_x·(d·Σ_s sc_s·Σ_{l∈s} q_l·x_l − dmin·Σ_s m_s·bsum_s), s the eight 32-weight sub-blocks;
 *   Q6_K:      d_x·d·Σ_t sc_t·(Σ_{l∈t} q_l·x_l − 32·bsum_t), t the sixteen 16-weight sub-blocks, q ∈ [0, 63].
 * Every weight is unsigned (0–15, 0–31, 0–63), so the products are u8 × s8: on x86 `vpmaddubsw`
 * (pairs summed to i16, at most 2·63·127, never saturating), then each pair sum times its
 * sub-block's scale and added into i32 lanes by `vpdpwssd` (AVX-512 VNNI, AVX-VNNI) or
 * `vpmaddwd` + add (AVX2); the generic build is plain C over the same integers. Each sub-block's
 * weights are unpacked once for up to four activation rows.
 */
#include <math.h>
#include <string.h>

#include "kquants.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define KQ_K 256

static inline float kq_f16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
  float mag;
  memcpy(&mag, &bits, 4);
  mag *= 5.192296858534828e33f; /* 2^112: an f16's exponent and mantissa moved into an f32's (subnormals too) */
  return (h & 0x8000) ? -mag : mag;
}

int64_t KF_FN(kq_prepare_bytes)(int32_t rows, int32_t in_dim) {
  const int64_t nb = (int64_t)rows * (in_dim / KQ_K);
  return (int64_t)rows * in_dim + nb * 4 + nb * 32;
}

void KF_FN(kq_prepare)(uint8_t *xp, const float *x, int32_t rows, int32_t in_dim) {
  const int64_t nb = (int64_t)rows * (in_dim / KQ_K);
  int8_t *q = (int8_t *)xp;
  float *ds = (float *)(xp + (int64_t)rows * in_dim);
  int16_t *bsums = (int16_t *)(xp + (int64_t)rows * in_dim + nb * 4);
  for (int64_t b = 0; b < nb; b++) {
    const float *p = x + b * KQ_K;
    int8_t *qb = q + b * KQ_K;
    float amax = 0, max = 0;
    for (int k = 0; k < KQ_K; k++) {
      const float a = fabsf(p[k]);
      if (a > amax) {
        amax = a;
        max = p[k];
      }
    }
    if (amax == 0) {
      ds[b] = 0;
      memset(qb, 0, KQ_K);
      memset(bsums + b * 16, 0, 32);
      continue;
    }
    const float iscale = -127.f / max;
    for (int k = 0; k < KQ_K; k++) {
      const float v = nearbyintf(iscale * p[k]);
      qb[k] = (int8_t)(v > 127 ? 127 : v);
    }
    for (int t = 0; t < 16; t++) {
      int s = 0;
      for (int k = 0; k < 16; k++) s += qb[16 * t + k];
      bsums[b * 16 + t] = (int16_t)s;
    }
    ds[b] = 1 / iscale;
  }
}

/* Q4_K/Q5_K's 6-bit scale (m = 0) or min (m = 4) of sub-block s from the 12 scale bytes at p. */
static inline int kq_scale(const uint8_t *p, int s, int m) {
  if (s < 4) return p[s + m] & 63;
  const int lo = p[s + 4], hi = p[s - 4 + m] >> 6;
  return (m == 0 ? lo & 15 : lo >> 4) | (hi << 4);
}

/* Up to four activation rows (quants, scales, bsums of each) for one weight row. */
typedef struct {
  const int8_t *q[4];
  const float *d[4];
  const int16_t *bs[4];
  int n;
} kq_rows;

#if defined(__AVX2__)
/* A row's integer sum for one super-block: eight i32 lanes (summed once per column, in f32). */
typedef __m256i kq_isum;
#define KQ_ISUM_ZERO _mm256_setzero_si256()

/* acc + Σ pairs of p (i16) times s (i16) in i32 lanes. */
static inline __m256i kq_dpwssd(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

#else
typedef int kq_isum;
#define KQ_ISUM_ZERO 0
#endif

/* Σ_s sc_s·Σ_{l∈s} q_l·x_l of one Q4_K/Q5_K super-block for each row (isum[i]). */
static inline void kq45_isums(const uint8_t *bp, int five, const int *sc, const kq_rows *r, int64_t xo,
                              kq_isum *isum) {
  const uint8_t *qs = bp + (five ? 48 : 16);
  const uint8_t *qh = bp + 16;
#if defined(__AVX2__)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  const __m256i nib = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i h = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
  for (int g = 0; g < 4; g++) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * g));
    __m256i lo = _mm256_and_si256(v, nib);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    if (five) {
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g + 1), one), 4));
    }
    const __m256i s1 = _mm256_set1_epi16((short)sc[2 * g]), s2 = _mm256_set1_epi16((short)sc[2 * g + 1]);
    for (int i = 0; i < r->n; i++) {
      const int8_t *x = r->q[i] + xo + 64 * g;
      const __m256i p1 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x));
      const __m256i p2 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32)));
      acc[i] = kq_dpwssd(kq_dpwssd(acc[i], p1, s1), p2, s2);
    }
  }
  for (int i = 0; i < r->n; i++) isum[i] = acc[i];
#else
  for (int i = 0; i < r->n; i++) isum[i] = 0;
  for (int g = 0; g < 4; g++) {
    for (int i = 0; i < r->n; i++) {
      const int8_t *x = r->q[i] + xo + 64 * g;
      int a = 0, b = 0;
      for (int l = 0; l < 32; l++) {
        const int hb = five ? qh[l] >> (2 * g) : 0;
        a += ((qs[32 * g + l] & 15) | ((hb & 1) << 4)) * x[l];
        b += ((qs[32 * g + l] >> 4) | ((hb & 2) << 3)) * x[l + 32];
      }
      isum[i] += sc[2 * g] * a + sc[2 * g + 1] * b;
    }
  }
#endif
}

/* Σ_t sc_t·Σ_{l∈t} q_l·x_l (q ∈ [0, 63], without the −32) of one Q6_K super-block for each row. */
static inline void kq6_isums(const uint8_t *bp, const kq_rows *r, int64_t xo, kq_isum *isum) {
  const int8_t *sc = (const int8_t *)(bp + 192);
#if defined(__AVX2__)
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  const __m256i nib = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
  for (int n = 0; n < 2; n++) {
    const uint8_t *ql = bp + 64 * n;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(bp + 128 + 32 * n));
    for (int k = 0; k < 4; k++) {
      const __m256i l = k & 1 ? l1 : l0;
      const __m256i low = k < 2 ? _mm256_and_si256(l, nib) : _mm256_and_si256(_mm256_srli_epi16(l, 4), nib);
      const __m256i q =
          _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * k), three), 4));
      const int t = 8 * n + 2 * k; /* sub-blocks t (weights 0–15 of the quarter) and t + 1 (16–31) */
      const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[t + 1]), _mm_set1_epi16(sc[t]));
      for (int i = 0; i < r->n; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(r->q[i] + xo + 128 * n + 32 * k));
        acc[i] = kq_dpwssd(acc[i], _mm256_maddubs_epi16(q, x), s);
      }
    }
  }
  for (int i = 0; i < r->n; i++) isum[i] = acc[i];
#else
  for (int i = 0; i < r->n; i++) isum[i] = 0;
  for (int n = 0; n < 2; n++) {
    const uint8_t *ql = bp + 64 * n, *qh = bp + 128 + 32 * n;
    for (int k = 0; k < 4; k++) {
      for (int i = 0; i < r->n; i++) {
        const int8_t *x = r->q[i] + xo + 128 * n + 32 * k;
        int a = 0, b = 0;
        for (int l = 0; l < 32; l++) {
          const int low = k < 2 ? ql[32 * (k & 1) + l] & 15 : ql[32 * (k & 1) + l] >> 4;
          const int q = low | (((qh[l] >> (2 * k)) & 3) << 4);
          if (l < 16) a += q * x[l];
          else b += q * x[l];
        }
        isum[i] += sc[8 * n + 2 * k] * a + sc[8 * n + 2 * k + 1] * b;
      }
    }
  }
#endif
}

/* Adds isum·f to the column's accumulator (lanes in the x86 builds, summed at the end). */
#if defined(__AVX2__)
typedef __m256 kq_facc;
#define KQ_FACC_ZERO _mm256_setzero_ps()
static inline kq_facc kq_fadd(kq_facc a, kq_isum isum, float f) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(f), a);
}
static inline float kq_fsum(kq_facc a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
typedef float kq_facc;
#define KQ_FACC_ZERO 0
static inline kq_facc kq_fadd(kq_facc a, kq_isum isum, float f) { return a + (float)isum * f; }
static inline float kq_fsum(kq_facc a) { return a; }
#endif

/* out[i][j] (row stride out_dim) for rows r and columns [c0, c1) of weights w in dtype. */
static void kq_rows_cols(float *out, int64_t out_dim, const kq_rows *r, const uint8_t *w, int32_t in_dim, int32_t c0,
                         int32_t c1, int dtype) {
  const int nbk = in_dim / KQ_K;
  const int64_t row_bytes = kf_row_bytes(dtype, in_dim);
  const int64_t bsz = row_bytes / nbk;
  for (int32_t j = c0; j < c1; j++) {
    kq_facc acc[4] = {KQ_FACC_ZERO, KQ_FACC_ZERO, KQ_FACC_ZERO, KQ_FACC_ZERO};
    float mins[4] = {0, 0, 0, 0}; /* the min (Q4_K/Q5_K) or −32 offset (Q6_K) terms, scalar */
    const uint8_t *wj = w + (int64_t)j * row_bytes;
    for (int b = 0; b < nbk; b++) {
      const uint8_t *bp = wj + b * bsz;
      const int64_t xo = (int64_t)b * KQ_K;
      kq_isum isum[4] = {KQ_ISUM_ZERO, KQ_ISUM_ZERO, KQ_ISUM_ZERO, KQ_ISUM_ZERO};
      if (dtype == KF_Q6_K) {
        kq6_isums(bp, r, xo, isum);
        const int8_t *sc = (const int8_t *)(bp + 192);
        const float d = kq_f16(bp + 208);
        for (int i = 0; i < r->n; i++) {
          const int16_t *bs = r->bs[i] + 16 * b;
          int off = 0;
          for (int t = 0; t < 16; t++) off += sc[t] * bs[t];
          const float f = r->d[i][b] * d;
          acc[i] = kq_fadd(acc[i], isum[i], f);
          mins[i] += f * (float)(32 * off);
        }
      } else {
        int sc[8], m[8];
        for (int s = 0; s < 8; s++) {
          sc[s] = kq_scale(bp + 4, s, 0);
          m[s] = kq_scale(bp + 4, s, 4);
        }
        kq45_isums(bp, dtype == KF_Q5_K, sc, r, xo, isum);
        const float d = kq_f16(bp), dmin = kq_f16(bp + 2);
        for (int i = 0; i < r->n; i++) {
          const int16_t *bs = r->bs[i] + 16 * b;
          int msum = 0;
          for (int s = 0; s < 8; s++) msum += m[s] * (bs[2 * s] + bs[2 * s + 1]);
          acc[i] = kq_fadd(acc[i], isum[i], r->d[i][b] * d);
          mins[i] += r->d[i][b] * dmin * (float)msum;
        }
      }
    }
    for (int i = 0; i < r->n; i++) out[i * out_dim + j] = kq_fsum(acc[i]) - mins[i];
  }
}

void KF_FN(kq_cols)(float *out, const uint8_t *xp, int32_t rows, int32_t r0, int32_t rn, const uint8_t *w,
                    int32_t in_dim, int32_t out_dim, int32_t c0, int32_t c1, int dtype) {
  const int64_t nb = in_dim / KQ_K;
  const int8_t *q = (const int8_t *)xp;
  const float *ds = (const float *)(xp + (int64_t)rows * in_dim);
  const int16_t *bsums = (const int16_t *)(xp + (int64_t)rows * in_dim + (int64_t)rows * nb * 4);
  for (int32_t r = r0; r < r0 + rn; r += 4) {
    kq_rows rr;
    rr.n = r0 + rn - r < 4 ? r0 + rn - r : 4;
    for (int i = 0; i < rr.n; i++) {
      rr.q[i] = q + (int64_t)(r + i) * in_dim;
      rr.d[i] = ds + (int64_t)(r + i) * nb;
      rr.bs[i] = bsums + (int64_t)(r + i) * nb * 16;
    }
    kq_rows_cols(out + (int64_t)(r - r0) * out_dim, out_dim, &rr, w, in_dim, c0, c1, dtype);
  }
}
