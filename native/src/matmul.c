/*
 * The native matmul (kf_matmul_table in native/include/kvfence-kernels.h; issue #33): out = x · wᵀ
 * for f32, f16, bf16, Q8_0 and Q4_0 weights [out][in] in their stored layouts
 * (src/kernels/weight-format.ts), compiled once per ISA level. AVX-512 (16 f32 lanes) and AVX2
 * (8 lanes, with or without AVX-VNNI) share the code below through a few vector helpers; the
 * generic level is plain C.
 *
 * Float weights (f32, f16, bf16) are multiplied exactly as the reference does: each weight widened
 * to f32 (bf16 by a shift, f16 by vcvtph2ps) and fused-multiply-added with f32 x, so results match
 * src/kernels/reference.ts to f32 rounding. (vdpbf16ps on x rounded to bf16 would double the peak,
 * but on random rows of 576 and 1536 values 96% of the outputs then miss the parity tests' rtol
 * 1e-4/atol 1e-5; x split into two bf16 halves still misses 0.2–0.5% and gains nothing over FMA.)
 * The tile is a dot product along k: MR rows of x × NR weight rows, MR·NR vector accumulators summed
 * across lanes at the end, so neither x nor the weights are transposed. Up to STREAMED_ROWS rows
 * (decode) stream each weight row once, widening as they read; more rows widen (f32: copy) a block
 * of NR weight rows × KC values into an L1 scratch on the stack once and run every row group over
 * it. The streamed tiles prefetch the weights PF_BYTES ahead (the rows of a chunk are one stretch
 * of memory): without it decode read 19 GB/s of bf16 on one core, with it 28. One row on bf16
 * weights (batch-1 decode) widens a pair of weights a 32-bit lane by an AND and a shift against x
 * split into its even and odd values (bp_tile): from L2, one core, 115–123 GB/s of weights became
 * 142–164 (native/test/decode-bench.sh, CACHED=1). At batch 1 on AVX-512 a bf16 or Q8_0 tile is
 * one weight row, so a thread reads its chunk in address order rather than 8 or 4 rows side by
 * side: the step's matmuls read 1.11–1.14× (bf16) and 1.12–1.25× (Q8_0) as fast in
 * decode-bench.sh, and batch-1 decode ran 1.12× (bf16, fast memory; 1.0× when the VM's memory was
 * slow) and 1.16–1.24× (Q8_0) in `kvfence bench model --baseline` (docs/benchmarks.md §17).
 *
 * Q8_0/Q4_0 weights are multiplied as integers against x quantised per 32-block as quantizeRowsQ8
 * in the WebAssembly kernels (d = amax/127, q = x·(1/d) rounded to nearest even), with vpdpbusd
 * (u8 × s8, four products a lane): the weights are the unsigned side (Q8_0's q + 128, Q4_0's raw
 * nibbles) and each block's integer sum starts at the offset that removes the shift (−128·Σq_x or
 * −8·Σq_x, from `prepare`). Without VNNI (the avx2 level) Q8_0 puts |q_w| on the unsigned side and
 * q_w's sign onto x (vpsignb) and vpmaddubsw + vpmaddwd do the four products. Up to STREAMED_ROWS
 * rows stream the weights: on AVX-512 two Q8_0 blocks (one 64-byte vector) or four Q4_0 blocks
 * (their 64 nibble bytes gathered by one vpermt2w) a step, the blocks' f16 scales picked into
 * lanes by vpermw, x laid out by `prepare` in the same order with each lane's d_x and offset; 8
 * lanes (one block) a step elsewhere. More rows put MM_W activation rows in the lanes of a vector
 * (`prepare` lays them out so): each weight quad is broadcast and multiplied against MM_W rows'
 * quads at once, then each block's sum is scaled by d_w·d_x into f32 accumulators; the weights of
 * Q_NS columns are unpacked to bytes in a stack scratch first, once per column block.
 *
 * Work: the items of matmul_par (row block × column chunk, see the header) claimed with kf_claim
 * by both of the engine's threads; matmul_chunks picks their size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvfence-kernels.h"
#include "kquants.h" /* k-quants: kquants.c */

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KF_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)
#define MM_W 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MM_W 8
#else
#define MM_W 0
#endif

/* Rows up to which x is streamed against each weight row (decode); more rows run the tiles. */
#define STREAMED_ROWS 3
/* Rows of a work item for batches (matmul_chunks): a multiple of every tile's rows (4, 16). */
#define BATCH_ROW_CHUNK 64

static inline int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
static inline int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
  float mag;
  memcpy(&mag, &bits, 4);
  mag *= 5.192296858534828e33f; /* 2^112: rebias the exponent (subnormals and infinities included) */
  uint32_t m;
  memcpy(&m, &mag, 4);
  if ((h & 0x7c00) == 0x7c00) m = 0x7f800000 | ((uint32_t)(h & 0x3ff) << 13);
  m |= sign;
  memcpy(&mag, &m, 4);
  return mag;
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t load_u16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

/* The multiple of a block's Σq_x that `prepare` stores as its offset: what the unsigned weights
   add to the block's integer sum, negated (Q4_0 nibbles are q + 8, VNNI's Q8_0 bytes q + 128). */
static inline int32_t q_offset(int dtype, int vnni) { return dtype == KF_Q4_0 ? -8 : vnni ? -128 : 0; }

/* The chunk claimed as `c` of matmul_par: the segment and column range; 0 when it is empty. */
static int item_columns(const kf_segment *segs, int32_t num_segs, int32_t k, int32_t col_chunk,
                        const kf_segment **seg, int32_t *c0, int32_t *c1) {
  int32_t s = 0;
  while (s + 1 < num_segs && segs[s + 1].first_chunk <= k) s++;
  *seg = &segs[s];
  *c0 = (k - segs[s].first_chunk) * col_chunk;
  *c1 = imin(*c0 + col_chunk, segs[s].out_dim);
  return *c0 >= 0 && *c0 < *c1;
}

#if MM_W > 0
/* ============================================================================================= */
/* Vector helpers: vf holds MM_W f32, vi MM_W i32.                                               */

