/*
 * Standalone check and bench of native/src/matmul.c at every ISA level, without Node: random
 * weights in each format (quantised by the rules of src/kernels/weight-format.ts), the result of
 * matmul_par on two threads (pthreads sharing one counter, first = 0 and 1) compared with a
 * double-precision loop over the dequantised weights, and for Q8_0/Q4_0 with the int8 algorithm
 * emulated in doubles; then GFLOP/s per format and shape on one and two threads.
 *
 *   sh native/test/matmul-driver.sh [check|bench|all] [level|-] [format|-] [rows in out]
 *
 * check (the default) checks every level (or the one named); bench times the best level (or the one named) on every
 * format (or the one named) on the 135M model's shapes (or the one given); all does both.
 *
 * The parity tests through the addon (src/kernels/ tests over the native backend) are the real
 * tests; this driver is for working on the kernels (a failing check prints the first bad value).
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvfence-kernels.h"

#define DECL(isa)                                                                                          \
  int64_t kf_##isa##_prepare_bytes(int32_t, int32_t, int);                                                 \
  void kf_##isa##_prepare(uint8_t *, const float *, int32_t, int32_t, int);                                \
  void kf_##isa##_matmul_par(const float *, const uint8_t *, int32_t, int32_t, const kf_segment *, int32_t, \
                             int32_t *, int32_t, int32_t, int, int);                                       \
  void kf_##isa##_matmul_chunks(int32_t, int32_t, int32_t, int, int, int32_t *, int32_t *);
DECL(avx512)
DECL(avxvnni)
DECL(avx2)
DECL(generic)

typedef struct {
  const char *name;
  int64_t (*prepare_bytes)(int32_t, int32_t, int);
  void (*prepare)(uint8_t *, const float *, int32_t, int32_t, int);
  void (*matmul_par)(const float *, const uint8_t *, int32_t, int32_t, const kf_segment *, int32_t, int32_t *,
                     int32_t, int32_t, int, int);
  void (*matmul_chunks)(int32_t, int32_t, int32_t, int, int, int32_t *, int32_t *);
  const char *cpu; /* __builtin_cpu_supports feature it needs */
} level;

#define LEVEL(isa, cpu) \
  {#isa, kf_##isa##_prepare_bytes, kf_##isa##_prepare, kf_##isa##_matmul_par, kf_##isa##_matmul_chunks, cpu}
static const level LEVELS[] = {LEVEL(avx512, "avx512vnni"), LEVEL(avxvnni, "avxvnni"), LEVEL(avx2, "avx2"),
                               LEVEL(generic, NULL)};
static const char *DT_NAMES[] = {"f32", "f16", "bf16", "q8_0", "q4_0"};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------------------------- */
/* formats (weight-format.ts)                                                                     */

static uint32_t f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}
static float bits_f32(uint32_t b) {
  float x;
  memcpy(&x, &b, 4);
  return x;
}
static uint16_t to_f16(float x) {
  uint32_t b = f32_bits(x), sign = (b >> 16) & 0x8000, exp = (b >> 23) & 0xff, mant = b & 0x7fffff;
  if (exp == 0xff) return sign | 0x7c00 | (mant ? 0x200 | (mant >> 13) : 0);
  if (exp > 112) {
    uint32_t h = ((exp - 112) << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return h >= 0x7c00 ? sign | 0x7c00 : sign | h;
  }
  uint32_t shift = 126 - exp;
  if (shift > 24) return sign;
  uint32_t m = mant | (exp ? 0x800000 : 0), h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1))) h++;
  return sign | h;
}
static float from_f16(uint16_t h) {
  int e = (h >> 10) & 31, f = h & 1023;
  double v = e == 0 ? f * ldexp(1, -24) : e == 31 ? (f ? NAN : INFINITY) : (1 + f / 1024.0) * ldexp(1, e - 15);
  return (float)((h & 0x8000) ? -v : v);
}
static uint16_t to_bf16(float x) {
  uint32_t b = f32_bits(x);
  return (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
static float round_away(float x) { return x < 0 ? -floorf(-x + 0.5f) : floorf(x + 0.5f); }

/* Encodes w [n] (n a multiple of 32 for the block formats) into dst; returns its bytes. */
static void encode(uint8_t *dst, const float *w, int64_t n, int dt) {
  for (int64_t i = 0; i < n; i++) {
    if (dt == KF_F32) memcpy(dst + 4 * i, &w[i], 4);
    if (dt == KF_F16 || dt == KF_BF16) {
      uint16_t h = dt == KF_F16 ? to_f16(w[i]) : to_bf16(w[i]);
      memcpy(dst + 2 * i, &h, 2);
    }
  }
  if (dt < KF_Q8_0) return;
  for (int64_t b = 0; b < n / 32; b++) {
    const float *x = w + 32 * b;
    if (dt == KF_Q8_0) {
      uint8_t *o = dst + 34 * b;
      float amax = 0;
      for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
      float d = amax / 127, id = d != 0 ? 1 / d : 0;
      uint16_t h = to_f16(d);
      memcpy(o, &h, 2);
      for (int j = 0; j < 32; j++) o[2 + j] = (uint8_t)(int8_t)round_away(x[j] * id);
    } else {
      uint8_t *o = dst + 18 * b;
      float amax = 0, max = 0;
      for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]), max = x[j];
      float d = max / -8, id = d != 0 ? 1 / d : 0;
      uint16_t h = to_f16(d);
      memcpy(o, &h, 2);
      for (int j = 0; j < 16; j++) {
        float x0 = x[j] * id, x1 = x[16 + j] * id;
        int q0 = (int)(x0 + 8.5f), q1 = (int)(x1 + 8.5f);
        q0 = q0 > 15 ? 15 : q0;
        q1 = q1 > 15 ? 15 : q1;
        o[2 + j] = (uint8_t)(q0 | (q1 << 4));
      }
    }
  }
}

