/**
 * The prefill node's side of the transfer protocol (docs/design.md §4), sans-IO. State is plain data
 * keyed by attempt (`"rid:epoch"`); source pages live in this node's `OwnershipTable`.
 *
 * - **prefill**: check the lease's layout, re-check admission against this pool — a request that
 *   does not fit is refused with its original error, **never replaced by a placeholder** — allocate
 *   source pages and ask the engine to compute the prompt's KV (`compute` effect).
 * - **computed**: hash each source page keyed by `(rid, epoch, logical index)` and write every page
 *   into its leased destination (`write` effects); the host reports each with `write_done`.
 * - When every write has drained, send the **manifest** (coverage, first token, checksums) and hold
 *   the source pages until decode's `release` (the transfer committed) or an abort.
 * - **abort**: stop writing; answer `ABORT_ACK(rid, epoch)` only once every outstanding write has
 *   drained, then free the source pages. An abort for an attempt this node never saw (or already
 *   ended) is acknowledged at once — it has nothing in flight — and leaves a tombstone so a late
 *   `prefill` for it is refused. ABORT_ACK is never dropped.
 * - **The prefix cache** (optional, `PrefillContext.prefix`): at `prefill` the source pages start
 *   with the cached full pages of the prompt — references, read-only, computed already — and only
 *   the rest is leased and computed (the `compute` effect says how many are cached); at `computed`
 *   the attempt's full pages are offered to the cache (they turn SHARED, the attempt keeps its
 *   reference).
 * - **Decode-side reuse** (`TransferLease.held`): the lease's first `held` pages are decode's own
 *   cached pages; prefill computes the whole prompt as before but writes only the pages after them,
 *   and its manifest covers `[held·P, promptLen)` with a checksum per page sent.
 *   Freeing the source pages drops the references (`unref`) and frees the rest.
 * - **peer_lost** (a decode incarnation gone): its pool and connection are gone with it; free the
 *   attempts whose lease it granted. A lease from another decode incarnation than the one this
 *   node is connected to, or for another prefill incarnation than this one, is refused.
 * - **watermark** (from the router, after its last message for every rid below it): tombstones
 *   below it are forgotten, and a message below it is stale without leaving one (an abort there is
 *   still acknowledged: no `prefill` for it can come any more). So the state holds the attempts in
 *   flight and the tombstones of rids at or above the watermark, nothing older.
 */
import type { WireError } from "../lib/errors.js";
import { type Effects, type KvPool, leaseOrEvict, poolExhausted } from "./effects.js";
import { contextLengthError } from "./router-machine.js";
import { faultOn, guardOn, type Safety } from "./safety.js";
import {
  applyWatermark,
  attemptKey,
  belowWatermark,
  type ControlMessage,
  type LeasePage,
  type PrefillRequest,
  type Watermarks,
} from "./wire.js";

export interface PrefillConfig {
  readonly maxModelLen: number;
  readonly layoutSignature: string;
}

export type PrefillPhase = "computing" | "writing" | "held" | "aborting";

export interface PrefillAttempt {
  rid: number;
  epoch: number;
  tenant: number;
  /** Tokens computed and sent (the prompt's length; 1 under `placeholder-reject`). */
  promptLen: number;
  phase: PrefillPhase;
  /** Source pages in this pool, in logical order, and their generations. */
  pages: number[];
  generations: number[];
  /** Destination pages leased by decode, and the decode incarnation that leased them. */
  lease: LeasePage[];
  decodeIncarnation: number;
  /** Page writes issued and not yet drained. */
  outstanding: number;
  firstToken: number;
  checksums: string[];
  /** 1 where the source page is a prefix-cache reference (SHARED), 0 for the attempt's own page. */
  shared: number[];
  /** The lease's first `held` pages are decode's cached pages: nothing is written into them (absent: 0). */
  held?: number;
}

export interface PrefillState {
  /** This node's incarnation (boot count or boot id); it writes only leases granted for it. */
  incarnation: number;
  /** The incarnation of the decode node this prefill node is connected to now. */
  decodeIncarnation: number;
  /** The newest decode incarnation known to be gone (0: none); its leases are refused. */
  decodeLost: number;
  attempts: Record<string, PrefillAttempt>;
  /** Tombstones of attempts that ended here (or were aborted before they arrived), at or above `watermark`. */
  ended: Record<string, 1>;
  /**
   * The routers' watermarks, one per router slot (none yet: absent): every rid of that slot before
   * it is over at its router (`belowWatermark`).
   */
  watermarks: Watermarks;
  stale: number;
}