#if MM_W == 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero() _mm512_setzero_ps()
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_set1(s) _mm512_set1_ps(s)
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_to_vf(v) _mm512_cvtepi32_ps(v)
KF_INLINE vf vf_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
KF_INLINE vf widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
KF_INLINE vf vf_bf16(const uint8_t *p) { return widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }
KF_INLINE vf vf_bf16_n(const uint8_t *p, int n) {
  return widen_bf16(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
}
KF_INLINE vf vf_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
KF_INLINE vf vf_f16_n(const uint8_t *p, int n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p));
}
KF_INLINE float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* [Σa, Σb, Σc, Σd]. */
KF_INLINE __m128 vf_sum4(vf a, vf b, vf c, vf d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
/* acc + Σ of four u8 × s8 products a lane. */
KF_INLINE vi vi_dp(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
KF_INLINE vi vi_bcast32(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
#define MM_VNNI 1
#else /* MM_W == 8 */
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero() _mm256_setzero_ps()
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_set1(s) _mm256_set1_ps(s)
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_to_vf(v) _mm256_cvtepi32_ps(v)
static const int32_t mask_table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
KF_INLINE vf vf_load_n(const float *p, int n) {
  return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i *)(mask_table + 8 - n)));
}
KF_INLINE vf widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
KF_INLINE vf vf_bf16(const uint8_t *p) { return widen_bf16(_mm_loadu_si128((const __m128i *)p)); }
KF_INLINE __m128i load_halves_n(const uint8_t *p, int n) {
  uint16_t t[8] = {0};
  memcpy(t, p, (size_t)n * 2);
  return _mm_loadu_si128((const __m128i *)t);
}
KF_INLINE vf vf_bf16_n(const uint8_t *p, int n) { return widen_bf16(load_halves_n(p, n)); }
KF_INLINE vf vf_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
KF_INLINE vf vf_f16_n(const uint8_t *p, int n) { return _mm256_cvtph_ps(load_halves_n(p, n)); }
KF_INLINE float vf_sum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
KF_INLINE __m128 vf_sum4(vf a, vf b, vf c, vf d) {
  __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
  __m256 s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)), _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#if defined(__AVXVNNI__)
