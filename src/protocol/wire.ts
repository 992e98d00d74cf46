/**
 * The control messages of the transfer protocol (docs/design.md §4), as plain JSON-able data that the
 * servers post on MessagePorts (worker threads) or send framed over TCP, and that the model checker
 * moves through its abstract network. Every message is keyed by `(rid, epoch)`: `rid` is the
 * router's u32 request id, `epoch` the attempt (a retry is a new epoch with new pages); a receiver
 * ignores (and counts) any message whose key is not the one it expects.
 *
 * Checksums travel as 16-digit lowercase hex strings (xxhash64), because JSON has no bigint. A
 * prompt's token ids (`promptTokens`, servers only) are one `Int32Array`: cloned by a MessagePort,
 * written as base64 by the router's TCP control link (src/transfer/control-codec.ts).
 */
import type { WireError } from "../lib/errors.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";

/** The three roles of docs/design.md §2. */
export type NodeRole = "router" | "prefill" | "decode";

/** One destination page of a lease: the physical page and the generation it was leased at. */
export interface LeasePage {
  readonly page: number;
  readonly generation: number;
}

/** Router → decode: reserve destination pages for a prompt (docs/design.md §4 step 2). */
export interface ReserveRequest {
  readonly type: "reserve";
  readonly rid: number;
  readonly epoch: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly maxTokens: number;
  /**
   * `n` > 1: the request ids of its samples after the first (which is `rid`). Decode reserves each
   * sample's own pages (its copy of the prompt's partial last page and its tail) beside the one
   * transfer lease, and at the commit forks the attempt into the samples, which share the prompt's
   * full pages read-only (docs/protocol.md §3, item 14). Absent: one sample.
   */
  readonly samples?: readonly number[];
  /**
   * The prompt's token ids (servers): decode looks them up in its prefix cache (and its sampling
   * reads them for a repetition penalty). Absent (the model checker, or a router that sends none):
   * decode knows only the prompt's length and holds no page.
   */
  readonly promptTokens?: Int32Array;
  // --- #35 decode-side reuse: the salt inputs of decode's prefix-cache lookup (as `PrefillRequest`'s).
  /** The client's `cache_salt` and the server's namespace within the tenant (`prefixCacheSalt`). */
  readonly cacheSalt?: string | null;
  readonly cacheScope?: string;
}

/** Decode → router: the reservation, forwarded by the router to prefill inside `PrefillRequest`. */
export interface TransferLease {
  readonly type: "lease";
  readonly rid: number;
  readonly epoch: number;
  /** Destination pages in logical order: entry i receives tokens [i*pageSize, (i+1)*pageSize). */
  readonly pages: readonly LeasePage[];
  readonly pageSize: number;
  readonly layoutSignature: string;
  /**
   * The decode node's incarnation (boot count or boot id) that granted the lease. Prefill writes
   * only into a lease of the decode incarnation it is connected to: a lease from before a decode
   * restart names pages of a pool that no longer exists (or now belongs to others).
   */
  readonly incarnation: number;
  /**
   * The prefill incarnation this lease is for (decode's view when it granted it). Prefill refuses
   * a lease for another incarnation, so when decode learns that incarnation is gone it knows
   * exactly which leases can no longer be written. Always set by the decode machine; optional only
   * so hand-built leases (transport tests, benchmarks) need not name one.
   */
  readonly writerIncarnation?: number;
  /**
   * #35 decode-side reuse: the first `held` pages are decode's own prefix-cache pages of this
   * tenant's prompt (full pages, references decode holds): prefill writes nothing into them, and
   * its manifest covers tokens `[held * pageSize, promptLen)` with a checksum per page sent.
   * Absent: 0, every page is written.
   */
  readonly held?: number;
}

/** Router → prefill: compute the prompt's KV and write it into the lease (step 3). */
export interface PrefillRequest {
  readonly type: "prefill";
  readonly rid: number;
  readonly epoch: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly maxTokens: number;
  /** The prompt's token ids (servers); absent in the model checker, which abstracts tokens. */
  readonly promptTokens?: Int32Array;
  /** The client's `cache_salt` and the server's namespace within the tenant (the prefix cache). */
  readonly cacheSalt?: string | null;
  readonly cacheScope?: string;
  /** The tenant's cache epoch (keys file `cache_epoch`; absent: 0): part of the salt (KV tiers, #35). */
  readonly cacheEpoch?: number;
  readonly lease: TransferLease;
}

