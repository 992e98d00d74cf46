/**
 * The two backends of the fast kernel set (`WasmKernels`): the WebAssembly kernels
 * (src/kernels/assembly, instance exports over a shared `WebAssembly.Memory`) and the native
 * kernels (native/, the Node-API addon dist/native/kvfence-kernels.node over a plain
 * SharedArrayBuffer, docs/kernels.md). Both take byte offsets into the memory as numbers and have
 * the same parallel kernels, so `WasmKernels` — its arena, fence, staging and the job protocol with
 * its worker (wasm-kernels-worker.ts) — is one implementation over either; what differs is here:
 * how x is prepared for a matmul and in what chunks it is cut, and the width of the staging
 * records (Int32Array for wasm32 addresses, Float64Array for native ones, which may pass 4 GiB).
 * The native glue checks every offset and length against the memory and the engine's region
 * (native/src/addon.c) and throws a RangeError instead of computing; the extra arguments it takes
 * for those checks (the RoPE tables' bytes, the KV pool's and the scratch's bytes, the thread) are
 * ignored by the WebAssembly exports.
 */
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

export type BackendName = "wasm" | "native";

/** The kernels a `WasmKernels` calls (addresses are byte offsets into its memory). */
export interface KernelBackend {
  readonly name: BackendName;
  /** For native: the ISA level the addon dispatched to (avx512, avxvnni, avx2, generic); for wasm: "simd128". */
  readonly isa: string;
  /** Whether staging records are Float64Array (native) or Int32Array (wasm). */
  readonly wideRecords: boolean;
  /** wasm: whether the relaxed int8 dot with accumulate is exact here (1) (see `WasmKernels.dotAdd`). */
  readonly dotAddExact?: (p: number) => number;
  /** Bytes `prepare` writes for x [rows][inDim] before a matmul on `dtype` (0: none). */
  prepareBytes(rows: number, inDim: number, dtype: number): number;
  prepare(xp: number, x: number, rows: number, inDim: number, dtype: number): void;
  /** Column and row chunk of a matmul job, as colChunk · 2^24 + rowChunk. */
  matmulChunks(rows: number, inDim: number, totalOut: number, dtype: number, threads: number): number;
  matmulPar(
    x: number,
    xp: number,
    rows: number,
    inDim: number,
    segs: number,
    numSegs: number,
    counter: number,
    colChunk: number,
    rowChunk: number,
    first: number,
    dtype: number,
  ): void;
  add(out: number, a: number, b: number, n: number): void;
  addBias(out: number, bias: number, rows: number, n: number): void;
  rmsnorm(out: number, x: number, weight: number, n: number, eps: number, rows: number): void;
  rope(
    x: number,
    positions: number,
    cos: number,
    sin: number,
    rows: number,
    numHeads: number,
    headDim: number,
    tableBytes: number,
  ): void;
  swiglu(out: number, gate: number, up: number, n: number): void;
  swigluPar(out: number, gate: number, up: number, n: number, counter: number, chunk: number): void;
  attentionPar(
    out: number,
    q: number,
    pool: number,
    seqs: number,
    numSeqs: number,
    scratch: number,
    layer: number,
    numLayers: number,
    numHeads: number,
    numKvHeads: number,
    headDim: number,
    pageSize: number,
    counter: number,
    splits: number,
    partial: number,
    ml: number,
    kvParts: number,
    kvDtype: number,
    poolBytes: number,
    scratchBytes: number,
    first: number,
  ): void;
  attentionMerge(
    out: number,
    partial: number,
    ml: number,
    rowStart: number,
    rows: number,
    numHeads: number,
    headDim: number,
    splits: number,
  ): void;
  kvStore(dst: number, src: number, n: number, kvDtype: number): void;
}

/** A byte range [start, end) of a memory: one kernel set's arena. */
export interface MemoryRegion {
  readonly start: number;
  readonly end: number;
}

// ---------------------------------------------------------------------------------------------
// WebAssembly

/** The kernel exports of kernels.wasm used here (the rest of `KernelBackend` passes straight through). */
interface WasmOnly {
  pack8(xp: number, x: number, rows: number, inDim: number): void;
  quantizeRowsQ8(xq: number, x: number, rows: number, inDim: number, quads: number): void;
  quantizedBytes(rows: number, inDim: number): number;
}