#define MM_VNNI 1
KF_INLINE vi vi_dp(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define MM_VNNI 0
/* Without VNNI: u ≤ 128 and |s| ≤ 127 here, so vpmaddubsw's pair sums never saturate. */
KF_INLINE vi vi_dp(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif
KF_INLINE vi vi_bcast32(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
#endif

/* The 8-lane (one 32-block) int8 dot product of the streamed path, at every SIMD level. */
#if MM_W == 16 || defined(__AVXVNNI__)
KF_INLINE __m256i dp8(__m256i acc, __m256i u, __m256i s) {
#if MM_W == 16
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
KF_INLINE __m256i dp8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

KF_INLINE float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* ============================================================================================= */
/* Float weights                                                                                 */

/* Rows × weight rows of the batched float tile (accumulators MR·NR) and of the streamed one. */
#if MM_W == 16
#define F_MR 4
#define F_NR 6
#define FS_NR1 8
#define FS_NR2 6
#define FS_NR3 6
#else
#define F_MR 2
#define F_NR 5
#define FS_NR1 4
#define FS_NR2 4
#define FS_NR3 3
#endif
/* Bounds of the tiles' MR and NR (array sizes). */
#define F_MAX_MR 6
#define F_MAX_NR 8
/* Largest K block of the widened-weight scratch (floats per weight row). */
#define F_KC 1024
/* Bytes ahead (rounded up to whole weight rows) that the streamed tiles prefetch. */
#define PF_BYTES 8192
static inline int64_t prefetch_ahead(int64_t wsb) { return (PF_BYTES + wsb - 1) / wsb * wsb; }
/*
 * The hint of the float tiles' weight prefetch in decode: non-temporal, as a step reads each weight
 * line once. Batch-1 decode against T0, `kvfence bench model --baseline` (12 paired repeats, 95%
 * CIs; docs/benchmarks.md §18): bf16 1.116 (1.090–1.143), f16 1.006 (0.977–1.035). Not measured:
 * why. On this Zen VM a line that leaves L2 is written into the L3 (a victim cache) whether it is
 * needed again or not; a non-temporal line may skip that. The Q8_0/Q4_0 tiles keep T0: NTA ran
 * 0.986 (0.926–1.049) and 0.969 (0.909–1.032) there.
 */
#define PF_STREAM _MM_HINT_NTA

/* MM_W weights of row `row` from index k, widened to f32; wload_n: the first n (< MM_W), the rest 0. */
KF_INLINE vf wload(const int dt, const uint8_t *row, int32_t k) {
  if (dt == KF_F32) return vf_load((const float *)row + k);
  if (dt == KF_F16) return vf_f16(row + 2 * (int64_t)k);
  return vf_bf16(row + 2 * (int64_t)k);
}
KF_INLINE vf wload_n(const int dt, const uint8_t *row, int32_t k, int n) {
  if (dt == KF_F32) return vf_load_n((const float *)row + k, n);
  if (dt == KF_F16) return vf_f16_n(row + 2 * (int64_t)k, n);
  return vf_bf16_n(row + 2 * (int64_t)k, n);
}

/* o[c] (+)= Σ lanes of a[c] for c < n. */
KF_INLINE void store_sums(float *o, const vf *a, const int n, int add) {
  int c = 0;
#pragma GCC unroll 8
  for (; c + 4 <= n; c += 4) {
    __m128 s = vf_sum4(a[c], a[c + 1], a[c + 2], a[c + 3]);
    if (add) s = _mm_add_ps(s, _mm_loadu_ps(o + c));
    _mm_storeu_ps(o + c, s);
  }
#pragma GCC unroll 8
  for (; c < n; c++) o[c] = (add ? o[c] : 0) + vf_sum(a[c]);
}

/*
 * out[r][c] (+)= Σ_k x[r][k]·w[c][k] for r < MR, c < NR over k < K: x rows xs floats apart, weight
 * rows wsb bytes apart in format dt, out rows os floats apart; `add` adds to out (a K block after
 * the first). PF: prefetch each weight row pfd bytes ahead as it is read (streamed weights).
 */
KF_INLINE void ftile(const int MR, const int NR, const int dt, const int PF, const float *x, int64_t xs,
                     const uint8_t *w, int64_t wsb, int32_t K, float *out, int64_t os, int add, int64_t pfd) {
  const int es = dt == KF_F32 ? 4 : 2;
  vf acc[F_MAX_MR][F_MAX_NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) acc[r][c] = vf_zero();
  int32_t k = 0;
  for (; k + MM_W <= K; k += MM_W) {
    vf xv[F_MAX_MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) xv[r] = vf_load(x + r * xs + k);
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) {
      if (PF && (es == 4 || (k & MM_W) == 0)) _mm_prefetch((const char *)w + c * wsb + (int64_t)k * es + pfd, PF_STREAM);
      vf wv = wload(dt, w + c * wsb, k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) acc[r][c] = vf_fma(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {
    const int n = K - k;
    vf xv[F_MAX_MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) xv[r] = vf_load_n(x + r * xs + k, n);
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) {
      vf wv = wload_n(dt, w + c * wsb, k, n);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) acc[r][c] = vf_fma(xv[r], wv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++) store_sums(out + r * os, acc[r], NR, add);
}

/* Decode: rows (1–3) of x against weight rows [c0, c1), each weight row read once. */
KF_INLINE void fcols_streamed(const int dt, const float *x, int32_t rows, int32_t K, const uint8_t *w, int64_t wsb,
                              float *out, int64_t os, int32_t c0, int32_t c1) {
  const int64_t pfd = prefetch_ahead(wsb);
  int32_t j = c0;
#define FS_CASE(MR, NR)                                                                                     \
  for (; j + NR <= c1; j += NR) ftile(MR, NR, dt, 1, x, K, w + j * wsb, wsb, K, out + j, os, 0, pfd); \
  for (; j < c1; j++) ftile(MR, 1, dt, 1, x, K, w + j * wsb, wsb, K, out + j, os, 0, pfd);
  if (rows == 1) {
    FS_CASE(1, FS_NR1)
  } else if (rows == 2) {
    FS_CASE(2, FS_NR2)
  } else {
    FS_CASE(3, FS_NR3)
  }
#undef FS_CASE
}

/* Rows [0, rn) of x (f32, rows xs apart) against nr (≤ F_NR) widened weight rows (ws floats apart):
   tiles of F_MR rows, then one of the rows left. */
static void frows_block(const float *x, int32_t rn, int64_t xs, const float *w, int64_t ws, int nr, int32_t K,
                        float *out, int64_t os, int add) {
  const uint8_t *wb = (const uint8_t *)w;
  const int64_t wsb = ws * 4;
  for (int c = 0; c < nr; c += nr == F_NR ? F_NR : 1) {
    const uint8_t *wc = wb + c * wsb;
    int32_t r = 0;
#define FB_TILE(MR)                                                                                          \
  (nr == F_NR ? ftile(MR, F_NR, KF_F32, 0, x + r * xs, xs, wc, wsb, K, out + r * os + c, os, add, 0)        \
              : ftile(MR, 1, KF_F32, 0, x + r * xs, xs, wc, wsb, K, out + r * os + c, os, add, 0))
    for (; r + F_MR <= rn; r += F_MR) FB_TILE(F_MR);
    switch (rn - r) {
      case 1: FB_TILE(1); break;
      case 2: FB_TILE(2); break;
      case 3: FB_TILE(3); break;
#if F_MR > 4
      case 4: FB_TILE(4); break;
#endif
#if F_MR > 5
      case 5: FB_TILE(5); break;
#endif
      default: break;
    }
#undef FB_TILE
  }
}

/* Weight rows [j, j + nr), values [kb, kb + kn), widened to f32 rows of kc at dst; the next nr rows
   are prefetched meanwhile (the weights of a chunk are one stretch of memory). */
KF_INLINE void fwiden(const int dt, float *dst, int32_t kc, const uint8_t *w, int64_t wsb, int32_t j, int nr,
                      int32_t kb, int32_t kn) {
  const int es = dt == KF_F32 ? 4 : 2;
  for (int c = 0; c < nr; c++) {
    const uint8_t *src = w + (j + c) * wsb + (int64_t)kb * es;
    float *d = dst + c * kc;
    int32_t k = 0;
    for (; k + MM_W <= kn; k += MM_W) {
      if (es == 4 || (k & MM_W) == 0) _mm_prefetch((const char *)src + (int64_t)k * es + F_NR * wsb, _MM_HINT_T0);
      vf_store(d + k, wload(dt, src, k));
    }
    if (k < kn) vf_store(d + k, wload_n(dt, src, k, kn - k));
  }
}

/*
 * Batches: rn rows of x against weight rows [c0, c1), in K blocks of up to F_KC; per block of F_NR
 * weight rows, the weights are widened (or copied) into an L1 scratch once, then every row group
 * runs over it.
 */
static void fcols_batched(int dt, const float *x, int32_t rn, int32_t K, const uint8_t *w, int64_t wsb, float *out,
                          int64_t os, int32_t c0, int32_t c1) {
  float scratch[F_NR * F_KC] __attribute__((aligned(64)));
  const int32_t kblocks = (K + F_KC - 1) / F_KC;
  const int32_t kc = ((K + kblocks - 1) / kblocks + MM_W - 1) / MM_W * MM_W;
  for (int32_t kb = 0; kb < K; kb += kc) {
    const int32_t kn = imin(kc, K - kb);
    for (int32_t j = c0; j < c1; j += F_NR) {
      const int nr = imin(F_NR, c1 - j);
      if (dt == KF_F32) fwiden(KF_F32, scratch, kc, w, wsb, j, nr, kb, kn);
      else if (dt == KF_F16) fwiden(KF_F16, scratch, kc, w, wsb, j, nr, kb, kn);
      else fwiden(KF_BF16, scratch, kc, w, wsb, j, nr, kb, kn);
      frows_block(x + kb, rn, K, scratch, kc, nr, kn, out + j, os, kb > 0);
    }
  }
}

static void fcols_streamed_f32(const float *x, int32_t rows, int32_t K, const uint8_t *w, int64_t wsb, float *out,
                               int64_t os, int32_t c0, int32_t c1) {
  fcols_streamed(KF_F32, x, rows, K, w, wsb, out, os, c0, c1);
}
static void fcols_streamed_f16(const float *x, int32_t rows, int32_t K, const uint8_t *w, int64_t wsb, float *out,
                               int64_t os, int32_t c0, int32_t c1) {
  fcols_streamed(KF_F16, x, rows, K, w, wsb, out, os, c0, c1);
}
static void fcols_streamed_bf16(const float *x, int32_t rows, int32_t K, const uint8_t *w, int64_t wsb, float *out,
                                int64_t os, int32_t c0, int32_t c1) {
  fcols_streamed(KF_BF16, x, rows, K, w, wsb, out, os, c0, c1);
}

/*
 * bf16 weights, one row of x (decode): a pair of bf16 weights (w[2i], w[2i+1]) is one 32-bit lane,
 * whose high half is w[2i+1] as an f32 once the low half is cleared, and whose low half shifted left
 * by 16 is w[2i]: an AND and a shift a vector instead of vpmovzxwd (a shuffle) and a shift a half
 * vector, so fewer instructions a cache line and more of the weight stream in flight. x is split
 * once a call (bp_split: per 2·MM_W values the even ones, then the odd ones); even and odd products
 * go to their own accumulators, summed at the end. Each weight widened exactly and each product
 * fused-multiply-added in f32 as in ftile.
 */
/* Weight rows a tile: on AVX-512 one, so a tile reads one stretch of memory in order, which the
   prefetchers follow better than rows read side by side (native/test/decode-bench.sh, paired by
   round: 1.14× the 8-row tile, 2-row 0.82×); the AVX2 level keeps 4 (not measured there). */
#define BP_NR (MM_W == 16 ? 1 : 4)
/* Largest in_dim split on the stack (floats); longer rows take fcols_streamed. */
#define BP_MAX_K 8192

#if MM_W == 16
KF_INLINE vf bp_even(vi v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
KF_INLINE vf bp_odd(vi v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }
#else
KF_INLINE vf bp_even(vi v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
KF_INLINE vf bp_odd(vi v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
#endif

/* xd: x's whole blocks of 2·MM_W values, each as its even values then its odd ones; the rest as is. */
static void bp_split(float *xd, const float *x, int32_t K) {
  int32_t k = 0;
  for (; k + 2 * MM_W <= K; k += 2 * MM_W)
    for (int i = 0; i < MM_W; i++) {
      xd[k + i] = x[k + 2 * i];
      xd[k + MM_W + i] = x[k + 2 * i + 1];
    }
  for (; k < K; k++) xd[k] = x[k];
}

/* out[c] = Σ_k x[k]·w[c][k] for c < NR (xd: x split by bp_split). */
KF_INLINE void bp_tile(const int NR, const float *xd, int32_t K, const uint8_t *w, int64_t wsb, float *out,
                       int64_t pfd) {
  vf ae[BP_NR], ao[BP_NR];
#pragma GCC unroll 8
  for (int c = 0; c < NR; c++) ae[c] = ao[c] = vf_zero();
  int32_t k = 0;
  for (; k + 2 * MM_W <= K; k += 2 * MM_W) {
    const vf xe = vf_load(xd + k), xo = vf_load(xd + k + MM_W);
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) {
      const uint8_t *p = w + c * wsb + 2 * (int64_t)k;
      if (MM_W == 16 || (k & (2 * MM_W)) == 0) _mm_prefetch((const char *)p + pfd, PF_STREAM);
      const vi v = vi_load(p);
      ae[c] = vf_fma(xe, bp_even(v), ae[c]);
      ao[c] = vf_fma(xo, bp_odd(v), ao[c]);
    }
  }
  for (; k < K; k += MM_W) {
    const int n = imin(MM_W, K - k);
    const vf xv = vf_load_n(xd + k, n);
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) ae[c] = vf_fma(xv, wload_n(KF_BF16, w + c * wsb, k, n), ae[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NR; c++) ae[c] = vf_add(ae[c], ao[c]);
  store_sums(out, ae, NR, 0);
}

/*
 * matmul_par for one row of x on bf16 weights: x split once on this thread's stack, then the n work
 * items (column chunks of the segments) claimed as in matmul_par, each weight row read once.
 */
static __attribute__((noinline)) void bf16_row1_par(const float *x, int32_t K, const kf_segment *segs,
                                                    int32_t num_segs, int32_t *counter, int32_t col_chunk, int32_t n,
                                                    int first) {
  float xd[BP_MAX_K] __attribute__((aligned(64)));
  bp_split(xd, x, K);
  const int64_t wsb = kf_row_bytes(KF_BF16, K);
  const int64_t pfd = prefetch_ahead(wsb);
  for (;;) {
    const int32_t c = kf_claim(counter, n, first);
    if (c < 0) return;
    const kf_segment *seg;
    int32_t c0, c1;
    if (!item_columns(segs, num_segs, c, col_chunk, &seg, &c0, &c1)) continue;
    int32_t j = c0;
    for (; j + BP_NR <= c1; j += BP_NR) bp_tile(BP_NR, xd, K, seg->w + j * wsb, wsb, seg->out + j, pfd);
    for (; j < c1; j++) bp_tile(1, xd, K, seg->w + j * wsb, wsb, seg->out + j, pfd);
  }
}

/* ============================================================================================= */
/* Quantised weights                                                                             */

/* Blocks of a weight row that one streamed step reads: AVX-512 Q8_0 2 (64 quants, one vector),
   Q4_0 4 (their 4 × 16 nibble bytes, low and high nibbles two vectors); 8-lane levels 1. */
#if MM_W == 16
#define QG(dt) ((dt) == KF_Q8_0 ? 2 : 4)
#else
#define QG(dt) 1
#endif

/*
 * `prepare`'s layout. Streamed (rows ≤ STREAMED_ROWS): per row its K quants in the order the
 * streamed tile reads them (per group of QG blocks: Q8_0 in order; Q4_0 values 0–15 of the 4
 * blocks, then values 16–31; blocks after the last whole group in order), then from
 * q_lanes_at [rows][K/4] f32: each accumulator lane's d_x, then [rows][K/4] i32: its share of the
 * block's offset. Tiled (more rows): per group of MM_W rows (the last zero-padded) and block, a
 * record of Q_REC bytes: the quants as quads [8][MM_W][4] int8 (quad q of every row next to each
 * other: one vector), the scales [MM_W] f32, the offsets [MM_W] i32.
 */
#define Q_REC (40 * MM_W)
#define Q_SCALES (32 * MM_W)
#define Q_OFFSETS (36 * MM_W)
static inline int64_t q_lanes_at(int32_t rows, int32_t K) { return ((int64_t)rows * K + 63) & ~(int64_t)63; }

/* Columns of the tiles' weight scratch (Q_NS); the tiles over it: Q_MV activation vectors (MM_W
   rows each) × Q_NR columns, or one vector × Q_NS columns (at least 8 accumulators, 8 dependent
   vpdpbusd each a block, on AVX-512); then blocks of the scratch and weight rows of the streamed
   tile. */
#if MM_W == 16
#define Q_NS 8
#define Q_NR 4
#define Q_MV 2
#else
#define Q_NS 4
#define Q_NR 4
#define Q_MV 1
#endif
#define Q_KB 64
#define QS_NR 4

/* Quantises one 32-block of x as quantizeRowsQ8 into q[32]; returns d, *sum gets Σq. */
KF_INLINE float quantize32(int8_t *q, const float *x, int32_t *sum) {
#if MM_W == 16
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127;
  const __m512 iv = _mm512_set1_ps(d != 0 ? 1.0f / d : 0);
  const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return d;
#else
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                           _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127;
  const __m256 iv = _mm256_set1_ps(d != 0 ? 1.0f / d : 0);
  __m256i qi[4];
  for (int i = 0; i < 4; i++)
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  *sum = _mm_cvtsi128_si32(t);
  return d;
#endif
}

/*
 * Block at bp as 32 unsigned bytes for vi_dp: Q8_0 q + 128 (VNNI) or q itself (the sign trick
 * without VNNI), Q4_0's nibbles in value order (low nibbles are values 0–15).
 */
KF_INLINE __m256i q_block_bytes(const int dt, const uint8_t *bp) {
  if (dt == KF_Q8_0) {
    __m256i v = _mm256_loadu_si256((const __m256i *)(bp + 2));
    return MM_VNNI ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
  }
  __m128i v = _mm_loadu_si128((const __m128i *)(bp + 2));
  const __m128i nib = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_and_si128(v, nib));
}

/*
 * Decode (1–3 rows): out[r][c] for MR rows and NR weight rows, streaming the weights: per group of
 * QG blocks one vpdpbusd per row and weight row (two for Q4_0's nibble halves), started at the
 * lanes' offsets, then × d_w·d_x into f32 lanes; blocks after the last whole group 8 lanes at a
 * time. xq: row 0's quants (rows K apart), xl/xo: row 0's lane scales/offsets (rows K/4 apart).
 */
KF_INLINE void qtile_streamed(const int MR, const int NR, const int dt, const int8_t *xq, const float *xl,
                              const int32_t *xo, int32_t K, const uint8_t *w, int64_t wsb, float *out, int64_t os) {
  const int32_t nb = K / 32;
  const int64_t bs = dt == KF_Q8_0 ? 34 : 18;
  const int64_t ls = K / 4;
  const int32_t ng = nb / QG(dt);
  const int64_t pfd = prefetch_ahead(wsb);
  int32_t b = 0, lane = 0;
  float part[3][QS_NR] = {{0}};
#if MM_W == 16
  {
    __m512 acc[3][QS_NR];
#pragma GCC unroll 3
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) acc[r][c] = _mm512_setzero_ps();
    /* the f16 scales of a group as 16 lanes (words of the group's first 64 bytes) */
    const __m512i dsel = dt == KF_Q8_0 ? _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17,
                                                          17, 17, 17, 17, 17, 0, 0, 0, 0, 0, 0, 0, 0)
                                       : _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 27, 27,
                                                          27, 18, 18, 18, 18, 9, 9, 9, 9, 0, 0, 0, 0);
    /* Q4_0: the 4 blocks' 16 quant bytes (words 1–8, 10–17, 19–26, 28–35 of the group) from the
       group's bytes [0, 64) and [8, 72) */
    const __m512i qsel = _mm512_set_epi16(63, 62, 61, 60, 31, 30, 29, 28, 26, 25, 24, 23, 22, 21, 20, 19, 17, 16, 15,
                                          14, 13, 12, 11, 10, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int32_t g = 0; g < ng; g++, b += QG(dt), lane += 16) {
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) {
        const uint8_t *bp = w + c * wsb + b * bs;
        /* a group is 68 or 72 bytes: its first and last byte's lines, so no line goes unprefetched */
        _mm_prefetch((const char *)bp + pfd, _MM_HINT_T0);
        _mm_prefetch((const char *)bp + pfd + QG(dt) * bs - 1, _MM_HINT_T0);
        const __m512i head = _mm512_loadu_si512((const void *)bp);
        const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(dsel, head)));
        __m512i u0, u1 = _mm512_setzero_si512();
        if (dt == KF_Q8_0) {
          u0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(bp + 2))),
                                  _mm256_loadu_si256((const __m256i *)(bp + 36)), 1);
          u0 = _mm512_xor_si512(u0, _mm512_set1_epi8((char)0x80));
        } else {
          const __m512i q = _mm512_permutex2var_epi16(head, qsel, _mm512_loadu_si512((const void *)(bp + 8)));
          u0 = _mm512_and_si512(q, nib);
          u1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), nib);
        }
#pragma GCC unroll 3
        for (int r = 0; r < MR; r++) {
          const int8_t *xr = xq + r * K + 32 * b;
          __m512i s = _mm512_loadu_si512((const void *)(xo + r * ls + lane));
          s = _mm512_dpbusd_epi32(s, u0, _mm512_loadu_si512((const void *)xr));
          if (dt == KF_Q4_0) s = _mm512_dpbusd_epi32(s, u1, _mm512_loadu_si512((const void *)(xr + 64)));
          const __m512 sc = _mm512_mul_ps(dw, _mm512_loadu_ps(xl + r * ls + lane));
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) part[r][c] = _mm512_reduce_add_ps(acc[r][c]);
  }