/** Decode or prefill → router: the node refused the request; `error` travels to the client unchanged. */
export interface Rejected {
  readonly type: "rejected";
  readonly rid: number;
  readonly epoch: number;
  readonly from: "prefill" | "decode";
  readonly error: WireError;
}

/** Header of one page write, prefill → decode pool (the bytes follow on TCP; shared memory copies). */
export interface PageWriteHeader {
  readonly type: "page_write";
  readonly rid: number;
  readonly epoch: number;
  /** Logical page index in the lease. */
  readonly index: number;
  /** Physical destination page and the generation it was leased at. */
  readonly page: number;
  readonly generation: number;
  readonly filledTokens: number;
  /** The decode incarnation whose pool the write targets (the lease's). */
  readonly incarnation: number;
}

/** Prefill → decode: the transfer is complete (step 5). Sent only after every write drained. */
export interface Manifest {
  readonly type: "manifest";
  readonly rid: number;
  readonly epoch: number;
  /** Token coverage [tokenStart, tokenEnd) the written pages hold (tokenStart: the lease's held pages' tokens). */
  readonly tokenStart: number;
  readonly tokenEnd: number;
  readonly firstToken: number;
  /**
   * `n` > 1: the first token of each sample after the first, in the order of the reserve's
   * `samples` (prefill draws each from the same logits with the sample's own generator). A sample
   * without one here starts from `firstToken`.
   */
  readonly sampleFirstTokens?: readonly number[];
  /** One checksum per written page (the held ones have none) keyed by (rid, epoch, logical page index), in logical order. */
  readonly checksums: readonly string[];
  /**
   * Servers only, when the request asked: the first token's log-probabilities and the prompt's,
   * for decode to pass on to the router with `committed` (the machines never read them).
   */
  readonly logprobs?: FirstLogprobs;
}

/** What prefill computed of a request's log-probabilities: its first token's, and the prompt's if asked. */
export interface FirstLogprobs {
  readonly first?: TokenLogprobs;
  readonly prompt?: readonly (TokenLogprobs | null)[];
}

/** Decode → router: the transfer committed; the first token may stream (HTTP 200 from here on). */
export interface Committed {
  readonly type: "committed";
  readonly rid: number;
  readonly epoch: number;
  readonly firstToken: number;
}

/** Decode → router: new tokens of a committed request. */
export interface Tokens {
  readonly type: "tokens";
  readonly rid: number;
  readonly epoch: number;
  readonly tokens: readonly number[];
}

/** Decode → router: the request finished; its pages are free. */
export interface Finished {
  readonly type: "finished";
  readonly rid: number;
  readonly epoch: number;
  readonly reason: "stop" | "length";
  readonly tokens: readonly number[];
  readonly completionTokens: number;
  /** The stop token (EOS) that ended a `stop` finish, when the decode engine named it. */
  readonly stopTokenId?: number;
}

/** Decode → router: the attempt failed after the reservation (commit check, page tags, pool). */
export interface Failed {
  readonly type: "failed";
  readonly rid: number;
  readonly epoch: number;
  readonly error: WireError;
}

/** Router → decode and prefill, decode → prefill: stop this attempt. */
export interface Abort {
  readonly type: "abort";
  readonly rid: number;
  readonly epoch: number;
}

/** Prefill → decode: every write of (rid, epoch) has drained; quarantined pages may go. Never dropped. */
export interface AbortAck {
  readonly type: "abort_ack";
  readonly rid: number;
  readonly epoch: number;
}

/** Decode → prefill: the transfer committed; prefill may free its source pages. */
export interface Release {
  readonly type: "release";
  readonly rid: number;
  readonly epoch: number;
}

/**
 * Router → decode and prefill, on the same FIFO link as the pair's other router messages: every
 * attempt of a request id before `below` (in serial order, `ridBefore`) is over at the router,
 * which will send nothing more for it. A node machine forgets its tombstones below it and treats
 * any later message below it as stale, so its protocol memory is bounded by the work in flight.
 */