/* The weights as f32, exactly as decodeRange widens/dequantises them. */
static void decode(float *out, const uint8_t *src, int64_t n, int dt) {
  for (int64_t i = 0; i < n; i++) {
    uint16_t h;
    if (dt == KF_F32) memcpy(&out[i], src + 4 * i, 4);
    if (dt == KF_F16 || dt == KF_BF16) {
      memcpy(&h, src + 2 * i, 2);
      out[i] = dt == KF_F16 ? from_f16(h) : bits_f32((uint32_t)h << 16);
    }
  }
  if (dt < KF_Q8_0) return;
  for (int64_t b = 0; b < n / 32; b++) {
    const uint8_t *p = src + (dt == KF_Q8_0 ? 34 : 18) * b;
    uint16_t h;
    memcpy(&h, p, 2);
    float d = from_f16(h);
    for (int j = 0; j < (dt == KF_Q8_0 ? 32 : 16); j++) {
      if (dt == KF_Q8_0) out[32 * b + j] = (int8_t)p[2 + j] * d;
      else out[32 * b + j] = ((p[2 + j] & 15) - 8) * d, out[32 * b + 16 + j] = ((p[2 + j] >> 4) - 8) * d;
    }
  }
}

static uint32_t rng = 12345;
static float frand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 17;
  rng ^= rng << 5;
  return (float)(rng / 4294967296.0 - 0.5) * 2;
}

/* ---------------------------------------------------------------------------------------------- */
/* two threads on one counter                                                                     */

typedef struct {
  const level *lv;
  const float *x;
  const uint8_t *xp;
  int32_t rows, in_dim, num_segs, col_chunk, row_chunk, dtype;
  const kf_segment *segs;
  int32_t *counter;
} job;

static job current;
/* The job's ticket: seq when published, -seq once the worker took it, 0 when the main thread
   cancelled it (the worker never started: the main thread ran every chunk). */
static atomic_int ticket, job_seq, job_done;
static pthread_t worker;
static int worker_started;

static void run_job(const job *j, int first) {
  j->lv->matmul_par(j->x, j->xp, j->rows, j->in_dim, j->segs, j->num_segs, j->counter, j->col_chunk, j->row_chunk,
                    first, j->dtype);
}

static void *worker_main(void *arg) {
  (void)arg;
  int seen = 0;
  for (;;) {
    int s;
    while ((s = atomic_load(&job_seq)) == seen) __builtin_ia32_pause();
    if (s < 0) return NULL;
    seen = s;
    int expect = s;
    if (!atomic_compare_exchange_strong(&ticket, &expect, -s)) continue;
    run_job(&current, 1);
    atomic_store(&job_done, s);
  }
}

static int32_t counter_mem[64] __attribute__((aligned(64)));

