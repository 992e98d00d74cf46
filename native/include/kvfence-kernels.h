/*
 * The native kernels' internal C interface (issue #33): what the Node-API glue (native/src/addon.c)
 * calls and what each kernel file implements. The semantics are those of the WebAssembly kernels
 * (src/kernels/assembly/index.ts) and the reference (src/kernels/reference.ts): a weight is
 * [out][in] row-major in its stored format (src/kernels/weight-format.ts), matmul computes x·wᵀ.
 *
 * Every pointer handed to a kernel here has been checked by the glue against the engine's memory:
 * reads inside the memory, writes inside the engine's region, sizes from the functions below. A
 * kernel reads and writes only the ranges those functions describe — a kernel that needs more (a
 * bigger scratch, a padded read past a row's end) must say so in them, never read past them.
 *
 * ## One source, several instruction sets
 * Each kernel file is compiled once per ISA level by scripts/build-native.mjs, with KF_ISA set to
 * the level's name and the -m flags below; KF_FN(name) gives each copy its own symbol
 * (kf_avx512_name, ...). Inside, `#if defined(__AVX512VNNI__)` etc. choose the code path. The glue
 * picks one level at load time from the CPU (kf_detect_isa) and calls that copy.
 *
 *   level      flags
 *   avx512     -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c -mavx2
 *   avxvnni    -mavx2 -mfma -mf16c -mavxvnni
 *   avx2       -mavx2 -mfma -mf16c
 *   generic    (none: x86-64 baseline, or any other architecture)
 *
 * ## Sharing work between the engine's threads
 * Parallel kernels take the work counter (two int32 a cache line apart, zeroed by the caller) and
 * `first` (0 main thread, 1 worker) and claim chunks with kf_claim, exactly as `claim` in the
 * WebAssembly kernels, so both threads call the same function with the same arguments and the
 * faster takes more chunks. No kernel starts threads, sleeps or waits.
 */
#ifndef KVFENCE_KERNELS_H
#define KVFENCE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Weight formats: the codes of DT_* in src/kernels/assembly/index.ts (DTYPE_CODE in wasm-kernels.ts). */
enum {
  KF_F32 = 0,
  KF_F16 = 1,
  KF_BF16 = 2,
  KF_Q8_0 = 3,
  KF_Q4_0 = 4,
  KF_Q4_K = 5,
  KF_Q5_K = 6,
  KF_Q6_K = 7,
};

/* KV pool element types (kvDtypeCode in src/kvcache/kv-layout.ts). */
enum { KF_KV_F32 = 0, KF_KV_F16 = 1, KF_KV_BF16 = 2 };

/* Bytes of one weight row of in_dim weights in `dtype` (in_dim a multiple of the block: 32, or 256 for *_K). */
static inline int64_t kf_row_bytes(int dtype, int64_t in_dim) {
  switch (dtype) {
    case KF_F32: return in_dim * 4;
    case KF_F16:
    case KF_BF16: return in_dim * 2;
    case KF_Q8_0: return in_dim / 32 * 34;
    case KF_Q4_0: return in_dim / 32 * 18;
    case KF_Q4_K: return in_dim / 256 * 144;
    case KF_Q5_K: return in_dim / 256 * 176;
    case KF_Q6_K: return in_dim / 256 * 210;
    default: return -1;
  }
}

/* Weights per block of `dtype` (in_dim must be a multiple of it). */
static inline int kf_block(int dtype) {
  return dtype >= KF_Q4_K ? 256 : dtype >= KF_Q8_0 ? 32 : 1;
}

/* One output segment of a matmul job: out [rows][out_dim] f32, weight [out_dim][in_dim] in the job's dtype. */
typedef struct {
  float *out;
  const uint8_t *w;
  int32_t out_dim;
  /* Index of the segment's first chunk: the chunks of all segments before it. */
  int32_t first_chunk;
} kf_segment;

/* The next of n work items for thread `first`, or -1 (see `claim` in src/kernels/assembly/index.ts). */
static inline int32_t kf_claim(int32_t *counter, int32_t n, int first) {
  int32_t mid = n >> 1;
  for (int h = 0; h < 2; h++) {
    int half = first ^ h;
    int32_t c = __atomic_fetch_add(counter + 16 * half, 1, __ATOMIC_SEQ_CST) + (half == 0 ? 0 : mid);
    if (c < (half == 0 ? mid : n)) return c;
  }
  return -1;
}

