/**
 * What the sans-IO state machines ask their host to do, as plain data. A machine never performs
 * I/O: the servers turn these effects into MessagePort posts, socket writes, engine calls and HTTP
 * responses; the model checker turns them into its abstract network and ghost checks.
 *
 * Pool operations are not effects: the machines call the node's `OwnershipTable` directly (it is
 * synchronous, allocation-free shared memory), so the checker sees the real page states.
 */

import type { OwnershipTable } from "../kvcache/ownership-table.js";
import type { WireError } from "../lib/errors.js";
import type { ControlMessage, LeasePage, NodeRole, PageWriteHeader } from "./wire.js";

/** What a node's state machine needs of its KV pool. */
export interface KvPool {
  readonly table: OwnershipTable;
  /** Tokens per page. */
  readonly pageSize: number;
  /**
   * Checksum (hex) of the bytes `page` holds now, keyed by `(rid, epoch, logical index)`; servers
   * use `pageChecksum` of src/transfer (xxhash64), the checker an exact abstraction of the bytes.
   */
  pageChecksum(page: number, rid: number, epoch: number, index: number): string;
  /**
   * Optional observer called at the instant a decode step of `attempt` has read the first `count`
   * of its pages (after its tag check and the write of its own token; `freshIndex` the logical page
   * that write opened, or -1), before anything else changes the table. `attempt` is the machine's
   * own: read it, never keep it. Servers leave it out; the model checker checks invariant 1 here.
   */
  observeRead?(attempt: ReadingAttempt, count: number, freshIndex: number): void;
}

/** What a decode step read: its attempt's physical pages in logical order, leased at `generations`. */
export interface ReadingAttempt {
  readonly rid: number;
  readonly epoch: number;
  readonly pages: readonly number[];
  readonly generations: readonly number[];
}

let scratchPages = new Int32Array(64);
let scratchGenerations = new Uint32Array(64);

/** The refusal of a node whose pool has too few free pages for request `rid` now (the router may wait). */
export function poolExhausted(node: "prefill" | "decode", rid: number, count: number): WireError {
  return {
    code: "pool_exhausted",
    message: `The ${node} KV pool has no room for request ${rid} now: ${count} pages needed; retry later`,
  };
}

/**
 * Leases `count` pages of `pool` to `(rid, epoch)` of `tenant`, all or nothing, and returns them as
 * plain arrays (machine state is plain data); null when the pool has too few free pages.
 */
export function leasePages(
  pool: KvPool,
  count: number,
  lease: { readonly rid: number; readonly epoch: number; readonly tenant: number },
): { pages: number[]; generations: number[] } | null {
  if (count > scratchPages.length) {
    scratchPages = new Int32Array(count);
    scratchGenerations = new Uint32Array(count);
  }
  if (!pool.table.allocate(count, lease.rid, lease.epoch, lease.tenant, scratchPages, scratchGenerations)) {
    return null;
  }
  return {
    pages: Array.from(scratchPages.subarray(0, count)),
    generations: Array.from(scratchGenerations.subarray(0, count)),
  };
}

/**
 * `leasePages`, evicting unreferenced prefix-cache pages first when the pool is short (`cache`,
 * the node's: prefill's and decode's machines both lease this way). Null when even that leaves
 * too few free pages.
 */
export function leaseOrEvict(
  pool: KvPool,
  cache: { evict(count: number): number } | undefined,
  count: number,
  lease: { readonly rid: number; readonly epoch: number; readonly tenant: number },
): { pages: number[]; generations: number[] } | null {
  const leased = leasePages(pool, count, lease);
  if (leased !== null || cache === undefined) return leased;
  const free = pool.table.counts().free;
  if (cache.evict(count - free) === 0) return null;
  return leasePages(pool, count, lease);
}

/** Send a control message to another role. */
export interface SendEffect {
  readonly kind: "send";
  readonly to: NodeRole;
  readonly msg: ControlMessage;
}

/**
 * Prefill: copy source page `sourcePage` into the decode pool as described by `header`. Shared
 * memory writes it one-sided and stamps the writer stamp; TCP frames it and the receiver applies it
 * only if `receiverAccepts`. The host reports completion with a `write_done` event. `corrupt` is
 * set only by the `corrupt-transfer` fault: the host flips a byte of the page in flight.
 */
export interface WriteEffect {
  readonly kind: "write";
  readonly header: PageWriteHeader;
  readonly sourcePage: number;
  readonly corrupt: boolean;
}

/**
 * Prefill: run the forward pass over the prompt into the source pages (the engine stamps them
 * with `(rid, epoch)` and marks them READY as it writes them), then feed a `computed` event.
 * `promptLen` is the number of tokens actually computed (1 under `placeholder-reject`).
 */
export interface ComputeEffect {
  readonly kind: "compute";
  readonly rid: number;
  readonly epoch: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly pages: readonly LeasePage[];
  /** Leading pages that are prefix-cache references (already computed, read-only); 0 without a hit. */
  readonly cachedPages?: number;
}

/**
 * Decode: the transfer committed; `pages` (READY, in logical order, then the reserved tail for
 * generated tokens) now belong to the engine's running batch for `(rid, epoch)`.
 */
export interface CommitEffect {
  readonly kind: "commit";
  readonly rid: number;
  readonly epoch: number;
  readonly promptLen: number;
  readonly coverage: number;
  readonly pages: readonly LeasePage[];
  /** The first `held` pages are decode's prefix-cache references (decode-side reuse); absent: 0. */
  readonly held?: number;
}

/**
 * Decode, at the commit of a request of `n` > 1 samples: copy the first `tokens` token slots of
 * page `from` (the prompt's partial last page, the first sample's) into page `to` (a later sample's
 * own page). The machine has already stamped `to` as that sample's and marked it READY: the host
 * copies the bytes while it handles this step's effects, before any step of the sample runs.
 */
export interface CopyEffect {
  readonly kind: "copy";
  readonly from: number;
  readonly to: number;
  readonly tokens: number;
}

/** Decode: stop running `(rid, epoch)` (abort or failure); its pages were freed or quarantined. */
export interface StopEffect {
  readonly kind: "stop";
  readonly rid: number;
  readonly epoch: number;
}

/** Router: stream tokens of `(rid, epoch)` to the client (the first one sends HTTP 200 headers). */
export interface TokensEffect {
  readonly kind: "tokens";
  readonly rid: number;
  readonly epoch: number;
  readonly tokens: readonly number[];
}

/** Router: the request's final answer. `status` 200 with a finish reason, or the error's status. */
export interface RespondEffect {
  readonly kind: "respond";
  readonly rid: number;
  readonly epoch: number;
  readonly status: number;
  readonly error: WireError | null;
  readonly finishReason: "stop" | "length" | null;
}

export type Effect =
  | SendEffect
  | WriteEffect
  | ComputeEffect
  | CommitEffect
  | CopyEffect
  | StopEffect
  | TokensEffect
  | RespondEffect;

/** Effects sink: machines push into a caller-owned array (no allocation per call for the host). */
export type Effects = Effect[];