/* out_s = x · w_sᵀ for the segments on `threads` threads; xp is prepared here (exactly its bytes). */
static void matmul(const level *lv, int threads, const float *x, int32_t rows, int32_t in_dim, kf_segment *segs,
                   int32_t num_segs, int dtype, uint8_t **xp_buf) {
  int32_t total = 0, cc, rc;
  for (int s = 0; s < num_segs; s++) total += segs[s].out_dim;
  lv->matmul_chunks(rows, in_dim, total, dtype, threads, &cc, &rc);
  int32_t chunks = 0;
  for (int s = 0; s < num_segs; s++) {
    segs[s].first_chunk = chunks;
    chunks += (segs[s].out_dim + cc - 1) / cc;
  }
  int64_t xb = lv->prepare_bytes(rows, in_dim, dtype);
  uint8_t *xp = NULL;
  if (xb > 0) {
    if (*xp_buf == NULL) *xp_buf = malloc(xb);
    xp = *xp_buf;
    lv->prepare(xp, x, rows, in_dim, dtype);
  }
  counter_mem[0] = counter_mem[16] = 0;
  job j = {lv, x, xp, rows, in_dim, num_segs, cc, rc, dtype, segs, counter_mem};
  if (threads == 1) {
    run_job(&j, 0);
    return;
  }
  if (!worker_started) {
    pthread_create(&worker, NULL, worker_main, NULL);
    worker_started = 1;
  }
  current = j;
  const int seq = atomic_load(&job_seq) + 1;
  atomic_store(&ticket, seq);
  atomic_store(&job_seq, seq);
  run_job(&j, 0);
  int expect = seq;
  if (atomic_compare_exchange_strong(&ticket, &expect, 0)) return;
  while (atomic_load(&job_done) != seq) __builtin_ia32_pause();
}

/* ---------------------------------------------------------------------------------------------- */
/* checks                                                                                         */

static int failures;

/* The expected values at sampled outputs (every row and column of small shapes; every 7th row and
   5th column of big ones): doubles over the dequantised weights, the quantisation bound, and for
   Q8_0/Q4_0 the int8 algorithm emulated in doubles with Σ|terms| (its f32 rounding scale). */
typedef struct {
  int32_t n, *idx;
  double *want, *bound, *emu, *scale;
} expected;

static expected expect(int dt, const float *x, const float *wf, const uint8_t *wb, int32_t rows, int32_t in_dim,
                       int32_t out_dim) {
  const int rstep = rows > 64 ? 7 : 1, cstep = (int64_t)rows * out_dim > 20000 ? 5 : 1;
  const int32_t nb = in_dim / 32;
  expected e = {0};
  const int64_t cap = ((int64_t)rows / rstep + 2) * (out_dim / cstep + 2);
  e.idx = malloc(cap * 4), e.want = malloc(cap * 8), e.bound = malloc(cap * 8), e.emu = malloc(cap * 8);
  e.scale = malloc(cap * 8);
  int8_t *qx = malloc(in_dim);
  double *dx = malloc(sizeof(double) * (nb + 1));
  for (int32_t r = 0; r < rows; r = r + rstep < rows || r == rows - 1 ? r + rstep : rows - 1) {
    const float *xr = x + (int64_t)r * in_dim;
    for (int32_t b = 0; b < nb; b++) {
      float amax = 0;
      for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(xr[32 * b + k]));
      float d = amax / 127, id = d != 0 ? 1 / d : 0;
      dx[b] = d;
      for (int k = 0; k < 32; k++) qx[32 * b + k] = (int8_t)nearbyintf(xr[32 * b + k] * id);
    }
    for (int32_t j = 0; j < out_dim; j = j + cstep < out_dim || j == out_dim - 1 ? j + cstep : out_dim - 1) {
      const float *w = wf + (int64_t)j * in_dim;
      double want = 0, mag = 0, bound = 1e-6, emu = 0, scale = 0;
      for (int32_t k = 0; k < in_dim; k++) want += (double)xr[k] * w[k], mag += fabs((double)xr[k] * w[k]);
      if (dt >= KF_Q8_0) {
        const uint8_t *row = wb + (int64_t)j * kf_row_bytes(dt, in_dim);
        for (int32_t b = 0; b < nb; b++) {
          const uint8_t *p = row + (dt == KF_Q8_0 ? 34 : 18) * b;
          uint16_t h;
          memcpy(&h, p, 2);
          double dw = from_f16(h);
          long sum = 0, abs_sum = 0;
          for (int k = 0; k < 32; k++) {
            int wq = dt == KF_Q8_0 ? (int8_t)p[2 + k] : (k < 16 ? (p[2 + k] & 15) : (p[2 + k - 16] >> 4)) - 8;
            sum += (long)wq * qx[32 * b + k];
            abs_sum += labs((long)wq * qx[32 * b + k]);
            bound += fabs(w[32 * b + k]) * dx[b] / 2;
          }
          emu += dw * dx[b] * sum;
          scale += fabs(dw * dx[b]) * abs_sum;
        }
        bound += 1e-5 * mag;
      } else {
        scale = mag;
      }
      e.idx[e.n] = r * out_dim + j, e.want[e.n] = want, e.bound[e.n] = bound, e.emu[e.n] = emu;
      e.scale[e.n++] = scale;
      if (j == out_dim - 1) break;
    }
    if (r == rows - 1) break;
  }
  free(qx), free(dx);
  return e;
}

