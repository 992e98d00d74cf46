/*
 * The Node-API glue of the native kernels (issue #33, docs/kernels.md): what src/kernels/native-
 * backend.ts calls. Plain C against node_api.h alone (NAPI_VERSION 8), so one binary loads on Node
 * 20, 22 and 24 and in worker threads; no mutable process-global state (the dispatch tables below
 * are read-only; everything else hangs off a handle).
 *
 * ## Memory and the handle
 * `bind(view, byteLength, regionStart, regionEnd[, level])` takes a small Uint8Array at offset 0 of
 * the engines' SharedArrayBuffer, the memory's length and the engine's region [start, end), and
 * returns a handle (an external, type-tagged) holding the base address, those bounds and the
 * kernel table of one ISA level (the CPU's best, or a lower one asked for). Every kernel takes the
 * handle first, then byte offsets into the memory as JS numbers (int64: the memory may pass 4 GiB).
 *
 * ## The checks
 * The WebAssembly sandbox kept a wasm kernel inside its memory for free; native code must check.
 * Before computing, every function checks each offset and length it is handed: reads inside the
 * memory [0, byteLength), writes (and the KV pool attention reads) inside the region, counts
 * non-negative int32, pointers aligned for their type. matmulPar's segment records and
 * attentionPar's sequence records (Float64Array: out, w, outDim, firstChunk; rowStart, rows,
 * startPos, table address, firstItem) are read, checked (every output range in the region, every
 * weight in the memory, every block-table page index below the pool's pages, items and positions
 * consistent) and copied to kf_segment / kf_attn_seq in a per-handle buffer: the kernels never read
 * a record the glue did not check. A violation throws a RangeError naming the function, the
 * argument and the ranges, and nothing is computed.
 *
 * ## Dispatch
 * Each kernel file is compiled per ISA level (scripts/build-native.mjs); `isa()` names the best
 * level this CPU runs (__builtin_cpu_supports: avx512 = avx512f+bw+vl+dq+vnni, avxvnni,
 * avx2 = avx2+fma+f16c, else generic).
 */
#include <node_api.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#define KF_MMAP 1
#endif

#include "kvfence-kernels.h"

/* ---------------------------------------------------------------------------------------------- */
/* dispatch tables */

#define KF_DECLARE(L)                                                                                             \
  int64_t kf_##L##_prepare_bytes(int32_t, int32_t, int);                                                          \
  void kf_##L##_prepare(uint8_t *, const float *, int32_t, int32_t, int);                                         \
  void kf_##L##_matmul_par(const float *, const uint8_t *, int32_t, int32_t, const kf_segment *, int32_t,        \
                           int32_t *, int32_t, int32_t, int, int);                                                \
  void kf_##L##_matmul_chunks(int32_t, int32_t, int32_t, int, int, int32_t *, int32_t *);                         \
  void kf_##L##_attention_par(const kf_attention_job *, int);                                                     \
  void kf_##L##_attention_merge(float *, const float *, const float *, int32_t, int32_t, int32_t, int32_t,        \
                                int32_t);                                                                         \
  void kf_##L##_add(float *, const float *, const float *, int32_t);                                              \
  void kf_##L##_add_bias(float *, const float *, int32_t, int32_t);                                               \
  void kf_##L##_rmsnorm(float *, const float *, const float *, int32_t, double, int32_t);                         \
  void kf_##L##_rope(float *, const int32_t *, const double *, const double *, int32_t, int32_t, int32_t);        \
  void kf_##L##_swiglu(float *, const float *, const float *, int32_t);                                           \
  void kf_##L##_swiglu_par(float *, const float *, const float *, int32_t, int32_t *, int32_t);                   \
  void kf_##L##_kv_store(uint8_t *, const float *, int32_t, int);

typedef struct {
  const char *name;
  kf_matmul_table matmul;
  kf_attention_table attention;
  kf_ops_table ops;
} kf_level;

#define KF_LEVEL(L)                                                                                              \
  {                                                                                                              \
    #L, {kf_##L##_prepare_bytes, kf_##L##_prepare, kf_##L##_matmul_par, kf_##L##_matmul_chunks},                 \
        {kf_##L##_attention_par, kf_##L##_attention_merge}, {                                                    \
      kf_##L##_add, kf_##L##_add_bias, kf_##L##_rmsnorm, kf_##L##_rope, kf_##L##_swiglu, kf_##L##_swiglu_par,    \
          kf_##L##_kv_store                                                                                      \
    }                                                                                                            \
  }

KF_DECLARE(generic)
#ifdef KF_X86
KF_DECLARE(avx2)
KF_DECLARE(avxvnni)
KF_DECLARE(avx512)
/* Best first. */
static const kf_level KF_LEVELS[] = {KF_LEVEL(avx512), KF_LEVEL(avxvnni), KF_LEVEL(avx2), KF_LEVEL(generic)};
#else
static const kf_level KF_LEVELS[] = {KF_LEVEL(generic)};
#endif
#define KF_NUM_LEVELS ((int)(sizeof(KF_LEVELS) / sizeof(KF_LEVELS[0])))