#define KF_CAT3(a, b, c) a##b##c
#define KF_XCAT3(a, b, c) KF_CAT3(a, b, c)
#ifdef KF_ISA
#define KF_FN(name) KF_XCAT3(kf_, KF_ISA, _##name)
#endif

/*
 * The kernel table of one ISA level. matmul.c, attention.c, ops.c and kquants.c each define their
 * entries with KF_FN; the glue builds one table per level from them.
 */
typedef struct {
  /* Bytes of the scratch `prepare` fills for x [rows][in_dim] on `dtype` weights (0: none needed). */
  int64_t (*prepare_bytes)(int32_t rows, int32_t in_dim, int dtype);
  /* Fills xp (prepare_bytes bytes) from x: quantised or packed activations for matmul_par. */
  void (*prepare)(uint8_t *xp, const float *x, int32_t rows, int32_t in_dim, int dtype);
  /*
   * out_s = x · w_sᵀ for each segment s. Work items: ceil(rows/row_chunk) row blocks × (each
   * segment's ceil(out_dim/col_chunk) column chunks), claimed with kf_claim. xp is what prepare
   * filled (or NULL when prepare_bytes is 0).
   */
  void (*matmul_par)(const float *x, const uint8_t *xp, int32_t rows, int32_t in_dim, const kf_segment *segs,
                     int32_t num_segs, int32_t *counter, int32_t col_chunk, int32_t row_chunk, int first, int dtype);
  /* Chunk sizes matmul_par should be called with for this shape (the glue asks before each job). */
  void (*matmul_chunks)(int32_t rows, int32_t in_dim, int32_t total_out, int dtype, int threads,
                        int32_t *col_chunk, int32_t *row_chunk);
} kf_matmul_table;

/* One sequence of an attention job (the glue has checked its rows, positions and every page index). */
typedef struct {
  int32_t row_start;  /* its first query row in q/out */
  int32_t rows;       /* query rows */
  int32_t start_pos;  /* position of its first query row */
  int32_t first_item; /* index of its first work item */
  const int32_t *table; /* block table: ceil((start_pos + rows) / page_size) page indices */
} kf_attn_seq;

/* The arguments of attentionPar in src/kernels/assembly/index.ts, as pointers. */
typedef struct {
  float *out;
  const float *q;
  const uint8_t *pool;
  const kf_attn_seq *seqs;
  int32_t num_seqs;
  float *scratch;
  int32_t layer, num_layers, num_heads, num_kv_heads, head_dim, page_size;
  int32_t *counter;
  int32_t splits;
  float *partial;
  float *ml;
  int32_t kv_parts;
  int kv_dtype;
} kf_attention_job;

typedef struct {
  void (*attention_par)(const kf_attention_job *job, int first);
  void (*attention_merge)(float *out, const float *partial, const float *ml, int32_t row_start, int32_t rows,
                          int32_t num_heads, int32_t head_dim, int32_t splits);
} kf_attention_table;

/*
 * The element-wise kernels (native/src/ops.c), same semantics as the WebAssembly kernels of the
 * same names. out may alias an input where the WebAssembly kernel allows it (rmsnorm, swiglu).
 */
typedef struct {
  void (*add)(float *out, const float *a, const float *b, int32_t n);
  void (*add_bias)(float *out, const float *bias, int32_t rows, int32_t n);
  void (*rmsnorm)(float *out, const float *x, const float *weight, int32_t n, double eps, int32_t rows);
  /* positions were checked: each row's [pos·head_dim/2, (pos+1)·head_dim/2) lies in cos and sin. */
  void (*rope)(float *x, const int32_t *positions, const double *cos, const double *sin, int32_t rows,
               int32_t num_heads, int32_t head_dim);
  void (*swiglu)(float *out, const float *gate, const float *up, int32_t n);
  /* swiglu over chunks of `chunk` floats claimed from one counter (atomic add, as swigluPar). */
  void (*swiglu_par)(float *out, const float *gate, const float *up, int32_t n, int32_t *counter, int32_t chunk);
  /* n f32 at src into the pool at dst as kv_dtype (f16/bf16: nearest, ties to even; f16 saturates). */
  void (*kv_store)(uint8_t *dst, const float *src, int32_t n, int kv_dtype);
} kf_ops_table;

/*
 * Each table entry is a function named KF_FN(<field>) in its kernel file: matmul.c defines
 * prepare_bytes, prepare, matmul_par, matmul_chunks; attention.c attention_par, attention_merge;
 * ops.c the fields of kf_ops_table. The glue (addon.c) declares them per level and builds the tables.
 */

#endif