/** Work chunk of a matmul over 4 or more rows: 64 rows × 48 columns (see wasm-kernels.ts). */
const MATMUL_ROW_CHUNK = 64;
const MATMUL_COL_CHUNK = 48;
/** Up to this many rows, `matmulCols` in the kernels streams the weights (no packed x, no tile). */
const STREAMED_ROWS = 3;
/** Flag on a block format's code: batches run the relaxed int8 dot with accumulate (DT_DOT_ADD). */
const DT_DOT_ADD = 8;
const CHUNK_SCALE = 16777216;

/**
 * The WebAssembly backend over an instance's exports. Batches of rows: blocks of 64 rows × 48
 * columns on x packed in groups of 8 rows (pack8); one to three rows: chunks of whole weight rows
 * (`matvecChunk`, or about totalOut/16 rounded to a multiple of 4, 16–128), or on one thread each
 * segment in one piece. Q8_0/Q4_0 quantise x (quantizeRowsQ8).
 */
export function wasmBackend(exports: Record<string, unknown>, matvecChunk: number): KernelBackend {
  const x = exports as unknown as KernelBackend & WasmOnly;
  return {
    name: "wasm",
    isa: "simd128",
    wideRecords: false,
    prepareBytes: (rows, inDim, dtype) =>
      (dtype & 7) >= 3
        ? x.quantizedBytes(rows, inDim)
        : rows > STREAMED_ROWS
          ? Math.ceil(rows / 8) * Math.ceil(inDim / 4) * 128
          : 0,
    prepare(xp, xa, rows, inDim, dtype) {
      if ((dtype & 7) >= 3) x.quantizeRowsQ8(xp, xa, rows, inDim, dtype & DT_DOT_ADD ? 1 : 0);
      else if (rows > STREAMED_ROWS) x.pack8(xp, xa, rows, inDim);
    },
    matmulChunks(rows, _inDim, totalOut, _dtype, threads) {
      if (rows > STREAMED_ROWS) return MATMUL_COL_CHUNK * CHUNK_SCALE + MATMUL_ROW_CHUNK;
      const col =
        threads === 1
          ? totalOut
          : matvecChunk > 0
            ? matvecChunk
            : Math.min(128, Math.max(16, Math.ceil(totalOut / 64) * 4));
      return col * CHUNK_SCALE + rows;
    },
    matmulPar: x.matmulPar,
    add: x.add,
    addBias: x.addBias,
    rmsnorm: x.rmsnorm,
    rope: x.rope,
    swiglu: x.swiglu,
    swigluPar: x.swigluPar,
    attentionPar: x.attentionPar,
    attentionMerge: x.attentionMerge,
    kvStore: x.kvStore,
    dotAddExact: (x as unknown as { dotAddExact(p: number): number }).dotAddExact,
  };
}

// ---------------------------------------------------------------------------------------------
// native

/** The exports of dist/native/kvfence-kernels.node (native/src/addon.c): each kernel takes the handle first. */
export interface NativeAddon {
  /** ISA levels this build has, best first. */
  readonly levels: readonly string[];
  bind(view: Uint8Array, byteLength: number, regionStart: number, regionEnd: number, level?: string): object;
  /** The best level this CPU runs, or (given a handle) the handle's level. */
  isa(handle?: object): string;
  /** Where the memory's first byte (a Uint8Array at its offset 0) sits in its page. */
  pageOffset(view: Uint8Array): number;
  /**
   * Maps the first `fileBytes` of the open file `fd` copy-on-write over the memory at `byteOffset`
   * (page-aligned) in place of reading it; false (nothing changed) where it cannot.
   */
  mapFile(view: Uint8Array, byteLength: number, byteOffset: number, fd: number, fileBytes: number): boolean;
  [kernel: string]: unknown;
}

/** Where the build puts the addon (scripts/build-native.mjs); KVFENCE_NATIVE_ADDON overrides it (the sanitizer build). */
export function nativeAddonPath(): string {
  return (
    process.env.KVFENCE_NATIVE_ADDON ??
    fileURLToPath(new URL("../../native/kvfence-kernels.node", import.meta.url))
  );
}

let loaded: { addon: NativeAddon } | { error: string } | undefined;

/**
 * The native addon of this thread, loaded once, or why it is not there: not built (no C compiler
 * at install: scripts/build-native.mjs said so), or it failed to load (the message).
 */
export function loadNativeAddon(): { addon: NativeAddon } | { error: string } {
  if (loaded !== undefined) return loaded;
  const path = nativeAddonPath();
  try {
    loaded = { addon: createRequire(import.meta.url)(path) as NativeAddon };
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    loaded = {
      error:
        e.code === "MODULE_NOT_FOUND" || /cannot open shared object file/.test(e.message)
          ? `the native addon is not built (${path} is missing: no C compiler at install, or npm run build not run)`
          : `the native addon failed to load: ${e.message}`,
    };
  }
  return loaded;
}

