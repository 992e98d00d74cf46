/**
 * One copy of the weights for every engine of a process (issue #15 item 4, docs/design.md §2): a
 * single shared `WebAssembly.Memory` laid out once, before anything is read —
 *
 *   [64 KiB unused][the weights, each tensor 64-byte aligned][engine 0's region][engine 1's region]…
 *
 * — then the weight files are read straight into it (fs.readSync into views of the memory's
 * buffer: no JavaScript copy of a file exists at any point; the tensors are views of it in their
 * stored format, src/kernels/weight-format.ts), and each engine thread
 * (the prefill and decode nodes of the default topology, or the one engine) runs its own kernel
 * set over the same memory with its region as its arena: its control block, activations, staging
 * and its own KV pool. The regions never overlap and the kernels refuse to write or to read a KV
 * pool outside their own region (`WasmKernels`' fence), so the pools stay separate and fenced as
 * when each engine had its own memory; what they share is read-only weights.
 *
 * On the native kernels (`kernels: "native"`, docs/kernels.md) the memory is a plain
 * SharedArrayBuffer of the same layout (`{ buffer }`), which has no 4 GiB limit, and each weight
 * file is mapped over its window (copy-on-write, each on a page boundary) instead of read into it:
 * the page cache's pages, faulted in as first read, no copy (the file is read where that fails).
 *
 * A region's size is planned here from the engine's limits (`engineRegionBytes`) and is fixed: the
 * memory never grows (a grow by one thread while another runs would race with the plan). wasm32
 * addresses 4 GiB, so weights plus every region must fit; the plan says so with the numbers before
 * a byte is read.
 */
import { statSync } from "node:fs";
import { loadNativeAddon } from "../kernels/kernel-backend.js";
import type { KernelMemory, MemoryRegion } from "../kernels/wasm-kernels.js";
import { type Matrix, matrixBytes, type WeightTensor, weightBytes } from "../kernels/weight-format.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import { KvfenceError } from "../lib/errors.js";
import {
  expectedTensors,
  type LoadProgress,
  loadModelWeights,
  type ModelHeader,
  weightFilesOf,
} from "../model/load-model.js";
import type { ModelWeights } from "../model/model-config.js";
import { aligned } from "./engine-sizing.js";

const PAGE_BYTES = 65536;
/** What wasm32 addresses, in 64 KiB pages. */
const MAX_PAGES = 65536;
/** The first 64 KiB stay unused (as in a kernel set's own memory). */
const WEIGHTS_START = 65536;
/** The page size `loadEngineMemory` aligns a mapped file to (4 KiB; a larger page just falls back to reading). */
const MAP_PAGE_BYTES = 4096;

export {
  attentionStagingBytes,
  ENGINE_DEFAULTS,
  type EngineLimits,
  type EngineSizing,
  engineRegionBytes,
  layoutOf,
  matmulScratchBytes,
  regionBytesOf,
  servedConfig,
} from "./engine-sizing.js";
export type { KernelMemory, MemoryRegion };

/** A shared memory holding the weights, with one region per engine. */
export interface EngineMemory {
  /** A `WebAssembly.Memory` (wasm kernels) or `{ buffer }` over a plain SharedArrayBuffer (native). */
  readonly memory: KernelMemory;
  /** The weights as views of the memory's buffer. */
  readonly weights: ModelWeights;
  readonly regions: readonly MemoryRegion[];
  /** Bytes of the weights in the memory. */
  readonly weightBytes: number;
}

/**
 * Bytes the weights of `meta` take in the engines' memory: the weight files whole (each with a page
 * of slack, to start on a page boundary when mapped: `loadEngineMemory`), and a tail for what cannot be a
 * view of them (the norms widened to f32, the matrices `quantize` converts).
 */
export function weightMemoryBytes(meta: ModelHeader, quantize?: "q8_0" | "q4_0"): number {
  const fileBytes = weightFilesOf(meta).reduce(
    (sum, f) => sum + MAP_PAGE_BYTES + aligned(statSync(f).size),
    0,
  );
  const tailBytes = [...expectedTensors(meta.config).values()].reduce((sum, shape) => {
    const n = shape.reduce((a, b) => a * b, 1);
    if (shape.length !== 2) return sum + aligned(4 * n);
    return quantize === undefined ? sum : sum + aligned(weightBytes(quantize, n));
  }, 0);
  return fileBytes + tailBytes;
}

/**
 * Lays out the memory for the weights of `meta` and one region of each size in `regionBytes`,
 * creates it and reads the weight files into it whole: every tensor is a view of them, in its
 * stored format. What cannot be a view — a norm stored as bf16 (widened to f32), a matrix
 * `quantize` converts — is moved into the tail reserved after the files; anything beyond that
 * (an f32 tensor at an odd offset) stays where the loader put it, and each engine copies it into
 * its region. Refuses (`config_invalid`, with the numbers) a plan beyond wasm32's 4 GiB before
 * reading anything.
 */
