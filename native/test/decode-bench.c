/*
 * Batch-1 decode's matmuls on the 135M shape (SmolLM2-135M: 30 layers of q/k/v 576→576+192+192 as
 * one job of three segments, o 576→576, gate/up 576→1536+1536, down 1536→576, then the LM head
 * 576→49152), all weights in one buffer in the model's order, on two threads sharing one counter
 * (first = 0 and 1, as the engine's main thread and kernel worker), beside a read-bandwidth probe
 * (memchr over 1 GiB split over the same two threads, as src/tools/bench/roofline.ts) in the same
 * run. Two builds of native/src/matmul.c (KF_ISA old and avx512: native/test/decode-bench.sh builds
 * the old one from a git revision) run interleaved, round by round, so a noisy neighbour hits both.
 *
 *   [THREADS=1] [BEST=1] sh native/test/decode-bench.sh [bf16|q8_0|q4_0|f16|f32] [rounds] [steps a round]
 *
 * THREADS=1 runs one thread (each matmul one chunk a segment, the probe on one thread); BEST=1
 * takes each round's fastest step rather than its median (on a loaded machine). HUGE=1 (with BASE
 * left at HEAD, so both builds are the same code) compares page sizes instead: the new build reads
 * a copy of the weights advised MADV_HUGEPAGE (transparent huge pages, `madvise` mode here), the old
 * one the 4 KiB-page original, and the probe is timed on both kinds of page. Every buffer is
 * 2 MiB-aligned fresh anonymous memory (the weights, 269 MB in bf16, far past the 32 MB L3).
 *
 * Prints per round the probe's GB/s and each build's weight GB/s over the step (matmuls only), and
 * at the end the medians with their ranges and the per-kind GB/s (qkv, o, gate/up, down, LM head) of
 * the median step, new against old.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kvfence-kernels.h"

#define DECL(isa)                                                                                          \
  int64_t kf_##isa##_prepare_bytes(int32_t, int32_t, int);                                                 \
  void kf_##isa##_prepare(uint8_t *, const float *, int32_t, int32_t, int);                                \
  void kf_##isa##_matmul_par(const float *, const uint8_t *, int32_t, int32_t, const kf_segment *, int32_t, \
                             int32_t *, int32_t, int32_t, int, int);                                       \
  void kf_##isa##_matmul_chunks(int32_t, int32_t, int32_t, int, int, int32_t *, int32_t *);
DECL(old)
DECL(avx512)

typedef struct {
  const char *name;
  int64_t (*prepare_bytes)(int32_t, int32_t, int);
  void (*prepare)(uint8_t *, const float *, int32_t, int32_t, int);
  void (*matmul_par)(const float *, const uint8_t *, int32_t, int32_t, const kf_segment *, int32_t, int32_t *,
                     int32_t, int32_t, int, int);
  void (*matmul_chunks)(int32_t, int32_t, int32_t, int, int, int32_t *, int32_t *);
} build;
#define BUILD(isa) {#isa, kf_##isa##_prepare_bytes, kf_##isa##_prepare, kf_##isa##_matmul_par, kf_##isa##_matmul_chunks}
static const build BUILDS[2] = {BUILD(old), BUILD(avx512)};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- the worker: runs the published job with first = 1 (spins between jobs, as the engine's) -- */
typedef struct {
  const build *b;
  const float *x;
  const uint8_t *xp;
  int32_t in_dim, num_segs, cc, rc, dtype;
  kf_segment *segs;
  int32_t *counter;
  const uint8_t *probe; /* non-NULL: a probe job, memchr over probe_len bytes */
  size_t probe_len;
} job;
static job current;
static atomic_int job_seq, job_done;
static int32_t counter_mem[64] __attribute__((aligned(64)));
static volatile size_t sink;

static void run_job(const job *j, int first) {
  if (j->probe) {
    sink += (size_t)memchr(j->probe, 1, j->probe_len);
    return;
  }
  j->b->matmul_par(j->x, j->xp, 1, j->in_dim, j->segs, j->num_segs, j->counter, j->cc, j->rc, first, j->dtype);
}

static void *worker_main(void *arg) {
  (void)arg;
  int seen = 0;
  for (;;) {
    int s;
    while ((s = atomic_load(&job_seq)) == seen) __builtin_ia32_pause();
    if (s < 0) return NULL;
    seen = s;
    run_job(&current, 1);
    atomic_store(&job_done, s);
  }
}