#else
  (void)ng;
#endif
  if (b < nb) {
    __m256 acc[3][QS_NR];
#pragma GCC unroll 3
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_ps();
    for (; b < nb; b++, lane += 8) {
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) {
        const uint8_t *bp = w + c * wsb + b * bs;
        _mm_prefetch((const char *)bp + pfd, _MM_HINT_T0);
        const __m256i u = q_block_bytes(dt, bp);
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(load_u16(bp)));
#pragma GCC unroll 3
        for (int r = 0; r < MR; r++) {
          const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * b));
          const __m256i o = _mm256_loadu_si256((const __m256i *)(xo + r * ls + lane));
          __m256i s;
          if (dt == KF_Q8_0 && !MM_VNNI) s = dp8(o, _mm256_abs_epi8(u), _mm256_sign_epi8(xv, u));
          else s = dp8(o, u, xv);
          const __m256 sc = _mm256_mul_ps(dw, _mm256_loadu_ps(xl + r * ls + lane));
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
      for (int c = 0; c < NR; c++) part[r][c] += hsum8(acc[r][c]);
  }
#pragma GCC unroll 3
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
    for (int c = 0; c < NR; c++) out[r * os + c] = part[r][c];
}

KF_INLINE void qcols_streamed(const int dt, const uint8_t *xp, int32_t rows, int32_t r0, int32_t rn, int32_t K,
                              const uint8_t *w, int64_t wsb, float *out, int64_t os, int32_t c0, int32_t c1) {
  const int8_t *xq = (const int8_t *)xp + (int64_t)r0 * K;
  const float *xl = (const float *)(xp + q_lanes_at(rows, K)) + (int64_t)r0 * (K / 4);
  const int32_t *xo = (const int32_t *)(xp + q_lanes_at(rows, K)) + (int64_t)(rows + r0) * (K / 4);
  int32_t j = c0;
#define QS_CASE(MR)                                                                                     \
  for (; j + QS_NR <= c1; j += QS_NR) qtile_streamed(MR, QS_NR, dt, xq, xl, xo, K, w + j * wsb, wsb, out + j, os); \
  for (; j < c1; j++) qtile_streamed(MR, 1, dt, xq, xl, xo, K, w + j * wsb, wsb, out + j, os);
  if (rn == 1 && MM_W == 16 && dt == KF_Q8_0) {
    /* one weight row a tile, read in order (as BP_NR): 1.25× the 4-row tile here; Q4_0, whose tile
       does more work a byte, ran 0.79× so and keeps 4 */
    for (; j < c1; j++) qtile_streamed(1, 1, dt, xq, xl, xo, K, w + j * wsb, wsb, out + j, os);
  } else if (rn == 1) {
    QS_CASE(1)
  } else if (rn == 2) {
    QS_CASE(2)
  } else {
    QS_CASE(3)
  }
#undef QS_CASE
}

