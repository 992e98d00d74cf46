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
 * SharedArrayBuffer of the same layout (`{ buffer }`), which has no 4 GiB limit.
 *
 * A region's size is planned here from the engine's limits (`engineRegionBytes`) and is fixed: the
 * memory never grows (a grow by one thread while another runs would race with the plan). wasm32
 * addresses 4 GiB, so weights plus every region must fit; the plan says so with the numbers before
 * a byte is read.
 */
import { statSync } from "node:fs";
import type { KernelMemory, MemoryRegion } from "../kernels/wasm-kernels.js";
import { type Matrix, matrixBytes, type WeightTensor, weightBytes } from "../kernels/weight-format.js";
import { DEFAULT_KV_CACHE_DTYPE, type KvDtype, type KvLayout } from "../kvcache/kv-layout.js";
import { PagePool } from "../kvcache/page-pool.js";
import { KvfenceError } from "../lib/errors.js";
import { ForwardPass } from "../model/forward.js";
import {
  expectedTensors,
  type LoadProgress,
  loadModelWeights,
  type ModelMeta,
  weightFilesOf,
} from "../model/load-model.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";

const PAGE_BYTES = 65536;
/** What wasm32 addresses, in 64 KiB pages. */
const MAX_PAGES = 65536;
/** The first 64 KiB stay unused (as in a kernel set's own memory). */
const WEIGHTS_START = 65536;

const aligned = (bytes: number): number => Math.ceil(bytes / 64) * 64;

export type { KernelMemory, MemoryRegion };

/** The step limits an engine gets by default (`maxBatchTokens`, `maxSequences`, `pageSize`). */
export const ENGINE_DEFAULTS = { maxBatchTokens: 256, maxSequences: 16, pageSize: 16 } as const;

/** The limits and pool an engine is built with (part of its build options, src/engine/build-engine.ts). */
export interface EngineLimits {
  /** Pages in the KV pool. */
  readonly numPages: number;
  /** Tokens per page. Default 16. */
  readonly pageSize?: number;
  /** The KV cache element type (`--kv-cache-dtype`). Default f16. */
  readonly kvCacheDtype?: KvDtype;
  /** Tokens per forward step. Default 256. */
  readonly maxBatchTokens?: number;
  /** Requests per forward step. Default 16. */
  readonly maxSequences?: number;
}

/** Bytes of an engine's region in a shared memory, from its build options' limits and pool. */
export function regionBytesOf(config: ModelConfig, options: EngineLimits): number {
  return engineRegionBytes(config, layoutOf(config, options), {
    maxBatchTokens: options.maxBatchTokens ?? ENGINE_DEFAULTS.maxBatchTokens,
    maxSequences: options.maxSequences ?? ENGINE_DEFAULTS.maxSequences,
    poolPages: [options.numPages],
  });
}

/** What one engine is sized by. */
export interface EngineSizing {
  readonly maxBatchTokens: number;
  readonly maxSequences: number;
  /** Pages of each of its KV pools. */
  readonly poolPages: readonly number[];
}

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

/** An engine's KV page layout: the model's shape, its page size and its KV cache dtype. */
export function layoutOf(
  config: ModelConfig,
  options: { readonly pageSize?: number; readonly kvCacheDtype?: KvDtype },
): KvLayout {
  return {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: options.pageSize ?? ENGINE_DEFAULTS.pageSize,
    dtype: options.kvCacheDtype ?? DEFAULT_KV_CACHE_DTYPE,
  };
}

/**
 * Bytes an engine's kernels allocate at most: the control block and small records, the forward
 * pass's buffers, its pools, the attention staging at the longest context (grown by doubling) and
 * the matmul's packed rows (likewise), plus 1 MiB of slack.
 */
export function engineRegionBytes(config: ModelConfig, layout: KvLayout, sizing: EngineSizing): number {
  const pools = sizing.poolPages.reduce((sum, n) => sum + aligned(PagePool.dataBytesFor(layout, n)), 0);
  const totalPages = sizing.poolPages.reduce((a, b) => a + b, 0);
  return aligned(
    64 * 1024 +
      ForwardPass.bufferBytes(config, sizing) +
      pools +
      attentionStagingBytes(config, totalPages) +
      matmulScratchBytes(config, sizing.maxBatchTokens) +
      (1 << 20),
  );
}

/**
 * What a matmul's prepared x (packed rows, or quantised activations with their scales) takes at
 * most, twice over (it grows by doubling): the largest of rows·inDim·4 floats' worth, a generous
 * bound for both kernel sets' `prepare`.
 */
export function matmulScratchBytes(config: ModelConfig, maxBatchTokens: number): number {
  const maxIn = Math.max(config.hiddenSize, config.numHeads * config.headDim, config.intermediateSize);
  return 2 * Math.ceil(maxBatchTokens / 8) * Math.ceil(maxIn / 4) * 128;
}

/**
 * What `WasmKernels.pagedAttentionBatch` stages on demand at the longest context: the block
 * tables, two score scratches and the split partials, twice over (they grow by doubling), plus 1 MiB
 * of slack for the control block, the per-sequence records and alignment.
 */
export function attentionStagingBytes(config: ModelConfig, numPages: number): number {
  const group = config.numHeads / config.numKvHeads;
  const ctx = config.maxPositionEmbeddings;
  const partials = config.numHeads * 8 * (config.headDim + 2);
  return 2 * (4 * numPages + 2 * 4 * group * ctx + 4 * partials) + (1 << 20);
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
  meta: ModelMeta,
  regionBytes: readonly number[],
  options?: {
    readonly onProgress?: (progress: LoadProgress) => void;
    readonly quantize?: "q8_0" | "q4_0";
    /** "native": a plain SharedArrayBuffer, no 4 GiB limit; else (default) a WebAssembly.Memory. */
    readonly kernels?: "wasm" | "native";
  },
): EngineMemory {
  const fileBytes = weightFilesOf(meta).reduce((sum, f) => sum + aligned(statSync(f).size), 0);
  const tailBytes = [...expectedTensors(meta.config).values()].reduce((sum, shape) => {
    const n = shape.reduce((a, b) => a * b, 1);
    if (shape.length !== 2) return sum + aligned(4 * n);
    return options?.quantize === undefined ? sum : sum + aligned(weightBytes(options.quantize, n));
  }, 0);
  const weightBytesTotal = fileBytes + tailBytes;
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
  const into = (bytes: number): Uint8Array => {
    const view = new Uint8Array(buffer, next, bytes);
    next += aligned(bytes);
    return view;
  };
  const loaded = loadModelWeights(meta, {
    into,
    ...(options?.onProgress === undefined ? {} : { onProgress: options.onProgress }),
    ...(options?.quantize === undefined ? {} : { quantize: options.quantize }),
  });
  const tailEnd = WEIGHTS_START + weightBytesTotal;
  const gather = <M extends Matrix>(m: M): M => {
    const src = matrixBytes(m);
    if (src.buffer === buffer || next + src.byteLength > tailEnd) return m;
    const dst = into(src.byteLength);
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