/* Floats: rtol 1e-4/atol 1e-5 against doubles (the parity tests'); block formats: within the
   activation-quantisation bound, and to 1e-6 of Σ|terms| of the emulated int8 algorithm. The
   largest |diff| / Σ|terms| goes to *max_err. */
static void check(const char *lvname, int dt, const expected *e, const float *got, int32_t rows, int32_t in_dim,
                  int32_t out_dim, double *max_err) {
  for (int32_t i = 0; i < e->n; i++) {
    const double g = got[e->idx[i]];
    const double err = fabs(g - e->want[i]);
    const double rel = (dt < KF_Q8_0 ? err : fabs(g - e->emu[i])) / (e->scale[i] + 1e-30);
    if (!(rel <= *max_err)) *max_err = rel;
    const int ok = dt < KF_Q8_0 ? err <= 1e-5 + 1e-4 * fabs(e->want[i])
                                : err <= e->bound[i] && fabs(g - e->emu[i]) <= 1e-6 * e->scale[i] + 1e-6;
    if (!ok && failures++ < 10)
      printf("FAIL %s %s %dx%dx%d [%d][%d]: got %.9g want %.9g (bound %.3g) emulated %.9g\n", lvname, DT_NAMES[dt],
             rows, in_dim, out_dim, e->idx[i] / out_dim, e->idx[i] % out_dim, g, e->want[i], e->bound[i], e->emu[i]);
  }
}

static void unexpect(expected *e) { free(e->idx), free(e->want), free(e->bound), free(e->emu), free(e->scale); }

static int supported(const level *lv) {
  if (lv->cpu == NULL) return 1;
  if (!strcmp(lv->cpu, "avx512vnni"))
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!strcmp(lv->cpu, "avxvnni")) return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

typedef struct {
  int32_t rows, in_dim, out_dim;
} shape;

