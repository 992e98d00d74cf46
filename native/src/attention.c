/*
 * Paged causal attention over the tagged KV pool (kf_attention_table), for f32, f16 and bf16 KV.
 *
 * The contract is attentionPar / attentionMerge of the WebAssembly kernels
 * (src/kernels/assembly/index.ts) and pagedAttention of the reference (src/kernels/reference.ts):
 * the same work items, claimed in the same order from one counter (job->counter, an atomic add),
 * each one (sequence, query row, part of the KV heads, context split); with splits > 1 an item
 * writes its range's softmax-weighted V sum to `partial` and the range's score max and exp-sum to
 * `ml`, and attention_merge combines them. K and V are read only through each sequence's block
 * table, at page·pageBytes + the layer's offset, as the WebAssembly kernels read them.
 *
 * ## One sweep over the K and V rows
 * An item walks its context range once, in chunks of up to VL tokens within one page (VL = 16
 * with AVX-512, 8 with AVX2, 4 on the generic level), with an online softmax: per query head a
 * running max m, a running exp-sum l (kept in VL lanes) and the output row itself as the
 * accumulator, rescaled by exp(m_old − m_new) when a chunk raises the max. A chunk's K rows are
 * read 4 rows at a time over every KV head of the item (so a page is read in address order, all
 * query heads of a group sharing each loaded K vector), then its V rows, while still in L1. The
 * chunk two ahead is prefetched while the V rows are read: pages lie scattered over the pool, and
 * the hardware's prefetchers do not follow a jump to the next page.
 *
 * Scores: for 4 tokens at a time, the dot products over the head dim accumulate in one vector per
 * (query head, token) (f16 widened with vcvtph2ps, bf16 by a shift), and two shuffle-and-add steps
 * fold the 4 vectors into one whose 128-bit blocks hold the 4 tokens' partial sums; two more fold
 * the chunk's VL/4 such vectors into one vector of VL scores. V: each query head's output row is
 * held in registers over a chunk (head-dim blocks of 4 vectors with AVX-512, 2 otherwise), each
 * token's softmax weight broadcast into FMAs against the widened V vectors. Head dims 64 and 128
 * get their own copies with the head dim a constant.
 *
 * Sums accumulate in f32 (the reference uses doubles); exp is a Cephes-style polynomial, as in the
 * WebAssembly kernels. Widening is exact for every finite f16 (subnormals too) and every bf16, so
 * one token of context returns V bit for bit.
 *
 * ## Levels
 * The vector layer below is written three times: AVX-512 (16 lanes, masked tails), AVX2 + FMA +
 * F16C (8 lanes), and the generic level in GCC's vector extensions (4 lanes: SSE2 on a bare
 * x86-64, NEON on arm64; f16 widened by integer shifts and a multiply by 2^112, exact). The
 * kernel above it is one source. The running sums live in the thread's scratch (the job's, at
 * most numHeads·headDim of its numHeads·(maxCtx + headDim) floats), the rest of the per-chunk
 * state on the stack (a few KB, SWEEP_HEADS query heads at a time).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvfence-kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define KF_INLINE static inline __attribute__((always_inline))

/* Bytes of one KV element. */
KF_INLINE int64_t kv_elem_bytes(int dt) { return dt == KF_KV_F32 ? 4 : 2; }

/* Where one item's K and V rows are and what it computes (the arguments of attendRange). */
typedef struct {
  const uint8_t *pool;
  const int32_t *table;
  const float *q;  /* the query row's first head of the item (head g0·group) */
  float *o;        /* output of that head; head h at o + h·o_stride */
  float *acc;      /* the thread's scratch: a sweep's running sums, head h at acc + h·head_dim */
  int64_t o_stride;
  float *ml;       /* NULL, or the range's (max, exp-sum) of head h at ml + h·ml_stride */
  int64_t ml_stride;
  int32_t g0, g1, ta, tb;
  int32_t group, head_dim, page_size;
  int64_t row_bytes;  /* one token's K (or V) row: every KV head */
  int64_t page_bytes; /* one page: every layer's K and V rows */
  int64_t k_base;     /* the layer's K rows within a page */
  int64_t v_off;      /* from a token's K row to its V row */
  float scale;
} kf_range;

/* ---------------------------------------------------------------------------------------------
 * The vector layer: VL f32 lanes. */