/*
 * MV·MM_W rows (tile records at xr, groups gs bytes apart) × NR columns of unpacked weights (ws:
 * [NR][Q_KB][32] bytes, dws: [NR][Q_KB] f32) over nbk blocks; res[v][c] gets lane l = row l of
 * group v.
 */
KF_INLINE void qtile(const int MV, const int NR, const int sgn, const uint8_t *xr, int64_t gs, const uint8_t *ws,
                     const float *dws, int32_t nbk, vf res[][Q_NS]) {
  vf fa[Q_MV][Q_NS];
#pragma GCC unroll 2
  for (int v = 0; v < MV; v++)
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) fa[v][c] = vf_zero();
  for (int32_t b = 0; b < nbk; b++) {
    vi ia[Q_MV][Q_NS];
    const uint8_t *rec[Q_MV];
#pragma GCC unroll 2
    for (int v = 0; v < MV; v++) {
      rec[v] = xr + v * gs + (int64_t)b * Q_REC;
      const vi o = vi_load(rec[v] + Q_OFFSETS);
#pragma GCC unroll 8
      for (int c = 0; c < NR; c++) ia[v][c] = o;
    }
#pragma GCC unroll 8
    for (int q = 0; q < 8; q++) {
      vi xv[Q_MV];
#pragma GCC unroll 2
      for (int v = 0; v < MV; v++) xv[v] = vi_load(rec[v] + q * 4 * MM_W);
#pragma GCC unroll 8
      for (int c = 0; c < NR; c++) {
        const vi wb = vi_bcast32(ws + ((int64_t)c * Q_KB + b) * 32 + q * 4);
#if MM_W == 8 && !MM_VNNI
        if (sgn) {
          const vi wa = _mm256_abs_epi8(wb);
#pragma GCC unroll 2
          for (int v = 0; v < MV; v++) ia[v][c] = vi_dp(ia[v][c], wa, _mm256_sign_epi8(xv[v], wb));
          continue;
        }
#endif
#pragma GCC unroll 2
        for (int v = 0; v < MV; v++) ia[v][c] = vi_dp(ia[v][c], wb, xv[v]);
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) {
      const vf dw = vf_set1(dws[c * Q_KB + b]);
#pragma GCC unroll 2
      for (int v = 0; v < MV; v++) {
        const vf dx = vf_load((const float *)(rec[v] + Q_SCALES));
        fa[v][c] = vf_fma(vi_to_vf(ia[v][c]), vf_mul(dx, dw), fa[v][c]);
      }
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < MV; v++)
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++) res[v][c] = fa[v][c];
}