static void check_all(const char *only) {
  static const int32_t ROWS[] = {1, 2, 3, 4, 5, 8, 16, 17, 64, 512};
  static const int32_t INS[] = {576, 1536};
  static const int32_t OUTS[] = {576, 192, 1536, 49152};
  static const shape ODD[] = {{1, 1, 1},    {1, 37, 13}, {2, 37, 13},  {3, 5, 7},    {4, 33, 41},
                              {7, 66, 19},  {8, 37, 13}, {17, 66, 9},  {1, 32, 5},   {2, 64, 9},
                              {3, 96, 7},   {5, 32, 13}, {6, 128, 19}, {33, 96, 70}, {70, 160, 50}, {2, 160, 9}, {3, 224, 5}};
  for (int dt = 0; dt <= KF_Q4_0; dt++) {
    double max_err[4] = {0};
    int nshapes = 0;
    shape shapes[128];
    for (size_t a = 0; a < sizeof ROWS / 4; a++)
      for (size_t b = 0; b < 2; b++)
        for (size_t c = 0; c < 4; c++)
          if (OUTS[c] != 49152 || (ROWS[a] <= 8 && INS[b] == 576)) shapes[nshapes++] = (shape){ROWS[a], INS[b], OUTS[c]};
    for (size_t i = 0; i < sizeof ODD / sizeof ODD[0]; i++)
      if (dt < KF_Q8_0 || ODD[i].in_dim % 32 == 0) shapes[nshapes++] = ODD[i];
    for (int s = 0; s < nshapes; s++) {
      const shape sh = shapes[s];
      const int64_t nw = (int64_t)sh.out_dim * sh.in_dim;
      float *w = malloc(nw * 4), *wf = malloc(nw * 4), *x = malloc((int64_t)sh.rows * sh.in_dim * 4);
      uint8_t *wb = malloc(kf_row_bytes(dt, sh.in_dim) * sh.out_dim);
      for (int64_t i = 0; i < nw; i++) w[i] = frand() * 0.5f;
      for (int64_t i = 0; i < (int64_t)sh.rows * sh.in_dim; i++) x[i] = frand() * 2;
      if (sh.rows > 1 && dt >= KF_Q8_0) x[0] = 40; /* an outlier: its block quantises coarsely */
      encode(wb, w, nw, dt);
      decode(wf, wb, nw, dt);
      expected e = expect(dt, x, wf, wb, sh.rows, sh.in_dim, sh.out_dim);
      float *out = malloc((int64_t)sh.rows * sh.out_dim * 4);
      for (int l = 0; l < 4; l++) {
        if (!supported(&LEVELS[l]) || (only && strcmp(only, LEVELS[l].name))) continue;
        for (int threads = 1; threads <= 2; threads++) {
          memset(out, 0xff, (int64_t)sh.rows * sh.out_dim * 4); /* NaN: every output must be written */
          kf_segment seg = {out, wb, sh.out_dim, 0};
          uint8_t *xp = NULL;
          matmul(&LEVELS[l], threads, x, sh.rows, sh.in_dim, &seg, 1, dt, &xp);
          free(xp);
          check(LEVELS[l].name, dt, &e, out, sh.rows, sh.in_dim, sh.out_dim, &max_err[l]);
        }
      }
      unexpect(&e);
      free(w), free(wf), free(x), free(wb), free(out);
    }
    /* three segments as one job (q/k/v) */
    for (int l = 0; l < 4; l++) {
      if (!supported(&LEVELS[l]) || (only && strcmp(only, LEVELS[l].name))) continue;
      const int32_t in_dim = 96, outs[3] = {45, 7, 100};
      for (int32_t rows = 1; rows <= 40; rows += 6) {
        float *x = malloc(rows * in_dim * 4);
        for (int i = 0; i < rows * in_dim; i++) x[i] = frand();
        kf_segment segs[3];
        float *ws[3], *wfs[3], *outsv[3];
        uint8_t *wbs[3];
        for (int s = 0; s < 3; s++) {
          ws[s] = malloc(outs[s] * in_dim * 4), wfs[s] = malloc(outs[s] * in_dim * 4);
          wbs[s] = malloc(kf_row_bytes(dt, in_dim) * outs[s]);
          outsv[s] = malloc(rows * outs[s] * 4);
          memset(outsv[s], 0xff, rows * outs[s] * 4);
          for (int i = 0; i < outs[s] * in_dim; i++) ws[s][i] = frand();
          encode(wbs[s], ws[s], outs[s] * in_dim, dt);
          decode(wfs[s], wbs[s], outs[s] * in_dim, dt);
          segs[s] = (kf_segment){outsv[s], wbs[s], outs[s], 0};
        }
        uint8_t *xp = NULL;
        matmul(&LEVELS[l], 2, x, rows, in_dim, segs, 3, dt, &xp);
        free(xp);
        for (int s = 0; s < 3; s++) {
          expected e = expect(dt, x, wfs[s], wbs[s], rows, in_dim, outs[s]);
          check(LEVELS[l].name, dt, &e, outsv[s], rows, in_dim, outs[s], &max_err[l]);
          unexpect(&e);
          free(ws[s]), free(wfs[s]), free(wbs[s]), free(outsv[s]);
        }
        free(x);
      }
    }
    printf("%-5s %d shapes: max |diff|/Σ|terms| (%s) avx512 %.2e, avxvnni %.2e, avx2 %.2e, generic %.2e\n",
           DT_NAMES[dt], nshapes, dt < KF_Q8_0 ? "vs doubles" : "vs the int8 algorithm",
           max_err[0], max_err[1], max_err[2], max_err[3]);
  }
}

/* ---------------------------------------------------------------------------------------------- */
/* bench                                                                                          */

/* GFLOP/s of x[rows][in] · w[out][in]ᵀ (prepare included) from the fastest of the calls in
   ~`seconds` (the machine is shared: the best call is the one nobody interrupted); `copies` distinct
   weight matrices in turn, so decode reads them from memory rather than cache. *gbs: weight GB/s. */