static void run_both(const job *j, const job *mine) {
  current = *j;
  const int seq = atomic_load(&job_seq) + 1;
  atomic_store(&job_seq, seq);
  run_job(mine, 0);
  while (atomic_load(&job_done) != seq) __builtin_ia32_pause();
}

/* ---- the model's matmuls ------------------------------------------------------------------- */
enum { K_QKV, K_O, K_GATEUP, K_DOWN, K_HEAD, KINDS };
static const char *KIND_NAMES[KINDS] = {"qkv", "o", "gate/up", "down", "LM head"};
typedef struct {
  int kind, in_dim, num_segs;
  int32_t outs[3];
  const uint8_t *w; /* the first segment's weights; the others follow */
} mm;
#define LAYERS 30
#define NMM (LAYERS * 4 + 1)
static mm mms[NMM];
static float xbuf[1536], obuf[3][49152];
static uint8_t xpbuf[1 << 16];
static int threads = 2;
/* HUGE=1: the new build reads a copy of the weights on transparent huge pages (and a second probe
   buffer on them is timed too), the old one the 4 KiB-page original */
static ptrdiff_t wshift[2];

/* size bytes of fresh anonymous memory, 2 MiB-aligned; huge: advised MADV_HUGEPAGE before touching */
static uint8_t *alloc_pages(size_t size, int huge) {
  const size_t align = (size_t)2 << 20;
  uint8_t *p = mmap(NULL, size + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) abort();
  p = (uint8_t *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
  if (huge) madvise(p, size, MADV_HUGEPAGE);
  memset(p, 0, size);
  return p;
}

static long anon_huge_kb(void) {
  FILE *f = fopen("/proc/self/smaps_rollup", "r");
  char line[256];
  long kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "AnonHugePages: %ld", &kb) == 1) break;
  if (f) fclose(f);
  return kb;
}

static double run_mm(const build *b, const mm *m, int dtype) {
  const int64_t rb = kf_row_bytes(dtype, m->in_dim);
  kf_segment segs[3];
  int32_t total = 0, cc, rc, chunks = 0;
  for (int s = 0; s < m->num_segs; s++) total += m->outs[s];
  const double t0 = now();
  b->matmul_chunks(1, m->in_dim, total, dtype, threads, &cc, &rc);
  const uint8_t *w = m->w + wshift[b == &BUILDS[1]];
  for (int s = 0; s < m->num_segs; s++) {
    segs[s] = (kf_segment){obuf[s], w, m->outs[s], chunks};
    chunks += (m->outs[s] + cc - 1) / cc;
    w += rb * m->outs[s];
  }
  const int64_t xb = b->prepare_bytes(1, m->in_dim, dtype);
  if (xb > (int64_t)sizeof xpbuf) abort();
  if (xb > 0) b->prepare(xpbuf, xbuf, 1, m->in_dim, dtype);
  counter_mem[0] = counter_mem[16] = 0;
  job j = {b, xbuf, xb > 0 ? xpbuf : NULL, m->in_dim, m->num_segs, cc, rc, dtype, segs, counter_mem, NULL, 0};
  if (threads == 1) run_job(&j, 0);
  else run_both(&j, &j);
  return now() - t0;
}

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  double t[256];
  memcpy(t, v, n * sizeof *v);
  qsort(t, n, sizeof *t, cmp);
  return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}
