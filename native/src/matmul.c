/*
 * PLACEHOLDER matmul (kf_matmul_table): plain scalar C, correct and slow, so the glue runs end to
 * end; replaced by the fast kernels (issue #33). Q8_0/Q4_0 quantise the activations exactly as
 * quantizeRowsQ8 in the WebAssembly kernels: per 32-block d = amax/127, quants x·(1/d) rounded to
 * nearest even; prepare's scratch is [rows][in] int8 quants, then [rows][in/32] f32 scales.
 */
#include <math.h>
#include <string.h>

#include "kvfence-kernels.h"
#include "kquants.h" /* k-quants: kquants.c */

static inline float kf_f16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
  float mag;
  memcpy(&mag, &bits, 4);
  mag *= 5.192296858534828e33f; /* 2^112 */
  return (h & 0x8000) ? -mag : mag;
}

static inline float kf_bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

int64_t KF_FN(prepare_bytes)(int32_t rows, int32_t in_dim, int dtype) {
  if (dtype >= KF_Q4_K) return KF_FN(kq_prepare_bytes)(rows, in_dim); /* k-quants: kquants.c */
  if (dtype != KF_Q8_0 && dtype != KF_Q4_0) return 0;
  return (int64_t)rows * in_dim + (int64_t)rows * (in_dim / 32) * 4;
}

void KF_FN(prepare)(uint8_t *xp, const float *x, int32_t rows, int32_t in_dim, int dtype) {
  if (dtype >= KF_Q4_K) { /* k-quants: kquants.c */
    KF_FN(kq_prepare)(xp, x, rows, in_dim);
    return;
  }
  if (dtype != KF_Q8_0 && dtype != KF_Q4_0) return;
  const int64_t nb = (int64_t)rows * (in_dim / 32);
  int8_t *q = (int8_t *)xp;
  float *scales = (float *)(xp + (int64_t)rows * in_dim);
  for (int64_t b = 0; b < nb; b++) {
    const float *p = x + b * 32;
    float amax = 0;
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(p[k]));
    const float d = amax / 127;
    const float iv = d != 0 ? 1.0f / d : 0;
    for (int k = 0; k < 32; k++) {
      float v = nearbyintf(p[k] * iv);
      q[b * 32 + k] = (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v);
    }
    scales[b] = d;
  }
}

static float kf_dot_row(const float *x, const uint8_t *w, const int8_t *xq, const float *xd, int32_t in_dim,
                        int dtype) {
  double s = 0; /* doubles, as the reference: a serial f32 sum drifts past the parity tests' 1e-4 */
  if (dtype == KF_F32) {
    const float *wf = (const float *)w;
    for (int32_t k = 0; k < in_dim; k++) s += (double)x[k] * wf[k];
  } else if (dtype == KF_F16 || dtype == KF_BF16) {
    const uint16_t *wh = (const uint16_t *)w;
    for (int32_t k = 0; k < in_dim; k++)
      s += (double)x[k] * (dtype == KF_F16 ? kf_f16_to_f32(wh[k]) : kf_bf16_to_f32(wh[k]));
  } else {
    const int bs = dtype == KF_Q8_0 ? 34 : 18;
    for (int32_t b = 0; b < in_dim / 32; b++) {
      const uint8_t *bp = w + (int64_t)b * bs;
      uint16_t dh;
      memcpy(&dh, bp, 2);
      const int8_t *xb = xq + b * 32;
      int32_t acc = 0;
      if (dtype == KF_Q8_0) {
        /* Through an int8_t pointer, not (int8_t)bp[k]: GCC 12 vectorises the cast's form with
         * vpdpbusd, which takes the weights as unsigned (wrong results with AVX-VNNI). */
        const int8_t *wq = (const int8_t *)(bp + 2);
        for (int k = 0; k < 32; k++) acc += wq[k] * xb[k];
      } else {
        for (int k = 0; k < 16; k++) acc += ((bp[2 + k] & 15) - 8) * xb[k] + ((bp[2 + k] >> 4) - 8) * xb[k + 16];
      }
      s += (double)acc * (kf_f16_to_f32(dh) * xd[b]);
    }
  }
  return (float)s;
}

void KF_FN(matmul_par)(const float *x, const uint8_t *xp, int32_t rows, int32_t in_dim, const kf_segment *segs,
                       int32_t num_segs, int32_t *counter, int32_t col_chunk, int32_t row_chunk, int first,
                       int dtype) {
  const kf_segment *last = segs + num_segs - 1;
  const int32_t per_block = last->first_chunk + (last->out_dim + col_chunk - 1) / col_chunk;
  const int32_t n = (rows + row_chunk - 1) / row_chunk * per_block;
  const int64_t row_bytes = kf_row_bytes(dtype, in_dim);
  const int8_t *xq = (const int8_t *)xp;
  const float *xd = xp == NULL ? NULL : (const float *)(xp + (int64_t)rows * in_dim);
  for (;;) {
    const int32_t c = kf_claim(counter, n, first);
    if (c < 0) return;
    const int32_t r0 = c / per_block * row_chunk, k = c % per_block;
    const kf_segment *sg = segs;
    while (sg < last && sg[1].first_chunk <= k) sg++;
    const int32_t c0 = (k - sg->first_chunk) * col_chunk;
    const int32_t c1 = c0 + col_chunk < sg->out_dim ? c0 + col_chunk : sg->out_dim;
    const int32_t r1 = r0 + row_chunk < rows ? r0 + row_chunk : rows;
    if (dtype >= KF_Q4_K) { /* k-quants: kquants.c */
      KF_FN(kq_cols)(sg->out + (int64_t)r0 * sg->out_dim, xp, rows, r0, r1 - r0, sg->w, in_dim, sg->out_dim, c0, c1, dtype);
      continue;
    }
    for (int32_t r = r0; r < r1; r++) {
      for (int32_t j = c0; j < c1; j++) {
        sg->out[(int64_t)r * sg->out_dim + j] =
            kf_dot_row(x + (int64_t)r * in_dim, sg->w + j * row_bytes, xq == NULL ? NULL : xq + (int64_t)r * in_dim,
                       xd == NULL ? NULL : xd + (int64_t)r * (in_dim / 32), in_dim, dtype);
      }
    }
  }
}

void KF_FN(matmul_chunks)(int32_t rows, int32_t in_dim, int32_t total_out, int dtype, int threads, int32_t *col_chunk,
                          int32_t *row_chunk) {
  if (rows > 3) {
    *col_chunk = 48;
    *row_chunk = 64;
    return;
  }
  const int32_t c = (total_out + 63) / 64 * 4;
  *col_chunk = threads < 2 ? total_out : c < 16 ? 16 : c > 128 ? 128 : c;
  *row_chunk = rows;
}
