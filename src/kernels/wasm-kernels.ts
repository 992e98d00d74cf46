/**
 * `WasmKernels`: the WebAssembly SIMD kernels (src/kernels/assembly, built to kernels.wasm) behind
 * the `Kernels` interface, over one shared `WebAssembly.Memory`, run on two threads.
 *
 * ## Memory
 * Everything the kernels touch lives in one `WebAssembly.Memory({shared: true})`, whose buffer is a
 * SharedArrayBuffer that the worker and the transfer engine see too. A bump arena (`allocF32`,
 * `allocBytes`, `placeF32`, `placeWeights`) hands out views into it; nothing is ever freed — the
 * weights, the KV pool (pass `memory.buffer` + `allocBytes()` offset to `PagePool` as
 * `dataBuffer`/`dataByteOffset`) and the activations are allocated once. The memory grows on demand
 * up to 4 GiB (wasm32); views made before a growth stay valid (shared memory never detaches).
 *
 * A kernel whose operands are not all inside the memory (a caller's own Float32Array) falls back to
 * the reference kernel for that call and counts it in `fallbackCalls`, so results are always right
 * and a misplaced buffer shows up as a number, not as wrong output.
 *
 * ## Two threads
 * The main thread and one worker (wasm-kernels-worker.ts) run the same module over the same memory.
 * `matmul`/`matmulEach`, `pagedAttentionBatch` and large `swiglu` calls are published as a job in
 * a control block in the memory; both threads then call the same parallel kernel, which claims
 * chunks of work (48 output columns of a row block, 16–128 for one to three rows, or one (sequence,
 * query row, KV heads) attention item) from atomic counters, so the faster thread takes more and
 * neither waits for a late starter. With no worker (or little work) the main thread runs the same
 * kernel alone. The worker spins on `Atomics.load` for a
 * bounded time (`workerSpinMs`) between jobs and then sleeps in `Atomics.wait`; a futex wake costs
 * about 50 µs on these machines against well under 1 µs for a spin (docs/benchmarks.md §3.2), so within a
 * token it never sleeps. A job the worker has not picked up by the time the main thread finished
 * every chunk is cancelled (a ticket compare-and-swap), so a descheduled or sleeping worker never
 * delays the main thread by more than the chunk it is running.
 *
 * ## Two backends
 * The same class, arena, fence, staging and job protocol serve two backends (kernel-backend.ts):
 * the WebAssembly kernels over a `WebAssembly.Memory` (`name` "wasm") and the native kernels, a
 * Node-API addon over a plain SharedArrayBuffer of fixed size (`name` "native", `backend:
 * "native"`; docs/kernels.md), whose C glue checks every offset and length it is handed against
 * the memory and this set's region. The native memory may pass 4 GiB, so staging records and job
 * arguments are Float64Array there (Int32Array records for wasm).
 *
 * ## Two builds
 * One AssemblyScript source is built twice: kernels-fma.wasm, whose multiply-adds are relaxed-SIMD
 * fused multiply-adds, and kernels.wasm, a multiply and an add. `create()` takes the first where the
 * engine accepts relaxed SIMD (see `wasmModule`) unless `fma: false`; `fma` says which it got. Both
 * are tested against the reference kernels and the golden logits.
 */
import { Worker } from "node:worker_threads";
import {
  cacheLineShift,
  type KernelBackend,
  type MemoryRegion,
  nativeBackend,
  wasmBackend,
} from "./kernel-backend.js";
import type { Kernels } from "./kernels.js";
import type { AttentionSequence } from "./reference.js";
import * as ref from "./reference.js";
import { blockWeights, type Matrix, matrixBytes, matrixDType, type WeightDType } from "./weight-format.js";

// The WebAssembly JS API as far as this module uses it (lib "ES2023" and @types/node 20 omit it).
declare global {
  namespace WebAssembly {
    /** An opaque compiled module. */
    interface Module {
      readonly __brand?: "WebAssembly.Module";
    }
    const Module: { new (bytes: ArrayBufferView | ArrayBuffer): Module };
    interface Memory {
      readonly buffer: ArrayBufferLike;
      grow(deltaPages: number): number;
    }
    const Memory: { new (descriptor: { initial: number; maximum?: number; shared?: boolean }): Memory };
    interface Instance {
      readonly exports: Record<string, unknown>;
    }
    const Instance: { new (module: Module, imports?: Record<string, Record<string, unknown>>): Instance };
    function compile(bytes: ArrayBufferView | ArrayBuffer): Promise<Module>;
    function validate(bytes: ArrayBufferView | ArrayBuffer): boolean;
  }
}

const PAGE_BYTES = 65536;
const MAX_PAGES = 65536;
/** The first 64 KiB stay unused (the module has no data segments, but keep address 0 unused). */
const ARENA_START = 65536;
/** A word in that unused first 64 KiB, for `owns` to tell whether a buffer is this memory. */
const PROBE_BYTE = 1024;
const CTL_BYTES = 1024;

// Control block (Int32 indices); hot words on separate 64-byte lines.
export const CTL_SEQ = 0;
export const CTL_TICKET = 16;
export const CTL_DONE = 32;
export const CTL_WORKER_SLEEPING = 33;
export const CTL_MAIN_SLEEPING = 34;
export const CTL_QUIT = 35;
export const CTL_WORKER_JOBS = 36;
export const CTL_OP = 40;
/** Two work counters, a cache line apart (see `claim` in the kernels). */
export const CTL_COUNTER = 96;
/** The job's arguments: 24 doubles from this Int32 index (addresses may pass 2^32 on native). */
export const CTL_ARGS = 128;

export const OP_MATMUL = 1;
export const OP_ATTENTION = 2;
export const OP_SWIGLU = 3;

const compiled = new Map<boolean, Promise<WebAssembly.Module | null>>();