/* The rows of res (lane l of vector v: row row0 + v·MM_W + l) that lie in [lo, hi) into out, whose
   first row is lo: out[r − lo][c] (+)= res[v][c] lane l. */
static void qstore(float *out, int64_t os, int32_t row0, int32_t lo, int32_t hi, vf res[][Q_NS], int mv, int nr,
                   int add) {
  float lanes[MM_W] __attribute__((aligned(64)));
  for (int v = 0; v < mv; v++)
    for (int c = 0; c < nr; c++) {
      vf_store(lanes, res[v][c]);
      for (int l = 0; l < MM_W; l++) {
        const int32_t r = row0 + v * MM_W + l;
        if (r < lo || r >= hi) continue;
        float *o = out + (int64_t)(r - lo) * os + c;
        *o = add ? *o + lanes[l] : lanes[l];
      }
    }
}

/*
 * Batches: rows [r0, r0 + rn) of the tiled x against weight rows [c0, c1): per K block of up to
 * Q_KB blocks and per Q_NS weight rows, the blocks are unpacked into the stack scratch (the next
 * Q_NS rows prefetched meanwhile), then every row group in the chunk runs over them.
 */
static void qcols_batched(int dt, const uint8_t *xp, int32_t r0, int32_t rn, int32_t K, const uint8_t *w, int64_t wsb,
                          float *out, int64_t os, int32_t c0, int32_t c1) {
  uint8_t ws[Q_NS * Q_KB * 32] __attribute__((aligned(64)));
  float dws[Q_NS * Q_KB];
  vf res[Q_MV][Q_NS];
  const int32_t nb = K / 32;
  const int64_t bs = dt == KF_Q8_0 ? 34 : 18;
  const int64_t gs = (int64_t)nb * Q_REC;
  const int sgn = dt == KF_Q8_0 && !MM_VNNI;
  const int32_t g0 = r0 / MM_W, g1 = (r0 + rn + MM_W - 1) / MM_W;
#define Q_TILE(MV, NR, xr, c) \
  (sgn ? qtile(MV, NR, 1, xr, gs, ws + (c) * Q_KB * 32, dws + (c) * Q_KB, nbk, res) \
       : qtile(MV, NR, 0, xr, gs, ws + (c) * Q_KB * 32, dws + (c) * Q_KB, nbk, res))
  for (int32_t kb = 0; kb < nb; kb += Q_KB) {
    const int32_t nbk = imin(Q_KB, nb - kb);
    for (int32_t j = c0; j < c1; j += Q_NS) {
      const int nr = imin(Q_NS, c1 - j);
      for (int c = 0; c < nr; c++)
        for (int32_t b = 0; b < nbk; b++) {
          const uint8_t *bp = w + (j + c) * wsb + (kb + b) * bs;
          _mm_prefetch((const char *)bp + Q_NS * wsb, _MM_HINT_T0);
          _mm256_store_si256((__m256i *)(ws + ((int64_t)c * Q_KB + b) * 32), q_block_bytes(dt, bp));
          dws[c * Q_KB + b] = _cvtsh_ss(load_u16(bp));
        }
      for (int32_t g = g0; g < g1; g += Q_MV) {
        const uint8_t *xr = xp + g * gs + (int64_t)kb * Q_REC;
        const int mv = imin(Q_MV, g1 - g);
        if (nr == Q_NS && mv == Q_MV && Q_MV > 1) {
          for (int c = 0; c < Q_NS; c += Q_NR) {
            Q_TILE(Q_MV, Q_NR, xr, c);
            qstore(out + j + c, os, g * MM_W, r0, r0 + rn, res, Q_MV, Q_NR, kb > 0);
          }
        } else if (nr == Q_NS) {
          for (int v = 0; v < mv; v++) {
            Q_TILE(1, Q_NS, xr + v * gs, 0);
            qstore(out + j, os, (g + v) * MM_W, r0, r0 + rn, res, 1, Q_NS, kb > 0);
          }
        } else {
          for (int v = 0; v < mv; v++)
            for (int c = 0; c < nr; c++) {
              Q_TILE(1, 1, xr + v * gs, c);
              qstore(out + j + c, os, (g + v) * MM_W, r0, r0 + rn, res, 1, 1, kb > 0);
            }
        }
      }
    }
  }
#undef Q_TILE
}