/**
 * Bytes to add to a 64-byte-aligned offset of `buffer` so that the address it names is 64-byte
 * aligned too. A large SharedArrayBuffer starts 16 bytes into its page (the C allocator's chunk
 * header), so each "aligned" offset sat 16 bytes past a cache line and every 64-byte load of a
 * weight row straddled two lines: batch-1 decode on bf16 read 20.4 GB/s of weights on one thread
 * where the same weights on line boundaries read 24.7 (paired, same process). 0 without the addon.
 */
export function cacheLineShift(buffer: SharedArrayBuffer): number {
  const a = loadNativeAddon();
  if ("error" in a) return 0;
  return (64 - (a.addon.pageOffset(new Uint8Array(buffer, 0, 16)) % 64)) % 64;
}

/** The addon, or an Error saying why there is none. */
export function nativeAddon(): NativeAddon {
  const a = loadNativeAddon();
  if ("error" in a) throw new Error(`Native kernels unavailable: ${a.error}`);
  return a.addon;
}

/**
 * The native backend over `buffer` for the engine whose arena is `region`: binds the addon to the
 * memory (a 16-byte view at offset 0 gives the base address) and the region, at the CPU's best ISA
 * level or `level`.
 */
export function nativeBackend(
  buffer: SharedArrayBuffer,
  region: MemoryRegion,
  level?: string,
): KernelBackend {
  const a = nativeAddon();
  const view = new Uint8Array(buffer, 0, 16);
  const h =
    level === undefined
      ? a.bind(view, buffer.byteLength, region.start, region.end)
      : a.bind(view, buffer.byteLength, region.start, region.end, level);
  // Explicit parameters, not rest arguments: a call on the hot path allocates nothing.
  const f = a as unknown as NativeKernels;
  return {
    name: "native",
    isa: a.isa(h),
    wideRecords: true,
    prepareBytes: (rows, inDim, dtype) => f.prepareBytes(h, rows, inDim, dtype),
    prepare: (xp, x, rows, inDim, dtype) => f.prepare(h, xp, x, rows, inDim, dtype),
    matmulChunks: (rows, inDim, totalOut, dtype, threads) =>
      f.matmulChunks(h, rows, inDim, totalOut, dtype, threads),
    matmulPar: (x, xp, rows, inDim, segs, numSegs, counter, colChunk, rowChunk, first, dtype) =>
      f.matmulPar(h, x, xp, rows, inDim, segs, numSegs, counter, colChunk, rowChunk, first, dtype),
    add: (out, x, y, n) => f.add(h, out, x, y, n),
    addBias: (out, bias, rows, n) => f.addBias(h, out, bias, rows, n),
    rmsnorm: (out, x, weight, n, eps, rows) => f.rmsnorm(h, out, x, weight, n, eps, rows),
    rope: (x, positions, cos, sin, rows, numHeads, headDim, tableBytes) =>
      f.rope(h, x, positions, cos, sin, rows, numHeads, headDim, tableBytes),
    swiglu: (out, gate, up, n) => f.swiglu(h, out, gate, up, n),
    swigluPar: (out, gate, up, n, counter, chunk) => f.swigluPar(h, out, gate, up, n, counter, chunk),
    attentionPar: (
      o,
      q,
      pool,
      seqs,
      ns,
      scr,
      l,
      nl,
      nh,
      nkv,
      hd,
      ps,
      ctr,
      sp,
      part,
      ml,
      kp,
      kd,
      pb,
      sb,
      first,
    ) =>
      f.attentionPar(
        h,
        o,
        q,
        pool,
        seqs,
        ns,
        scr,
        l,
        nl,
        nh,
        nkv,
        hd,
        ps,
        ctr,
        sp,
        part,
        ml,
        kp,
        kd,
        pb,
        sb,
        first,
      ),
    attentionMerge: (out, partial, ml, rowStart, rows, numHeads, headDim, splits) =>
      f.attentionMerge(h, out, partial, ml, rowStart, rows, numHeads, headDim, splits),
    kvStore: (dst, src, n, kvDtype) => f.kvStore(h, dst, src, n, kvDtype),
  };
}

/** The addon's kernels: `KernelBackend`'s, each with the handle first. */
type NativeKernels = {
  [K in Exclude<keyof KernelBackend, "name" | "isa" | "wideRecords" | "dotAddExact">]: (
    h: object,
    ...args: Parameters<KernelBackend[K]>
  ) => ReturnType<KernelBackend[K]>;
};
