/**
 * Builds an `Engine` from plain options: the model (a folder, or weights already in memory), the
 * forward pass and its KV page pool, the guards. The single-engine worker
 * (src/topology/engine-worker.ts) and the prefill and decode nodes (src/node/node-host.ts) build
 * their engines here, one way.
 */
import type { GrammarSource } from "../grammar/grammar-engine.js";
import type { PagePool } from "../kvcache/page-pool.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";
import { makeSafety } from "../protocol/safety.js";
import { Engine } from "./engine.js";
import type { KernelMemory, MemoryRegion } from "./engine-memory.js";
import { ENGINE_DEFAULTS, type EngineLimits, layoutOf, servedConfig } from "./engine-sizing.js";
import { createForward, type KernelsName } from "./forward-setup.js";
import { openTiers, type TierConfig } from "./open-tiers.js";
import { fromPortable, type PortableWeights } from "./portable-weights.js";

/**
 * What an engine is built from: plain data, so it crosses a thread boundary as a worker's
 * `workerData` (with its weights made portable first: `portableOptions`, src/engine/portable-weights.ts).
 */
export interface EngineBuildOptions extends EngineLimits {
  /**
   * A Hugging Face model folder or GGUF file, or a model already in memory (weights in
   * SharedArrayBuffers are not copied), its weights as views or, posted to a worker, portable.
   */
  readonly model:
    | { readonly dir: string }
    | { readonly config: ModelConfig; readonly weights: ModelWeights | PortableWeights };
  /** Prefill tokens per step. Default `maxBatchTokens`. */
  readonly maxPrefillTokens?: number;
  readonly scrubOnFree?: boolean;
  /** Guards to switch off (names from `src/protocol/safety.ts`; the engine honours `page-tags`). */
  readonly disabledGuards?: readonly string[];
  /** Faults to switch on (the engine honours the prefix cache's: `shared-prefix`, `prefix-collision`). */
  readonly faults?: readonly string[];
  /** Keep a tenant-fenced prefix cache (requests the engine serves end to end). Default false. */
  readonly prefixCache?: boolean;
  /** KV tiers below the pool (with `prefixCache`): `--cache-ram`, `--cache-disk` (docs/design.md §3b). */
  readonly tiers?: TierConfig;
  readonly seed?: number;
  /** Record the per-phase histograms (default true; off only for the overhead benchmark's baseline). */
  readonly phaseMetrics?: boolean;
  /**
   * The model folder or GGUF file whose tokenizer structured output masks by (default: `model.dir`);
   * read on the first constrained request. Absent with an in-memory model: such requests are refused.
   */
  readonly tokenizer?: string;
  /** `--otlp-endpoint`: the node built around this engine exports its spans there (the engine itself ignores it). */
  readonly otlpEndpoint?: string;
  /**
   * The forward pass's kernels: "wasm" (default, WebAssembly SIMD), "native" (the Node-API addon,
   * docs/kernels.md) or "ts" (the TypeScript reference). `--kernels auto` is resolved before this
   * (src/kernels/choose-kernels.ts).
   */
  readonly kernels?: KernelsName;
  /** Threads of the WebAssembly kernels: 1 (default, this thread only) or 2 (plus one spinning worker). */
  readonly kernelThreads?: 1 | 2;
  /**
   * WebAssembly kernels: the process's shared memory, which holds `model`'s weights, and this
   * engine's region of it (src/engine/engine-memory.ts). Absent: the engine makes its own memory
   * and copies the weights in.
   */
  readonly memory?: { readonly memory: KernelMemory; readonly region: MemoryRegion };
}

/**
 * Builds the engine from `options` (also usable in-thread by tests and benchmarks): the forward
 * pass and its pool on the WebAssembly kernels by default, weights, activations and pool in one
 * shared memory (src/engine/forward-setup.ts); `kernels: "ts"` keeps the TypeScript reference.
 */
export async function buildEngine(options: EngineBuildOptions): Promise<Engine> {
  let config: ModelConfig;
  let weights: ModelWeights;
  const tokenizerPath = options.tokenizer ?? ("dir" in options.model ? options.model.dir : undefined);
  if ("dir" in options.model) {
    // Loaded here only: an engine thread given weights in memory never loads the model readers.
    const { loadModelWeights, openModelMeta } = await import("../model/load-model.js");
    const meta = await openModelMeta(options.model.dir);
    config = meta.config;
    weights = loadModelWeights(meta, { shared: true });
  } else {
    config = options.model.config;
    const w = options.model.weights;
    weights = "portable" in w ? fromPortable(w) : w;
  }
  config = servedConfig(config, options.maxModelLen);
  const layout = layoutOf(config, options);
  const { forward, pools } = await createForward(config, weights, layout, {
    kernels: options.kernels ?? "wasm",
    kernelThreads: options.kernelThreads ?? 1,
    maxBatchTokens: options.maxBatchTokens ?? ENGINE_DEFAULTS.maxBatchTokens,
    maxSequences: options.maxSequences ?? ENGINE_DEFAULTS.maxSequences,
    poolPages: [options.numPages],
    scrubOnFree: options.scrubOnFree ?? false,
    ...(options.memory === undefined || options.kernels === "ts" ? {} : { shared: options.memory }),
  });
  const pool = pools[0] as PagePool;
  const safety = makeSafety({ disabledGuards: options.disabledGuards ?? [], faults: options.faults ?? [] });
  const tiers =
    options.tiers === undefined || options.prefixCache !== true
      ? undefined
      : await openTiers(options.tiers, pool, config, safety);
  return new Engine(forward, pool, {
    ...(options.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: options.maxPrefillTokens }),
    ...(options.maxModelLen === undefined ? {} : { maxModelLen: options.maxModelLen }),
    safety,
    prefixCache: options.prefixCache ?? false,
    ...(tiers === undefined ? {} : { tiers }),
    ...(options.seed === undefined ? {} : { seed: options.seed }),
    ...(options.phaseMetrics === undefined ? {} : { phaseMetrics: options.phaseMetrics }),
    ...(tokenizerPath === undefined ? {} : { grammar: grammarOf(tokenizerPath, config.vocabSize) }),
  });
}

/**
 * Structured output's grammar threads for the tokenizer at `path` (started on the first constrained
 * request). Their module loads then too: an engine thread that serves no constrained request never
 * loads it (src/node/node-worker-imports.test.ts).
 */
function grammarOf(path: string, vocabSize: number): () => Promise<GrammarSource> {
  return async () => {
    const { GrammarThreads } = await import("../grammar/grammar-thread.js");
    return new GrammarThreads({ tokenizerPath: path, vocabSize });
  };
}