export interface Watermark {
  readonly type: "watermark";
  /** Always 0: a watermark is not about one request. */
  readonly rid: 0;
  readonly epoch: 0;
  readonly below: number;
}

export type ControlMessage =
  | ReserveRequest
  | TransferLease
  | PrefillRequest
  | Rejected
  | Manifest
  | Committed
  | Tokens
  | Finished
  | Failed
  | Abort
  | AbortAck
  | Release
  | Watermark;

export type ControlMessageType = ControlMessage["type"];

/** `"rid:epoch"`, the key under which nodes keep per-attempt state. */
export function attemptKey(rid: number, epoch: number): string {
  return `${rid}:${epoch}`;
}

/**
 * Request ids are u32 and wrap (0 is never used): `a` comes before `b` in serial-number order
 * (RFC 1982), which holds while the ids in flight span less than 2^31.
 */
export function ridBefore(a: number, b: number): boolean {
  return a !== b && (b - a) >>> 0 < 0x8000_0000;
}

/** The request id after `rid`, skipping 0. */
export function nextRid(rid: number): number {
  const next = (rid + 1) >>> 0;
  return next === 0 ? 1 : next;
}

/**
 * Several routers share a node (docs/protocol.md §3, item 13): the low bits of a rid name the
 * router slot that handed it out (`--router-slot`, 0 to `ROUTER_SLOTS - 1`), so the attempts of
 * two routers are distinct at the nodes, in their page tags and on the decode ⇄ prefill link
 * without any message naming a router. A router hands out only rids of its own slot, in serial
 * order (`nextRidIn`); the nodes keep one watermark and one rid floor per slot.
 */
export const ROUTER_SLOTS = 16;

/** The router slot of `rid` (its low bits). */
export function routerSlotOf(rid: number): number {
  return rid & (ROUTER_SLOTS - 1);
}

/** The first rid of router slot `slot` after `rid` in serial order (0: the first one), skipping 0. */
export function nextRidIn(rid: number, slot: number): number {
  let next = ((rid & ~(ROUTER_SLOTS - 1)) | slot) >>> 0;
  if (!ridBefore(rid, next)) next = (next + ROUTER_SLOTS) >>> 0;
  return next === 0 ? ROUTER_SLOTS : next;
}

/** A node machine's watermarks, one per router slot (decimal string keys, so the state stays JSON). */
export type Watermarks = Record<string, number>;

/** Whether `rid` is below its router slot's watermark: over at that router, no message of it to wait for. */
export function belowWatermark(marks: Watermarks, rid: number): boolean {
  const w = marks[routerSlotOf(rid)];
  return w !== undefined && ridBefore(rid, w);
}

/**
 * Moves the watermark of `to`'s router slot to `to`: false (nothing moved) when `to` is 0 or not
 * after the slot's current one. The caller then forgets its records below it (`prunable`).
 */
export function moveWatermark(marks: Watermarks, to: number): boolean {
  if (to === 0) return false;
  const slot = routerSlotOf(to);
  const w = marks[slot];
  if (w !== undefined && !ridBefore(w, to)) return false;
  marks[slot] = to;
  return true;
}

/** Whether the record of attempt key `key` lies below watermark `to` (of `to`'s router slot). */
export function prunable(key: string, to: number): boolean {
  const rid = ridOf(key);
  return routerSlotOf(rid) === routerSlotOf(to) && ridBefore(rid, to);
}

/**
 * A node machine's `watermark` message: moves `state.watermarks` to `to` and forgets the records
 * of each of `records` below it (keyed by attempt key). One that moves nothing is stale, unless it
 * repeats the slot's current watermark.
 */
export function applyWatermark(
  state: { readonly watermarks: Watermarks; stale: number },
  to: number,
  records: readonly Record<string, unknown>[],
): void {
  if (!moveWatermark(state.watermarks, to)) {
    if (to === 0 || state.watermarks[routerSlotOf(to)] !== to) state.stale++;
    return;
  }
  for (const record of records) for (const key in record) if (prunable(key, to)) delete record[key];
}

/** The rid of an attempt key `"rid:epoch"`. */
export function ridOf(key: string): number {
  return Number(key.slice(0, key.indexOf(":")));
}