static void qcols_streamed_q8(const uint8_t *xp, int32_t rows, int32_t r0, int32_t rn, int32_t K, const uint8_t *w,
                              int64_t wsb, float *out, int64_t os, int32_t c0, int32_t c1) {
  qcols_streamed(KF_Q8_0, xp, rows, r0, rn, K, w, wsb, out, os, c0, c1);
}
static void qcols_streamed_q4(const uint8_t *xp, int32_t rows, int32_t r0, int32_t rn, int32_t K, const uint8_t *w,
                              int64_t wsb, float *out, int64_t os, int32_t c0, int32_t c1) {
  qcols_streamed(KF_Q4_0, xp, rows, r0, rn, K, w, wsb, out, os, c0, c1);
}

/* Quantises x [rows][K] into `prepare`'s layout for `dtype` (see q_lanes_at). */
static void quantize_rows(uint8_t *xp, const float *x, int32_t rows, int32_t K, int dtype) {
  const int32_t nb = K / 32;
  const int32_t offset = q_offset(dtype, MM_VNNI);
  if (rows <= STREAMED_ROWS) {
    const int G = QG(dtype);
    for (int32_t r = 0; r < rows; r++) {
      int8_t *xq = (int8_t *)xp + (int64_t)r * K;
      float *xl = (float *)(xp + q_lanes_at(rows, K)) + (int64_t)r * (K / 4);
      int32_t *xo = (int32_t *)(xp + q_lanes_at(rows, K)) + (int64_t)(rows + r) * (K / 4);
      int32_t b = 0, lane = 0;
      for (; b + G <= nb && G > 1; b += G) {
        /* a group of G blocks: G·32 quants, 16 lanes (Q8_0: 8 a block; Q4_0: 4 a block) */
        for (int i = 0; i < G; i++) {
          int8_t q[32];
          int32_t sum;
          const float d = quantize32(q, x + (int64_t)r * K + 32 * (b + i), &sum);
          if (G == 2) {
            memcpy(xq + 32 * (b + i), q, 32);
          } else {
            memcpy(xq + 32 * b + 16 * i, q, 16);
            memcpy(xq + 32 * b + 64 + 16 * i, q + 16, 16);
          }
          for (int l = 0; l < 16 / G; l++) {
            xl[lane + i * (16 / G) + l] = d;
            xo[lane + i * (16 / G) + l] = offset * sum / (16 / G);
          }
        }
        lane += 16;
      }
      for (; b < nb; b++, lane += 8) {
        int32_t sum;
        const float d = quantize32(xq + 32 * b, x + (int64_t)r * K + 32 * b, &sum);
        for (int l = 0; l < 8; l++) {
          xl[lane + l] = d;
          xo[lane + l] = offset * sum / 8;
        }
      }
    }
    return;
  }
  const int32_t groups = (rows + MM_W - 1) / MM_W;
  for (int32_t g = 0; g < groups; g++)
    for (int32_t b = 0; b < nb; b++) {
      uint8_t *rec = xp + ((int64_t)g * nb + b) * Q_REC;
      for (int l = 0; l < MM_W; l++) {
        const int32_t r = g * MM_W + l;
        int8_t q[32] = {0};
        int32_t sum = 0;
        float d = 0;
        if (r < rows) d = quantize32(q, x + (int64_t)r * K + 32 * b, &sum);
        for (int qd = 0; qd < 8; qd++) memcpy(rec + (qd * MM_W + l) * 4, q + 4 * qd, 4);
        memcpy(rec + Q_SCALES + 4 * l, &d, 4);
        const int32_t o = offset * sum;
        memcpy(rec + Q_OFFSETS + 4 * l, &o, 4);
      }
    }
}

static int64_t quantized_bytes(int32_t rows, int32_t K) {
  if (rows <= STREAMED_ROWS) return q_lanes_at(rows, K) + (int64_t)rows * (K / 4) * 8;
  return (int64_t)((rows + MM_W - 1) / MM_W) * (K / 32) * Q_REC;
}

/* One item of matmul_par: rows [r0, r0 + rn) × columns [c0, c1) of one segment. */
static void run_item(int dtype, const float *x, const uint8_t *xp, int32_t rows, int32_t K, int32_t r0, int32_t rn,
                     const uint8_t *w, float *out, int32_t out_dim, int32_t c0, int32_t c1) {
  const int64_t wsb = kf_row_bytes(dtype, K);
  const int64_t os = out_dim;
  float *o = out + (int64_t)r0 * os;
  const float *xr = x + (int64_t)r0 * K;
  if (dtype == KF_Q8_0 || dtype == KF_Q4_0) {
    if (rows <= STREAMED_ROWS) {
      if (dtype == KF_Q8_0) qcols_streamed_q8(xp, rows, r0, rn, K, w, wsb, o, os, c0, c1);
      else qcols_streamed_q4(xp, rows, r0, rn, K, w, wsb, o, os, c0, c1);
    } else {
      qcols_batched(dtype, xp, r0, rn, K, w, wsb, o, os, c0, c1);
    }
    return;
  }
  if (rows <= STREAMED_ROWS) {
    if (dtype == KF_F32) fcols_streamed_f32(xr, rn, K, w, wsb, o, os, c0, c1);
    else if (dtype == KF_F16) fcols_streamed_f16(xr, rn, K, w, wsb, o, os, c0, c1);
    else fcols_streamed_bf16(xr, rn, K, w, wsb, o, os, c0, c1);
    return;
  }
  fcols_batched(dtype, xr, rn, K, w, wsb, o, os, c0, c1);
}

#else /* MM_W == 0: plain C */
/* ============================================================================================= */

/*
 * Quantises one 32-block of x as quantizeRowsQ8: q[32], returns d; *sum gets Σq (x·(1/d) to
 * nearest, ties to even, as the vector levels' quantize32).
 */
static float quantize_block(int8_t *q, const float *x, int32_t *sum) {
  float amax = 0;
  for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[k]));
  const float d = amax / 127;
  const float iv = d != 0 ? 1.0f / d : 0;
  int32_t s = 0;
  for (int k = 0; k < 32; k++) {
    float v = nearbyintf(x[k] * iv);
    int32_t i = v > 127 ? 127 : v < -127 ? -127 : (int32_t)v;
    q[k] = (int8_t)i;
    s += i;
  }
  *sum = s;
  return d;
}

/* Weights per block of the generic float path's widened scratch. */
#define G_KC 256

static void g_widen(float *dst, int dt, const uint8_t *row, int32_t k0, int32_t n) {
  for (int32_t k = 0; k < n; k++) {
    if (dt == KF_F32) memcpy(dst + k, row + 4 * (int64_t)(k0 + k), 4);
    else if (dt == KF_F16) dst[k] = f16_to_f32(load_u16(row + 2 * (int64_t)(k0 + k)));
    else dst[k] = bf16_to_f32(load_u16(row + 2 * (int64_t)(k0 + k)));
  }
}