export function loadEngineMemory(
  meta: ModelHeader,
  regionBytes: readonly number[],
  options?: {
    readonly onProgress?: (progress: LoadProgress) => void;
    readonly quantize?: "q8_0" | "q4_0";
    /** "native": a plain SharedArrayBuffer, no 4 GiB limit; else (default) a WebAssembly.Memory. */
    readonly kernels?: "wasm" | "native";
  },
): EngineMemory {
  const weightBytesTotal = weightMemoryBytes(meta, options?.quantize);
  const regions: MemoryRegion[] = [];
  let at = WEIGHTS_START + weightBytesTotal;
  for (const bytes of regionBytes) {
    regions.push({ start: at, end: at + aligned(bytes) });
    at += aligned(bytes);
  }
  const pages = Math.ceil(at / PAGE_BYTES);
  const native = options?.kernels === "native";
  if (!native && pages > MAX_PAGES) {
    const gib = (b: number): string => `${(b / 1024 ** 3).toFixed(2)} GiB`;
    throw new KvfenceError(
      "config_invalid",
      `The weights and the engines' memory need ${gib(at)} (weights ${gib(weightBytesTotal)}, ${regionBytes.length} engine region(s) of ${regionBytes.map(gib).join(" and ")}) but WebAssembly addresses at most 4 GiB; use --kernels native, a smaller --kv-memory or --kv-pages, --max-model-len, a smaller weight format, or --kernels ts`,
    );
  }
  const memory: KernelMemory = native
    ? { buffer: new SharedArrayBuffer(pages * PAGE_BYTES) }
    : new WebAssembly.Memory({ initial: pages, maximum: pages, shared: true });
  const buffer = memory.buffer as SharedArrayBuffer;
  let next = WEIGHTS_START;
  // A byte range, not a view: a weight file may pass 4 GiB (the loader reads it in pieces).
  const into = (bytes: number): ByteRange => {
    const range = { buffer, byteOffset: next, byteLength: bytes };
    next += aligned(bytes);
    return range;
  };
  // Native: each weight file is mapped copy-on-write over its window, on the next page boundary
  // (the page of slack `weightMemoryBytes` plans), in place of reading it: no copy, its pages are
  // the page cache's, faulted in as the first step reads them (on this VM, reading 143 MB into
  // fresh memory and then touching it took about 1 s; mapping it and touching it 0.2 s). Where
  // that fails (no addon, another page size, the system's refusal) the file is read as before.
  const addon = native ? loadNativeAddon() : null;
  const map = (fd: number, bytes: number): ByteRange | null => {
    if (addon === null || "error" in addon) return null;
    const view = new Uint8Array(buffer, 0, 16);
    const at =
      next + ((MAP_PAGE_BYTES - ((addon.addon.pageOffset(view) + next) % MAP_PAGE_BYTES)) % MAP_PAGE_BYTES);
    if (!addon.addon.mapFile(view, buffer.byteLength, at, fd, bytes)) return null;
    next = at + aligned(bytes);
    return { buffer, byteOffset: at, byteLength: bytes };
  };
  const loaded = loadModelWeights(meta, {
    into,
    ...(native ? { map } : {}),
    ...(options?.onProgress === undefined ? {} : { onProgress: options.onProgress }),
    ...(options?.quantize === undefined ? {} : { quantize: options.quantize }),
  });
  const tailEnd = WEIGHTS_START + weightBytesTotal;
  const gather = <M extends Matrix>(m: M): M => {
    const src = matrixBytes(m);
    if (src.buffer === buffer || next + src.byteLength > tailEnd) return m;
    const dst = byteView(into(src.byteLength), 0, src.byteLength);
    dst.set(src);
    if (m instanceof Float32Array) return new Float32Array(buffer, dst.byteOffset, m.length) as M;
    return { ...(m as WeightTensor), bytes: dst } as M;
  };
  const opt = (a: Float32Array | null): Float32Array | null => (a === null ? null : gather(a));
  const embed = gather(loaded.embed);
  const weights: ModelWeights = Object.freeze({
    embed,
    layers: Object.freeze(
      loaded.layers.map((l) =>
        Object.freeze({
          inputNorm: gather(l.inputNorm),
          q: gather(l.q),
          k: gather(l.k),
          v: gather(l.v),
          qBias: opt(l.qBias),
          kBias: opt(l.kBias),
          vBias: opt(l.vBias),
          o: gather(l.o),
          postNorm: gather(l.postNorm),
          gate: gather(l.gate),
          up: gather(l.up),
          down: gather(l.down),
        }),
      ),
    ),
    finalNorm: gather(loaded.finalNorm),
    lmHead: loaded.lmHead === loaded.embed ? embed : gather(loaded.lmHead),
  });
  return { memory, weights, regions, weightBytes: weightBytesTotal };
}
