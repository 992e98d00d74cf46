/**
 * The contract between the HTTP router and the engine. The router assigns request ids, tokenizes,
 * matches stop *strings* itself (then calls `abort`), and turns these events into SSE/JSON. The
 * engine runs in a worker thread (`src/topology/engine-worker.ts`); `src/topology/engine-client.ts` is the
 * main-thread `EngineHandle` that proxies it over a MessagePort, batching tokens per step.
 */
import type { WireError } from "../lib/errors.js";
import type { NodeInfo } from "./admin-wire.js";

/** One generation request, as the engine sees it (already tokenized and validated by the router). */
export interface GenerationRequest {
  /** u32, unique per request (router assigns). */
  readonly rid: number;
  /** u32 tenant index from the API key. */
  readonly tenant: number;
  readonly promptTokens: Int32Array;
  readonly maxTokens: number;
  /** 0 = greedy. */
  readonly temperature: number;
  readonly topP: number;
  /** 0 = off. */
  readonly topK: number;
  readonly seed: number | null;
  /** EOS ids; stop *strings* are matched by the router, which then aborts. */
  readonly stopTokenIds: readonly number[];
  /**
   * The client's `cache_salt` (narrows the prefix-cache namespace; never replaces the tenant's).
   * Absent or null: none.
   */
  readonly cacheSalt?: string | null;
  /**
   * The server's prefix-cache namespace within the tenant (`--prefix-cache-scope key`: the API
   * key's; absent or "": the tenant's).
   */
  readonly cacheScope?: string;
}

/** Token counts of a finished request. */
export interface GenerationUsage {
  promptTokens: number;
  completionTokens: number;
  /** Prompt tokens served from the prefix cache (present when the cache is on). */
  cachedTokens?: number;
}

/** What the engine reports for one request. Exactly one of `onFinish`/`onError` ends it (none after `abort`). */
export interface GenerationEvents {
  /**
   * One or more new tokens (batched per step). The stop token id that ends a request with `stop`
   * is not reported here; it counts in `usage.completionTokens`.
   */
  onTokens(tokenIds: readonly number[]): void;
  onFinish(reason: "stop" | "length", usage: GenerationUsage): void;
  /** E.g. `context_length_exceeded` at the engine's door, `page_tag_mismatch`. */
  onError(error: WireError): void;
}

export interface EngineCapacity {
  readonly poolTokens: number;
  readonly pageSize: number;
  readonly maxModelLen: number;
  /** Requests one forward step batches (sequence slots), over every engine that decodes. */
  readonly maxSequences?: number;
}

/** For /metrics and the idle-pool checks in tests. */
export interface EngineStats {
  pages: { free: number; reserved: number; ready: number; quarantined: number; total: number };
  queue: { waiting: number; running: number; preempted: number };
  counters: {
    tagCheckFailures: number;
    preemptions: number;
    aborts: number;
    promptTokens: number;
    completionTokens: number;
  };
  /** The prefix cache's counters and pages (present when it is on). */
  prefixCache?: {
    hits: number;
    misses: number;
    hitTokens: number;
    evictions: number;
    collisions: number;
    sharedPages: number;
    evictablePages: number;
  };
}

/** Readiness of one role's nodes: how many answer now, of how many. */
export interface RoleHealth {
  readonly ready: number;
  readonly total: number;
}

/**
 * Liveness and readiness, kept up to date in the background (pings with a deadline) and read
 * without waiting on any node: `/health` and `/ready` answer from it at once.
 */
export interface EngineHealth {
  /** False once the engine can never serve again (its worker died): restart the process. */
  readonly live: boolean;
  /** True when a request submitted now can be served: a prefill/decode pair (or the engine) answers. */
  readonly ready: boolean;
  /** Why it is not ready, for operators: roles and counts only, never internal ids or addresses. */
  readonly reason: string | null;
  /** The disaggregated topologies: nodes that answer, by role. */
  readonly prefill?: RoleHealth;
  readonly decode?: RoleHealth;
}

export interface EngineHandle {
  readonly capacity: EngineCapacity;
  submit(request: GenerationRequest, events: GenerationEvents): void;
  /** Idempotent; frees the request's pages exactly once. No further events for `rid` after this. */
  abort(rid: number): void;
  stats(): Promise<EngineStats>;
  close(): Promise<void>;
  /** The nodes behind this handle for `/kvfence/nodes` (the disaggregated topology); absent: one engine. */
  nodes?(): NodeInfo[];
  /** Liveness and readiness now, without waiting (absent: always live and ready). */
  health?(): EngineHealth;
}
