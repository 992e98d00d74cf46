/*
 * A standalone test and timing driver for native/src/attention.c, before (and beside) the glue.
 *
 *   gcc -O2 -pthread -Inative/include native/test/attention-driver.c <attention objects> -lm
 *   ./a.out test [avx512|avx2|generic]   parity against a naive double loop over a matrix of shapes
 *   ./a.out bench [avx512|avx2|generic] [context 4096] [kv f16|f32|bf16]
 *
 * The objects are attention.c compiled once per level with -DKF_ISA=<level> and the level's flags
 * (native/include/kvfence-kernels.h). The driver stages jobs as WasmKernels.pagedAttentionBatch
 * does (records, items, kvParts, splits, a scratch per thread), runs them on 1 or 2 pthreads
 * claiming items from one counter, merges context splits, and compares every output with
 * assertAllClose's bound (|got − want| ≤ 1e-5 + 1e-4·|want|).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvfence-kernels.h"

#define DECLARE(level)                                                                                         \
  void kf_##level##_attention_par(const kf_attention_job *j, int first);                                     \
  void kf_##level##_attention_merge(float *out, const float *partial, const float *ml, int32_t row_start,    \
                                    int32_t rows, int32_t num_heads, int32_t head_dim, int32_t splits);
DECLARE(avx512)
DECLARE(avx2)
DECLARE(generic)

static kf_attention_table table_of(const char *level) {
  if (strcmp(level, "avx512") == 0) return (kf_attention_table){kf_avx512_attention_par, kf_avx512_attention_merge};
  if (strcmp(level, "avx2") == 0) return (kf_attention_table){kf_avx2_attention_par, kf_avx2_attention_merge};
  return (kf_attention_table){kf_generic_attention_par, kf_generic_attention_merge};
}

static uint64_t rng = 88172645463325252ull;
static double urand(void) { /* [0, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}

static uint16_t f16_bits(float x) { /* nearest, ties to even; |x| small enough here */
  _Float16 h = (_Float16)x;
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}
static uint16_t bf16_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
/* Every f16 and bf16 value as a double (exact), built once. */
static double wide_f16[65536], wide_bf16[65536];
static void widen_tables(void) {
  for (int h = 0; h < 65536; h++) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double mag = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    wide_f16[h] = h & 0x8000 ? -mag : mag;
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    wide_bf16[h] = f;
  }
}
static double widen(const uint8_t *pool, int64_t elem, int dt) {
  if (dt == KF_KV_F32) return ((const float *)pool)[elem];
  const uint16_t h = ((const uint16_t *)pool)[elem];
  return dt == KF_KV_BF16 ? wide_bf16[h] : wide_f16[h];
}

typedef struct {
  int32_t rows, start_pos;
} seq_shape;

typedef struct {
  int num_heads, num_kv_heads, head_dim, page_size, num_layers, dt;
  int64_t num_pages, page_elems;
  uint8_t *pool;
} pool_t;