/**
 * The compiled kernels (built by scripts/build-wasm.mjs next to this file in dist/): with `fma`,
 * kernels-fma.wasm, whose multiply-adds are relaxed-SIMD `f32x4.relaxed_madd`, or null where the
 * engine rejects relaxed SIMD; else kernels.wasm (multiply, then add). Node 20's V8 (11.3)
 * validates relaxed SIMD only behind --experimental-wasm-relaxed-simd; Node 22 and 24 accept it
 * with no flag (tested in wasm-kernels.test.ts), so only on Node 20 does a module that fails
 * validation turn that flag on once and try again. The flag only lets the validator accept those
 * opcodes; V8 11.3 compiles them (FMA where the CPU has it).
 */
export function wasmModule(fma: true): Promise<WebAssembly.Module | null>;
export function wasmModule(fma?: false): Promise<WebAssembly.Module>;
export function wasmModule(fma = false): Promise<WebAssembly.Module | null> {
  let m = compiled.get(fma);
  if (m === undefined) {
    m = compileKernels(fma ? "kernels-fma.wasm" : "kernels.wasm", fma);
    compiled.set(fma, m);
  }
  return m;
}

async function compileKernels(file: string, relaxed: boolean): Promise<WebAssembly.Module | null> {
  const { readFile } = await import("node:fs/promises");
  const url = new URL(`./${file}`, import.meta.url);
  let bytes: Buffer;
  try {
    bytes = await readFile(url);
  } catch (err) {
    throw new Error(
      `WebAssembly kernels are not built: ${url.pathname} is missing; run npm run build (it runs scripts/build-wasm.mjs)`,
      { cause: err },
    );
  }
  if (relaxed && !WebAssembly.validate(bytes)) {
    const { setFlagsFromString } = await import("node:v8");
    setFlagsFromString("--experimental-wasm-relaxed-simd");
    if (!WebAssembly.validate(bytes)) return null;
  }
  return WebAssembly.compile(bytes);
}

export function instantiate(module: WebAssembly.Module, memory: WebAssembly.Memory): Record<string, unknown> {
  return new WebAssembly.Instance(module, { env: { memory } }).exports;
}

/** The memory of a kernel set: a `WebAssembly.Memory`, or for native a plain SharedArrayBuffer (`{ buffer }`, fixed size). */
export interface KernelMemory {
  readonly buffer: ArrayBufferLike;
  grow?(deltaPages: number): number;
}

/** Where a kernel set's worker finds its backend (wasm-kernels-worker.ts). */
export type BackendSpec =
  | { readonly kind: "wasm"; readonly module: WebAssembly.Module; readonly memory: WebAssembly.Memory }
  | {
      readonly kind: "native";
      readonly buffer: SharedArrayBuffer;
      readonly region: MemoryRegion;
      readonly level?: string;
    };

/** The backend a spec describes, over its memory. */
export function backendOf(spec: BackendSpec, matvecChunk: number): KernelBackend {
  if (spec.kind === "wasm") return wasmBackend(instantiate(spec.module, spec.memory), matvecChunk);
  return nativeBackend(spec.buffer, spec.region, spec.level);
}

/** The weight tensors of a model (structurally the model's `ModelWeights`). */
export interface WeightsLike {
  readonly embed: Matrix;
  readonly layers: readonly {
    readonly inputNorm: Float32Array;
    readonly q: Matrix;
    readonly k: Matrix;
    readonly v: Matrix;
    readonly qBias: Float32Array | null;
    readonly kBias: Float32Array | null;
    readonly vBias: Float32Array | null;
    readonly o: Matrix;
    readonly postNorm: Float32Array;
    readonly gate: Matrix;
    readonly up: Matrix;
    readonly down: Matrix;
  }[];
  readonly finalNorm: Float32Array;
  readonly lmHead: Matrix;
}

/** The kernels' code for each weight format (DT_* in src/kernels/assembly/index.ts). */
const DTYPE_CODE: Readonly<Record<WeightDType, number>> = {
  f32: 0,
  f16: 1,
  bf16: 2,
  q8_0: 3,
  q4_0: 4,
  q4_K: 5,
  q5_K: 6,
  q6_K: 7,
};
/** Flag on a block format's code: batches run the relaxed int8 dot with accumulate (DT_DOT_ADD in the kernels). */
const DT_DOT_ADD = 8;
const CHUNK_SCALE = 16777216;

export interface WasmKernelsOptions {
  /** 1: main thread only; 2 (default): main thread plus one worker. */
  readonly threads?: 1 | 2;
  /**
   * Initial memory size in bytes (wasm: grows on demand up to 4 GiB; native: the fixed size, which
   * may pass 4 GiB). Default 64 MiB.
   */
  readonly initialBytes?: number;
  /** How long the idle worker spins before sleeping in Atomics.wait. Default 2 ms. */
  readonly workerSpinMs?: number;
  /** Calls doing fewer multiply-adds than this run on the main thread alone. Default 32768. */
  readonly parallelMinWork?: number;
  /**
   * Output columns per work chunk of a parallel matvec (1–3 rows); 0 (default) picks about
   * outDim/16 rounded to a multiple of 4, between 16 and 128: long enough contiguous weight streams
   * for the prefetcher, enough chunks to balance two threads.
   */
  readonly matvecChunk?: number;
  /**
   * Use the relaxed-SIMD build (fused multiply-add) where the engine accepts it. Default true;
   * false runs the plain SIMD128 build, as `kvfence bench model --kernels wasm-mul-add` does.
   */
  readonly fma?: boolean;
  /**
   * Run batches on Q8_0/Q4_0 weights on the relaxed int8 dot with accumulate where the engine
   * computes it exactly (see `dotAdd`). Default true; false keeps them on the i16 tile everywhere.
   */
  readonly dotAdd?: boolean;
  /**
   * A memory shared with other kernel sets of the process (src/engine/engine-memory.ts): the
   * weights sit in it already, and this set's arena is `region` of it (it never grows it). Without
   * one the kernels make their own memory and arena.
   */
  readonly shared?: { readonly memory: KernelMemory; readonly region: MemoryRegion };
  /**
   * "wasm" (default): the WebAssembly kernels; "native": the Node-API addon (throws where it is not
   * built or does not load: see `loadNativeAddon`). A shared memory must be of the same kind.
   */
  readonly backend?: "wasm" | "native";
  /** Native: an ISA level below the CPU's best (avx512, avxvnni, avx2, generic), for tests and benchmarks. */
  readonly isa?: string;
}

