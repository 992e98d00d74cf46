/**
 * The messages between the router-side driver (`src/cluster/disaggregated-engine.ts`) and the
 * prefill and decode nodes, in both topologies: posted on a `MessagePort` (worker threads,
 * `worker-link.ts`) or sent as authenticated lines over TCP (`control-link.ts`, processes). Plain
 * data only: JSON-able, and `Int32Array`s (below). This folder is the link code both sides use: the router (src/cluster) and
 * the nodes (src/node) import it, it imports neither.
 *
 * A protocol message (`src/protocol/wire.ts`) travels inside an envelope that adds what the
 * servers need and the state machines abstract away: the request's `SamplingParams`
 * (src/protocol/sampling-params.ts, the engine's own, whole; on `reserve` and `prefill`), and
 * which prefill node a decode attempt is paired with (a decode node runs one decode state machine
 * per prefill peer, so that peer's fence releases exactly its own quarantined pages). The prompt's
 * token ids ride in the protocol message itself (`promptTokens` of `prefill`, and of `reserve`
 * when decode's sampling reads them), one `Int32Array` from the router's tokenizer to the node's
 * engine: a MessagePort clones it, the TCP link's JSON carries its bytes in base64
 * (src/transfer/control-codec.ts).
 */
import type { PageCounts } from "../kvcache/ownership-table.js";
import type { PhaseSnapshot } from "../lib/phase-histograms.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import type { RequestTrace } from "../lib/tracing.js";
import type { EngineStats, PageMap } from "../protocol/engine-api.js";
import type { SamplingParams } from "../protocol/sampling-params.js";
import type { ControlMessage } from "../protocol/wire.js";

/** Router → node. */
export type ToNode =
  | {
      readonly kind: "protocol";
      /** The prefill node this attempt is paired with (decode: selects its state machine). */
      readonly prefill: string;
      readonly msg: ControlMessage;
      /** On `reserve` and `prefill`: the request's sampling, as the router's parser built it. */
      readonly sampling?: SamplingParams;
      /** On `reserve` and `prefill`: the request's id and trace context, for the node's spans. */
      readonly trace?: RequestTrace;
      /** Prefill, on a watermark: the incarnation of the decode node of the pair (selects its machine). */
      readonly decode?: number;
    }
  | { readonly kind: "stats"; readonly id: number }
  /** Readiness: answer `pong` with the same id at once (the router's deadline says the node turns). */
  | { readonly kind: "ping"; readonly id: number }
  /** Decode, process form: connect the transfer channel to this prefill node. */
  | {
      readonly kind: "connect_prefill";
      readonly prefill: string;
      readonly host: string;
      readonly port: number;
      readonly incarnation: number;
    }
  /** Decode: this prefill node is fenced (its worker exited, its connection closed). */
  | { readonly kind: "prefill_lost"; readonly prefill: string };

/** What a node tells the router about itself when the link opens. */
export interface NodeHello {
  readonly kind: "hello";
  readonly role: "prefill" | "decode";
  readonly poolTokens: number;
  readonly pageSize: number;
  readonly maxModelLen: number;
  readonly layoutSignature: string;
  /** Prefill, process form: where its transfer server listens. */
  readonly transferPort?: number;
  /** The node's incarnation (a fresh value per start): decode stamps it on leases, prefill writes only leases for its own. */
  readonly incarnation: number;
  /** Requests its engine batches per step (its sequence slots). */
  readonly maxSequences?: number;
  /**
   * The rid after the newest one any router sent it (0 or absent: none): a router hands out rids
   * after the floors of its nodes, so a restarted router never reuses an older one's rids.
   */
  readonly ridFloor?: number;
  /** Prefill: it keeps a prefix cache (the router routes a prompt to the node likely to hold its prefix). */
  readonly prefixCache?: boolean;
}