static void quantize_rows(uint8_t *xp, const float *x, int32_t rows, int32_t K, int dtype) {
  const int64_t nb = (int64_t)rows * (K / 32);
  float *xd = (float *)(xp + (((int64_t)rows * K + 63) & ~(int64_t)63));
  for (int64_t i = 0; i < nb; i++) {
    int32_t sum;
    xd[i] = quantize_block((int8_t *)xp + i * 32, x + i * 32, &sum);
  }
}

static int64_t quantized_bytes(int32_t rows, int32_t K) {
  return (((int64_t)rows * K + 63) & ~(int64_t)63) + (int64_t)rows * (K / 32) * 4;
}

static void run_item(int dtype, const float *x, const uint8_t *xp, int32_t rows, int32_t K, int32_t r0, int32_t rn,
                     const uint8_t *w, float *out, int32_t out_dim, int32_t c0, int32_t c1) {
  const int64_t wsb = kf_row_bytes(dtype, K);
  if (dtype == KF_Q8_0 || dtype == KF_Q4_0) {
    const int32_t nb = K / 32;
    const int64_t bs = dtype == KF_Q8_0 ? 34 : 18;
    const float *xd = (const float *)(xp + (((int64_t)rows * K + 63) & ~(int64_t)63));
    for (int32_t j = c0; j < c1; j++) {
      const uint8_t *row = w + j * wsb;
      for (int32_t r = r0; r < r0 + rn; r++) {
        const int8_t *q = (const int8_t *)xp + (int64_t)r * K;
        float acc = 0;
        for (int32_t b = 0; b < nb; b++) {
          const uint8_t *bp = row + b * bs;
          int32_t s = 0;
          if (dtype == KF_Q8_0) {
            for (int k = 0; k < 32; k++) s += (int32_t)q[32 * b + k] * (int8_t)bp[2 + k];
          } else {
            for (int k = 0; k < 16; k++) {
              s += (int32_t)q[32 * b + k] * ((bp[2 + k] & 15) - 8);
              s += (int32_t)q[32 * b + 16 + k] * ((bp[2 + k] >> 4) - 8);
            }
          }
          acc += (float)s * (f16_to_f32(load_u16(bp)) * xd[(int64_t)r * nb + b]);
        }
        out[(int64_t)r * out_dim + j] = acc;
      }
    }
    return;
  }
  float wbuf[G_KC];
  for (int32_t j = c0; j < c1; j++) {
    const uint8_t *row = w + j * wsb;
    for (int32_t k0 = 0; k0 < K; k0 += G_KC) {
      const int32_t n = imin(G_KC, K - k0);
      g_widen(wbuf, dtype, row, k0, n);
      for (int32_t r = r0; r < r0 + rn; r++) {
        const float *xr = x + (int64_t)r * K + k0;
        float a[8] = {0};
        int32_t k = 0;
        for (; k + 8 <= n; k += 8)
          for (int i = 0; i < 8; i++) a[i] += xr[k + i] * wbuf[k + i];
        for (; k < n; k++) a[0] += xr[k] * wbuf[k];
        const float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        float *o = out + (int64_t)r * out_dim + j;
        *o = k0 == 0 ? s : *o + s;
      }
    }
  }
}
#endif

/* ============================================================================================= */
/* The table's entries                                                                           */

int64_t KF_FN(prepare_bytes)(int32_t rows, int32_t in_dim, int dtype) {
  if (dtype >= KF_Q4_K) return KF_FN(kq_prepare_bytes)(rows, in_dim); /* k-quants: kquants.c */
  if (dtype != KF_Q8_0 && dtype != KF_Q4_0) return 0;
  return quantized_bytes(rows, in_dim);
}

void KF_FN(prepare)(uint8_t *xp, const float *x, int32_t rows, int32_t in_dim, int dtype) {
  if (dtype >= KF_Q4_K) { /* k-quants: kquants.c */
    KF_FN(kq_prepare)(xp, x, rows, in_dim);
    return;
  }
  if (dtype != KF_Q8_0 && dtype != KF_Q4_0) return;
  quantize_rows(xp, x, rows, in_dim, dtype);
}

void KF_FN(matmul_par)(const float *x, const uint8_t *xp, int32_t rows, int32_t in_dim, const kf_segment *segs,
                       int32_t num_segs, int32_t *counter, int32_t col_chunk, int32_t row_chunk, int first,
                       int dtype) {
  if (rows <= 0 || num_segs <= 0 || col_chunk <= 0 || row_chunk <= 0) return;
  const kf_segment *last = &segs[num_segs - 1];
  const int32_t per_block = last->first_chunk + (last->out_dim + col_chunk - 1) / col_chunk;
  const int32_t n = (rows + row_chunk - 1) / row_chunk * per_block;
#if MM_W > 0
  if (dtype == KF_BF16 && rows == 1 && in_dim <= BP_MAX_K) {
    bf16_row1_par(x, in_dim, segs, num_segs, counter, col_chunk, n, first);
    return;
  }
#endif
  for (;;) {
    const int32_t c = kf_claim(counter, n, first);
    if (c < 0) return;
    const int32_t r0 = c / per_block * row_chunk;
    const kf_segment *seg;
    int32_t c0, c1;
    if (!item_columns(segs, num_segs, c % per_block, col_chunk, &seg, &c0, &c1)) continue;
    if (dtype >= KF_Q4_K) { /* k-quants: kquants.c */
      KF_FN(kq_cols)(seg->out + (int64_t)r0 * seg->out_dim, xp, rows, r0, imin(row_chunk, rows - r0), seg->w, in_dim,
                     seg->out_dim, c0, c1, dtype);
      continue;
    }
    run_item(dtype, x, xp, rows, in_dim, r0, imin(row_chunk, rows - r0), seg->w, seg->out, seg->out_dim, c0, c1);
  }
}

/*
 * Decode (up to STREAMED_ROWS rows): on one thread each segment in one piece (one unbroken weight
 * stream); on two about 32 chunks of 16–128 weight rows (a multiple of 8, every streamed tile's
 * width), so the faster thread takes more. Batches: BATCH_ROW_CHUNK rows (their x stays in L2)
 * × 48 columns (a multiple of every batch tile's width: 6 and 8 on AVX-512, 4 on the int8 tile of
 * AVX2), 40 for AVX2's 5-wide float tile.
 */
void KF_FN(matmul_chunks)(int32_t rows, int32_t in_dim, int32_t total_out, int dtype, int threads,
                          int32_t *col_chunk, int32_t *row_chunk) {
  if (rows <= STREAMED_ROWS) {
    *row_chunk = imax(rows, 1);
    *col_chunk = threads <= 1 ? imax(total_out, 1) : imin(128, imax(16, (total_out + 255) / 256 * 8));
    return;
  }
  *row_chunk = BATCH_ROW_CHUNK;
#if MM_W == 8
  *col_chunk = dtype == KF_Q8_0 || dtype == KF_Q4_0 ? 48 : 40;
#else
  *col_chunk = 48;
#endif
}