export type { MemoryRegion };

/**
 * The fast kernel set (named for its first backend): the WebAssembly kernels, or the native ones
 * (`backend: "native"`) — same arena, fence, staging and worker, see the module header.
 */
export class WasmKernels implements Kernels {
  readonly name: "wasm" | "native";
  /** Native: the ISA level the addon dispatched to; wasm: "simd128". */
  readonly isa: string;
  readonly memory: KernelMemory;
  readonly threads: 1 | 2;
  /** Whether the kernels are the relaxed-SIMD build (fused multiply-add). */
  readonly fma: boolean;
  /**
   * Whether batches (2+ rows) on Q8_0/Q4_0 weights run `qTileDot16` in the kernels, on
   * `i32x4.relaxed_dot_i8x16_i7x16_add_s` (16 multiply-adds an instruction; one vpdpbusd where
   * Node 22/24's V8 has AVX-VNNI): only where the relaxed build runs and the engine returns the
   * exact sum (`dotAddExact`; Node 20's V8 11.3 does not). Otherwise the i16 tile (`qTile16`).
   * Both give the same integer sums, so the same results.
   */
  readonly dotAdd: boolean;
  /**
   * Whether this set's arena is memory nothing wrote before: its own new memory, or the first kernel
   * set over a shared region (claimed by a word at the region's start). What it allocates is then
   * all zeros (the arena hands out each byte once), so a KV pool there needs no zeroing
   * (`PagePool`'s `zeroed`). False for a set over a region an earlier set used (a restarted engine
   * worker over the same shared memory).
   */
  readonly freshArena: boolean;
  /** Calls that ran the reference kernel because an operand was outside the memory. */
  fallbackCalls = 0;
  #x: KernelBackend;
  /** Every buffer object known to be this memory (see `owns`). */
  #buffers = new WeakSet<ArrayBufferLike>();
  #buf0: ArrayBufferLike;
  #top = ARENA_START;
  /** This set's arena [#arenaStart, #arenaEnd): everything it allocates and every kernel output. */
  #arenaStart = ARENA_START;
  #arenaEnd = MAX_PAGES * PAGE_BYTES;
  /** The word `owns` writes through this memory (in this set's arena: sets sharing a memory race otherwise). */
  #probe = PROBE_BYTE;
  #ctl: Int32Array;
  #args: Float64Array;
  #ctlBase: number;
  #counter: number;
  #seq = 0;
  #worker: Worker | null = null;
  #ready: Promise<void>;
  #parallelMinWork: number;
  // Attention staging: the block table and one scratch per thread (grown on demand).
  #table: Int32Array;
  #seqRecords: Int32Array | Float64Array;
  #segRecords: Int32Array | Float64Array;
  #scratchMain = 0;
  #scratchWorker = 0;
  #scratchFloats = 0;
  #partial = 0;
  #partialFloats = 0;
  // Matmul staging: x rows packed in groups of 8 for the 8-row tile (grown on demand).
  #packed = 0;
  #packedBytes = 0;
  /** Bytes from a 64-byte-aligned offset to a cache line of the address (native; see cacheLineShift). */
  #lineShift = 0;