/* Whether this CPU runs level i of KF_LEVELS. */
static bool kf_cpu_runs(int i) {
#ifdef KF_X86
  const char *n = KF_LEVELS[i].name;
  if (strcmp(n, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  if (strcmp(n, "avxvnni") == 0) {
    return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (strcmp(n, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
#endif
  return true;
}

static int kf_best_level(void) {
  for (int i = 0; i < KF_NUM_LEVELS; i++)
    if (kf_cpu_runs(i)) return i;
  return KF_NUM_LEVELS - 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* the handle */

typedef struct {
  uint8_t *base;
  int64_t len;
  int64_t region_start, region_end;
  const kf_level *level;
  napi_ref view; /* keeps the memory alive as long as the handle */
  kf_segment *segs;
  int32_t segs_cap;
  kf_attn_seq *seqs;
  int32_t seqs_cap;
} kf_handle;

static const napi_type_tag KF_TAG = {0x6b7666656e636531ULL, 0x6e61746976656b31ULL};

static void kf_handle_free(napi_env env, void *data, void *hint) {
  kf_handle *h = data;
  napi_delete_reference(env, h->view);
  free(h->segs);
  free(h->seqs);
  free(h);
}

/* One call's arguments: the handle and up to 24 numbers. */
typedef struct {
  napi_env env;
  const char *fn;
  kf_handle *h;
  double v[24];
  size_t n;
} kf_call;

static bool kf_throw(kf_call *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool kf_throw(kf_call *c, const char *fmt, ...) {
  char msg[512];
  int at = snprintf(msg, sizeof msg, "Native %s: ", c->fn);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + at, sizeof msg - (size_t)at, fmt, ap);
  va_end(ap);
  napi_throw_range_error(c->env, "ERR_KVFENCE_NATIVE_RANGE", msg);
  return false;
}

/* Reads the handle and `n` number arguments; false (with an exception pending) when they are not that. */
static bool kf_args(napi_env env, napi_callback_info info, const char *fn, size_t n, kf_call *c) {
  napi_value argv[25];
  size_t argc = 25;
  c->env = env;
  c->fn = fn;
  c->n = n;
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok) return false;
  if (argc != n + 1) return kf_throw(c, "takes a handle and %zu numbers, got %zu arguments", n, argc);
  bool tagged = false;
  if (napi_check_object_type_tag(env, argv[0], &KF_TAG, &tagged) != napi_ok || !tagged) {
    napi_value pending;
    bool is_pending = false;
    if (napi_is_exception_pending(env, &is_pending) == napi_ok && is_pending)
      napi_get_and_clear_last_exception(env, &pending);
    return kf_throw(c, "the first argument is not a handle from bind()");
  }
  if (napi_get_value_external(env, argv[0], (void **)&c->h) != napi_ok) return false;
  for (size_t i = 0; i < n; i++) {
    if (napi_get_value_double(env, argv[i + 1], &c->v[i]) != napi_ok)
      return kf_throw(c, "argument %zu is not a number", i + 1);
  }
  return true;
}

/* Argument i as an integer in [lo, hi], else a RangeError naming it. */
static bool kf_int(kf_call *c, size_t i, const char *name, int64_t lo, int64_t hi, int64_t *out) {
  const double v = c->v[i];
  if (!(v >= (double)lo && v <= (double)hi) || v != (double)(int64_t)v) {
    return kf_throw(c, "%s must be an integer in [%lld, %lld]: %.17g", name, (long long)lo, (long long)hi, v);
  }
  *out = (int64_t)v;
  return true;
}

#define KF_I32 2147483647LL
#define KF_MAX_OFFSET 9007199254740991LL

/* a·b, or INT64_MAX when it overflows (a range that size never fits). */
static int64_t kf_mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

/* Whether [off, off + bytes) lies inside [lo, hi) with `off` a multiple of `align` (kf_range's test). */
static bool kf_fits(const kf_handle *h, int64_t off, int64_t bytes, int64_t align, bool write_region) {
  const int64_t lo = write_region ? h->region_start : 0, hi = write_region ? h->region_end : h->len;
  return off >= lo && bytes >= 0 && bytes <= hi - off && off % align == 0;
}

/* kf_fits, else a RangeError. */
static bool kf_range(kf_call *c, const char *what, int64_t off, int64_t bytes, int64_t align, bool write_region) {
  if (kf_fits(c->h, off, bytes, align, write_region)) return true;
  const int64_t lo = write_region ? c->h->region_start : 0;
  const int64_t hi = write_region ? c->h->region_end : c->h->len;
  if (off < lo || bytes < 0 || bytes > hi - off) {
    return kf_throw(c, "%s [%lld, %lld + %lld) is outside the %s [%lld, %lld)", what, (long long)off, (long long)off,
                    (long long)bytes, write_region ? "engine's region" : "memory", (long long)lo, (long long)hi);
  }
  if (off % align != 0) return kf_throw(c, "%s at %lld is not %lld-byte aligned", what, (long long)off, (long long)align);
  return true;
}

#define ARG(i, name, lo, hi, var) \
  int64_t var = 0;                \
  if (!kf_int(&c, i, name, lo, hi, &var)) return NULL;
#define READS(what, off, bytes, align) \
  if (!kf_range(&c, what, off, bytes, align, false)) return NULL;
#define WRITES(what, off, bytes, align) \
  if (!kf_range(&c, what, off, bytes, align, true)) return NULL;
#define CALL(fn, n)    \
  kf_call c;           \
  if (!kf_args(env, info, fn, n, &c)) return NULL; \
  uint8_t *const B = c.h->base;                    \
  (void)B;

static napi_value kf_number(napi_env env, double v) {
  napi_value r;
  napi_create_double(env, v, &r);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* bind, isa */

static napi_value kf_bind(napi_env env, napi_callback_info info) {
  napi_value argv[5];
  size_t argc = 5;
  kf_call c = {.env = env, .fn = "bind"};
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok) return NULL;
  if (argc < 4) return (kf_throw(&c, "takes (view, byteLength, regionStart, regionEnd[, level])"), NULL);
  napi_typedarray_type type;
  size_t length, offset;
  void *data;
  napi_value ab;
  bool is_ta = false;
  napi_is_typedarray(env, argv[0], &is_ta);
  if (!is_ta || napi_get_typedarray_info(env, argv[0], &type, &length, &data, &ab, &offset) != napi_ok ||
      type != napi_uint8_array || offset != 0 || data == NULL) {
    return (kf_throw(&c, "view must be a Uint8Array at offset 0 of the memory"), NULL);
  }
  for (int i = 0; i < 3; i++) {
    if (napi_get_value_double(env, argv[i + 1], &c.v[i]) != napi_ok) return (kf_throw(&c, "bounds must be numbers"), NULL);
  }
  int64_t len = 0, rs = 0, re = 0;
  if (!kf_int(&c, 0, "byteLength", 1, KF_MAX_OFFSET, &len) || !kf_int(&c, 1, "regionStart", 0, len, &rs) ||
      !kf_int(&c, 2, "regionEnd", rs, len, &re)) {
    return NULL;
  }
  int level = kf_best_level();
  if (argc >= 5) {
    char name[32] = {0};
    size_t got;
    if (napi_get_value_string_utf8(env, argv[4], name, sizeof name, &got) != napi_ok)
      return (kf_throw(&c, "level must be a string"), NULL);
    int want = -1;
    for (int i = 0; i < KF_NUM_LEVELS; i++)
      if (strcmp(KF_LEVELS[i].name, name) == 0) want = i;
    if (want < 0 || !kf_cpu_runs(want)) {
      return (kf_throw(&c, "level is not one this build and CPU run: %s", name), NULL);
    }
    level = want;
  }
  kf_handle *h = calloc(1, sizeof *h);
  if (h == NULL) return (kf_throw(&c, "out of memory"), NULL);
  h->base = data;
  h->len = len;
  h->region_start = rs;
  h->region_end = re;
  h->level = &KF_LEVELS[level];
  napi_value ext;
  if (napi_create_reference(env, argv[0], 1, &h->view) != napi_ok ||
      napi_create_external(env, h, kf_handle_free, NULL, &ext) != napi_ok ||
      napi_type_tag_object(env, ext, &KF_TAG) != napi_ok) {
    return NULL;
  }
  return ext;
}

/* isa(): the best level this CPU runs; isa(handle): the handle's level. */
static napi_value kf_isa(napi_env env, napi_callback_info info) {
  napi_value argv[1], r;
  size_t argc = 1;
  napi_get_cb_info(env, info, &argc, argv, NULL, NULL);
  const char *name = KF_LEVELS[kf_best_level()].name;
  if (argc == 1) {
    kf_call c;
    if (!kf_args(env, info, "isa", 0, &c)) return NULL;
    name = c.h->level->name;
  }
  napi_create_string_utf8(env, name, NAPI_AUTO_LENGTH, &r);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* mapping a weight file into the memory */

static int64_t kf_page_bytes(void) {
#ifdef KF_MMAP
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? page : 4096;
#else
  return 4096;
#endif
}

/* pageOffset(view): where the memory's first byte (view: a Uint8Array at offset 0) sits in its
 * page, so the caller can place a file's window on a page boundary (mapFile). */
static napi_value kf_page_offset(napi_env env, napi_callback_info info) {
  napi_value argv[1], r;
  size_t argc = 1;
  kf_call c = {.env = env, .fn = "pageOffset"};
  napi_typedarray_type type;
  size_t length, offset;
  void *data = NULL;
  napi_value ab;
  bool is_ta = false;
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok) return NULL;
  if (argc >= 1) napi_is_typedarray(env, argv[0], &is_ta);
  if (!is_ta || napi_get_typedarray_info(env, argv[0], &type, &length, &data, &ab, &offset) != napi_ok ||
      type != napi_uint8_array || offset != 0 || data == NULL) {
    return (kf_throw(&c, "view must be a Uint8Array at offset 0 of the memory"), NULL);
  }
  napi_create_double(env, (double)((uintptr_t)data % (uintptr_t)kf_page_bytes()), &r);
  return r;
}

/* mapFile(view, byteLength, byteOffset, fd, fileBytes): maps the first fileBytes bytes of the open
 * file fd copy-on-write over [byteOffset, byteOffset + fileBytes) of the memory (view: a Uint8Array
 * at offset 0 of it; byteLength: the memory's size), in place of its fresh anonymous pages: the
 * weights are the page cache's pages until written, faulted in as first read, with no copy (what
 * reading them cost: a fault per 4 KiB page of the destination, then a slow first touch of each on
 * this VM). The last page's bytes past the end of the file are zeros. Returns false, with the range
 * as it was (fresh zeros), where the address is not page-aligned, the pages would pass the memory's
 * end, or the system refuses; the caller then reads the file. Throws on bad arguments. */
static napi_value kf_map_file(napi_env env, napi_callback_info info) {
  napi_value argv[5], r;
  size_t argc = 5;
  kf_call c = {.env = env, .fn = "mapFile"};
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok) return NULL;
  if (argc < 5) return (kf_throw(&c, "takes (view, byteLength, byteOffset, fd, fileBytes)"), NULL);
  napi_typedarray_type type;
  size_t length, offset;
  void *data = NULL;
  napi_value ab;
  bool is_ta = false;
  napi_is_typedarray(env, argv[0], &is_ta);
  if (!is_ta || napi_get_typedarray_info(env, argv[0], &type, &length, &data, &ab, &offset) != napi_ok ||
      type != napi_uint8_array || offset != 0 || data == NULL) {
    return (kf_throw(&c, "view must be a Uint8Array at offset 0 of the memory"), NULL);
  }
  for (int i = 0; i < 4; i++) {
    if (napi_get_value_double(env, argv[i + 1], &c.v[i]) != napi_ok) return (kf_throw(&c, "arguments must be numbers"), NULL);
  }
  int64_t len = 0, at = 0, fd = 0, n = 0;
  if (!kf_int(&c, 0, "byteLength", 1, KF_MAX_OFFSET, &len) || !kf_int(&c, 1, "byteOffset", 0, len, &at) ||
      !kf_int(&c, 2, "fd", 0, KF_I32, &fd) || !kf_int(&c, 3, "fileBytes", 0, len - at, &n)) {
    return NULL;
  }
  bool mapped = false;
#ifdef KF_MMAP
  const int64_t page = kf_page_bytes();
  const uintptr_t addr = (uintptr_t)data + (uintptr_t)at;
  const int64_t span = (n + page - 1) / page * page;
  if (n > 0 && addr % (uintptr_t)page == 0 && at + span <= len) {
    void *p = mmap((void *)addr, (size_t)span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, (int)fd, 0);
    mapped = p == (void *)addr;
    if (!mapped) {
      /* A failed MAP_FIXED may have unmapped the range: put fresh zero pages back (or stop). */
      void *z = mmap((void *)addr, (size_t)span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (z != (void *)addr) abort();
    }
  }
#endif
  napi_get_boolean(env, mapped, &r);
  return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* element-wise kernels */

static napi_value kf_add(napi_env env, napi_callback_info info) {
  CALL("add", 4);
  ARG(3, "n", 0, KF_I32, n);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "a", 0, KF_MAX_OFFSET, a);
  ARG(2, "b", 0, KF_MAX_OFFSET, b);
  WRITES("out", out, n * 4, 4);
  READS("a", a, n * 4, 4);
  READS("b", b, n * 4, 4);
  c.h->level->ops.add((float *)(B + out), (const float *)(B + a), (const float *)(B + b), (int32_t)n);
  return NULL;
}

static napi_value kf_add_bias(napi_env env, napi_callback_info info) {
  CALL("addBias", 4);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "bias", 0, KF_MAX_OFFSET, bias);
  ARG(2, "rows", 0, KF_I32, rows);
  ARG(3, "n", 0, KF_I32, n);
  WRITES("out", out, kf_mul(rows * 4, n), 4);
  READS("bias", bias, n * 4, 4);
  c.h->level->ops.add_bias((float *)(B + out), (const float *)(B + bias), (int32_t)rows, (int32_t)n);
  return NULL;
}

static napi_value kf_rmsnorm(napi_env env, napi_callback_info info) {
  CALL("rmsnorm", 6);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "x", 0, KF_MAX_OFFSET, x);
  ARG(2, "weight", 0, KF_MAX_OFFSET, w);
  ARG(3, "n", 1, KF_I32, n);
  ARG(5, "rows", 0, KF_I32, rows);
  WRITES("out", out, kf_mul(rows * 4, n), 4);
  READS("x", x, kf_mul(rows * 4, n), 4);
  READS("weight", w, n * 4, 4);
  c.h->level->ops.rmsnorm((float *)(B + out), (const float *)(B + x), (const float *)(B + w), (int32_t)n, c.v[4],
                          (int32_t)rows);
  return NULL;
}

static napi_value kf_rope(napi_env env, napi_callback_info info) {
  CALL("rope", 8);
  ARG(0, "x", 0, KF_MAX_OFFSET, x);
  ARG(1, "positions", 0, KF_MAX_OFFSET, pos);
  ARG(2, "cos", 0, KF_MAX_OFFSET, cs);
  ARG(3, "sin", 0, KF_MAX_OFFSET, sn);
  ARG(4, "rows", 0, KF_I32, rows);
  ARG(5, "numHeads", 0, KF_I32, heads);
  ARG(6, "headDim", 0, KF_I32, hd);
  ARG(7, "tableBytes", 0, KF_MAX_OFFSET, table);
  if (hd % 2 != 0) return (kf_throw(&c, "headDim must be even: %lld", (long long)hd), NULL);
  WRITES("x", x, kf_mul(kf_mul(rows * 4, heads), hd), 4);
  READS("positions", pos, rows * 4, 4);
  READS("cos", cs, table, 8);
  READS("sin", sn, table, 8);
  const int32_t *p = (const int32_t *)(B + pos);
  for (int64_t r = 0; r < rows; r++) {
    if (p[r] < 0 || ((int64_t)p[r] + 1) * (hd / 2) * 8 > table) {
      return (kf_throw(&c, "positions[%lld] is outside the tables (%lld bytes): %d", (long long)r, (long long)table,
                       p[r]),
              NULL);
    }
  }
  c.h->level->ops.rope((float *)(B + x), p, (const double *)(B + cs), (const double *)(B + sn), (int32_t)rows,
                       (int32_t)heads, (int32_t)hd);
  return NULL;
}

static napi_value kf_swiglu(napi_env env, napi_callback_info info) {
  CALL("swiglu", 4);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "gate", 0, KF_MAX_OFFSET, gate);
  ARG(2, "up", 0, KF_MAX_OFFSET, up);
  ARG(3, "n", 0, KF_I32, n);
  WRITES("out", out, n * 4, 4);
  READS("gate", gate, n * 4, 4);
  READS("up", up, n * 4, 4);
  c.h->level->ops.swiglu((float *)(B + out), (const float *)(B + gate), (const float *)(B + up), (int32_t)n);
  return NULL;
}

static napi_value kf_swiglu_par(napi_env env, napi_callback_info info) {
  CALL("swigluPar", 6);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "gate", 0, KF_MAX_OFFSET, gate);
  ARG(2, "up", 0, KF_MAX_OFFSET, up);
  ARG(3, "n", 0, KF_I32, n);
  ARG(4, "counter", 0, KF_MAX_OFFSET, counter);
  ARG(5, "chunk", 1, KF_I32, chunk);
  WRITES("out", out, n * 4, 4);
  READS("gate", gate, n * 4, 4);
  READS("up", up, n * 4, 4);
  WRITES("counter", counter, 4, 4);
  c.h->level->ops.swiglu_par((float *)(B + out), (const float *)(B + gate), (const float *)(B + up), (int32_t)n,
                             (int32_t *)(B + counter), (int32_t)chunk);
  return NULL;
}

static napi_value kf_kv_store(napi_env env, napi_callback_info info) {
  CALL("kvStore", 4);
  ARG(0, "dst", 0, KF_MAX_OFFSET, dst);
  ARG(1, "src", 0, KF_MAX_OFFSET, src);
  ARG(2, "n", 0, KF_I32, n);
  ARG(3, "kvDtype", 0, 2, dt);
  const int64_t el = dt == KF_KV_F32 ? 4 : 2;
  WRITES("dst", dst, n * el, el);
  READS("src", src, n * 4, 4);
  c.h->level->ops.kv_store(B + dst, (const float *)(B + src), (int32_t)n, (int)dt);
  return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* matmul */

#define KF_MAX_DTYPE KF_Q6_K /* the k-quants: kquants.c */

/* Checks rows, inDim and dtype (arguments ri, ii, di); the row bytes of a weight. */
static bool kf_shape(kf_call *c, size_t ri, size_t ii, size_t di, int64_t *rows, int64_t *in_dim, int64_t *dtype) {
  if (!kf_int(c, ri, "rows", 1, KF_I32, rows) || !kf_int(c, ii, "inDim", 1, KF_I32, in_dim) ||
      !kf_int(c, di, "dtype", 0, KF_MAX_DTYPE, dtype)) {
    return false;
  }
  if (*in_dim % kf_block((int)*dtype) != 0) {
    return kf_throw(c, "inDim must be a multiple of %d for dtype %lld: %lld", kf_block((int)*dtype), (long long)*dtype,
                    (long long)*in_dim);
  }
  return true;
}

static napi_value kf_prepare_bytes(napi_env env, napi_callback_info info) {
  CALL("prepareBytes", 3);
  int64_t rows = 0, in_dim = 0, dtype = 0;
  if (!kf_shape(&c, 0, 1, 2, &rows, &in_dim, &dtype)) return NULL;
  return kf_number(env, (double)c.h->level->matmul.prepare_bytes((int32_t)rows, (int32_t)in_dim, (int)dtype));
}

static napi_value kf_prepare(napi_env env, napi_callback_info info) {
  CALL("prepare", 5);
  ARG(0, "xp", 0, KF_MAX_OFFSET, xp);
  ARG(1, "x", 0, KF_MAX_OFFSET, x);
  int64_t rows = 0, in_dim = 0, dtype = 0;
  if (!kf_shape(&c, 2, 3, 4, &rows, &in_dim, &dtype)) return NULL;
  const kf_matmul_table *t = &c.h->level->matmul;
  const int64_t bytes = t->prepare_bytes((int32_t)rows, (int32_t)in_dim, (int)dtype);
  if (bytes == 0) return NULL;
  WRITES("xp", xp, bytes, 64);
  READS("x", x, kf_mul(rows * 4, in_dim), 4);
  t->prepare(B + xp, (const float *)(B + x), (int32_t)rows, (int32_t)in_dim, (int)dtype);
  return NULL;
}

/* matmulChunks(h, rows, inDim, totalOut, dtype, threads): colChunk · 2^24 + rowChunk. */
static napi_value kf_matmul_chunks(napi_env env, napi_callback_info info) {
  CALL("matmulChunks", 5);
  int64_t rows = 0, in_dim = 0, dtype = 0;
  if (!kf_shape(&c, 0, 1, 3, &rows, &in_dim, &dtype)) return NULL;
  ARG(2, "totalOut", 1, KF_I32, total);
  ARG(4, "threads", 1, 2, threads);
  int32_t col = 0, row = 0;
  c.h->level->matmul.matmul_chunks((int32_t)rows, (int32_t)in_dim, (int32_t)total, (int)dtype, (int)threads, &col, &row);
  if (col < 1 || row < 1 || col >= (1 << 24) || row >= (1 << 24)) {
    return (kf_throw(&c, "the kernel chose chunks out of range: %d columns × %d rows", col, row), NULL);
  }
  return kf_number(env, (double)col * 16777216.0 + row);
}

/* Grows a per-handle record buffer to n entries. */
static bool kf_reserve(kf_call *c, void **buf, int32_t *cap, int64_t n, size_t size) {
  if (n <= *cap) return true;
  void *p = realloc(*buf, (size_t)n * size);
  if (p == NULL) return kf_throw(c, "out of memory for %lld records", (long long)n);
  *buf = p;
  *cap = (int32_t)n;
  return true;
}

static napi_value kf_matmul_par(napi_env env, napi_callback_info info) {
  CALL("matmulPar", 11);
  ARG(0, "x", 0, KF_MAX_OFFSET, x);
  ARG(1, "xp", 0, KF_MAX_OFFSET, xp);
  int64_t rows = 0, in_dim = 0, dtype = 0;
  if (!kf_shape(&c, 2, 3, 10, &rows, &in_dim, &dtype)) return NULL;
  ARG(4, "segs", 0, KF_MAX_OFFSET, segs);
  ARG(5, "numSegs", 1, 1 << 20, num_segs);
  ARG(6, "counter", 0, KF_MAX_OFFSET, counter);
  ARG(7, "colChunk", 1, KF_I32, col_chunk);
  ARG(8, "rowChunk", 1, KF_I32, row_chunk);
  ARG(9, "first", 0, 1, first);
  const kf_matmul_table *t = &c.h->level->matmul;
  READS("x", x, kf_mul(rows * 4, in_dim), 4);
  const int64_t xp_bytes = t->prepare_bytes((int32_t)rows, (int32_t)in_dim, (int)dtype);
  if (xp_bytes > 0) WRITES("xp", xp, xp_bytes, 64);
  WRITES("counter", counter, 68, 4);
  READS("segs", segs, num_segs * 32, 8);
  if (!kf_reserve(&c, (void **)&c.h->segs, &c.h->segs_cap, num_segs, sizeof(kf_segment))) return NULL;
  const double *rec = (const double *)(B + segs);
  const int64_t row_bytes = kf_row_bytes((int)dtype, in_dim);
  int64_t chunks = 0;
  for (int64_t i = 0; i < num_segs; i++) {
    const double *r = rec + 4 * i;
    for (int k = 0; k < 4; k++) c.v[k] = r[k];
    ARG(0, "segment out", 0, KF_MAX_OFFSET, out);
    ARG(1, "segment w", 0, KF_MAX_OFFSET, w);
    ARG(2, "segment outDim", 1, KF_I32, out_dim);
    ARG(3, "segment firstChunk", 0, KF_I32, first_chunk);
    if (first_chunk != chunks) {
      return (kf_throw(&c, "segment %lld's firstChunk must be %lld: %lld", (long long)i, (long long)chunks,
                       (long long)first_chunk),
              NULL);
    }
    chunks += (out_dim + col_chunk - 1) / col_chunk;
    if (chunks > KF_I32) return (kf_throw(&c, "too many chunks: %lld", (long long)chunks), NULL);
    const int64_t out_bytes = kf_mul(rows * 4, out_dim), w_bytes = kf_mul(out_dim, row_bytes);
    if (!kf_fits(c.h, out, out_bytes, 4, true) || !kf_fits(c.h, w, w_bytes, 1, false)) {
      char what[48]; /* named only on failure: two snprintf a segment cost ~90 ns a call */
      snprintf(what, sizeof what, "segment %lld out", (long long)i);
      WRITES(what, out, out_bytes, 4);
      snprintf(what, sizeof what, "segment %lld weight", (long long)i);
      READS(what, w, w_bytes, 1);
    }
    c.h->segs[i] = (kf_segment){(float *)(B + out), B + w, (int32_t)out_dim, (int32_t)first_chunk};
  }
  if (kf_mul((rows + row_chunk - 1) / row_chunk, chunks) > KF_I32) {
    return (kf_throw(&c, "too many work items: %lld row blocks × %lld chunks", (long long)((rows + row_chunk - 1) / row_chunk),
                     (long long)chunks),
            NULL);
  }
  t->matmul_par((const float *)(B + x), xp_bytes > 0 ? B + xp : NULL, (int32_t)rows, (int32_t)in_dim, c.h->segs,
                (int32_t)num_segs, (int32_t *)(B + counter), (int32_t)col_chunk, (int32_t)row_chunk, (int)first,
                (int)dtype);
  return NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* attention */

static napi_value kf_attention_par(napi_env env, napi_callback_info info) {
  CALL("attentionPar", 21);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "q", 0, KF_MAX_OFFSET, q);
  ARG(2, "pool", 0, KF_MAX_OFFSET, pool);
  ARG(3, "seqs", 0, KF_MAX_OFFSET, seqs);
  ARG(4, "numSeqs", 1, 1 << 20, num_seqs);
  ARG(5, "scratch", 0, KF_MAX_OFFSET, scratch);
  ARG(7, "numLayers", 1, 1 << 16, num_layers);
  ARG(6, "layer", 0, num_layers - 1, layer);
  ARG(8, "numHeads", 1, 1 << 16, num_heads);
  ARG(9, "numKvHeads", 1, num_heads, num_kv_heads);
  ARG(10, "headDim", 1, 1 << 16, hd);
  ARG(11, "pageSize", 1, 1 << 20, page_size);
  ARG(12, "counter", 0, KF_MAX_OFFSET, counter);
  ARG(13, "splits", 1, 1 << 10, splits);
  ARG(14, "partial", 0, KF_MAX_OFFSET, partial);
  ARG(15, "ml", 0, KF_MAX_OFFSET, ml);
  ARG(16, "kvParts", 1, num_kv_heads, kv_parts);
  ARG(17, "kvDtype", 0, 2, kv_dtype);
  ARG(18, "poolBytes", 0, KF_MAX_OFFSET, pool_bytes);
  ARG(19, "scratchBytes", 0, KF_MAX_OFFSET, scratch_bytes);
  ARG(20, "first", 0, 1, first);
  if (num_heads % num_kv_heads != 0 || num_kv_heads % kv_parts != 0) {
    return (kf_throw(&c, "numKvHeads must divide numHeads and kvParts numKvHeads: %lld, %lld, %lld", (long long)num_heads,
                     (long long)num_kv_heads, (long long)kv_parts),
            NULL);
  }
  if (splits > 1 && num_seqs != 1) return (kf_throw(&c, "splits > 1 takes one sequence: %lld", (long long)num_seqs), NULL);
  const int64_t el = kv_dtype == KF_KV_F32 ? 4 : 2;
  const int64_t page_bytes = kf_mul(kf_mul(num_layers * 2 * page_size, num_kv_heads * hd), el);
  WRITES("pool", pool, pool_bytes, el);
  const int64_t pool_pages = pool_bytes / page_bytes;
  WRITES("counter", counter, 68, 4);
  READS("seqs", seqs, num_seqs * 40, 8);
  if (!kf_reserve(&c, (void **)&c.h->seqs, &c.h->seqs_cap, num_seqs, sizeof(kf_attn_seq))) return NULL;
  const double *rec = (const double *)(B + seqs);
  const int64_t per_row = kv_parts * splits;
  int64_t items = 0, rows_end = 0, total_rows = 0, max_ctx = 0;
  char what[64];
  for (int64_t i = 0; i < num_seqs; i++) {
    for (int k = 0; k < 5; k++) c.v[k] = rec[5 * i + k];
    ARG(0, "sequence rowStart", 0, KF_I32, row_start);
    ARG(1, "sequence rows", 1, KF_I32, rows);
    ARG(2, "sequence startPos", 0, KF_I32 - rows, start_pos);
    ARG(3, "sequence table", 0, KF_MAX_OFFSET, table);
    ARG(4, "sequence firstItem", 0, KF_I32, first_item);
    if (first_item != items) {
      return (kf_throw(&c, "sequence %lld's firstItem must be %lld: %lld", (long long)i, (long long)items,
                       (long long)first_item),
              NULL);
    }
    items += rows * per_row;
    if (items > KF_I32) return (kf_throw(&c, "too many work items: %lld", (long long)items), NULL);
    if (row_start + rows > rows_end) rows_end = row_start + rows;
    total_rows += rows;
    const int64_t ctx = start_pos + rows;
    if (ctx > max_ctx) max_ctx = ctx;
    const int64_t pages = (ctx + page_size - 1) / page_size;
    snprintf(what, sizeof what, "sequence %lld's block table", (long long)i);
    READS(what, table, pages * 4, 4);
    const int32_t *tb = (const int32_t *)(B + table);
    for (int64_t p = 0; p < pages; p++) {
      if (tb[p] < 0 || tb[p] >= pool_pages) {
        return (kf_throw(&c, "sequence %lld's block table entry %lld is outside the pool's %lld pages: %d", (long long)i,
                         (long long)p, (long long)pool_pages, tb[p]),
                NULL);
      }
    }
    c.h->seqs[i] = (kf_attn_seq){(int32_t)row_start, (int32_t)rows, (int32_t)start_pos, (int32_t)first_item, tb};
  }
  const int64_t act = kf_mul(kf_mul(rows_end, num_heads * 4), hd);
  WRITES("out", out, act, 4);
  READS("q", q, act, 4);
  WRITES("scratch", scratch, scratch_bytes, 4);
  if (kf_mul(num_heads * 4, max_ctx + hd) > scratch_bytes) {
    return (kf_throw(&c, "scratch of %lld bytes is smaller than the %lld the longest context (%lld) needs",
                     (long long)scratch_bytes, (long long)kf_mul(num_heads * 4, max_ctx + hd), (long long)max_ctx),
            NULL);
  }
  if (splits > 1) {
    WRITES("partial", partial, kf_mul(kf_mul(total_rows * num_heads, splits * 4), hd), 4);
    WRITES("ml", ml, kf_mul(total_rows * num_heads, splits * 8), 4);
  }
  const kf_attention_job job = {
      .out = (float *)(B + out),
      .q = (const float *)(B + q),
      .pool = B + pool,
      .seqs = c.h->seqs,
      .num_seqs = (int32_t)num_seqs,
      .scratch = (float *)(B + scratch),
      .layer = (int32_t)layer,
      .num_layers = (int32_t)num_layers,
      .num_heads = (int32_t)num_heads,
      .num_kv_heads = (int32_t)num_kv_heads,
      .head_dim = (int32_t)hd,
      .page_size = (int32_t)page_size,
      .counter = (int32_t *)(B + counter),
      .splits = (int32_t)splits,
      .partial = splits > 1 ? (float *)(B + partial) : NULL,
      .ml = splits > 1 ? (float *)(B + ml) : NULL,
      .kv_parts = (int32_t)kv_parts,
      .kv_dtype = (int)kv_dtype,
  };
  c.h->level->attention.attention_par(&job, (int)first);
  return NULL;
}

static napi_value kf_attention_merge(napi_env env, napi_callback_info info) {
  CALL("attentionMerge", 8);
  ARG(0, "out", 0, KF_MAX_OFFSET, out);
  ARG(1, "partial", 0, KF_MAX_OFFSET, partial);
  ARG(2, "ml", 0, KF_MAX_OFFSET, ml);
  ARG(3, "rowStart", 0, KF_I32, row_start);
  ARG(4, "rows", 0, KF_I32, rows);
  ARG(5, "numHeads", 1, 1 << 16, num_heads);
  ARG(6, "headDim", 1, 1 << 16, hd);
  ARG(7, "splits", 1, 1 << 10, splits);
  WRITES("out", out, kf_mul(kf_mul(row_start + rows, num_heads * 4), hd), 4);
  READS("partial", partial, kf_mul(kf_mul(rows * num_heads, splits * 4), hd), 4);
  READS("ml", ml, kf_mul(rows * num_heads, splits * 8), 4);
  c.h->level->attention.attention_merge((float *)(B + out), (const float *)(B + partial), (const float *)(B + ml),
                                        (int32_t)row_start, (int32_t)rows, (int32_t)num_heads, (int32_t)hd,
                                        (int32_t)splits);
  return NULL;
}

/* ---------------------------------------------------------------------------------------------- */

NAPI_MODULE_INIT(/* napi_env env, napi_value exports */) {
  static const struct {
    const char *name;
    napi_callback fn;
  } fns[] = {
      {"bind", kf_bind},
      {"isa", kf_isa},
      {"add", kf_add},
      {"addBias", kf_add_bias},
      {"rmsnorm", kf_rmsnorm},
      {"rope", kf_rope},
      {"swiglu", kf_swiglu},
      {"swigluPar", kf_swiglu_par},
      {"kvStore", kf_kv_store},
      {"prepareBytes", kf_prepare_bytes},
      {"prepare", kf_prepare},
      {"matmulChunks", kf_matmul_chunks},
      {"matmulPar", kf_matmul_par},
      {"attentionPar", kf_attention_par},
      {"attentionMerge", kf_attention_merge},
      {"pageOffset", kf_page_offset},
      {"mapFile", kf_map_file},
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    napi_value f;
    if (napi_create_function(env, fns[i].name, NAPI_AUTO_LENGTH, fns[i].fn, NULL, &f) != napi_ok ||
        napi_set_named_property(env, exports, fns[i].name, f) != napi_ok) {
      return NULL;
    }
  }
  napi_value levels;
  napi_create_array_with_length(env, KF_NUM_LEVELS, &levels);
  for (int i = 0; i < KF_NUM_LEVELS; i++) {
    napi_value s;
    napi_create_string_utf8(env, KF_LEVELS[i].name, NAPI_AUTO_LENGTH, &s);
    napi_set_element(env, levels, (uint32_t)i, s);
  }
  napi_set_named_property(env, exports, "levels", levels);
  return exports;
}
