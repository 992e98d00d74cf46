/*
 * PLACEHOLDER attention (kf_attention_table): plain scalar C, correct and slow, so the glue runs
 * end to end; replaced by the fast kernels (issue #33). Work items, their order and the context
 * splits are those of attentionPar / attendRange / attentionMerge in the WebAssembly kernels.
 */
#include <math.h>
#include <string.h>

#include "kvfence-kernels.h"

static inline float kf_kv_load(const uint8_t *row, int32_t d, int kv_dtype) {
  if (kv_dtype == KF_KV_F32) return ((const float *)row)[d];
  const uint16_t h = ((const uint16_t *)row)[d];
  uint32_t bits;
  float f;
  if (kv_dtype == KF_KV_BF16) {
    bits = (uint32_t)h << 16;
    memcpy(&f, &bits, 4);
    return f;
  }
  bits = (uint32_t)(h & 0x7fff) << 13;
  memcpy(&f, &bits, 4);
  f *= 5.192296858534828e33f; /* 2^112 */
  return (h & 0x8000) ? -f : f;
}

/* Query row i of seq against KV heads [g0, g1) over positions [ta, tb) (attendRange). */
static void kf_attend(const kf_attention_job *j, const kf_attn_seq *seq, float *o, int64_t o_stride, float *ml,
                      int64_t ml_stride, int32_t i, int32_t g0, int32_t g1, int32_t ta, int32_t tb, float *scores) {
  const int32_t group = j->num_heads / j->num_kv_heads, hd = j->head_dim, n = tb - ta;
  const int64_t el = j->kv_dtype == KF_KV_F32 ? 4 : 2;
  const int64_t row_bytes = (int64_t)j->num_kv_heads * hd * el;
  const int64_t page_bytes = (int64_t)j->num_layers * 2 * j->page_size * row_bytes;
  const int64_t k_base = (int64_t)j->layer * 2 * j->page_size * row_bytes;
  const int64_t v_base = k_base + j->page_size * row_bytes;
  const float scale = (float)(1.0 / sqrt((double)hd));
  for (int32_t g = g0; g < g1; g++) {
    for (int32_t hh = 0; hh < group; hh++) {
      const int32_t h = (g - g0) * group + hh;
      const float *q = j->q + (((int64_t)seq->row_start + i) * j->num_heads + g * group + hh) * hd;
      float m = -INFINITY, sum = 0;
      for (int32_t t = ta; t < tb; t++) {
        const uint8_t *k = j->pool + (int64_t)seq->table[t / j->page_size] * page_bytes + k_base +
                           (t % j->page_size) * row_bytes + (int64_t)g * hd * el;
        double s = 0; /* doubles, as the reference */
        for (int32_t d = 0; d < hd; d++) s += (double)q[d] * kf_kv_load(k, d, j->kv_dtype);
        scores[t - ta] = (float)(s * scale);
        m = fmaxf(m, scores[t - ta]);
      }
      for (int32_t t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - m);
        sum += scores[t];
      }
      float *out = o + h * o_stride;
      memset(out, 0, (size_t)hd * 4);
      for (int32_t t = ta; t < tb; t++) {
        const uint8_t *v = j->pool + (int64_t)seq->table[t / j->page_size] * page_bytes + v_base +
                           (t % j->page_size) * row_bytes + (int64_t)g * hd * el;
        const float p = scores[t - ta] / sum;
        for (int32_t d = 0; d < hd; d++) out[d] += p * kf_kv_load(v, d, j->kv_dtype);
      }
      if (ml != NULL) {
        ml[h * ml_stride] = m;
        ml[h * ml_stride + 1] = sum;
      }
    }
  }
}

void KF_FN(attention_par)(const kf_attention_job *j, int first) {
  const int32_t group = j->num_heads / j->num_kv_heads, per_kv = j->num_kv_heads / j->kv_parts;
  const int32_t per_row = j->kv_parts * j->splits, hd = j->head_dim;
  const kf_attn_seq *last = j->seqs + j->num_seqs - 1, *sq = j->seqs;
  const int32_t n = last->first_item + last->rows * per_row;
  float *scratch = j->scratch;
  for (;;) {
    const int32_t c = __atomic_fetch_add(j->counter, 1, __ATOMIC_SEQ_CST);
    if (c >= n) return;
    while (sq < last && sq[1].first_item <= c) sq++;
    const int32_t local = c - sq->first_item;
    const int32_t i = sq->rows - 1 - local / per_row, rem = local % per_row;
    const int32_t g0 = rem / j->splits * per_kv, sp = rem % j->splits, ctx = sq->start_pos + i + 1;
    if (j->splits == 1) {
      float *o = j->out + (((int64_t)sq->row_start + i) * j->num_heads + (int64_t)g0 * group) * hd;
      kf_attend(j, sq, o, hd, NULL, 0, i, g0, g0 + per_kv, 0, ctx, scratch);
    } else {
      const int32_t ta = (int32_t)((int64_t)ctx * sp / j->splits), tb = (int32_t)((int64_t)ctx * (sp + 1) / j->splits);
      const int64_t slot = ((int64_t)i * j->num_heads + (int64_t)g0 * group) * j->splits + sp;
      kf_attend(j, sq, j->partial + slot * hd, (int64_t)j->splits * hd, j->ml + slot * 2, (int64_t)j->splits * 2, i,
                g0, g0 + per_kv, ta, tb, scratch);
    }
  }
}

void KF_FN(attention_merge)(float *out, const float *partial, const float *ml, int32_t row_start, int32_t rows,
                            int32_t num_heads, int32_t head_dim, int32_t splits) {
  for (int32_t i = 0; i < rows; i++) {
    for (int32_t h = 0; h < num_heads; h++) {
      const int64_t slot0 = ((int64_t)i * num_heads + h) * splits;
      float m = -INFINITY, total = 0;
      for (int32_t sp = 0; sp < splits; sp++) m = fmaxf(m, ml[(slot0 + sp) * 2]);
      for (int32_t sp = 0; sp < splits; sp++) total += ml[(slot0 + sp) * 2 + 1] * expf(ml[(slot0 + sp) * 2] - m);
      float *o = out + (((int64_t)row_start + i) * num_heads + h) * head_dim;
      memset(o, 0, (size_t)head_dim * 4);
      for (int32_t sp = 0; sp < splits; sp++) {
        const float w = ml[(slot0 + sp) * 2 + 1] * expf(ml[(slot0 + sp) * 2] - m) / total;
        for (int32_t d = 0; d < head_dim; d++) o[d] += w * partial[(slot0 + sp) * head_dim + d];
      }
    }
  }
}
