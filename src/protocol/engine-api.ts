/**
 * The contract between the HTTP router and the engine. The router assigns request ids, tokenizes,
 * matches stop *strings* itself (then calls `abort`), and turns these events into SSE/JSON. The
 * engine runs in a worker thread (`src/topology/engine-worker.ts`); `src/topology/engine-client.ts` is the
 * main-thread `EngineHandle` that proxies it over a MessagePort, batching tokens per step.
 */

import type { NodeInfo } from "../admin-api/admin-wire.js";
import type { WireError } from "../lib/errors.js";
import type { PhaseSnapshot } from "../lib/phase-histograms.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { RequestTrace } from "../lib/tracing.js";
import type { SamplingParams } from "./sampling-params.js";

/** One generation request, as the engine sees it (already tokenized and validated by the router). */
export interface GenerationRequest {
  /** u32, unique per request (router assigns). */
  readonly rid: number;
  /** u32 tenant index from the API key. */
  readonly tenant: number;
  readonly promptTokens: Int32Array;
  readonly maxTokens: number;
  /** How its tokens are drawn and reported, as the router's parser built it (carried whole). */
  readonly sampling: SamplingParams;
  /**
   * One of a request's `n` samples other than the first (`index` ≥ 1; `of`: the first's rid, submitted
   * before it). An engine that runs the first may fork its computed prompt for this one (copy its
   * KV into this sample's own pages and draw this sample's first token from the same logits)
   * instead of computing it again; otherwise it is an ordinary request.
   */
  readonly sample?: { readonly of: number; readonly index: number } | undefined;
  /**
   * The first sample of a request of `n` > 1 whose samples run as one group on a prefill and a
   * decode node: the rids of its later samples, in order (each `rid` + j; the decode machine forks
   * them after the one transfer, docs/protocol.md §3, item 14). An engine that runs it alone ignores it.
   */
  readonly samples?: readonly number[] | undefined;
  /**
   * Its HTTP request's generations, when there are several (`n` > 1, several prompts): the first
   * one's rid and how many. They are submitted one after the other in the same turn; the engine
   * admits them as one (src/fair-share/fair-share.ts): all start or none does, and a group that could
   * never run at once under its tenant's caps or in the pool is refused whole. Absent: on its own.
   */
  readonly group?: { readonly first: number; readonly size: number } | undefined;
  /** The HTTP request's id and trace context (logs and spans; src/lib/tracing.ts). */
  readonly trace?: RequestTrace;
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
  /**
   * The tenant's cache epoch (keys file `cache_epoch`; absent: 0): part of the prefix-cache salt,
   * so raising it retires every page cached before, in the pool and in the KV tiers.
   */
  readonly cacheEpoch?: number;
}

/** Token counts of a finished request. */
export interface GenerationUsage {
  promptTokens: number;
  completionTokens: number;
  /** Prompt tokens served from the prefix cache (present when the cache is on). */
  cachedTokens?: number;
  /** The stop token (EOS) that ended a `stop` finish, when the engine knows it (SGLang's matched_stop). */
  stopTokenId?: number;
  /** Times it migrated mid-stream to another prefill/decode pair (src/cluster/migration.ts); absent: none. */
  migrations?: number;
}

/** What the engine reports for one request. Exactly one of `onFinish`/`onError` ends it (none after `abort`). */
export interface GenerationEvents {
  /**
   * One or more new tokens (batched per step). The stop token id that ends a request with `stop`
   * is not reported here; it counts in `usage.completionTokens`. `logprobs` (when the request
   * asked) has one entry per token; the arrays may be reused after the call: copy what you keep.
   */
  onTokens(tokenIds: readonly number[], logprobs?: readonly TokenLogprobs[]): void;
  /**
   * The prompt's log-probabilities when the request asked (`promptLogprobs`): entry i for prompt
   * token i, null for the first (nothing precedes it). Once, before the first `onTokens`.
   */
  onPromptLogprobs?(entries: readonly (TokenLogprobs | null)[]): void;
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
    /** Prompt tokens computed (one engine; absent elsewhere). */
    prefillTokens?: number;
    /** Samples of n > 1 forked from their first sample's prompt KV (one engine). */
    forkedSamples?: number;
    /** Engine steps that decoded at least one token (a batch of B decodes B tokens in one step). */
    decodeSteps?: number;
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
  /** The KV tiers below the pool (present when the engine has them, docs/design.md §3b). */
  tiers?: EngineTierStats;
  /** The engine's per-phase histograms so far (absent from a handle that keeps none). */
  phases?: PhaseSnapshot;
  /** Every page's state and tenant (absent from a handle that sums several pools). */
  pageMap?: PageMap;
}

/**
 * The KV tiers' pages and bytes now, and their counters: pages spilled from the pool, records loaded
 * back verified (by the tier they came from), prompt tokens those loads served (pages promoted into
 * the pool times the page size), loads refused by reason (the guard that refused them), records
 * dropped out of the last tier for room.
 */
export interface EngineTierStats {
  pages: { ram: number; disk: number };
  bytes: { ram: number; disk: number };
  spills: number;
  loads: { ram: number; disk: number };
  hitTokens: { ram: number; disk: number };
  rejected: { format: number; mac: number; owner: number; epoch: number };
  dropped: number;
}

/** A pool's pages for the operator's dashboard: one digit per page (an index in `stateNames`), and each page's tenant (0: free). */
export interface PageMap {
  readonly states: string;
  readonly stateNames: readonly string[];
  readonly tenants: readonly number[];
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
  /** Each node's stats for the operator's dashboard (the disaggregated topology; absent: one engine). */
  nodeViews?(): Promise<NodeViews>;
}

/** One node as the dashboard shows it (`/kvfence/state`). */
export interface NodeView {
  readonly id: string;
  readonly role: "prefill" | "decode" | "engine";
  /** False once lost or while it does not answer (then `stats` is null). */
  readonly up: boolean;
  readonly stats: EngineStats | null;
  /** KV bytes this node applied (decode) or wrote (prefill) so far. */
  readonly transferBytes: number;
  /** Its guard counters so far, by name (`checksum_failures`, ...). */
  readonly guards: Readonly<Record<string, number>>;
}

export interface NodeViews {
  readonly nodes: readonly NodeView[];
  /** The router's own per-phase histograms. */
  readonly routerPhases: PhaseSnapshot;
  /** Requests waiting at the router. */
  readonly waiting: number;
}