static void pool_make(pool_t *p, int64_t num_pages, double amp) {
  p->page_elems = (int64_t)p->num_layers * 2 * p->page_size * p->num_kv_heads * p->head_dim;
  p->num_pages = num_pages;
  const int64_t n = num_pages * p->page_elems, es = p->dt == KF_KV_F32 ? 4 : 2;
#ifdef __SANITIZE_ADDRESS__
  p->pool = malloc((size_t)(n * es)); /* exactly: a read past the last page trips */
#else
  const size_t bytes = (size_t)((n * es + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  p->pool = aligned_alloc(2 << 20, bytes);
  if (getenv("HUGE") != NULL) madvise(p->pool, bytes, MADV_HUGEPAGE);
#endif
  for (int64_t i = 0; i < n; i++) {
    const float x = (float)((urand() * 2 - 1) * amp);
    if (p->dt == KF_KV_F32) ((float *)p->pool)[i] = x;
    else ((uint16_t *)p->pool)[i] = p->dt == KF_KV_F16 ? f16_bits(x) : bf16_bits(x);
  }
}

/* out[row][head][d] of the reference (pagedAttention, in doubles). */
static void reference(double *out, const float *q, const pool_t *p, const seq_shape *s, int32_t *const *tables,
                      int num_seqs, int layer) {
  const int group = p->num_heads / p->num_kv_heads, hd = p->head_dim;
  const int64_t row = (int64_t)p->num_kv_heads * hd;
  const int64_t k_base = (int64_t)layer * 2 * p->page_size * row, v_base = k_base + (int64_t)p->page_size * row;
  int row_start = 0;
  for (int si = 0; si < num_seqs; si++) {
    const int ctx_max = s[si].start_pos + s[si].rows;
    double *sc = malloc(sizeof(double) * (size_t)ctx_max);
    for (int i = 0; i < s[si].rows; i++) {
      const int ctx = s[si].start_pos + i + 1;
      for (int h = 0; h < p->num_heads; h++) {
        const int g = h / group;
        const float *qh = q + ((int64_t)(row_start + i) * p->num_heads + h) * hd;
        double m = -INFINITY, sum = 0;
        for (int t = 0; t < ctx; t++) {
          const int64_t base = tables[si][t / p->page_size] * p->page_elems + k_base + (t % p->page_size) * row + g * hd;
          double d = 0;
          for (int x = 0; x < hd; x++) d += (double)qh[x] * widen(p->pool, base + x, p->dt);
          sc[t] = d / sqrt((double)hd);
          if (sc[t] > m) m = sc[t];
        }
        for (int t = 0; t < ctx; t++) sum += (sc[t] = exp(sc[t] - m));
        double *o = out + ((int64_t)(row_start + i) * p->num_heads + h) * hd;
        for (int x = 0; x < hd; x++) o[x] = 0;
        for (int t = 0; t < ctx; t++) {
          const int64_t base = tables[si][t / p->page_size] * p->page_elems + v_base + (t % p->page_size) * row + g * hd;
          for (int x = 0; x < hd; x++) o[x] += sc[t] / sum * widen(p->pool, base + x, p->dt);
        }
      }
    }
    row_start += s[si].rows;
    free(sc);
  }
}

/* ---- running a job on 1 or 2 threads, as the engine does ---- */

typedef struct {
  kf_attention_table k;
  kf_attention_job job[2]; /* one per thread: the same but for the scratch */
  int threads;
  volatile int go, done;
  pthread_t worker;
  int stop;
} runner_t;

static void *worker_main(void *arg) {
  runner_t *r = arg;
  int seen = 0;
  for (;;) {
    int g;
    while ((g = __atomic_load_n(&r->go, __ATOMIC_ACQUIRE)) == seen) __builtin_ia32_pause();
    seen = g;
    if (r->stop) return NULL;
    r->k.attention_par(&r->job[1], 1);
    __atomic_store_n(&r->done, g, __ATOMIC_RELEASE);
  }
}

static void runner_start(runner_t *r) {
  if (r->threads == 2) pthread_create(&r->worker, NULL, worker_main, r);
}
static void runner_stop(runner_t *r) {
  if (r->threads == 2) {
    r->stop = 1;
    __atomic_store_n(&r->go, r->go + 1, __ATOMIC_RELEASE);
    pthread_join(r->worker, NULL);
  }
}
/* One job: counter zeroed, both threads claim, then the merge. */
static void runner_run(runner_t *r, int32_t row_start, int32_t total_rows) {
  memset(r->job[0].counter, 0, 128);
  if (r->threads == 2) {
    const int g = r->go + 1;
    __atomic_store_n(&r->go, g, __ATOMIC_RELEASE);
    r->k.attention_par(&r->job[0], 0);
    while (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE) != g) __builtin_ia32_pause();
  } else {
    r->k.attention_par(&r->job[0], 0);
  }
  if (r->job[0].splits > 1) {
    r->k.attention_merge(r->job[0].out, r->job[0].partial, r->job[0].ml, row_start, total_rows, r->job[0].num_heads,
                         r->job[0].head_dim, r->job[0].splits);
  }
}

static int bench_mode = 0;

/* Stages a job as pagedAttentionBatch does (kv_parts, splits given: 0 = pagedAttentionBatch's choice). */
typedef struct {
  kf_attn_seq *seqs;
  float *scratch[2], *partial, *ml;
  int32_t counter[32] __attribute__((aligned(64)));
  int total_rows;
} staged_t;

static void stage(runner_t *r, staged_t *st, const pool_t *p, const seq_shape *s, int32_t *const *tables, int num_seqs,
                  float *out, const float *q, int layer, int kv_parts, int splits) {
  int total_rows = 0, max_ctx = 0, long_ctx = 0;
  for (int i = 0; i < num_seqs; i++) {
    total_rows += s[i].rows;
    const int ctx = s[i].start_pos + s[i].rows;
    if (ctx > max_ctx) max_ctx = ctx;
    if (ctx >= 512) long_ctx = 1;
  }
  const int solo = r->threads == 1;
  if (kv_parts == 0) kv_parts = solo || total_rows >= 8 || long_ctx ? 1 : p->num_kv_heads;
  if (splits == 0) {
    const int items = total_rows * kv_parts;
    int sp = (max_ctx - total_rows + 1) / 256;
    splits = solo || items >= 8 || num_seqs > 1 ? 1 : sp < 1 ? 1 : sp > 8 ? 8 : sp;
  }
  st->seqs = calloc((size_t)num_seqs, sizeof(kf_attn_seq));
  int row = 0, item = 0;
  for (int i = 0; i < num_seqs; i++) {
    st->seqs[i] = (kf_attn_seq){row, s[i].rows, s[i].start_pos, item, tables[i]};
    row += s[i].rows;
    item += s[i].rows * kv_parts * splits;
  }
  const size_t need = (size_t)p->num_heads * (size_t)(max_ctx + p->head_dim);
  const size_t partial_bytes = (size_t)total_rows * p->num_heads * splits * (p->head_dim + 2) * 4 + 64;
  if (bench_mode) {
    /* Timing: buffers made once and kept, 64-byte aligned, as the engine's arena holds them (a
     * fresh mmap'd scratch per call timed page faults and the munmap's cross-CPU TLB shootdowns). */
    static float *keep[3];
    static size_t keep_bytes[3];
    const size_t want[3] = {need * 4, need * 4, partial_bytes};
    for (int b = 0; b < 3; b++) {
      if (keep_bytes[b] < want[b]) {
        free(keep[b]);
        keep_bytes[b] = (want[b] + 63) / 64 * 64;
        keep[b] = aligned_alloc(64, keep_bytes[b]);
        memset(keep[b], 0, keep_bytes[b]);
      }
    }
    st->scratch[0] = keep[0];
    st->scratch[1] = keep[1];
    st->partial = keep[2];
  } else {
    for (int t = 0; t < 2; t++) st->scratch[t] = malloc(need * 4);
    st->partial = malloc(partial_bytes);
  }
  st->ml = st->partial + (size_t)total_rows * p->num_heads * splits * p->head_dim;
  st->total_rows = total_rows;
  for (int t = 0; t < 2; t++) {
    r->job[t] = (kf_attention_job){
        .out = out, .q = q, .pool = p->pool, .seqs = st->seqs, .num_seqs = num_seqs, .scratch = st->scratch[t],
        .layer = layer, .num_layers = p->num_layers, .num_heads = p->num_heads, .num_kv_heads = p->num_kv_heads,
        .head_dim = p->head_dim, .page_size = p->page_size, .counter = st->counter, .splits = splits,
        .partial = st->partial, .ml = st->ml, .kv_parts = kv_parts, .kv_dtype = p->dt};
  }
}
static void unstage(staged_t *st) {
  free(st->seqs);
  if (bench_mode) return;
  free(st->scratch[0]);
  free(st->scratch[1]);
  free(st->partial);
}

static int32_t *shuffled_table(int pages, int64_t num_pages) {
  /* distinct random pages out of num_pages */
  int32_t *all = malloc(sizeof(int32_t) * (size_t)num_pages);
  for (int64_t i = 0; i < num_pages; i++) all[i] = (int32_t)i;
  for (int64_t i = num_pages - 1; i > 0; i--) {
    const int64_t k = (int64_t)(urand() * (double)(i + 1));
    const int32_t x = all[i];
    all[i] = all[k];
    all[k] = x;
  }
  int32_t *t = malloc(sizeof(int32_t) * (size_t)(pages > 0 ? pages : 1));
  memcpy(t, all, sizeof(int32_t) * (size_t)pages);
  free(all);
  return t;
}

static int failures = 0, cases = 0;
static double worst_err = 0, worst_ratio = 0;

/* One case: a pool, sequences and their reference; each variant (threads, kv_parts, splits; 0 =
 * pagedAttentionBatch's choice) run against it on both layers of the pool. */
typedef struct {
  int threads, kv_parts, splits;
} variant;

static void run_case(const char *level, int dt, int num_heads, int num_kv_heads, int head_dim, int page_size,
                     const seq_shape *s, int num_seqs, const variant *vs, int nv, double amp) {
  pool_t p = {num_heads, num_kv_heads, head_dim, page_size, 2, dt, 0, 0, NULL};
  int pages_total = 0, total_rows = 0;
  for (int i = 0; i < num_seqs; i++) {
    pages_total += (s[i].start_pos + s[i].rows + page_size - 1) / page_size;
    total_rows += s[i].rows;
  }
#ifdef __SANITIZE_ADDRESS__
  const int spare = 0; /* every page read, the pool's last one too */
#else
  const int spare = 3;
#endif
  pool_make(&p, pages_total + spare, amp);
  int32_t **tables = malloc(sizeof(int32_t *) * (size_t)num_seqs);
  {
    int32_t *perm = shuffled_table(pages_total + spare, p.num_pages);
    int at = 0;
    for (int i = 0; i < num_seqs; i++) {
      const int n = (s[i].start_pos + s[i].rows + page_size - 1) / page_size;
      tables[i] = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
      memcpy(tables[i], perm + at, sizeof(int32_t) * (size_t)n);
      at += n;
    }
    free(perm);
  }
  const int64_t qn = (int64_t)total_rows * num_heads * head_dim;
  float *q = malloc((size_t)qn * 4), *out = malloc((size_t)qn * 4);
  double *want = malloc((size_t)qn * 8 + 8);
  for (int64_t i = 0; i < qn; i++) q[i] = (float)((urand() * 2 - 1) * amp);
  for (int layer = 0; layer < p.num_layers; layer++) {
    reference(want, q, &p, s, tables, num_seqs, layer);
    for (int vi = 0; vi < nv; vi++) {
      runner_t r = {.k = table_of(level), .threads = vs[vi].threads};
      runner_start(&r);
      staged_t st;
      stage(&r, &st, &p, s, tables, num_seqs, out, q, layer, vs[vi].kv_parts, vs[vi].splits);
      for (int64_t i = 0; i < qn; i++) out[i] = NAN;
      runner_run(&r, 0, st.total_rows);
      runner_stop(&r);
      double err = 0, ratio = 0;
      for (int64_t i = 0; i < qn; i++) {
        const double e = fabs((double)out[i] - want[i]), bound = 1e-5 + 1e-4 * fabs(want[i]);
        if (!(e <= bound)) ratio = INFINITY;
        if (e > err) err = e;
        if (e / bound > ratio) ratio = e / bound;
      }
      cases++;
      if (err > worst_err) worst_err = err;
      if (ratio > worst_ratio) worst_ratio = ratio;
      if (!(ratio <= 1) || (getenv("WORST") && ratio > atof(getenv("WORST")))) {
        failures += !(ratio <= 1);
        printf("FAIL %s threads %d dt %d heads %d/%d hd %d page %d seqs %d (rows %d start %d) kvParts %d splits %d "
               "layer %d: max err %.3g (%.3g of the bound)\n",
               level, vs[vi].threads, dt, num_heads, num_kv_heads, head_dim, page_size, num_seqs, s[0].rows,
               s[0].start_pos, r.job[0].kv_parts, r.job[0].splits, layer, err, ratio);
      }
      unstage(&st);
    }
  }
  for (int i = 0; i < num_seqs; i++) free(tables[i]);
  free(tables);
  free(q);
  free(out);
  free(want);
  free(p.pool);
}

static int test(const char *level) {
  static const int shapes[][4] = {
      /* heads, kv heads, head dim, page size */
      {9, 3, 64, 16}, {3, 3, 8, 4}, {8, 2, 10, 3}, {4, 1, 6, 5}, {12, 3, 64, 16}, {6, 1, 10, 4},
      {8, 2, 12, 16}, {24, 8, 128, 16}, {32, 4, 64, 7}, {64, 2, 16, 16}, {7, 7, 33, 9}, {1, 1, 2048, 1},
      {71, 1, 64, 16}, {96, 2, 8, 4},
  };
  static const int contexts[] = {1, 2, 15, 16, 17, 100, 511, 512, 1000, 4096};
  for (int dt = 0; dt < 3; dt++) {
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      const int *sh = shapes[si];
      const int parts = sh[1] % 3 == 0 ? 3 : sh[1];
      for (size_t ci = 0; ci < sizeof contexts / sizeof contexts[0]; ci++) {
        const int ctx = contexts[ci];
        /* the long contexts on the 135M shape, a 3B-like and a wide one */
        if (ctx >= 1000 && !(si == 0 || si == 7 || si == 8 || si == 11 || si == 12)) continue;
        for (int rows_i = 0; rows_i < 3; rows_i++) {
          const int rows = rows_i == 0 ? 1 : rows_i == 1 ? 8 : 512;
          if (rows > ctx) continue;
          if (rows == 512 && !(ctx == 512 || (ctx == 1000 && si == 0))) continue;
          const seq_shape s = {rows, ctx - rows};
          variant vs[8];
          int nv = 0;
          for (int threads = 1; threads <= 2; threads++) {
            for (int pi = 0; pi < 2; pi++) {
              for (int sp = 1; sp <= 4; sp += 3) {
                if (sp > 1 && rows > 8) continue;
                vs[nv++] = (variant){threads, pi == 0 ? 1 : parts, sp};
              }
            }
          }
          run_case(level, dt, sh[0], sh[1], sh[2], sh[3], &s, 1, vs, nv, 1.5);
        }
      }
    }
    /* Several sequences (splits 1), pagedAttentionBatch's own choices, peaky scores. */
    const seq_shape batch[] = {{1, 33}, {12, 0}, {0, 7}, {1, 700}, {3, 50}};
    const seq_shape decode8[] = {{1, 20}, {1, 29}, {1, 38}, {1, 47}, {1, 56}, {1, 65}, {1, 74}, {1, 83}};
    const variant own[] = {{1, 0, 0}, {2, 0, 0}, {2, 3, 1}};
    run_case(level, dt, 9, 3, 64, 16, batch, 5, own, 3, 1.5);
    run_case(level, dt, 9, 3, 64, 16, batch, 5, own, 3, 4.0);
    run_case(level, dt, 9, 3, 64, 16, decode8, 8, own, 3, 3.0);
  }
  printf("%s: %d cases, %d failures; worst error %.3g, worst error / assertAllClose bound %.3g\n", level, cases,
         failures, worst_err, worst_ratio);
  return failures != 0;
}