/** One node's counters, polled by the router for /metrics and /kvfence/nodes. */
export interface NodeStats {
  readonly role: "prefill" | "decode";
  readonly pages: PageCounts;
  readonly queue: { readonly waiting: number; readonly running: number; readonly preempted: number };
  readonly counters: {
    readonly tagCheckFailures: number;
    readonly preemptions: number;
    readonly aborts: number;
    readonly promptTokens: number;
    readonly completionTokens: number;
    /** Prompt tokens its engine computed (prefill nodes). */
    readonly prefillTokens?: number;
    /** Samples of n > 1 forked from their group's one transfer (decode nodes). */
    readonly forkedSamples?: number;
    /** Engine steps that decoded at least one token (decode nodes). */
    readonly decodeSteps?: number;
  };
  /** Attempts the node's state machines hold now (reserved, quarantined, computing, held, ...). */
  readonly attempts: number;
  /** Its prefix cache's counters and pages (absent without a cache). */
  readonly prefixCache?: NonNullable<EngineStats["prefixCache"]>;
  /** Its KV tiers' pages, bytes and counters (absent without tiers). */
  readonly tiers?: NonNullable<EngineStats["tiers"]>;
  /** Protocol messages ignored because their (rid, epoch) was not current. */
  readonly staleMessages: number;
  /**
   * Records of ended attempts the machines keep (tombstones, early ABORT_ACKs): those of rids at or
   * above each pair's watermark, so it returns to 0 when the node is idle (docs/protocol.md).
   */
  readonly tombstones?: number;
  /** V8 heap in use by the node's isolate, bytes (garbage not yet collected included). */
  readonly heapUsedBytes?: number;
  readonly transfer: {
    readonly bytes: number;
    readonly pages: number;
    readonly transfers: number;
    readonly checksumFailures: number;
    readonly coverageFailures: number;
    readonly droppedStaleWrites: number;
    readonly droppedMisaddressedWrites: number;
    /** Decode: prompt pages it held in its prefix cache instead of receiving them (decode-side reuse). */
    readonly pagesReused?: number;
  };
  /**
   * Page checksums off the transfer's critical path: pages hashed at production (prefill) or as
   * they landed (decode), checksum reads served from those records, and reads that hashed then.
   */
  readonly checksums?: { readonly recorded: number; readonly hits: number; readonly misses: number };
  /** Observations since the previous poll (drained by each poll): GB/s per transfer, ABORT_ACK latency in seconds. */
  readonly transferGbps: readonly number[];
  readonly abortAckSeconds: readonly number[];
  /** The node's per-phase histograms so far (cumulative; src/lib/phase-histograms.ts). */
  readonly phases?: PhaseSnapshot;
  /** Every page's state and tenant, for the operator's dashboard. */
  readonly pageMap?: PageMap;
  /** Process topology: connections refused before admission, by port and reason (link-guard.ts). */
  readonly linkAuthFailures?: {
    readonly control?: Readonly<Record<string, number>>;
    readonly transfer?: Readonly<Record<string, number>>;
  };
}

/** Node → router. */
export type FromNode =
  | NodeHello
  | {
      readonly kind: "protocol";
      readonly msg: ControlMessage;
      /** When the request asked: one entry per token the message carries (`committed`: its first). */
      readonly logprobs?: readonly TokenLogprobs[] | undefined;
      /** With `committed`, when the request asked: the prompt's log-probabilities. */
      readonly promptLogprobs?: readonly (TokenLogprobs | null)[] | undefined;
    }
  | { readonly kind: "stats"; readonly id: number; readonly stats: NodeStats }
  /** `cachedPages`: the pages its prefix cache holds now (absent without a cache). */
  | { readonly kind: "pong"; readonly id: number; readonly cachedPages?: number }
  /** Decode: the transfer channel to this prefill node is up / went down (the fence). */
  | { readonly kind: "prefill_up"; readonly prefill: string }
  | { readonly kind: "prefill_down"; readonly prefill: string }
  /** Either role: its state machines freed pages (now `free` pages are FREE); waiting requests may retry. */
  | { readonly kind: "pages_freed"; readonly free: number }
  /** Prefill, prefix cache on: this attempt's prompt tokens served from the cache (before its compute). */
  | {
      readonly kind: "prefix_cached";
      readonly rid: number;
      readonly epoch: number;
      readonly cachedTokens: number;
    }
  | CacheEventsMessage;

// ---- KV cache events (issue #35 item 3: routing by where the KV lives) -------------------------
// A node with a prefix cache tells every router which chain keys it holds, so a router can route a
// prompt to the node holding its longest prefix (src/node/cache-events.ts publishes them,
// src/cluster/kv-index.ts keeps them). Keys only: never a token id.

/** Where a node holds a cached page: its KV pool, its host-memory tier, its disk tier. */
export type CacheTier = "pool" | "ram" | "disk";

/**
 * One tenant's changes in one tier: the chain keys it gained and lost there. A key is the first
 * `CACHE_EVENT_KEY_CHARS` hex digits of the page's chain key (`prefixBlockKey`, salted with the
 * tenant's namespace): opaque, a routing hint only (the node's cache compares the whole key and
 * the tokens on every hit).
 */
export interface CacheEventBatch {
  readonly tenant: number;
  readonly tier: CacheTier;
  readonly stored: readonly string[];
  readonly removed: readonly string[];
}

/** Hex digits of a chain key a cache event carries (64 bits). */
export const CACHE_EVENT_KEY_CHARS = 16;

/**
 * Node → every router: `cache_events`, the changes since the previous message (at most one per
 * `CACHE_EVENT_INTERVAL_MS`, src/node/cache-events.ts); `cache_snapshot`, to a router whose link
 * just opened, everything the node holds (it replaces what that router knew of the node; a large
 * set continues in `cache_events` right after it).
 */
export interface CacheEventsMessage {
  readonly kind: "cache_events" | "cache_snapshot";
  readonly batches: readonly CacheEventBatch[];
}

/** A bidirectional message channel (a MessagePort or an authenticated TCP link). */
export interface Link<Out, In> {
  send(message: Out): void;
  onMessage(handler: (message: In) => void): void;
  /** Called once when the link closes (the peer went away): the fence. */
  onClose(handler: (error?: Error) => void): void;
  close(): void;
}
