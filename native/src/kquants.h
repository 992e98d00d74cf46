/*
 * The k-quant matmul (kquants.c) for matmul.c: dtypes KF_Q4_K, KF_Q5_K, KF_Q6_K. Included by files
 * compiled with KF_ISA set, so KF_FN names this level's copy.
 */
#ifndef KVFENCE_KQUANTS_H
#define KVFENCE_KQUANTS_H

#include "kvfence-kernels.h"

/* Bytes kq_prepare writes for x [rows][in_dim] (in_dim a multiple of 256). */
int64_t KF_FN(kq_prepare_bytes)(int32_t rows, int32_t in_dim);
/* x's rows as ggml's block_q8_K: quants [rows][in_dim], d [rows][in_dim/256], bsums [rows][in_dim/256][16]. */
void KF_FN(kq_prepare)(uint8_t *xp, const float *x, int32_t rows, int32_t in_dim);
/*
 * out[r − r0][j] (out is row r0's output row, stride out_dim) = x[r] · w[j] for rows [r0, r0 + rn)
 * of the `rows` rows kq_prepare quantised at xp and columns [c0, c1) of w [out_dim][in_dim] in dtype.
 */
void KF_FN(kq_cols)(float *out, const uint8_t *xp, int32_t rows, int32_t r0, int32_t rn, const uint8_t *w,
                    int32_t in_dim, int32_t out_dim, int32_t c0, int32_t c1, int dtype);

#endif