export type PrefillEvent =
  | { readonly type: "message"; readonly msg: ControlMessage }
  /** The engine computed the prompt's KV into the source pages and sampled the first token. */
  | { readonly type: "computed"; readonly rid: number; readonly epoch: number; readonly firstToken: number }
  /** The transport finished one page write (it landed, or the receiver dropped it). */
  | { readonly type: "write_done"; readonly rid: number; readonly epoch: number; readonly index: number }
  /** Decode incarnation `incarnation` is fenced: its connection closed or its worker terminated. */
  | { readonly type: "peer_lost"; readonly role: "decode"; readonly incarnation: number }
  /** Connected (again) to a decode node of this incarnation. */
  | { readonly type: "peer_up"; readonly role: "decode"; readonly incarnation: number };

/** Everything `prefillStep` works with besides its state and event: pool, config, guards and faults, effects sink. */
export interface PrefillContext {
  readonly pool: KvPool;
  readonly config: PrefillConfig;
  readonly safety: Safety;
  readonly out: Effects;
  /** The node's prefix cache; absent: none (the model checker's transfer model, `--prefix-cache off`). */
  readonly prefix?: PrefillPrefixCache;
}

/** What the prefill machine asks of its node's prefix cache (`src/protocol/prefix-cache.ts`). */
export interface PrefillPrefixCache {
  /**
   * Takes a reference on each cached full page `msg`'s prompt starts with (at most `maxPages`) and
   * returns them in order.
   */
  lookup(msg: PrefillRequest, maxPages: number): { pages: number[]; generations: number[] };
  /** Offers the computed attempt's full pages to the cache, setting `shared[i]` for each it took. */
  insert(attempt: PrefillAttempt): void;
  /** Evicts up to `count` unreferenced cached pages (the pool is short); returns how many. */
  evict(count: number): number;
}

export function initialPrefillState(incarnation: number, decodeIncarnation: number): PrefillState {
  return { incarnation, decodeIncarnation, decodeLost: 0, attempts: {}, ended: {}, watermarks: {}, stale: 0 };
}

export function prefillStep(state: PrefillState, event: PrefillEvent, ctx: PrefillContext): void {
  const { pool, out } = ctx;
  switch (event.type) {
    case "message": {
      const msg = event.msg;
      if (msg.type === "prefill") prefill(state, msg, ctx);
      else if (msg.type === "abort") abort(state, attemptKey(msg.rid, msg.epoch), ctx);
      else if (msg.type === "release") release(state, attemptKey(msg.rid, msg.epoch), pool);
      // The router's watermark moved: forget the tombstones below it.
      else if (msg.type === "watermark") applyWatermark(state, msg.below, [state.ended]);
      else state.stale++;
      return;
    }
    case "computed":
      computed(state, event, ctx);
      return;
    case "write_done": {
      const key = attemptKey(event.rid, event.epoch);
      const a = state.attempts[key];
      if (a === undefined || a.outstanding === 0) {
        state.stale++;
        return;
      }
      a.outstanding--;
      if (a.outstanding > 0) return;
      if (a.phase === "aborting") finishAbort(state, key, a, ctx);
      else if (a.phase === "writing") {
        a.phase = "held";
        out.push({
          kind: "send",
          to: "decode",
          msg: {
            type: "manifest",
            rid: a.rid,
            epoch: a.epoch,
            tokenStart: (a.held ?? 0) * pool.pageSize,
            tokenEnd: a.promptLen,
            firstToken: a.firstToken,
            checksums: a.checksums,
          },
        });
      }
      return;
    }
    case "peer_lost":
      // That decode's pool and connection are gone: its leases need no writes, acks or releases,
      // and a lease of it still on its way here must be refused.
      state.decodeLost = Math.max(state.decodeLost, event.incarnation);
      for (const key in state.attempts) {
        const a = state.attempts[key]!;
        if (a.decodeIncarnation !== event.incarnation) continue;
        freeSource(a, pool);
        end(state, key);
      }
      return;
    case "peer_up":
      state.decodeIncarnation = event.incarnation;
      return;
  }
}

function prefill(state: PrefillState, msg: PrefillRequest, ctx: PrefillContext): void {
  const key = attemptKey(msg.rid, msg.epoch);
  if (state.ended[key] !== undefined || state.attempts[key] !== undefined || below(state, msg.rid)) {
    state.stale++;
    return;
  }
  const admitted = leaseRefusal(state, msg, ctx) ?? admit(msg, ctx);
  if ("code" in admitted) {
    reject(state, msg, admitted, ctx.out);
    return;
  }
  const { promptLen, count, held } = admitted;
  const source = sourcePages(msg, promptLen, count, ctx);
  if (source === null) {
    reject(state, msg, poolExhausted("prefill", msg.rid, count), ctx.out);
    return;
  }
  const { pages, generations, cached } = source;
  state.attempts[key] = {
    rid: msg.rid,
    epoch: msg.epoch,
    tenant: msg.tenant,
    promptLen,
    phase: "computing",
    pages,
    generations,
    lease: msg.lease.pages.slice(0, count),
    decodeIncarnation: msg.lease.incarnation,
    outstanding: 0,
    firstToken: 0,
    checksums: [],
    shared: pages.map((_, i) => (i < cached ? 1 : 0)),
    ...(held === 0 ? {} : { held }),
  };
  const computePages: LeasePage[] = [];
  for (let i = 0; i < count; i++) computePages.push({ page: pages[i]!, generation: generations[i]! });
  ctx.out.push({
    kind: "compute",
    rid: msg.rid,
    epoch: msg.epoch,
    tenant: msg.tenant,
    promptLen,
    pages: computePages,
    ...(cached > 0 ? { cachedPages: cached } : {}),
  });
}