#if defined(__AVX512F__)
#define VL 16
#define VBLOCK 4 /* head-dim vectors per V register block */
#define HTILE 4  /* query heads per register tile */
typedef __m512 vf;
KF_INLINE vf vzero(void) { return _mm512_setzero_ps(); }
KF_INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
KF_INLINE vf vload(const float *p) { return _mm512_loadu_ps(p); }
KF_INLINE void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
KF_INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
KF_INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
KF_INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
KF_INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
KF_INLINE float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
KF_INLINE float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
KF_INLINE __mmask16 lanes(int n) { return (__mmask16)((1u << n) - 1); }
/* The first n < VL lanes at p (the rest zero; nothing past them is read). */
KF_INLINE vf vload_n(const float *p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
KF_INLINE void vstore_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
/* v with lanes n.. set to x. */
KF_INLINE vf vkeep(vf v, int n, float x) { return _mm512_mask_blend_ps(lanes(n), _mm512_set1_ps(x), v); }
KF_INLINE vf widen_halves(__m256i h, int dt) {
  if (dt == KF_KV_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
KF_INLINE vf kv_load(const uint8_t *p, int dt) {
  if (dt == KF_KV_F32) return _mm512_loadu_ps((const float *)p);
  return widen_halves(_mm256_loadu_si256((const __m256i *)p), dt);
}
KF_INLINE vf kv_load_n(const uint8_t *p, int dt, int n) {
  if (dt == KF_KV_F32) return _mm512_maskz_loadu_ps(lanes(n), p);
  return widen_halves(_mm256_maskz_loadu_epi16(lanes(n), p), dt);
}
/* Per 128-bit block b: [Σ a_b, Σ b_b, Σ c_b, Σ d_b] (the sums over each vector's block b). */
KF_INLINE vf vfold4(vf a, vf b, vf c, vf d) {
  const vf ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const vf cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
/* The VL/4 results of vfold4 (tokens 4k..4k+3 in r[k]) into one vector: lane j = token j's sum. */
KF_INLINE vf vfold_blocks(const float *rq) {
  const vf r0 = vload(rq), r1 = vload(rq + VL), r2 = vload(rq + 2 * VL), r3 = vload(rq + 3 * VL);
  const vf y1 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));
  const vf y2 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(r2, r3, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y1, y2, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y1, y2, _MM_SHUFFLE(3, 1, 3, 1)));
}
KF_INLINE vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
KF_INLINE vf vpow2(vf y, vf n) { return _mm512_scalef_ps(y, n); }
KF_INLINE vf vclamp(vf x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }
KF_INLINE float vfirst(vf v) { return _mm512_cvtss_f32(v); }

#elif defined(__AVX2__) /* AVX2 + FMA + F16C */
#define VL 8
#define VBLOCK 2
#define HTILE 3
typedef __m256 vf;
KF_INLINE vf vzero(void) { return _mm256_setzero_ps(); }
KF_INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
KF_INLINE vf vload(const float *p) { return _mm256_loadu_ps(p); }
KF_INLINE void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
KF_INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
KF_INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
KF_INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
KF_INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
KF_INLINE float vhsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
KF_INLINE float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
KF_INLINE __m256i lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
KF_INLINE vf vload_n(const float *p, int n) { return _mm256_maskload_ps(p, lanes(n)); }
KF_INLINE void vstore_n(float *p, vf v, int n) { _mm256_maskstore_ps(p, lanes(n), v); }
KF_INLINE vf vkeep(vf v, int n, float x) { return _mm256_blendv_ps(_mm256_set1_ps(x), v, _mm256_castsi256_ps(lanes(n))); }
KF_INLINE vf widen_halves(__m128i h, int dt) {
  if (dt == KF_KV_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
KF_INLINE vf kv_load(const uint8_t *p, int dt) {
  if (dt == KF_KV_F32) return _mm256_loadu_ps((const float *)p);
  return widen_halves(_mm_loadu_si128((const __m128i *)p), dt);
}
KF_INLINE vf kv_load_n(const uint8_t *p, int dt, int n) {
  if (dt == KF_KV_F32) return _mm256_maskload_ps((const float *)p, lanes(n));
  uint16_t h[8] = {0};
  memcpy(h, p, (size_t)n * 2);
  return widen_halves(_mm_loadu_si128((const __m128i *)h), dt);
}
KF_INLINE vf vfold4(vf a, vf b, vf c, vf d) {
  const vf ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  const vf cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256d x = _mm256_castps_pd(ab), y = _mm256_castps_pd(cd);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
KF_INLINE vf vfold_blocks(const float *rq) {
  const vf r0 = vload(rq), r1 = vload(rq + VL);
  return _mm256_add_ps(_mm256_permute2f128_ps(r0, r1, 0x20), _mm256_permute2f128_ps(r0, r1, 0x31));
}
KF_INLINE vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
KF_INLINE vf vpow2(vf y, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
KF_INLINE vf vclamp(vf x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi)); }
KF_INLINE float vfirst(vf v) { return _mm256_cvtss_f32(v); }

#else /* generic: GCC's vector extensions, 4 lanes (SSE2 on x86-64, NEON on arm64) */
#define VL 4
#define VBLOCK 2
#define HTILE 3
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
KF_INLINE vf vzero(void) { return (vf){0, 0, 0, 0}; }
KF_INLINE vf vset1(float x) { return (vf){x, x, x, x}; }
KF_INLINE vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
KF_INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
KF_INLINE vf vfma(vf a, vf b, vf c) { return a * b + c; }
KF_INLINE vf vmul(vf a, vf b) { return a * b; }
KF_INLINE vf vsub(vf a, vf b) { return a - b; }
KF_INLINE vf vadd(vf a, vf b) { return a + b; }
KF_INLINE float vhsum(vf v) { return (v[0] + v[1]) + (v[2] + v[3]); }
KF_INLINE float vhmax(vf v) {
  const float a = v[0] > v[1] ? v[0] : v[1], b = v[2] > v[3] ? v[2] : v[3];
  return a > b ? a : b;
}
/* Lanes where m is all ones from a, the others from b. */
KF_INLINE vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
KF_INLINE vi lanes(int n) { return (vi){0, 1, 2, 3} < (vi){n, n, n, n}; }
KF_INLINE vf vload_n(const float *p, int n) {
  vf v = vzero();
  memcpy(&v, p, (size_t)n * 4);
  return v;
}
KF_INLINE void vstore_n(float *p, vf v, int n) { memcpy(p, &v, (size_t)n * 4); }
KF_INLINE vf vkeep(vf v, int n, float x) { return vselect(lanes(n), v, vset1(x)); }
KF_INLINE vf widen_halves(const uint16_t *h, int dt) {
  const vu u = {h[0], h[1], h[2], h[3]};
  if (dt == KF_KV_BF16) return (vf)(u << 16);
  const vf mag = (vf)((u & 0x7fff) << 13) * vset1(5.192296858534828e33f); /* 2^112 */
  return (vf)((vu)mag | ((u & 0x8000) << 16));
}
KF_INLINE vf kv_load(const uint8_t *p, int dt) {
  if (dt == KF_KV_F32) return vload((const float *)p);
  uint16_t h[4];
  memcpy(h, p, sizeof h);
  return widen_halves(h, dt);
}
KF_INLINE vf kv_load_n(const uint8_t *p, int dt, int n) {
  if (dt == KF_KV_F32) return vload_n((const float *)p, n);
  uint16_t h[4] = {0, 0, 0, 0};
  memcpy(h, p, (size_t)n * 2);
  return widen_halves(h, dt);
}
/* [Σa, Σb, Σc, Σd]: with 4 lanes the one block is the whole vector. */
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE4(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
#define SHUFFLE4(a, b, i, j, k, l) __builtin_shuffle(a, b, (vi){i, j, k, l})
#endif
KF_INLINE vf vfold4(vf a, vf b, vf c, vf d) {
  const vf ab = SHUFFLE4(a, b, 0, 4, 1, 5) + SHUFFLE4(a, b, 2, 6, 3, 7);
  const vf cd = SHUFFLE4(c, d, 0, 4, 1, 5) + SHUFFLE4(c, d, 2, 6, 3, 7);
  return SHUFFLE4(ab, cd, 0, 1, 4, 5) + SHUFFLE4(ab, cd, 2, 3, 6, 7);
}
KF_INLINE vf vfold_blocks(const float *rq) { return vload(rq); }
/* Nearest integer (ties to even) of |x| < 2^22: adding and subtracting 1.5·2^23 rounds in the FPU's mode. */
KF_INLINE vf vround(vf x) {
  const vf magic = vset1(12582912.0f);
  return (x + magic) - magic;
}
KF_INLINE vf vpow2(vf y, vf n) { return y * (vf)((__builtin_convertvector(n, vi) + 127) << 23); }
KF_INLINE vf vclamp(vf x, float lo, float hi) {
  x = vselect(x > vset1(lo), x, vset1(lo));
  return vselect(x < vset1(hi), x, vset1(hi));
}
KF_INLINE float vfirst(vf v) { return v[0]; }
#endif

/* exp on every lane (Cephes expf: range reduction to [-ln2/2, ln2/2], a degree-6 polynomial). */
KF_INLINE vf vexp(vf x) {
  x = vclamp(x, -87.3f, 88.7f);
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  const vf y = vfma(vmul(p, r), r, r);
  return vpow2(vadd(y, vset1(1.0f)), n);
}

/* ---------------------------------------------------------------------------------------------
 * The kernel: one sweep, chunks of up to VL tokens within a page, online softmax. */

/* Query heads of one sweep (the stack arrays below); an item with more sweeps over its KV heads in groups. */
#define SWEEP_HEADS 32
/*
 * How far ahead (in chunks) the K and V rows are prefetched, into L1. At 4,096 tokens, one thread,
 * f16 (native/test/attention-driver.c): none 310-434 us a call, 1 chunk 202-209, 2 chunks 185-187,
 * 3 chunks 186-187, 2 chunks into L2 (T1) 191-194; a second, far prefetch into L2 (6-10 chunks)
 * cost more in instructions than it saved.
 */
#define PF_CHUNKS 2
#define PREFETCH(a) __builtin_prefetch((a), 0, 3)

/*
 * The dot products of H query heads (q_h at q + h·hd) with 4 K rows (row j at k + min(j, n−1)·rb),
 * folded by vfold4: head h's vector to rq + h·(VL/4)·VL. Unscaled.
 */
KF_INLINE void scores_quad(float *rq, const float *q, int32_t hd, const uint8_t *k, int64_t rb, int n, int dt,
                           const int H) {
  const int64_t es = kv_elem_bytes(dt);
  const int32_t full = hd / VL * VL, tail = hd - full;
  const int64_t s1 = 1 < n ? rb : 0, s2 = 2 < n ? 2 * rb : s1, s3 = 3 < n ? 3 * rb : s2;
  vf a[HTILE][4];
#pragma GCC unroll 4
  for (int h = 0; h < H; h++) a[h][0] = a[h][1] = a[h][2] = a[h][3] = vzero();
#pragma GCC unroll 8
  for (int32_t d = 0; d < full; d += VL) {
    const uint8_t *kd = k + d * es;
    const vf c0 = kv_load(kd, dt), c1 = kv_load(kd + s1, dt), c2 = kv_load(kd + s2, dt), c3 = kv_load(kd + s3, dt);
#pragma GCC unroll 4
    for (int h = 0; h < H; h++) {
      const vf qv = vload(q + h * hd + d);
      a[h][0] = vfma(qv, c0, a[h][0]);
      a[h][1] = vfma(qv, c1, a[h][1]);
      a[h][2] = vfma(qv, c2, a[h][2]);
      a[h][3] = vfma(qv, c3, a[h][3]);
    }
  }
  if (tail) {
    const uint8_t *kd = k + full * es;
    const vf c0 = kv_load_n(kd, dt, tail), c1 = kv_load_n(kd + s1, dt, tail);
    const vf c2 = kv_load_n(kd + s2, dt, tail), c3 = kv_load_n(kd + s3, dt, tail);
#pragma GCC unroll 4
    for (int h = 0; h < H; h++) {
      const vf qv = vload_n(q + h * hd + full, tail);
      a[h][0] = vfma(qv, c0, a[h][0]);
      a[h][1] = vfma(qv, c1, a[h][1]);
      a[h][2] = vfma(qv, c2, a[h][2]);
      a[h][3] = vfma(qv, c3, a[h][3]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; h++) vstore(rq + h * (VL / 4) * VL, vfold4(a[h][0], a[h][1], a[h][2], a[h][3]));
}

/* scores_quad for the query heads of one KV head, in tiles of HTILE (the tile sizes as constants). */
KF_INLINE void scores_heads(float *rq, const float *q, int32_t hd, const uint8_t *k, int64_t rb, int n, int dt,
                            int32_t heads) {
  int32_t h = 0;
  for (; h + HTILE <= heads; h += HTILE) scores_quad(rq + h * (VL / 4) * VL, q + h * hd, hd, k, rb, n, dt, HTILE);
  switch (heads - h) {
    case 1: scores_quad(rq + h * (VL / 4) * VL, q + h * hd, hd, k, rb, n, dt, 1); break;
    case 2: scores_quad(rq + h * (VL / 4) * VL, q + h * hd, hd, k, rb, n, dt, 2); break;
#if HTILE > 3
    case 3: scores_quad(rq + h * (VL / 4) * VL, q + h * hd, hd, k, rb, n, dt, 3); break;
#endif
    default: break;
  }
}

/* Rows of a later chunk to prefetch: row j's bytes [k + j·rb, + seg) and the same at + v_off. */
typedef struct {
  const uint8_t *k;
  int64_t rb, v_off, seg;
  int n;
} kf_pf;

KF_INLINE void prefetch_row(const kf_pf *pf, int j) {
  const uint8_t *x = pf->k + j * pf->rb;
  const uintptr_t end = (uintptr_t)x + (uintptr_t)pf->seg;
  for (uintptr_t a = (uintptr_t)x & ~(uintptr_t)63; a < end; a += 64) {
    PREFETCH((const uint8_t *)a);
    PREFETCH((const uint8_t *)a + pf->v_off);
  }
}

/*
 * o_h ← o_h·alpha_h + Σ_j p[h·VL + j]·V_j for H query heads (o_h at o + h·os), n
 * tokens (V_j at v + j·rb), head-dim vectors [d0, d0 + NB·VL) (NB ≤ VBLOCK; the last one `tail`
 * lanes when tail > 0); with each token j, row j of pf prefetched (pf NULL: none).
 */
KF_INLINE void values_block(float *o, int64_t os, const float *alpha, const float *p, const uint8_t *v, int64_t rb,
                            int n, int32_t d0, int dt, const int H, const int NB, const int tail, const kf_pf *pf) {
  const int64_t es = kv_elem_bytes(dt);
  vf acc[HTILE][VBLOCK];
#pragma GCC unroll 4
  for (int h = 0; h < H; h++) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
      const float *src = o + h * os + d0 + b * VL;
      acc[h][b] = vmul(tail && b == NB - 1 ? vload_n(src, tail) : vload(src), vset1(alpha[h]));
    }
  }
  v += d0 * es;
  for (int j = 0; j < n; j++, v += rb) {
    if (pf != NULL && j < pf->n) prefetch_row(pf, j);
    vf x[VBLOCK];
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) x[b] = tail && b == NB - 1 ? kv_load_n(v + b * VL * es, dt, tail) : kv_load(v + b * VL * es, dt);
#pragma GCC unroll 4
    for (int h = 0; h < H; h++) {
      const vf w = vset1(p[h * VL + j]);
#pragma GCC unroll 4
      for (int b = 0; b < NB; b++) acc[h][b] = vfma(w, x[b], acc[h][b]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; h++) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; b++) {
      float *dst = o + h * os + d0 + b * VL;
      if (tail && b == NB - 1) vstore_n(dst, acc[h][b], tail);
      else vstore(dst, acc[h][b]);
    }
  }
}

/* values_block over the whole head dim (the prefetch with the first block). */
KF_INLINE void values_tile(float *o, int64_t os, const float *alpha, const float *p, const uint8_t *v, int64_t rb,
                           int n, int32_t hd, int dt, const int H, const kf_pf *pf) {
  const int32_t step = VBLOCK * VL;
  const int32_t blocks = hd / step * step;
  int32_t d = 0;
  for (; d < blocks; d += step, pf = NULL) values_block(o, os, alpha, p, v, rb, n, d, dt, H, VBLOCK, 0, pf);
  for (; d + VL <= hd; d += VL, pf = NULL) values_block(o, os, alpha, p, v, rb, n, d, dt, H, 1, 0, pf);
  if (d < hd) values_block(o, os, alpha, p, v, rb, n, d, dt, H, 1, hd - d, pf);
}

/* values_tile for the query heads of one KV head, in tiles of HTILE. */
KF_INLINE void values_heads(float *o, int64_t os, const float *alpha, const float *p, const uint8_t *v, int64_t rb,
                            int n, int32_t hd, int dt, int32_t heads, const kf_pf *pf) {
  int32_t h = 0;
  for (; h + HTILE <= heads; h += HTILE, pf = NULL) {
    values_tile(o + h * os, os, alpha + h, p + h * VL, v, rb, n, hd, dt, HTILE, pf);
  }
  const float *a = alpha + h;
  switch (heads - h) {
    case 1: values_tile(o + h * os, os, a, p + h * VL, v, rb, n, hd, dt, 1, pf); break;
    case 2: values_tile(o + h * os, os, a, p + h * VL, v, rb, n, hd, dt, 2, pf); break;
#if HTILE > 3
    case 3: values_tile(o + h * os, os, a, p + h * VL, v, rb, n, hd, dt, 3, pf); break;
#endif
    default: break;
  }
}

/* The K row (at byte head_off of a row) of token t, the first of a chunk, and the chunk's tokens. */
KF_INLINE const uint8_t *chunk_at(const kf_range *r, int32_t t, int64_t head_off, int *n) {
  const int32_t pg = t / r->page_size, page_end = (pg + 1) * r->page_size < r->tb ? (pg + 1) * r->page_size : r->tb;
  *n = page_end - t < VL ? page_end - t : VL;
  return r->pool + (int64_t)r->table[pg] * r->page_bytes + r->k_base + (int64_t)(t - pg * r->page_size) * r->row_bytes +
         head_off;
}

/* The online softmax of one chunk: scores of head h from rq (folded), weights to p, alpha, m, l. */
KF_INLINE void softmax_chunk(float *p, float *alpha, float *m, vf *l, const float *rq, int32_t heads, int n, vf scale) {
  for (int32_t h = 0; h < heads; h++) {
    vf s = vmul(vfold_blocks(rq + (int64_t)h * (VL / 4) * VL), scale);
    if (n < VL) s = vkeep(s, n, -INFINITY);
    const float mc = vhmax(s);
    const float mn = mc > m[h] ? mc : m[h];
    alpha[h] = mn == m[h] ? 1.0f : m[h] == -INFINITY ? 0.0f : vfirst(vexp(vset1(m[h] - mn)));
    vf e = vexp(vsub(s, vset1(mn)));
    if (n < VL) e = vkeep(e, n, 0.0f);
    l[h] = vfma(l[h], vset1(alpha[h]), e);
    vstore(p + h * VL, e);
    m[h] = mn;
  }
}

/*
 * One item (attendRange): query heads of KV heads [g0, g1) over tokens [ta, tb). HD: the head dim
 * as a constant (0: r->head_dim), so the common ones get their own unrolled copy.
 */
KF_INLINE void attend_simd(const kf_range *r, int dt, const int HD) {
  const int32_t hd = HD ? HD : r->head_dim, group = r->group;
  const int64_t es = kv_elem_bytes(dt), rb = r->row_bytes;
  /* A sweep: kv_heads whole groups, or (a group wider than SWEEP_HEADS) a slice of one group. */
  const int32_t sweep_kv = group >= SWEEP_HEADS ? 1 : SWEEP_HEADS / group;
  const int32_t slice = group < SWEEP_HEADS ? group : SWEEP_HEADS;
  const vf scale = vset1(r->scale);
  float m[SWEEP_HEADS], alpha[SWEEP_HEADS];
  vf l[SWEEP_HEADS];
  float p[SWEEP_HEADS * VL] __attribute__((aligned(64)));
  float rq[SWEEP_HEADS * (VL / 4) * VL] __attribute__((aligned(64))); /* scores_quad's folded quads */
  for (int32_t gb = r->g0; gb < r->g1; gb += sweep_kv) {
    for (int32_t hs = 0; hs < group; hs += slice) {
      const int32_t kv_heads = gb + sweep_kv < r->g1 ? sweep_kv : r->g1 - gb;
      const int32_t hn = group - hs < slice ? group - hs : slice; /* query heads per KV head */
      const int32_t heads = kv_heads * hn;
      /* Item head of sweep head g·hn + i (g counted from gb): (gb − g0 + g)·group + hs + i. */
      const int32_t h0 = (gb - r->g0) * group + hs;
      const int64_t head_off = (int64_t)gb * hd * es;
      /* The sums accumulate in the thread's own scratch (heads rows of hd), so the two threads
       * never write near each other's output rows while they work; o gets the result at the end. */
      float *acc = r->acc;
      for (int32_t h = 0; h < heads; h++) {
        memset(acc + h * hd, 0, (size_t)hd * 4);
        m[h] = -INFINITY;
        l[h] = vzero();
        for (int j0 = 0; j0 < VL; j0 += 4) vstore(rq + ((int64_t)h * (VL / 4) + j0 / 4) * VL, vzero());
      }
      /* The chunk PF_CHUNKS ahead is prefetched while a chunk's V rows are read (each KV head's
       * part of a row with that head's V rows); the first PF_CHUNKS chunks up front. */
      kf_pf pf = {NULL, rb, r->v_off, hd * es, 0};
      int32_t pt = r->ta;
      for (int c = 0; c < PF_CHUNKS && pt < r->tb; c++) {
        pf.k = chunk_at(r, pt, head_off, &pf.n);
        for (int32_t g = 0; g < kv_heads; g++, pf.k += hd * es) {
          for (int j = 0; j < pf.n; j++) prefetch_row(&pf, j);
        }
        pt += pf.n;
      }
      int32_t t = r->ta;
      while (t < r->tb) {
        int n;
        const uint8_t *row = chunk_at(r, t, head_off, &n);
        const int ahead = pt < r->tb;
        if (ahead) {
          pf.k = chunk_at(r, pt, head_off, &pf.n);
          pt += pf.n;
        }
        /* Scores 4 tokens at a time, every KV head of the sweep per 4 rows (rows read in order). */
        for (int j0 = 0; j0 < n; j0 += 4) {
          for (int32_t g = 0; g < kv_heads; g++) {
            scores_heads(rq + ((int64_t)g * hn * (VL / 4) + j0 / 4) * VL, r->q + (int64_t)(h0 + g * group) * hd, hd,
                         row + j0 * rb + g * hd * es, rb, n - j0, dt, hn);
          }
        }
        if (n < VL) {
          for (int32_t h = 0; h < heads; h++) {
            for (int j0 = (n + 3) / 4 * 4; j0 < VL; j0 += 4) vstore(rq + ((int64_t)h * (VL / 4) + j0 / 4) * VL, vzero());
          }
        }
        softmax_chunk(p, alpha, m, l, rq, heads, n, scale);
        /* Σ p·V, a KV head at a time; with each V row, that head's part of a row of the chunk ahead. */
        for (int32_t g = 0; g < kv_heads; g++) {
          const kf_pf pg = {pf.k + g * hd * es, rb, r->v_off, hd * es, pf.n};
          values_heads(acc + g * hn * hd, hd, alpha + g * hn, p + g * hn * VL, row + r->v_off + g * hd * es, rb, n, hd,
                       dt, hn, ahead ? &pg : NULL);
        }
        if (ahead && pf.n > n) { /* the rows of a longer chunk ahead that no V row of this one took */
          kf_pf pg = pf;
          for (int32_t g = 0; g < kv_heads; g++, pg.k += hd * es) {
            for (int j = n; j < pf.n; j++) prefetch_row(&pg, j);
          }
        }
        t += n;
      }
      for (int32_t h = 0; h < heads; h++) {
        const float sum = vhsum(l[h]);
        const vf inv = vset1(sum > 0 ? 1.0f / sum : 0.0f); /* an empty range: o = 0 */
        const float *ah = acc + h * hd;
        const int32_t item_head = h0 + h / hn * group + h % hn;
        float *oh = r->o + item_head * r->o_stride;
        int32_t d = 0;
        for (; d + VL <= hd; d += VL) vstore(oh + d, vmul(vload(ah + d), inv));
        if (d < hd) vstore_n(oh + d, vmul(vload_n(ah + d, hd - d), inv), hd - d);
        if (r->ml != NULL) {
          r->ml[item_head * r->ml_stride] = m[h];
          r->ml[item_head * r->ml_stride + 1] = sum;
        }
      }
    }
  }
}

/* attend_simd with the head dims of the common models as constants. */
static __attribute__((noinline)) void attend_f32(const kf_range *r) {
  if (r->head_dim == 64) attend_simd(r, KF_KV_F32, 64);
  else if (r->head_dim == 128) attend_simd(r, KF_KV_F32, 128);
  else attend_simd(r, KF_KV_F32, 0);
}
static __attribute__((noinline)) void attend_f16(const kf_range *r) {
  if (r->head_dim == 64) attend_simd(r, KF_KV_F16, 64);
  else if (r->head_dim == 128) attend_simd(r, KF_KV_F16, 128);
  else attend_simd(r, KF_KV_F16, 0);
}
static __attribute__((noinline)) void attend_bf16(const kf_range *r) {
  if (r->head_dim == 64) attend_simd(r, KF_KV_BF16, 64);
  else if (r->head_dim == 128) attend_simd(r, KF_KV_BF16, 128);
  else attend_simd(r, KF_KV_BF16, 0);
}

/* The work items of one job (attentionItems), for one KV element type. */
KF_INLINE void attention_items(const kf_attention_job *j, int dt) {
  const int32_t group = j->num_heads / j->num_kv_heads, per_kv = j->num_kv_heads / j->kv_parts;
  const int32_t per_row = j->kv_parts * j->splits, hd = j->head_dim, splits = j->splits;
  const kf_attn_seq *last = j->seqs + j->num_seqs - 1, *sq = j->seqs;
  const int32_t n = last->first_item + last->rows * per_row;
  kf_range r;
  r.pool = j->pool;
  r.acc = j->scratch;
  r.group = group;
  r.head_dim = hd;
  r.page_size = j->page_size;
  r.row_bytes = (int64_t)j->num_kv_heads * hd * kv_elem_bytes(dt);
  r.page_bytes = (int64_t)j->num_layers * 2 * j->page_size * r.row_bytes;
  r.k_base = (int64_t)j->layer * 2 * j->page_size * r.row_bytes;
  r.v_off = (int64_t)j->page_size * r.row_bytes;
  r.scale = (float)(1.0 / sqrt((double)hd));
  for (;;) {
    const int32_t c = __atomic_fetch_add(j->counter, 1, __ATOMIC_SEQ_CST);
    if (c >= n) return;
    /* Claims only grow, so the sequence of item c is at or after the previous one's. */
    while (sq < last && sq[1].first_item <= c) sq++;
    const int32_t local = c - sq->first_item;
    /* Longest rows of a sequence first. */
    const int32_t i = sq->rows - 1 - local / per_row, rem = local % per_row;
    const int32_t sp = rem % splits, ctx = sq->start_pos + i + 1;
    r.g0 = rem / splits * per_kv;
    r.g1 = r.g0 + per_kv;
    r.table = sq->table;
    r.q = j->q + (((int64_t)sq->row_start + i) * j->num_heads + (int64_t)r.g0 * group) * hd;
    if (splits == 1) {
      r.o = j->out + (((int64_t)sq->row_start + i) * j->num_heads + (int64_t)r.g0 * group) * hd;
      r.o_stride = hd;
      r.ml = NULL;
      r.ml_stride = 0;
      r.ta = 0;
      r.tb = ctx;
    } else {
      const int64_t slot = ((int64_t)i * j->num_heads + (int64_t)r.g0 * group) * splits + sp;
      r.o = j->partial + slot * hd;
      r.o_stride = (int64_t)splits * hd;
      r.ml = j->ml + slot * 2;
      r.ml_stride = (int64_t)splits * 2;
      r.ta = (int32_t)((int64_t)ctx * sp / splits);
      r.tb = (int32_t)((int64_t)ctx * (sp + 1) / splits);
    }
    if (dt == KF_KV_F16) attend_f16(&r);
    else if (dt == KF_KV_BF16) attend_bf16(&r);
    else attend_f32(&r);
  }
}

void KF_FN(attention_par)(const kf_attention_job *j, int first) {
  (void)first; /* one counter for both threads, as attentionItems */
  if (j->num_seqs <= 0) return;
  if (j->kv_dtype == KF_KV_F16) attention_items(j, KF_KV_F16);
  else if (j->kv_dtype == KF_KV_BF16) attention_items(j, KF_KV_BF16);
  else attention_items(j, KF_KV_F32);
}

void KF_FN(attention_merge)(float *out, const float *partial, const float *ml, int32_t row_start, int32_t rows,
                            int32_t num_heads, int32_t head_dim, int32_t splits) {
  for (int32_t i = 0; i < rows; i++) {
    for (int32_t h = 0; h < num_heads; h++) {
      const int64_t slot0 = ((int64_t)i * num_heads + h) * splits;
      const float *mls = ml + slot0 * 2;
      float m = -INFINITY, total = 0;
      for (int32_t sp = 0; sp < splits; sp++) m = mls[sp * 2] > m ? mls[sp * 2] : m;
      for (int32_t sp = 0; sp < splits; sp++) {
        if (mls[sp * 2 + 1] > 0) total += mls[sp * 2 + 1] * expf(mls[sp * 2] - m);
      }
      float *o = out + (((int64_t)row_start + i) * num_heads + h) * head_dim;
      memset(o, 0, (size_t)head_dim * 4);
      for (int32_t sp = 0; sp < splits; sp++) {
        if (!(mls[sp * 2 + 1] > 0)) continue; /* an empty split */
        const float w = mls[sp * 2 + 1] * expf(mls[sp * 2] - m) / total;
        const float *src = partial + (slot0 + sp) * head_dim;
        for (int32_t d = 0; d < head_dim; d++) o[d] += w * src[d];
      }
    }
  }
}