/* ---- timing ---- */

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

typedef struct {
  const uint8_t *p;
  int64_t n;
  volatile float sink;
} sweep_arg;
static void *sweep(void *arg) {
  sweep_arg *a = arg;
  float s = 0;
  for (int64_t i = 0; i < a->n; i += 64) s += a->p[i];
  a->sink = s;
  return NULL;
}

static int bench(const char *level, int ctx, int dt) {
  bench_mode = 1;
  pool_t p = {9, 3, 64, 16, 30, dt, 0, 0, NULL};
  const int pages = (ctx + 1 + 15) / 16;
  pool_make(&p, pages, 1.0);
  int32_t *table = shuffled_table(pages, pages);
  float *q = aligned_alloc(64, 9 * 64 * 4), *out = aligned_alloc(64, 9 * 64 * 4);
  for (int i = 0; i < 9 * 64; i++) q[i] = (float)(urand() - 0.5);
  const seq_shape s = {1, ctx};
  const int64_t es = dt == KF_KV_F32 ? 4 : 2;
  const double kv_bytes = (double)(ctx + 1) * 2 * 3 * 64 * es; /* one layer's K and V of the sequence */
  const int max_threads = getenv("ONE") ? 1 : 2;
  for (int threads = 1; threads <= max_threads; threads++) {
    runner_t r = {.k = table_of(level), .threads = threads};
    runner_start(&r);
    double best = 1e30;
    for (int rep = 0; rep < 12; rep++) {
      const double t0 = now_us();
      for (int layer = 0; layer < 30; layer++) {
        staged_t st;
        stage(&r, &st, &p, &s, &table, 1, out, q, layer, 0, 0);
        runner_run(&r, 0, 1);
        unstage(&st);
      }
      const double us = (now_us() - t0) / 30;
      if (us < best) best = us;
    }
    /* Hot: layer 0 again and again (its K and V stay in the caches), the compute alone. */
    double hot = 1e30;
    const int hot_reps = getenv("HOT") ? atoi(getenv("HOT")) : 60;
    for (int rep = 0; rep < hot_reps; rep++) {
      staged_t st;
      stage(&r, &st, &p, &s, &table, 1, out, q, 0, 0, 0);
      const double t0 = now_us();
      runner_run(&r, 0, 1);
      const double us = now_us() - t0;
      unstage(&st);
      if (us < hot) hot = us;
    }
    printf("  hot (layer 0 repeated): %.1f us\n", hot);
    if (threads == 1) {
      /* The same K and V bytes in the same order, one load a line, nothing computed. */
      double pat = 1e30;
      const int64_t rowb = 3 * 64 * es, pageb = 30 * 2 * 16 * rowb;
      for (int rep = 0; rep < 12; rep++) {
        float acc = 0;
        const double t0 = now_us();
        for (int layer = 0; layer < 30; layer++) {
          for (int pg = 0; pg * 16 < ctx + 1; pg++) {
            const uint8_t *b = p.pool + table[pg] * pageb + layer * 2 * 16 * rowb;
            for (int64_t x = 0; x < 2 * 16 * rowb; x += 64) acc += b[x];
          }
        }
        const double us = (now_us() - t0) / 30;
        if (us < pat) pat = us;
        if (acc == 1.5f) printf(" ");
      }
      printf("  the same bytes in the same order, no compute: %.1f us\n", pat);
    }
    runner_stop(&r);
    /* The same bytes read (one byte a line), all 30 layers' pages: the read bandwidth now. */
    const int64_t total = p.num_pages * p.page_elems * es;
    double best_sweep = 1e30;
    for (int rep = 0; rep < 5; rep++) {
      sweep_arg a[2] = {{p.pool, total / threads, 0}, {p.pool + total / threads, total - total / threads, 0}};
      pthread_t th;
      const double t0 = now_us();
      if (threads == 2) pthread_create(&th, NULL, sweep, &a[1]);
      sweep(&a[0]);
      if (threads == 2) pthread_join(th, NULL);
      const double us = now_us() - t0;
      if (us < best_sweep) best_sweep = us;
    }
    const double gbs = total / best_sweep / 1e3;
    printf("%s ctx %d kv %s threads %d: %.1f us per layer call (best of 12 passes over 30 layers), %.1f GB/s of KV; "
           "read sweep %.1f GB/s -> %.1f us for these bytes\n",
           level, ctx, dt == 0 ? "f32" : dt == 1 ? "f16" : "bf16", threads, best, kv_bytes / best / 1e3, gbs,
           kv_bytes / gbs / 1e3);
  }
  /* Prefill: 512 rows, causal, from position 0. */
  if (!getenv("NOPREFILL")) {
    const seq_shape pre = {512, 0};
    float *qp = aligned_alloc(64, 512 * 9 * 64 * 4), *op = aligned_alloc(64, 512 * 9 * 64 * 4);
    for (int i = 0; i < 512 * 9 * 64; i++) qp[i] = (float)(urand() - 0.5);
    for (int threads = 1; threads <= 2; threads++) {
      runner_t r = {.k = table_of(level), .threads = threads};
      runner_start(&r);
      double best = 1e30;
      for (int rep = 0; rep < 4; rep++) {
        const double t0 = now_us();
        for (int layer = 0; layer < 30; layer++) {
          staged_t st;
          stage(&r, &st, &p, &pre, &table, 1, op, qp, layer, 0, 0);
          runner_run(&r, 0, 512);
          unstage(&st);
        }
        const double us = (now_us() - t0) / 30;
        if (us < best) best = us;
      }
      runner_stop(&r);
      const double flop = 2.0 * 2 * 9 * 64 * (512.0 * 513 / 2);
      printf("%s prefill 512 rows kv %s threads %d: %.0f us per layer call (%.1f GFLOP/s), %.1f ms for 30 layers\n",
             level, dt == 0 ? "f32" : dt == 1 ? "f16" : "bf16", threads, best, flop / best / 1e3, best * 30 / 1e3);
    }
    free(qp);
    free(op);
  }
  free(p.pool);
  free(table);
  free(q);
  free(out);
  return 0;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "test";
  widen_tables();
  const char *level = argc > 2 ? argv[2] : "avx512";
  if (strcmp(mode, "test") == 0) return test(level);
  const int ctx = argc > 3 ? atoi(argv[3]) : 4096;
  const int dt = argc > 4 ? (strcmp(argv[4], "f32") == 0 ? 0 : strcmp(argv[4], "bf16") == 0 ? 2 : 1) : 1;
  return bench(level, ctx, dt);
}