/**
 * Why the lease `msg` carries cannot be written here: decode's KV layout differs from this node's,
 * or the lease is from before a restart (of decode, or of this node); null when it can.
 */
function leaseRefusal(state: PrefillState, msg: PrefillRequest, ctx: PrefillContext): WireError | null {
  const { config } = ctx;
  const P = ctx.pool.pageSize;
  if (msg.lease.layoutSignature !== config.layoutSignature || msg.lease.pageSize !== P) {
    return {
      code: "layout_mismatch",
      message: `The decode node's KV layout differs from this prefill node's (${config.layoutSignature}, page ${P}): ${msg.lease.layoutSignature}, page ${msg.lease.pageSize}`,
    };
  }
  if (
    msg.lease.incarnation !== state.decodeIncarnation ||
    msg.lease.incarnation <= state.decodeLost ||
    (msg.lease.writerIncarnation !== undefined && msg.lease.writerIncarnation !== state.incarnation)
  ) {
    return {
      code: "node_unavailable",
      message: `The lease of request ${msg.rid} is from before a restart: decode ${msg.lease.incarnation} for prefill ${msg.lease.writerIncarnation}, now decode ${state.decodeIncarnation} and prefill ${state.incarnation}`,
    };
  }
  return null;
}

/**
 * Admission against this pool and the window: the tokens this node computes for `msg` and the
 * pages they take, or why it refuses — the request does not fit (its original error; under the
 * `placeholder-reject` fault a one-token placeholder is computed instead), or the lease is too
 * short for those pages.
 */
function admit(
  msg: PrefillRequest,
  ctx: PrefillContext,
): { promptLen: number; count: number; held: number } | WireError {
  const { pool, config, safety } = ctx;
  const P = pool.pageSize;
  let promptLen = msg.promptLen;
  const limit = Math.min(config.maxModelLen, pool.table.numPages * P);
  if (msg.promptLen + msg.maxTokens > limit) {
    if (faultOn(safety, "placeholder-reject")) {
      // The fault (SGLang #30233): mark it rejected, swap in a one-token placeholder, carry on.
      promptLen = 1;
    } else if (guardOn(safety, "admission-doors")) {
      return contextLengthError(msg.promptLen, msg.maxTokens, limit);
    }
  }
  const count = Math.ceil(promptLen / P);
  if (msg.lease.pages.length < count) {
    return {
      code: "transfer_failed",
      message: `The lease of request ${msg.rid} has ${msg.lease.pages.length} pages, the prompt needs: ${count}`,
    };
  }
  // Decode holds the first `held` pages (decode-side reuse): at least the last page is written.
  const held = msg.lease.held ?? 0;
  if (!Number.isInteger(held) || held < 0 || held >= count) {
    return {
      code: "transfer_failed",
      message: `The lease of request ${msg.rid} marks ${held} of the prompt's ${count} pages as held by decode; it must leave the last page to write: ${held}`,
    };
  }
  return { promptLen, count, held };
}

/**
 * The attempt's `count` source pages: the prefix cache's full pages the prompt starts with (never
 * its last token: its logits are needed; `cached` of them), then freshly leased ones. Null when
 * the pool has no room (the cache references taken are dropped again).
 */
function sourcePages(
  msg: PrefillRequest,
  promptLen: number,
  count: number,
  ctx: PrefillContext,
): { pages: number[]; generations: number[]; cached: number } | null {
  const hit =
    ctx.prefix !== undefined && promptLen === msg.promptLen
      ? ctx.prefix.lookup(msg, Math.floor((promptLen - 1) / ctx.pool.pageSize))
      : { pages: [], generations: [] };
  const cached = hit.pages.length;
  const leased = leaseOrEvict(ctx.pool, ctx.prefix, count - cached, msg);
  if (leased === null) {
    for (let i = 0; i < cached; i++) ctx.pool.table.unref(hit.pages[i]!, hit.generations[i]!);
    return null;
  }
  return {
    pages: [...hit.pages, ...leased.pages],
    generations: [...hit.generations, ...leased.generations],
    cached,
  };
}