static double bench(const level *lv, int dt, int threads, int32_t rows, int32_t in_dim, int32_t out_dim,
                    const uint8_t *wb, int copies, double seconds, double *gbs) {
  const int64_t wbytes = kf_row_bytes(dt, in_dim) * out_dim;
  float *x = malloc((int64_t)rows * in_dim * 4), *out = malloc((int64_t)rows * out_dim * 4);
  for (int64_t i = 0; i < (int64_t)rows * in_dim; i++) x[i] = frand();
  uint8_t *xp = NULL;
  long calls = 0;
  double t0 = now(), best = 1e9, t;
  do {
    kf_segment seg = {out, wb + (calls % copies) * wbytes, out_dim, 0};
    const double c0 = now();
    matmul(lv, threads, x, rows, in_dim, &seg, 1, dt, &xp);
    const double c = now() - c0;
    if (c < best) best = c;
    calls++;
  } while ((t = now() - t0) < seconds || calls < 3);
  free(xp), free(x), free(out);
  *gbs = wbytes / best / 1e9;
  return 2.0 * rows * in_dim * out_dim / best / 1e9;
}

static void bench_all(const level *lv, const char *only, const shape *one) {
  static const shape ALL[] = {{512, 576, 576}, {512, 576, 1536}, {512, 1536, 576}, {64, 576, 1536},
                                 {16, 576, 1536}, {8, 576, 1536},   {8, 1536, 576},   {2, 576, 1536},
                                 {1, 576, 1536},  {1, 1536, 576},   {1, 576, 49152},  {8, 576, 49152}};
  printf("bench %s: GFLOP/s (weight GB/s), fastest call, 1 thread | 2 threads; up to 16 rows read %s\n", lv->name,
         "distinct copies of the weights (>= 256 MB: from memory)");
  const shape *shapes = one ? one : ALL;
  const size_t nshapes = one ? 1 : sizeof ALL / sizeof ALL[0];
  for (int dt = 0; dt <= KF_Q4_0; dt++) {
    if (only && strcmp(only, DT_NAMES[dt])) continue;
    for (size_t s = 0; s < nshapes; s++) {
      const shape sh = shapes[s];
      const int64_t n = (int64_t)sh.in_dim * sh.out_dim, wbytes = kf_row_bytes(dt, sh.in_dim) * sh.out_dim;
      int copies = sh.rows <= 16 ? (int)((256 << 20) / wbytes + 1) : 1;
      if (getenv("COPIES")) copies = atoi(getenv("COPIES")); /* COPIES=1: weights from cache */
      float *w = malloc(n * 4);
      uint8_t *wb = malloc(wbytes * copies);
      for (int64_t i = 0; i < n; i++) w[i] = frand() * 0.5f;
      encode(wb, w, n, dt);
      for (int c = 1; c < copies; c++) memcpy(wb + c * wbytes, wb, wbytes);
      double g1, g2, b1, b2;
      g1 = bench(lv, dt, 1, sh.rows, sh.in_dim, sh.out_dim, wb, copies, 0.3, &b1);
      g2 = bench(lv, dt, 2, sh.rows, sh.in_dim, sh.out_dim, wb, copies, 0.3, &b2);
      printf("%-5s %3dx%4dx%5d: %6.1f (%5.1f GB/s) | %6.1f (%5.1f GB/s)\n", DT_NAMES[dt], sh.rows, sh.in_dim,
             sh.out_dim, g1, b1, g2, b2);
      fflush(stdout);
      free(w), free(wb);
    }
  }
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "check";
  if (strcmp(mode, "bench")) {
    check_all(argc > 2 && strcmp(argv[2], "-") ? argv[2] : NULL);
    printf(failures ? "%d FAILURES\n" : "all checks passed\n", failures);
  }
  if (strcmp(mode, "check"))
    for (int l = 0; l < 4; l++)
      if (supported(&LEVELS[l]) && (argc > 2 && strcmp(argv[2], "-") ? !strcmp(argv[2], LEVELS[l].name) : 1)) {
        shape one = {argc > 6 ? atoi(argv[4]) : 0, argc > 6 ? atoi(argv[5]) : 0, argc > 6 ? atoi(argv[6]) : 0};
        bench_all(&LEVELS[l], argc > 3 && strcmp(argv[3], "-") ? argv[3] : NULL, argc > 6 ? &one : NULL);
        break;
      }
  if (worker_started) {
    atomic_store(&job_seq, -1);
    pthread_join(worker, NULL);
  }
  return failures != 0;
}