static double vmin(const double *v, int n) {
  double m = v[0];
  for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
  return m;
}
static double vmax(const double *v, int n) {
  double m = v[0];
  for (int i = 1; i < n; i++) m = v[i] > m ? v[i] : m;
  return m;
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int main(int argc, char **argv) {
  const char *fmt = argc > 1 ? argv[1] : "bf16";
  const int rounds = argc > 2 ? atoi(argv[2]) : 9, steps = argc > 3 ? atoi(argv[3]) : 10;
  static const char *NAMES[] = {"f32", "f16", "bf16", "q8_0", "q4_0"};
  int dtype = -1;
  for (int i = 0; i < 5; i++)
    if (!strcmp(fmt, NAMES[i])) dtype = i;
  if (getenv("THREADS")) threads = atoi(getenv("THREADS")) == 1 ? 1 : 2;
  if (dtype < 0 || rounds < 1 || rounds > 256 || steps < 1) {
    fprintf(stderr, "usage: decode-bench [bf16|q8_0|q4_0|f16|f32] [rounds ≤ 256] [steps]\n");
    return 2;
  }
  /* the weights, in the model's order */
  int64_t total = 0;
  for (int l = 0; l < LAYERS; l++) {
    mms[4 * l + 0] = (mm){K_QKV, 576, 3, {576, 192, 192}, NULL};
    mms[4 * l + 1] = (mm){K_O, 576, 1, {576}, NULL};
    mms[4 * l + 2] = (mm){K_GATEUP, 576, 2, {1536, 1536}, NULL};
    mms[4 * l + 3] = (mm){K_DOWN, 1536, 1, {576}, NULL};
  }
  mms[NMM - 1] = (mm){K_HEAD, 576, 1, {49152}, NULL};
  int64_t bytes[NMM], kind_bytes[KINDS] = {0};
  for (int i = 0; i < NMM; i++) {
    bytes[i] = 0;
    for (int s = 0; s < mms[i].num_segs; s++) bytes[i] += kf_row_bytes(dtype, mms[i].in_dim) * mms[i].outs[s];
    kind_bytes[mms[i].kind] += bytes[i];
    total += bytes[i];
  }
  const int huge = getenv("HUGE") && atoi(getenv("HUGE"));
  uint8_t *wall = alloc_pages((size_t)(total + 4095) / 4096 * 4096, 0);
  /* random but valid contents: bf16/f16/f32 small values; quantised blocks with a small f16 scale */
  uint32_t rng = 1;
  for (int64_t i = 0; i < total; i += 2) {
    rng = rng * 1664525u + 1013904223u;
    uint16_t v = dtype == KF_BF16 ? to_bf16(((int32_t)(rng >> 8) & 0xffff) / 65536.0f - 0.5f) : (uint16_t)(rng >> 16);
    if (dtype == KF_F16) v = 0x2c00 | (v & 0x83ff);                           /* |v| < 0.125 */
    if (dtype == KF_F32) v = (i & 2) ? 0x3c00 | (v & 0x807f) : v;             /* high half: ±~0.0078 */
    memcpy(wall + i, &v, 2);
  }
  if (dtype == KF_Q8_0 || dtype == KF_Q4_0) {
    const int64_t bs = dtype == KF_Q8_0 ? 34 : 18;
    for (int64_t i = 0; i + bs <= total; i += bs) {
      const uint16_t d = 0x1c00; /* f16 2^-8 */
      memcpy(wall + i, &d, 2);
    }
  }
  int64_t off = 0;
  for (int i = 0; i < NMM; i++) mms[i].w = wall + off, off += bytes[i];
  for (int i = 0; i < 1536; i++) xbuf[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
  /* the probe's buffer */
  const size_t probe_bytes = (size_t)1 << 30;
  uint8_t *probe = alloc_pages(probe_bytes, 0), *probe2 = huge ? alloc_pages(probe_bytes, 1) : NULL;
  if (huge) {
    uint8_t *w2 = alloc_pages((size_t)(total + 4095) / 4096 * 4096, 1);
    memcpy(w2, wall, (size_t)total);
    wshift[1] = w2 - wall;
    printf("HUGE=1: old reads 4 KiB pages, new a THP copy; AnonHugePages %ld kB\n", anon_huge_kb());
  }
  pthread_t worker;
  pthread_create(&worker, NULL, worker_main, NULL);

  if (getenv("CACHED")) { /* the compute ceiling: one thread, one L2-sized matrix, the fastest call */
    const int32_t in = 576, outd = dtype == KF_F32 ? 384 : 768;
    mm m = {K_GATEUP, in, 1, {outd}, wall};
    double best[2] = {1e9, 1e9};
    threads = 1;
    for (int r = 0; r < rounds * 20; r++)
      for (int bi = 0; bi < 2; bi++)
        for (int i = 0; i < steps * 5; i++) {
          const double t = run_mm(&BUILDS[bi], &m, dtype);
          best[bi] = t < best[bi] ? t : best[bi];
        }
    const double b = (double)kf_row_bytes(dtype, in) * outd;
    printf("cached %s 1x%dx%d, one thread, fastest call: old %.1f GB/s, new %.1f GB/s\n", fmt, in, outd, b / best[0] / 1e9,
           b / best[1] / 1e9);
    return 0;
  }
  printf("decode-bench %s: weights %.1f MB a step, %d rounds of %d steps a build, probe 1 GiB on %d thread(s)%s\n", fmt,
         total / 1e6, rounds, steps, threads, getenv("BEST") ? "; the fastest step of each round" : "; median steps");
  double pr[256], pr2[256], gb[2][256], kt[2][256][KINDS];
  for (int bi = 0; bi < 2; bi++) /* warm-up: every page and code path once */
    for (int i = 0; i < NMM; i++) run_mm(&BUILDS[bi], &mms[i], dtype);
  for (int r = 0; r < rounds; r++) {
    /* probe: best of 3 (HUGE: then on the THP buffer) */
    for (int pb = 0; pb < 1 + huge; pb++) {
    uint8_t *probe_at = pb ? probe2 : probe;
    double best = 1e9;
    for (int i = 0; i < 3; i++) {
      const double t0 = now();
      job pj = {0}, mine = {0};
      pj.probe = probe_at + probe_bytes / 2, pj.probe_len = probe_bytes / 2;
      mine.probe = probe_at, mine.probe_len = probe_bytes / 2;
      if (threads == 1) mine.probe_len = probe_bytes, run_job(&mine, 0);
      else run_both(&pj, &mine);
      const double t = now() - t0;
      best = t < best ? t : best;
    }
    (pb ? pr2 : pr)[r] = probe_bytes / best / 1e9;
    }
    for (int bi0 = 0; bi0 < 2; bi0++) {
      const int bi = r % 2 ? 1 - bi0 : bi0; /* alternate which build goes first */
      double st[64], kst[64][KINDS];
      for (int s = 0; s < steps && s < 64; s++) {
        double kk[KINDS] = {0}, t = 0;
        for (int i = 0; i < NMM; i++) {
          const double d = run_mm(&BUILDS[bi], &mms[i], dtype);
          kk[mms[i].kind] += d, t += d;
        }
        st[s] = t;
        memcpy(kst[s], kk, sizeof kk);
      }
      const int n = steps < 64 ? steps : 64;
      const double m = getenv("BEST") ? vmin(st, n) : median(st, n);
      gb[bi][r] = total / m / 1e9;
      for (int k = 0; k < KINDS; k++) {
        double v[64];
        for (int s = 0; s < n; s++) v[s] = kst[s][k];
        kt[bi][r][k] = getenv("BEST") ? vmin(v, n) : median(v, n);
      }
    }
    printf("round %2d: probe %5.1f GB/s | old %5.1f GB/s (%4.1f%%) | new %5.1f GB/s (%4.1f%%)\n", r, pr[r], gb[0][r],
           100 * gb[0][r] / pr[r], gb[1][r], 100 * gb[1][r] / pr[r]);
    if (huge) printf("          probe on THP %5.1f GB/s: new %4.1f%% of it\n", pr2[r], 100 * gb[1][r] / pr2[r]);
    fflush(stdout);
  }
  double ratio[2][256];
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < rounds; r++) ratio[b][r] = gb[b][r] / pr[r];
  printf("median: probe %.1f GB/s (%.1f–%.1f)\n", median(pr, rounds), vmin(pr, rounds), vmax(pr, rounds));
  for (int b = 0; b < 2; b++)
    printf("  %-3s %5.1f GB/s (%.1f–%.1f), of the probe %.1f%% (%.1f–%.1f%%)\n", b ? "new" : "old",
           median(gb[b], rounds), vmin(gb[b], rounds), vmax(gb[b], rounds), 100 * median(ratio[b], rounds),
           100 * vmin(ratio[b], rounds), 100 * vmax(ratio[b], rounds));
  double paired[256];
  for (int r = 0; r < rounds; r++) paired[r] = gb[1][r] / gb[0][r];
  printf("  new / old, paired by round: median %.3f (%.3f–%.3f)\n", median(paired, rounds), vmin(paired, rounds),
         vmax(paired, rounds));
  printf("per kind, GB/s (median over rounds), old → new:");
  for (int k = 0; k < KINDS; k++) {
    double v[2][256];
    for (int b = 0; b < 2; b++)
      for (int r = 0; r < rounds; r++) v[b][r] = kind_bytes[k] / kt[b][r][k] / 1e9;
    printf("  %s %.1f → %.1f", KIND_NAMES[k], median(v[0], rounds), median(v[1], rounds));
  }
  printf("\n");
  atomic_store(&job_seq, -1);
  pthread_join(worker, NULL);
  return 0;
}
