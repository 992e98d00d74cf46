/**
 * How big each engine's KV pool is, and whether this machine has the memory for the weights and
 * every pool (docs/api.md, "KV capacity").
 *
 * `--kv-pages N` or `--kv-memory SIZE` is taken as given. With neither, a pool holds one request of
 * the served context (`--max-model-len`, else the model's window) and at least
 * `DEFAULT_KV_MEMORY_BYTES` (256 MiB, so a small model keeps room for many requests): a 3B model
 * with `--max-model-len 8192` gets 896 MiB pools, where a fixed 256 MiB stopped the server.
 *
 * Why not all the memory there is, as vLLM gives its KV cache what a GPU has left after the weights
 * (90% of it)? A GPU's memory is the server's alone; a CPU's is shared with the system, the page
 * cache holding the weight files and other processes, and a pool's pages become resident as
 * requests first write them and stay so, so a pool sized to the free memory would starve the
 * machine once busy. What kvfence does take from vLLM is the refusal: before a
 * byte of the weights is read, the weights and every engine's region (its pool, activations and
 * staging) must fit in the memory available (`process.availableMemory()`: MemAvailable, or a
 * cgroup's limit), or the server stops with the numbers and the largest `--max-model-len` that fits.
 */
import { freemem } from "node:os";
import { type KvLayout, pageBytes } from "../kvcache/kv-layout.js";
import { PagePool } from "../kvcache/page-pool.js";
import { KvfenceError } from "../lib/errors.js";
import { DEFAULT_KV_MEMORY_BYTES } from "./serve-config.js";

/** What a process needs besides the weights and the engines' regions: Node, the router, the tokenizer threads. */
export const PROCESS_OVERHEAD_BYTES = 256 * 1024 ** 2;

/** Pages of an engine's pool: `--kv-pages`, `--kv-memory`, or one request of the context and at least 256 MiB. */
export function poolPagesOf(
  config: { readonly kvPages?: number | undefined; readonly kvMemory?: number | undefined },
  layout: KvLayout,
  contextLength: number,
): number {
  if (config.kvPages !== undefined) return config.kvPages;
  const bytesPerPage = pageBytes(layout);
  if (config.kvMemory !== undefined) return Math.floor(config.kvMemory / bytesPerPage);
  return Math.max(
    Math.ceil(contextLength / layout.pageSize),
    Math.floor(DEFAULT_KV_MEMORY_BYTES / bytesPerPage),
  );
}

/** The memory this process may take: `process.availableMemory()` (Node ≥ 20.13), else the free memory. */
export function availableMemoryBytes(): number {
  const p = process as { availableMemory?: () => number };
  return p.availableMemory?.() ?? freemem();
}

const gib = (bytes: number): string => `${(bytes / 1024 ** 3).toFixed(2)} GiB`;

/** An engine of this process: its pool's pages and its region's bytes (pool, activations, RoPE tables, staging). */
export interface EngineFootprint {
  readonly numPages: number;
  readonly regionBytes: number;
}

/**
 * Stops the server (`config_invalid`) before the weights load when the weights, every engine's
 * region and the process's overhead need more than `availableBytes`, or a pool passes what one
 * typed array holds (`PagePool.maxPages`); the message gives the numbers and the fixes, with the
 * largest context that fits when the pools follow the context.
 */
export function checkMemoryFits(input: {
  readonly weightBytes: number;
  /** The engines when serving `contextLength` tokens (their pools too, when `contextSized`). */
  readonly engines: (contextLength: number) => readonly EngineFootprint[];
  readonly layout: KvLayout;
  readonly contextLength: number;
  /** Whether the pools follow the context (neither `--kv-memory` nor `--kv-pages`). */
  readonly contextSized: boolean;
  readonly availableBytes: number;
}): void {
  const { weightBytes, layout, contextLength, availableBytes } = input;
  const bytesPerPage = pageBytes(layout);
  const need = (context: number): number =>
    weightBytes + PROCESS_OVERHEAD_BYTES + input.engines(context).reduce((sum, e) => sum + e.regionBytes, 0);
  const engines = input.engines(contextLength);
  const maxPages = PagePool.maxPages(layout);
  const maxTokens = maxPages * layout.pageSize;
  if (need(contextLength) > availableBytes) {
    // The largest context (whole pages, and what one pool holds) whose engines fit.
    let fits = 0;
    for (let lo = 1, hi = Math.ceil(Math.min(contextLength - 1, maxTokens) / layout.pageSize); lo <= hi; ) {
      const mid = Math.floor((lo + hi) / 2);
      if (need(mid * layout.pageSize) <= availableBytes) {
        fits = mid * layout.pageSize;
        lo = mid + 1;
      } else hi = mid - 1;
    }
    const context = input.contextSized && fits > 0 ? `a smaller context (--max-model-len ${fits}), ` : "";
    const pools = engines.map(
      (e) => `${gib(e.numPages * bytesPerPage)} (${e.numPages * layout.pageSize} tokens)`,
    );
    throw new KvfenceError(
      "config_invalid",
      `The weights (${gib(weightBytes)}) and ${engines.length} engine(s) with KV pools of ${pools.join(" and ")} need ${gib(need(contextLength))} but ${gib(availableBytes)} of memory is available; fix: ${context}a smaller pool (--kv-memory or --kv-pages), or a smaller weight format (--quantize q8_0)`,
    );
  }
  const tooBig = engines.find((e) => e.numPages > maxPages);
  if (tooBig !== undefined) {
    const context =
      input.contextSized && contextLength > maxTokens ? `--max-model-len ${maxTokens}, or ` : "";
    throw new KvfenceError(
      "config_invalid",
      `A KV pool of ${tooBig.numPages} pages (${gib(tooBig.numPages * bytesPerPage)}) is more than one pool holds: at most 2^32 elements, ${maxPages} pages (${maxTokens} tokens) of this layout; fix: ${context}a smaller --kv-memory or --kv-pages`,
    );
  }
}