function computed(
  state: PrefillState,
  event: Extract<PrefillEvent, { type: "computed" }>,
  ctx: PrefillContext,
): void {
  const { pool, safety, out } = ctx;
  const key = attemptKey(event.rid, event.epoch);
  const a = state.attempts[key];
  if (a === undefined || (a.phase !== "computing" && a.phase !== "aborting") || a.checksums.length > 0) {
    state.stale++;
    return;
  }
  a.firstToken = event.firstToken;
  const n = a.pages.length;
  // The pages sent: all but the ones decode holds (their checksums and writes are not needed).
  const held = a.held ?? 0;
  for (let i = held; i < n; i++) a.checksums.push(pool.pageChecksum(a.pages[i]!, a.rid, a.epoch, i));
  if (a.phase === "aborting") {
    // Aborted while computing: nothing was written.
    finishAbort(state, key, a, ctx);
    return;
  }
  ctx.prefix?.insert(a);
  a.phase = "writing";
  a.outstanding = n - held;
  const misaddress = faultOn(safety, "misaddressed-write");
  const corrupt = faultOn(safety, "corrupt-transfer");
  for (let i = held; i < n; i++) {
    const target = a.lease[i]!;
    out.push({
      kind: "write",
      header: {
        type: "page_write",
        rid: a.rid,
        epoch: a.epoch,
        index: i,
        // The fault: the first page sent goes one page past its leased destination.
        page: misaddress && i === held ? target.page + 1 : target.page,
        generation: target.generation,
        filledTokens: Math.min(pool.pageSize, a.promptLen - i * pool.pageSize),
        incarnation: a.decodeIncarnation,
      },
      sourcePage: a.pages[i]!,
      corrupt: corrupt && i === held,
    });
  }
}

function abort(state: PrefillState, key: string, ctx: PrefillContext): void {
  const { safety } = ctx;
  const a = state.attempts[key];
  if (a === undefined) {
    // Never seen here, or already ended: nothing in flight, acknowledge at once.
    const [rid, epoch] = key.split(":").map(Number) as [number, number];
    if (!below(state, rid)) state.ended[key] = 1;
    sendAck({ rid, epoch }, ctx);
    return;
  }
  if (a.phase === "aborting") return;
  if (a.phase === "writing" && a.outstanding > 0 && !faultOn(safety, "late-write")) {
    // Stop issuing writes; acknowledge when the outstanding ones drain (write_done).
    a.phase = "aborting";
    return;
  }
  if (a.phase === "computing") {
    a.phase = "aborting";
    return;
  }
  // Drained (or the late-write fault: acknowledge without waiting for the writes in flight).
  finishAbort(state, key, a, ctx);
}

function finishAbort(state: PrefillState, key: string, a: PrefillAttempt, ctx: PrefillContext): void {
  freeSource(a, ctx.pool);
  end(state, key);
  sendAck(a, ctx);
}

/** ABORT_ACK of `(rid, epoch)` to decode: every write of it has drained (unless the fault drops it). */
function sendAck(
  { rid, epoch }: { readonly rid: number; readonly epoch: number },
  ctx: PrefillContext,
): void {
  if (faultOn(ctx.safety, "drop-abort-ack")) return;
  ctx.out.push({ kind: "send", to: "decode", msg: { type: "abort_ack", rid, epoch } });
}

function release(state: PrefillState, key: string, pool: KvPool): void {
  const a = state.attempts[key];
  if (a === undefined || a.phase !== "held") {
    state.stale++;
    return;
  }
  freeSource(a, pool);
  end(state, key);
}

function reject(state: PrefillState, msg: PrefillRequest, error: WireError, out: Effects): void {
  if (!below(state, msg.rid)) state.ended[attemptKey(msg.rid, msg.epoch)] = 1;
  out.push({
    kind: "send",
    to: "router",
    msg: { type: "rejected", rid: msg.rid, epoch: msg.epoch, from: "prefill", error },
  });
}

function freeSource(a: PrefillAttempt, pool: KvPool): void {
  for (let i = 0; i < a.pages.length; i++) {
    if (a.shared[i] === 1) pool.table.unref(a.pages[i]!, a.generations[i]!);
    else pool.table.free(a.pages[i]!, a.generations[i]!, a.rid, a.epoch);
  }
}

function end(state: PrefillState, key: string): void {
  const a = state.attempts[key];
  delete state.attempts[key];
  if (a === undefined || !below(state, a.rid)) state.ended[key] = 1;
}

/** Whether `rid` is below the router's watermark: over at the router, no message of it to wait for. */
function below(state: PrefillState, rid: number): boolean {
  return belowWatermark(state.watermarks, rid);
}
