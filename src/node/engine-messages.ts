/**
 * The messages between `engine-client.ts` (main thread) and `engine-worker.ts`, and the worker's
 * options. Plain data only: they cross the thread boundary by structured clone.
 */
import type { EngineCapacity, EngineStats, GenerationRequest } from "../engine/engine-types.js";
import type { WireError } from "../lib/errors.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";

/** What the worker is built from (its `workerData`, plain data). */
export interface EngineWorkerOptions {
  /** A Hugging Face model folder, or a model already in memory (weights in SharedArrayBuffers are not copied). */
  readonly model: { readonly dir: string } | { readonly config: ModelConfig; readonly weights: ModelWeights };
  /** Pages in the KV pool. */
  readonly numPages: number;
  /** Tokens per page. Default 16. */
  readonly pageSize?: number;
  /** Tokens per forward step. Default 256. */
  readonly maxBatchTokens?: number;
  /** Requests per forward step. Default 16. */
  readonly maxSequences?: number;
  /** Prefill tokens per step. Default `maxBatchTokens`. */
  readonly maxPrefillTokens?: number;
  /** Context length to serve. Default: the model's window. */
  readonly maxModelLen?: number;
  readonly scrubOnFree?: boolean;
  /** Guards to switch off (names from `src/protocol/safety.ts`; the engine honours `page-tags`). */
  readonly disabledGuards?: readonly string[];
  readonly seed?: number;
  /** The forward pass's kernels: "wasm" (default, WebAssembly SIMD) or "ts" (the TypeScript reference). */
  readonly kernels?: "ts" | "wasm";
  /** Threads of the WebAssembly kernels: 1 (default, this thread only) or 2 (plus one spinning worker). */
  readonly kernelThreads?: 1 | 2;
}

/** Messages from the client to the worker. */
export type ToEngineWorker =
  | { readonly type: "submit"; readonly request: GenerationRequest }
  | { readonly type: "abort"; readonly rid: number }
  | { readonly type: "stats"; readonly id: number }
  | { readonly type: "close" };

/** Finish reasons as numbers in `EngineEventsMessage.finishes`. */
export const FINISH_REASONS = ["stop", "length"] as const;

/** Everything one step (or one message) produced, batched into one message. */
export interface EngineEventsMessage {
  readonly type: "events";
  /** Runs of `rid, count, token × count`. */
  readonly tokens: number[];
  /** Runs of `rid, reason index (FINISH_REASONS), promptTokens, completionTokens`; after the tokens. */
  readonly finishes: number[];
  readonly errors: { rid: number; error: WireError }[];
}

/** Messages from the worker to the client. */
export type FromEngineWorker =
  | { readonly type: "ready"; readonly capacity: EngineCapacity }
  | { readonly type: "failed"; readonly error: WireError }
  | EngineEventsMessage
  | { readonly type: "stats"; readonly id: number; readonly stats: EngineStats }
  | { readonly type: "closed" };

/** Marks `workerData` as ours, so importing this module elsewhere never starts a worker. */
export const ENGINE_WORKER_TAG = "kvfence-engine-worker";
