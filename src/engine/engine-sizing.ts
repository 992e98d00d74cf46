/**
 * How big an engine's region of the shared memory is (src/engine/engine-memory.ts lays the memory
 * out and reads the weights into it): its default step limits, its KV layout, and the bytes its
 * forward pass, pools, attention staging and matmul scratch take at most. Kept apart from the
 * loading so an engine thread, which only sizes and uses its region, does not load the model
 * readers (the tokenizer, the config schema) it never calls.
 */
import type { KvDtype, KvLayout } from "../kvcache/kv-layout.js";
import { DEFAULT_KV_CACHE_DTYPE } from "../kvcache/kv-layout.js";
import { PagePool } from "../kvcache/page-pool.js";
import { ForwardPass } from "../model/forward.js";
import type { ModelConfig } from "../model/model-config.js";

/** `bytes` rounded up to a multiple of 64 (every tensor and region is 64-byte aligned). */
export const aligned = (bytes: number): number => Math.ceil(bytes / 64) * 64;

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
  /** Context length to serve. Default: the model's window. */
  readonly maxModelLen?: number;
}

/**
 * The model's config as an engine serving at most `maxModelLen` tokens sees it: its window is the
 * served context, so the RoPE tables and the attention staging are sized by it, not by the model's
 * window (Llama-3.2-3B's 131,072 positions: 128 MiB of RoPE tables an engine).
 */
export function servedConfig(config: ModelConfig, maxModelLen: number | undefined): ModelConfig {
  if (maxModelLen === undefined || maxModelLen >= config.maxPositionEmbeddings) return config;
  return { ...config, maxPositionEmbeddings: maxModelLen };
}

/** Bytes of an engine's region in a shared memory, from its build options' limits and pool. */
export function regionBytesOf(model: ModelConfig, options: EngineLimits): number {
  const config = servedConfig(model, options.maxModelLen);
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
