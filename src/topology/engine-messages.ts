/**
 * The messages between `engine-client.ts` (main thread) and `engine-worker.ts`. Plain data only: they
 * cross the thread boundary by structured clone.
 */
import type { WireError } from "../lib/errors.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { EngineCapacity, EngineStats, GenerationRequest } from "../protocol/engine-api.js";

/** Messages from the client to the worker. */
export type ToEngineWorker =
  /**
   * The requests submitted in one turn of the client's event loop, in order: the engine sees them
   * all before its next step (a request's other samples are there when its first one's prompt is
   * computed, to fork it).
   */
  | { readonly type: "submit"; readonly requests: readonly GenerationRequest[] }
  | { readonly type: "abort"; readonly rid: number }
  | { readonly type: "stats"; readonly id: number }
  /** Readiness: answer `pong` at once (between two engine steps). */
  | { readonly type: "ping"; readonly id: number }
  | { readonly type: "close" };

/** Finish reasons as numbers in `EngineEventsMessage.finishes`. */
export const FINISH_REASONS = ["stop", "length"] as const;

/** Numbers per finish in `EngineEventsMessage.finishes`. */
export const FINISH_STRIDE = 6;

/** Everything one step (or one message) produced, batched into one message (packed and unpacked by engine-events.ts). */
export interface EngineEventsMessage {
  readonly type: "events";
  /** Runs of `rid, count, token × count`. */
  readonly tokens: number[];
  /** When a request asked for log-probabilities: entry i for the i-th run of `tokens` (null: none). */
  readonly logprobs?: (TokenLogprobs[] | null)[];
  /** Prompt log-probabilities, before the tokens. */
  readonly prompts?: { rid: number; entries: readonly (TokenLogprobs | null)[] }[];
  /**
   * Runs of `rid, reason index (FINISH_REASONS), promptTokens, completionTokens, cachedTokens,
   * stopTokenId` (cachedTokens -1: the prefix cache is off; stopTokenId -1: none); after the tokens.
   */
  readonly finishes: number[];
  readonly errors: { rid: number; error: WireError }[];
}

/** Messages from the worker to the client. */
export type FromEngineWorker =
  | { readonly type: "ready"; readonly capacity: EngineCapacity }
  | { readonly type: "failed"; readonly error: WireError }
  | EngineEventsMessage
  | { readonly type: "stats"; readonly id: number; readonly stats: EngineStats }
  | { readonly type: "pong"; readonly id: number }
  | { readonly type: "closed" };

/** Marks `workerData` as ours, so importing this module elsewhere never starts a worker. */
export const ENGINE_WORKER_TAG = "kvfence-engine-worker";