  private constructor(module: WebAssembly.Module | null, fma: boolean, options: WasmKernelsOptions) {
    this.fma = fma;
    const native = module === null;
    this.name = native ? "native" : "wasm";
    const limit = native ? Number.MAX_SAFE_INTEGER : MAX_PAGES * PAGE_BYTES;
    if (options.shared === undefined) {
      const initialBytes = options.initialBytes ?? 64 * 1024 * 1024;
      if (native) {
        this.memory = {
          buffer: new SharedArrayBuffer(Math.max(2 * PAGE_BYTES, Math.ceil(initialBytes / 64) * 64)),
        };
      } else {
        const pages = Math.min(MAX_PAGES, Math.max(2, Math.ceil(initialBytes / PAGE_BYTES)));
        this.memory = new WebAssembly.Memory({ initial: pages, maximum: MAX_PAGES, shared: true });
      }
      this.#arenaEnd = Math.min(limit, native ? this.memory.buffer.byteLength : limit);
    } else {
      const { memory, region } = options.shared;
      if (region.start < ARENA_START || region.start % 64 !== 0 || region.end > memory.buffer.byteLength) {
        throw new RangeError(
          `kernel arena [${region.start}, ${region.end}) is not inside the memory (${memory.buffer.byteLength} bytes, 64-byte aligned, above ${ARENA_START})`,
        );
      }
      if ((memory.grow === undefined) !== native) {
        throw new TypeError(
          `The ${this.name} kernels need a ${native ? "SharedArrayBuffer" : "WebAssembly.Memory"} as their shared memory`,
        );
      }
      this.memory = memory;
      this.#top = this.#arenaStart = region.start;
      this.#arenaEnd = region.end;
    }
    // Native: weights copied in start on a cache line of the address (`#weightBytes`).
    this.#lineShift = native ? cacheLineShift(this.memory.buffer as SharedArrayBuffer) : 0;
    this.threads = options.threads ?? 2;
    this.#parallelMinWork = options.parallelMinWork ?? 32768;
    const spec: BackendSpec = native
      ? {
          kind: "native",
          buffer: this.memory.buffer as SharedArrayBuffer,
          region: { start: this.#arenaStart, end: this.#arenaEnd },
          ...(options.isa === undefined ? {} : { level: options.isa }),
        }
      : { kind: "wasm", module, memory: this.memory as WebAssembly.Memory };
    this.#x = backendOf(spec, options.matvecChunk ?? 0);
    this.isa = this.#x.isa;
    this.#buf0 = this.memory.buffer;
    this.#buffers.add(this.#buf0);
    if (options.shared !== undefined) this.#probe = this.allocBytes(64);
    // The region's claim word sits beside the probe word, in the arena's first 64 bytes.
    this.freshArena =
      options.shared === undefined ||
      Atomics.exchange(new Int32Array(this.memory.buffer, this.#probe + 4, 1), 0, 1) === 0;
    this.#ctlBase = this.allocBytes(CTL_BYTES);
    this.#ctl = new Int32Array(this.memory.buffer, this.#ctlBase, CTL_BYTES / 4);
    this.#args = new Float64Array(this.memory.buffer, this.#ctlBase + CTL_ARGS * 4, 24);
    this.#counter = this.#ctlBase + CTL_COUNTER * 4;
    this.#table = this.allocI32(1024);
    this.#seqRecords = this.#records(5 * 64);
    this.#segRecords = this.#records(4 * 4);
    const exact = this.#x.dotAddExact;
    this.dotAdd = (options.dotAdd ?? true) && exact !== undefined && exact(this.allocBytes(48)) === 1;
    // Bound, so a caller may destructure the kernels (as ForwardPass.step() does).
    this.allocF32 = this.allocF32.bind(this);
    this.allocF64 = this.allocF64.bind(this);
    this.allocI32 = this.allocI32.bind(this);
    this.matmul = this.matmul.bind(this);
    this.matmulEach = this.matmulEach.bind(this);
    this.addBias = this.addBias.bind(this);
    this.add = this.add.bind(this);
    this.rmsnorm = this.rmsnorm.bind(this);
    this.rope = this.rope.bind(this);
    this.swiglu = this.swiglu.bind(this);
    this.pagedAttentionBatch = this.pagedAttentionBatch.bind(this);
    this.storeKv = this.storeKv.bind(this);
    if (this.threads === 2) {
      const worker = new Worker(new URL("./wasm-kernels-worker.js", import.meta.url), {
        workerData: {
          spec: native ? { ...spec, level: this.isa } : spec,
          ctlByteOffset: this.#ctlBase,
          spinMs: options.workerSpinMs ?? 2,
          matvecChunk: options.matvecChunk ?? 0,
        },
      });
      worker.unref();
      this.#worker = worker;
      this.#ready = new Promise((resolve, reject) => {
        worker.once("message", () => resolve());
        worker.once("error", reject);
      });
    } else {
      this.#ready = Promise.resolve();
    }
  }

  /** Compiles (once per process) and instantiates the kernels; starts the worker when threads is 2. */
  static async create(options: WasmKernelsOptions = {}): Promise<WasmKernels> {
    if (options.backend === "native") return new WasmKernels(null, false, options);
    const fused = options.fma === false ? null : await wasmModule(true);
    if (fused !== null) return new WasmKernels(fused, true, options);
    return new WasmKernels(await wasmModule(), false, options);
  }

  /** Resolves once the worker runs (jobs before that run on the main thread alone). */
  ready(): Promise<void> {
    return this.#ready;
  }

  /** Jobs the worker has taken part in so far. */
  get workerJobs(): number {
    return Atomics.load(this.#ctl, CTL_WORKER_JOBS);
  }

  /** Stops the worker. The memory and its views stay usable on the main thread (threads become 1). */
  async close(): Promise<void> {
    const worker = this.#worker;
    if (worker === null) return;
    this.#worker = null;
    Atomics.store(this.#ctl, CTL_QUIT, 1);
    Atomics.add(this.#ctl, CTL_SEQ, 1);
    Atomics.notify(this.#ctl, CTL_SEQ);
    await worker.terminate();
  }

  // -------------------------------------------------------------------------------------------
  // arena

  /** Reserves `bytes` (64-byte aligned) in the memory, growing it if needed; returns the byte offset. */
  allocBytes(bytes: number): number {
    const at = this.#top;
    const end = at + Math.ceil(bytes / 64) * 64;
    if (end > this.#arenaEnd) {
      throw new RangeError(
        `${this.name === "native" ? "Native kernel" : "WebAssembly"} memory region is full: ${end - this.#arenaStart} bytes needed, the region holds ${this.#arenaEnd - this.#arenaStart}; the memory plan (src/engine/engine-memory.ts) undercounts`,
      );
    }
    const have = this.memory.buffer.byteLength;
    if (end > have && this.memory.grow !== undefined) {
      const pages = Math.ceil((end - have) / PAGE_BYTES);
      if (have / PAGE_BYTES + pages > MAX_PAGES) {
        throw new RangeError(
          `WebAssembly memory is full: ${end} bytes needed, the limit is 4 GiB; use a smaller KV pool or model`,
        );
      }
      this.memory.grow(pages);
    }
    this.#top = end;
    return at;
  }

  /** Staging records of n entries: Float64Array on native (addresses past 2^32), Int32Array on wasm. */
  #records(n: number): Int32Array | Float64Array {
    return this.#x.wideRecords ? this.allocF64(n) : this.allocI32(n);
  }

  allocF32(n: number): Float32Array {
    const at = this.allocBytes(n * 4); // first: it may grow the memory (a new buffer)
    return new Float32Array(this.buffer(), at, n);
  }

  allocF64(n: number): Float64Array {
    const at = this.allocBytes(n * 8); // first: it may grow the memory (a new buffer)
    return new Float64Array(this.buffer(), at, n);
  }

  allocI32(n: number): Int32Array {
    const at = this.allocBytes(n * 4); // first: it may grow the memory (a new buffer)
    return new Int32Array(this.buffer(), at, n);
  }

  /** `src` inside the memory: itself when it is there already (weights read into a shared memory), else a copy. */
  placeF32(src: Float32Array): Float32Array {
    if (this.owns(src)) return src;
    const dst = this.allocF32(src.length);
    dst.set(src);
    return dst;
  }

  /**
   * A weight matrix inside the memory, in its own format: itself when it is there already, else a
   * copy starting on a cache line of the address (the arena's offsets are 64-byte aligned, but a
   * native memory starts 16 bytes into a page: `cacheLineShift`).
   */
  placeMatrix(src: Matrix): Matrix {
    if (this.owns(matrixBytes(src))) return src;
    const at = this.#weightBytes(matrixBytes(src).byteLength); // first: it may grow the memory
    if (src instanceof Float32Array) {
      const dst = new Float32Array(this.buffer(), at, src.length);
      dst.set(src);
      return dst;
    }
    const bytes = new Uint8Array(this.buffer(), at, src.bytes.byteLength);
    bytes.set(src.bytes);
    return { dtype: src.dtype, shape: src.shape, bytes };
  }

  /** Reserves `bytes` for a weight on a cache line of the address; returns the byte offset. */
  #weightBytes(bytes: number): number {
    return this.allocBytes(bytes + this.#lineShift) + this.#lineShift;
  }

  /** Copies every weight tensor into the memory (a tied lmHead stays the same array as embed). */
  placeWeights<W extends WeightsLike>(w: W): W {
    const opt = (a: Float32Array | null): Float32Array | null => (a === null ? null : this.placeF32(a));
    const embed = this.placeMatrix(w.embed);
    return {
      ...w,
      embed,
      layers: w.layers.map((l) => ({
        ...l,
        inputNorm: this.placeF32(l.inputNorm),
        q: this.placeMatrix(l.q),
        k: this.placeMatrix(l.k),
        v: this.placeMatrix(l.v),
        qBias: opt(l.qBias),
        kBias: opt(l.kBias),
        vBias: opt(l.vBias),
        o: this.placeMatrix(l.o),
        postNorm: this.placeF32(l.postNorm),
        gate: this.placeMatrix(l.gate),
        up: this.placeMatrix(l.up),
        down: this.placeMatrix(l.down),
      })),
      finalNorm: this.placeF32(w.finalNorm),
      lmHead: w.lmHead === w.embed ? embed : this.placeMatrix(w.lmHead),
    };
  }

  /**
   * The memory's current buffer object, remembered as this memory's. Use it (not `memory.buffer`)
   * to make views the kernels should accept, as PagePool's data.
   */
  buffer(): SharedArrayBuffer {
    const b = this.memory.buffer as SharedArrayBuffer;
    this.#buffers.add(b);
    return b;
  }

  /**
   * True when the view lies inside this kernel set's memory. A shared memory's `buffer` is not one
   * object for good: V8 (Node 20) hands out a new SharedArrayBuffer over the same memory after a
   * grow of this memory, and also after a grow of any other WebAssembly memory in the thread (a
   * second kernel set, a library's own). So a buffer object not seen before is compared by content:
   * a word at PROBE_BYTE (in the first 64 KiB, which the arena never hands out) written through this
   * memory must read back through it, twice. A view over another memory fails that and runs on the
   * reference kernels, as before; one over this memory is remembered and runs here. (Comparing
   * object identity alone sent every later view of a process's second kernel set to the reference
   * kernels, 20× slower.)
   */
  owns(a: ArrayBufferView): boolean {
    const b = a.buffer;
    if (b === this.#buf0 || this.#buffers.has(b)) return true;
    if (!(b instanceof SharedArrayBuffer) || b.byteLength < this.#probe + 4) return false;
    const mine = new Int32Array(this.memory.buffer, this.#probe, 1);
    const theirs = new Int32Array(b, this.#probe, 1);
    const v = (Math.random() * 0x7fffffff) | 0;
    mine[0] = v;
    if (theirs[0] !== v) return false;
    mine[0] = ~v;
    if (theirs[0] !== ~v) return false;
    this.#buffers.add(b);
    return true;
  }

  /**
   * The fence between kernel sets sharing a memory: what a kernel writes, and the KV pool attention
   * reads, must lie in this set's arena — never the shared weights, never another engine's pool or
   * activations. A view of this memory outside it is a bug, so it throws rather than computing.
   */
  #fence(a: ArrayBufferView, what: string): void {
    if (a.byteOffset < this.#arenaStart || a.byteOffset + a.byteLength > this.#arenaEnd) {
      throw new RangeError(
        `${what} [${a.byteOffset}, ${a.byteOffset + a.byteLength}) lies outside this engine's region [${this.#arenaStart}, ${this.#arenaEnd}) of the shared memory`,
      );
    }
  }

  /** Throws unless `pool` lies in this set's region (`#fence`); a pool outside the memory is the caller's own. */
  checkPool(pool: Float32Array | Uint16Array): void {
    if (this.owns(pool)) this.#fence(pool, "KV pool");
  }

  // -------------------------------------------------------------------------------------------
  // kernels (signatures of reference.ts)

  matmul(out: Float32Array, x: Float32Array, w: Matrix, rows: number, inDim: number, outDim: number): void {
    if (!(this.owns(out) && this.owns(x) && this.#ownsMatrix(w) && this.#runs(w, inDim))) {
      this.fallbackCalls++;
      ref.matmul(out, x, w, rows, inDim, outDim);
      return;
    }
    this.#fence(out, "matmul output");
    this.#segment(0, out, w, outDim);
    this.#matmulSegments(x, rows, inDim, 1, outDim, DTYPE_CODE[matrixDType(w)]);
  }

  matmulEach(
    outs: readonly Float32Array[],
    x: Float32Array,
    ws: readonly Matrix[],
    rows: number,
    inDim: number,
    outDims: readonly number[],
  ): void {
    let owned = this.owns(x);
    const dtype = ws.length === 0 ? "f32" : matrixDType(ws[0] as Matrix);
    let mixed = false;
    for (let i = 0; i < ws.length; i++) {
      const w = ws[i] as Matrix;
      owned = owned && this.owns(outs[i] as Float32Array) && this.#ownsMatrix(w) && this.#runs(w, inDim);
      mixed ||= matrixDType(w) !== dtype;
    }
    if (owned && mixed) {
      // A job has one weight format; GGUF mixes them (Q4_K_M: Q6_K attn_v beside Q4_K q and k).
      for (let i = 0; i < ws.length; i++)
        this.matmul(outs[i] as Float32Array, x, ws[i] as Matrix, rows, inDim, outDims[i] as number);
      return;
    }
    if (!owned) {
      this.fallbackCalls++;
      ref.matmulEach(outs, x, ws, rows, inDim, outDims);
      return;
    }
    if (this.#segRecords.length < 4 * ws.length) this.#segRecords = this.#records(4 * ws.length);
    let total = 0;
    for (let i = 0; i < ws.length; i++) {
      this.#fence(outs[i] as Float32Array, "matmul output");
      this.#segment(i, outs[i] as Float32Array, ws[i] as Matrix, outDims[i] as number);
      total += outDims[i] as number;
    }
    this.#matmulSegments(x, rows, inDim, ws.length, total, DTYPE_CODE[dtype]);
  }

  /** `owns` for a weight matrix (no view made: a step must not allocate). */
  #ownsMatrix(w: Matrix): boolean {
    return this.owns(w instanceof Float32Array ? w : w.bytes);
  }

  /** Whether the kernels take this weight: every format, the block ones with whole blocks per row. */
  #runs(w: Matrix, inDim: number): boolean {
    return inDim % blockWeights(matrixDType(w)) === 0;
  }

  /** Stages matmul segment i (see matmulPar in the kernels) for #matmulSegments. */
  #segment(i: number, out: Float32Array, w: Matrix, outDim: number): void {
    const r = this.#segRecords;
    r[4 * i] = out.byteOffset;
    r[4 * i + 1] = w instanceof Float32Array ? w.byteOffset : w.bytes.byteOffset;
    r[4 * i + 2] = outDim;
  }

  /**
   * Runs the staged segments over x as one job. Batches of rows: blocks of MATMUL_ROW_CHUNK rows ×
   * MATMUL_COL_CHUNK columns. One to three rows (decode): chunks of whole weight rows, or, on this
   * thread alone, each segment in one piece (one unbroken weight stream).
   */
  #matmulSegments(
    x: Float32Array,
    rows: number,
    inDim: number,
    numSegs: number,
    totalOut: number,
    format: number,
  ): void {
    const dtype = format >= DTYPE_CODE.q8_0 && this.dotAdd ? format | DT_DOT_ADD : format;
    const solo = this.#worker === null || rows * inDim * totalOut < this.#parallelMinWork;
    const chunks = this.#x.matmulChunks(rows, inDim, totalOut, dtype, solo ? 1 : 2);
    const colChunk = Math.floor(chunks / CHUNK_SCALE);
    const rowChunk = chunks % CHUNK_SCALE;
    const r = this.#segRecords;
    let n = 0;
    for (let i = 0; i < numSegs; i++) {
      r[4 * i + 3] = n;
      n += Math.ceil((r[4 * i + 2] as number) / colChunk);
    }
    const xp = this.#prepare(x, rows, inDim, dtype);
    let job = 0;
    if (solo) {
      this.#resetCounters();
    } else {
      const a = this.#args;
      a[0] = x.byteOffset;
      a[1] = xp;
      a[2] = rows;
      a[3] = inDim;
      a[4] = r.byteOffset;
      a[5] = numSegs;
      a[6] = this.#counter;
      a[7] = colChunk;
      a[8] = rowChunk;
      a[9] = dtype;
      job = this.#publish(OP_MATMUL);
    }
    try {
      this.#x.matmulPar(
        x.byteOffset,
        xp,
        rows,
        inDim,
        r.byteOffset,
        numSegs,
        this.#counter,
        colChunk,
        rowChunk,
        0,
        dtype,
      );
    } finally {
      if (!solo) this.#join(job);
    }
  }

  /**
   * x prepared for the matmul (quantised to int8 blocks for Q8_0/Q4_0, packed in groups of 8 rows
   * for a wasm batch, ...: the backend's `prepare`) in a scratch grown on demand; its address, or 0.
   */
  #prepare(x: Float32Array, rows: number, inDim: number, dtype: number): number {
    const bytes = this.#x.prepareBytes(rows, inDim, dtype);
    if (bytes === 0) return 0;
    if (bytes > this.#packedBytes) {
      this.#packedBytes = Math.max(bytes, this.#packedBytes * 2);
      this.#packed = this.allocBytes(this.#packedBytes);
    }
    this.#x.prepare(this.#packed, x.byteOffset, rows, inDim, dtype);
    return this.#packed;
  }

  addBias(out: Float32Array, bias: Float32Array, rows: number, n: number): void {
    if (!(this.owns(out) && this.owns(bias))) {
      this.fallbackCalls++;
      ref.addBias(out, bias, rows, n);
      return;
    }
    this.#x.addBias(out.byteOffset, bias.byteOffset, rows, n);
  }

  add(out: Float32Array, a: Float32Array, b: Float32Array, n: number): void {
    if (!(this.owns(out) && this.owns(a) && this.owns(b))) {
      this.fallbackCalls++;
      ref.add(out, a, b, n);
      return;
    }
    this.#x.add(out.byteOffset, a.byteOffset, b.byteOffset, n);
  }

  rmsnorm(out: Float32Array, x: Float32Array, weight: Float32Array, n: number, eps: number, rows = 1): void {
    if (!(this.owns(out) && this.owns(x) && this.owns(weight))) {
      this.fallbackCalls++;
      ref.rmsnorm(out, x, weight, n, eps, rows);
      return;
    }
    this.#x.rmsnorm(out.byteOffset, x.byteOffset, weight.byteOffset, n, eps, rows);
  }

  rope(
    x: Float32Array,
    positions: Int32Array,
    cos: Float64Array,
    sin: Float64Array,
    rows: number,
    numHeads: number,
    headDim: number,
  ): void {
    if (!(this.owns(x) && this.owns(positions) && this.owns(cos) && this.owns(sin))) {
      this.fallbackCalls++;
      ref.rope(x, positions, cos, sin, rows, numHeads, headDim);
      return;
    }
    this.#x.rope(
      x.byteOffset,
      positions.byteOffset,
      cos.byteOffset,
      sin.byteOffset,
      rows,
      numHeads,
      headDim,
      Math.min(cos.byteLength, sin.byteLength),
    );
  }

  swiglu(out: Float32Array, gate: Float32Array, up: Float32Array, n: number): void {
    if (!(this.owns(out) && this.owns(gate) && this.owns(up))) {
      this.fallbackCalls++;
      ref.swiglu(out, gate, up, n);
      return;
    }
    // An exp costs about as much as 16 multiply-adds.
    if (this.#worker === null || n * 16 < this.#parallelMinWork || n < 8192) {
      this.#x.swiglu(out.byteOffset, gate.byteOffset, up.byteOffset, n);
      return;
    }
    const a = this.#args;
    a[0] = out.byteOffset;
    a[1] = gate.byteOffset;
    a[2] = up.byteOffset;
    a[3] = n;
    a[4] = this.#counter;
    a[5] = 4096;
    const s = this.#publish(OP_SWIGLU);
    try {
      this.#x.swigluPar(out.byteOffset, gate.byteOffset, up.byteOffset, n, this.#counter, 4096);
    } finally {
      this.#join(s);
    }
  }

  /**
   * Every sequence's attention as one job, so the two threads share a batch of short decode rows
   * (one call per sequence left the worker idle: each was too small to split).
   */
  pagedAttentionBatch(
    out: Float32Array,
    q: Float32Array,
    pool: Float32Array | Uint16Array,
    sequences: readonly AttentionSequence[],
    count: number,
    scratch: Float64Array,
    layer: number,
    numLayers: number,
    numHeads: number,
    numKvHeads: number,
    headDim: number,
    pageSize: number,
    kvDtype = 0,
  ): void {
    if (!(this.owns(out) && this.owns(q) && this.owns(pool))) {
      this.fallbackCalls++;
      ref.pagedAttentionBatch(
        out,
        q,
        pool,
        sequences,
        count,
        scratch,
        layer,
        numLayers,
        numHeads,
        numKvHeads,
        headDim,
        pageSize,
        kvDtype,
      );
      return;
    }
    this.#fence(out, "attention output");
    this.#fence(pool, "KV pool");
    // Stage the block tables one after another and a record of 5 i32 per sequence (see attentionPar).
    let seqCount = 0;
    let tablePages = 0;
    let maxCtx = 0;
    let totalRows = 0;
    let work = 0;
    let long = false;
    for (let i = 0; i < count; i++) {
      const s = sequences[i] as AttentionSequence;
      if (s.rows <= 0) continue;
      const ctx = s.startPos + s.rows;
      seqCount++;
      tablePages += Math.ceil(ctx / pageSize);
      maxCtx = Math.max(maxCtx, ctx);
      totalRows += s.rows;
      work += s.rows * numKvHeads * ctx * headDim * 2;
      if (ctx >= 512) long = true;
    }
    if (seqCount === 0) return;
    if (this.#table.length < tablePages)
      this.#table = this.allocI32(Math.max(tablePages, this.#table.length * 2));
    if (this.#seqRecords.length < 5 * seqCount) {
      this.#seqRecords = this.#records(5 * Math.max(seqCount, (this.#seqRecords.length / 5) * 2));
    }
    const table = this.#table;
    const records = this.#seqRecords;
    const solo = this.#worker === null || work < this.#parallelMinWork;
    // Work items read every KV head of a page together (one sweep over each page's contiguous K and
    // V rows: ×1.10 at 4,096 tokens of context); few rows with a short context are cut by KV head
    // instead, so both threads get work; one sequence of few rows with a long context also splits
    // each row's context (flash-decoding), and attentionMerge combines the splits.
    const kvParts = solo || totalRows >= 8 || long ? 1 : numKvHeads;
    const items = totalRows * kvParts;
    const splits =
      solo || items >= 8 || seqCount > 1
        ? 1
        : Math.min(8, Math.max(1, Math.floor((maxCtx - totalRows + 1) / 256)));
    let at = 0;
    let item = 0;
    let r = 0;
    for (let i = 0; i < count; i++) {
      const s = sequences[i] as AttentionSequence;
      if (s.rows <= 0) continue;
      const pages = Math.ceil((s.startPos + s.rows) / pageSize);
      for (let p = 0; p < pages; p++) table[at + p] = s.blockTable[p] as number;
      records[r] = s.rowStart;
      records[r + 1] = s.rows;
      records[r + 2] = s.startPos;
      records[r + 3] = table.byteOffset + 4 * at;
      records[r + 4] = item;
      at += pages;
      item += s.rows * kvParts * splits;
      r += 5;
    }
    const need = numHeads * (maxCtx + headDim); // scores, then (f16) the scaled query rows
    if (need > this.#scratchFloats) {
      const floats = Math.max(need, this.#scratchFloats * 2);
      this.#scratchMain = this.allocBytes(floats * 4);
      this.#scratchWorker = this.allocBytes(floats * 4);
      this.#scratchFloats = floats;
    }
    if (splits > 1) {
      const floats = totalRows * numHeads * splits * (headDim + 2);
      if (floats > this.#partialFloats) {
        const grown = Math.max(floats, this.#partialFloats * 2);
        this.#partial = this.allocBytes(grown * 4);
        this.#partialFloats = grown;
      }
    }
    const partial = this.#partial;
    const ml = partial + totalRows * numHeads * splits * headDim * 4;
    const counter = this.#counter;
    let job = 0;
    if (solo) {
      this.#resetCounters();
    } else {
      const a = this.#args;
      a[0] = out.byteOffset;
      a[1] = q.byteOffset;
      a[2] = pool.byteOffset;
      a[3] = records.byteOffset;
      a[4] = seqCount;
      a[5] = this.#scratchWorker;
      a[6] = layer;
      a[7] = numLayers;
      a[8] = numHeads;
      a[9] = numKvHeads;
      a[10] = headDim;
      a[11] = pageSize;
      a[12] = counter;
      a[13] = splits;
      a[14] = partial;
      a[15] = ml;
      a[16] = kvParts;
      a[17] = kvDtype;
      a[18] = pool.byteLength;
      a[19] = this.#scratchFloats * 4;
      job = this.#publish(OP_ATTENTION);
    }
    try {
      this.#x.attentionPar(
        out.byteOffset,
        q.byteOffset,
        pool.byteOffset,
        records.byteOffset,
        seqCount,
        this.#scratchMain,
        layer,
        numLayers,
        numHeads,
        numKvHeads,
        headDim,
        pageSize,
        counter,
        splits,
        partial,
        ml,
        kvParts,
        kvDtype,
        pool.byteLength,
        this.#scratchFloats * 4,
        0,
      );
    } finally {
      if (!solo) this.#join(job);
    }
    if (solo) return;
    if (splits > 1) {
      this.#x.attentionMerge(
        out.byteOffset,
        partial,
        ml,
        records[0] as number,
        totalRows,
        numHeads,
        headDim,
        splits,
      );
    }
  }

  /**
   * The KV write of one layer (the contract of reference.ts `storeKv`): each new K and V row goes
   * to its slot through `kvStore`, which rounds it to the pool's dtype in WebAssembly.
   */
  storeKv(
    pool: Float32Array | Uint16Array,
    k: Float32Array,
    v: Float32Array,
    sequences: readonly AttentionSequence[],
    count: number,
    layer: number,
    numLayers: number,
    numKvHeads: number,
    headDim: number,
    pageSize: number,
    kvDtype = 0,
  ): void {
    if (!(this.owns(pool) && this.owns(k) && this.owns(v))) {
      this.fallbackCalls++;
      ref.storeKv(pool, k, v, sequences, count, layer, numLayers, numKvHeads, headDim, pageSize, kvDtype);
      return;
    }
    const kvDim = numKvHeads * headDim;
    const el = pool.BYTES_PER_ELEMENT;
    const pageBytes = numLayers * 2 * pageSize * kvDim * el;
    const kBase = pool.byteOffset + layer * 2 * pageSize * kvDim * el;
    const vBase = kBase + pageSize * kvDim * el;
    const rowBytes = kvDim * 4;
    const x = this.#x;
    for (let s = 0; s < count; s++) {
      const seq = sequences[s] as AttentionSequence;
      for (let i = 0; i < seq.rows; i++) {
        const pos = seq.startPos + i;
        const page = seq.blockTable[(pos / pageSize) | 0] as number;
        const off = page * pageBytes + (pos % pageSize) * kvDim * el;
        const src = (seq.rowStart + i) * rowBytes;
        x.kvStore(kBase + off, k.byteOffset + src, kvDim, kvDtype);
        x.kvStore(vBase + off, v.byteOffset + src, kvDim, kvDtype);
      }
    }
  }

  // -------------------------------------------------------------------------------------------
  // job protocol (see the module header; the worker side is in wasm-kernels-worker.ts)

  #resetCounters(): void {
    Atomics.store(this.#ctl, CTL_COUNTER, 0);
    Atomics.store(this.#ctl, CTL_COUNTER + 16, 0);
  }

  /** Publishes the job whose arguments are in #args; returns its sequence number. */
  #publish(op: number): number {
    const ctl = this.#ctl;
    const s = this.#seq >= 0x1fffffff ? 1 : this.#seq + 1;
    this.#seq = s;
    this.#resetCounters();
    ctl[CTL_OP] = op;
    Atomics.store(ctl, CTL_TICKET, 2 * s);
    Atomics.store(ctl, CTL_SEQ, s);
    if (Atomics.load(ctl, CTL_WORKER_SLEEPING) !== 0) Atomics.notify(ctl, CTL_SEQ, 1);
    return s;
  }

  /** After the main thread ran out of chunks: cancel the job if the worker never took it, else wait for it. */
  #join(s: number): void {
    const ctl = this.#ctl;
    if (Atomics.compareExchange(ctl, CTL_TICKET, 2 * s, 0) === 2 * s) return;
    let spins = 0;
    while (Atomics.load(ctl, CTL_DONE) !== s) {
      if (++spins < 20_000) continue;
      Atomics.store(ctl, CTL_MAIN_SLEEPING, 1);
      const done = Atomics.load(ctl, CTL_DONE);
      if (done !== s) Atomics.wait(ctl, CTL_DONE, done, 1);
      Atomics.store(ctl, CTL_MAIN_SLEEPING, 0);
    }
  }
}
