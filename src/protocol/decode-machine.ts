/**
 * The decode node's side of the transfer protocol (docs/design.md §4), sans-IO. The state is plain data
 * keyed by attempt (`"rid:epoch"`); page state lives in the node's `OwnershipTable`, which this
 * machine drives directly.
 *
 * - **reserve**: re-check admission against this pool (a rejection travels back unchanged),
 *   allocate all pages the request needs (prompt, then a tail for generated tokens, so decoding
 *   never runs out mid-request), and lease the prompt pages to the router for prefill.
 * - **manifest → commit** only when the manifest's key is this attempt's, its coverage equals the
 *   reservation exactly, and every page's checksum equals decode's own over its pool. Then the prompt
 *   pages turn READY and the router hears `committed` (HTTP 200 becomes possible only now), and
 *   prefill hears `release`. Anything else fails the attempt.
 * - **check → step**: one decode step of a committed attempt is two events. `check` comes before
 *   the engine's forward pass: the page-tag check of every page of the attempt
 *   (`OwnershipTable.checkStep`, the one rule set the engine's own guard uses too: the pages read
 *   are READY, this lease, this attempt's writer stamp and filled far enough; the page receiving
 *   this step's token is RESERVED for it when fresh; the pages ahead are still leased). It fails
 *   the attempt, or arms the step. `step` comes after the forward pass: it stamps the page the
 *   step wrote and sends the token. On a decode node this is the only tag check of a token (the
 *   engine asks the node instead of checking itself), so it runs once per token and allocates
 *   nothing: the host names the attempt by a key it built once, and the `tokens` message is the
 *   context's one reused message. A `step` that no passed `check` armed fails closed.
 * - **abort / failure** before commit: the abort is relayed to prefill, and the leased pages go
 *   QUARANTINED (prefill may still be writing into them) and leave only on prefill's ABORT_ACK for
 *   this attempt or a fence (prefill's
 *   connection closed or worker gone). An ack that arrives before the abort is remembered: it means
 *   prefill will never write for that attempt. After commit every write has drained (prefill sends
 *   the manifest last), so pages are freed at once.
 * - **n > 1** (a reserve with `samples`): one transfer for the request's prompt, into the first
 *   sample's lease; decode also reserves each later sample's own pages (its copy of the prompt's
 *   partial last page and its tail). At the commit it forks the attempt: the prompt's full pages
 *   turn SHARED between the samples (`OwnershipTable.shareSiblings`, a reference each), the partial
 *   page is copied into each later sample's own page (a `copy` effect; the machine stamps the copy as
 *   that sample's), and each sample becomes an attempt of its own (its rid, the same epoch) that
 *   commits, steps, finishes and aborts alone. Its per-token check reads the shared pages under
 *   `checkSibling` for the request's group, so they pass for its samples and nobody else; its own
 *   pages under the usual rules. A sample that ends drops its references; the last one frees the
 *   shared pages.
 * - **Decode-side reuse** (`DecodeContext.prefix`): the lease's first `held` pages are decode's own
 *   cached pages, never written by prefill; an attempt ending after its commit caches its pages.
 * - **Nothing is released on a timer.** (`quarantine_timeout` is honoured only with the `quarantine`
 *   guard disabled, to reproduce the timeout release of SGLang #35049/#38961.)
 *
 * Attempts that ended leave a tombstone so a late or duplicated message for them (a reserve
 * overtaken by its abort, a stale manifest) is ignored and counted, never acted on. The router's
 * **watermark** (sent after its last message for every rid below it) forgets the tombstones and
 * early acknowledgements below it; a message below it is stale and leaves none. So the state
 * holds the attempts in flight and the records of rids at or above the watermark, nothing older.
 */
import type { WireError } from "../lib/errors.js";
import * as held from "./decode-held.js";
import { type Effects, type KvPool, leasePages, poolExhausted, type SendEffect } from "./effects.js";
import { contextLengthError } from "./router-machine.js";
import { faultOn, guardOn, type Safety } from "./safety.js";
import {
  applyWatermark,
  attemptKey,
  belowWatermark,
  type ControlMessage,
  type LeasePage,
  type Manifest,
  type ReserveRequest,
  ridOf,
  routerSlotOf,
  type Watermarks,
} from "./wire.js";

export interface DecodeConfig {
  readonly maxModelLen: number;
  readonly layoutSignature: string;
}

/** A `tokens` message to the router, the one a `step` sends (reused: see `DecodeContext`). */
interface TokenSend extends SendEffect {
  readonly msg: { type: "tokens"; rid: number; epoch: number; tokens: number[] };
}

/**
 * Everything `decodeStep` works with besides its state and event: the node's pool, its config, the
 * guards and faults, and the effects sink. `tokenSend` is the one `tokens` message every `step`
 * pushes, rewritten in place: a host must send it on (post, encode) before it feeds the next event,
 * and never keep it. Build one with `decodeContext`.
 */
export interface DecodeContext {
  readonly pool: KvPool;
  readonly config: DecodeConfig;
  readonly safety: Safety;
  readonly out: Effects;
  readonly tokenSend: TokenSend;
  /** The node's prefix cache (decode-side reuse); absent: none, every page is transferred. */
  readonly prefix?: held.DecodePrefixCache;
}

export function decodeContext(
  pool: KvPool,
  config: DecodeConfig,
  safety: Safety,
  out: Effects = [],
  prefix?: held.DecodePrefixCache,
): DecodeContext {
  const tokenSend: TokenSend = {
    kind: "send",
    to: "router",
    msg: { type: "tokens", rid: 0, epoch: 0, tokens: [0] },
  };
  return { pool, config, safety, out, tokenSend, ...(prefix === undefined ? {} : { prefix }) };
}

export type DecodePhase = "reserved" | "decoding" | "quarantined";

export interface DecodeAttempt {
  rid: number;
  epoch: number;
  tenant: number;
  promptLen: number;
  maxTokens: number;
  phase: DecodePhase;
  /** All pages in logical order: the first `leaseCount` are the prompt's (the transfer lease). */
  pages: number[];
  generations: number[];
  leaseCount: number;
  /** The first `held` pages are decode's prefix-cache references, never written by prefill (absent: 0). */
  held?: number;
  /** Tokens produced so far, the first token (from prefill) included. */
  generated: number;
  /** The prefill incarnation the lease was granted for: the only one that can write it. */
  writer: number;
  /** A `check` passed for the next step (a `step` consumes it; with the guard off it is not needed). */
  checked: boolean;
  /** n > 1, until the commit: the own pages reserved for each later sample (its rid, the same epoch). */
  siblings?: SiblingReservation[];
  /** n > 1, after the commit: the first `shared` pages are the request's sibling pages (read-only). */
  shared?: number;
  /** n > 1: the rid of the request's first sample, whose attempt `(group, epoch)` owns the sibling pages. */
  group?: number;
}

/** A later sample's own pages (its copy of the partial last prompt page, then its tail), leased to `(rid, epoch)`. */
export interface SiblingReservation {
  rid: number;
  pages: number[];
  generations: number[];
}

export interface DecodeState {
  /** This node's incarnation (boot count or boot id), stamped on every lease. */
  incarnation: number;
  /** The incarnation of the prefill node it is connected to now; leases are granted for it. */
  prefillIncarnation: number;
  /** The newest prefill incarnation known to be gone (0: none): leases for it can no longer be written. */
  prefillLost: number;
  attempts: Record<string, DecodeAttempt>;
  /** Tombstones of attempts that ended here (or were aborted before they arrived). */
  ended: Record<string, 1>;
  /** ABORT_ACKs that arrived before the abort they answer. */
  acks: Record<string, 1>;
  /**
   * The routers' watermarks, one per router slot (none yet: absent): every rid of that slot before
   * it is over at its router (`belowWatermark`).
   */
  watermarks: Watermarks;
  stale: number;
  tagFailures: number;
}

export type DecodeEvent =
  | { readonly type: "message"; readonly msg: ControlMessage }
  /**
   * Before the engine's step of committed attempt `key` (`attemptKey(rid, epoch)`, built once per
   * attempt by the host): the page-tag check of the step. It fails the attempt or arms the step.
   */
  | { readonly type: "check"; readonly key: string }
  /** After that step: the engine wrote the step's KV and sampled `token`. */
  | { readonly type: "step"; readonly key: string; readonly token: number }
  /** Prefill incarnation `incarnation` is fenced: its connection closed or its worker terminated. */
  | { readonly type: "peer_lost"; readonly role: "prefill"; readonly incarnation: number }
  /** Connected to a prefill node of this incarnation (it may arrive before the old one's loss). */
  | { readonly type: "peer_up"; readonly role: "prefill"; readonly incarnation: number }
  /**
   * The link of the router of `slot` closed (its fence, docs/protocol.md §3, item 13): each of its
   * attempts here is aborted as its ABORT would (relayed to prefill, the lease quarantined until
   * the ABORT_ACK or prefill's fence); no other router's attempt is touched.
   */
  | { readonly type: "router_lost"; readonly slot: number }
  /** Only with the `quarantine` guard disabled: the deferred-release timer fired. */
  | { readonly type: "quarantine_timeout"; readonly rid: number; readonly epoch: number };

/**
 * The page decode leased for logical page `index` of `(rid, epoch)` while it awaits the transfer,
 * or -1: the receiver-side lease check of a framed (TCP) page write.
 */
export function leasedPage(state: DecodeState, rid: number, epoch: number, index: number): number {
  const a = state.attempts[attemptKey(rid, epoch)];
  if (a === undefined || a.phase !== "reserved" || index < (a.held ?? 0) || index >= a.leaseCount) return -1;
  return a.pages[index]!;
}

/**
 * Pages decode reserves for a request: the prompt, and the generated tokens but the last (whose KV
 * is never written), so the tail holds maxTokens - 1 tokens.
 */
export function decodeReservationPages(promptLen: number, maxTokens: number, pageSize: number): number {
  return Math.ceil(Math.max(promptLen, promptLen + maxTokens - 1) / pageSize);
}

/**
 * Pages decode reserves for a request of `samples` samples: the first sample's (as for one), and
 * for each later one its own pages past the prompt's full pages (which the samples share).
 */
export function decodeGroupPages(
  promptLen: number,
  maxTokens: number,
  pageSize: number,
  samples: number,
): number {
  const one = decodeReservationPages(promptLen, maxTokens, pageSize);
  return one + (samples - 1) * (one - Math.floor(promptLen / pageSize));
}

export function initialDecodeState(incarnation: number, prefillIncarnation: number): DecodeState {
  return {
    incarnation,
    prefillIncarnation,
    prefillLost: 0,
    attempts: {},
    ended: {},
    acks: {},
    watermarks: {},
    stale: 0,
    tagFailures: 0,
  };
}

export function decodeStep(state: DecodeState, event: DecodeEvent, ctx: DecodeContext): void {
  switch (event.type) {
    case "message": {
      const msg = event.msg;
      if (msg.type === "reserve") reserve(state, msg, ctx);
      else if (msg.type === "manifest") manifest(state, msg, ctx);
      else if (msg.type === "abort") abort(state, attemptKey(msg.rid, msg.epoch), ctx);
      else if (msg.type === "abort_ack") abortAck(state, attemptKey(msg.rid, msg.epoch), ctx.pool);
      // The router's watermark moved: forget the tombstones and early acks below it.
      else if (msg.type === "watermark") applyWatermark(state, msg.below, [state.ended, state.acks]);
      else state.stale++;
      return;
    }
    case "check":
      check(state, event.key, ctx);
      return;
    case "step":
      step(state, event.key, event.token, ctx);
      return;
    case "peer_up":
      state.prefillIncarnation = event.incarnation;
      // The same prefill incarnation connected again (decode reconnected after its transfer
      // connection dropped; the old one was fenced by its peer_lost, which ended every lease it
      // could write). Its new leases are writable: an abort of one must wait for its ABORT_ACK.
      if (state.prefillLost >= event.incarnation) state.prefillLost = event.incarnation - 1;
      return;
    case "peer_lost":
      state.prefillLost = Math.max(state.prefillLost, event.incarnation);
      for (const key in state.attempts) {
        const a = state.attempts[key]!;
        if (a.phase === "decoding" || a.writer > state.prefillLost) continue;
        // The only writer of this lease is gone: no write to these pages can land any more.
        if (a.phase === "quarantined") releaseQuarantined(a, ctx.pool);
        else {
          freeAll(a, ctx);
          ctx.out.push({ kind: "stop", rid: a.rid, epoch: a.epoch });
        }
        end(state, key);
      }
      return;
    case "router_lost":
      for (const key in state.attempts) {
        if (routerSlotOf(state.attempts[key]!.rid) === event.slot) abort(state, key, ctx);
      }
      return;
    case "quarantine_timeout": {
      const key = attemptKey(event.rid, event.epoch);
      const a = state.attempts[key];
      if (guardOn(ctx.safety, "quarantine") || a === undefined || a.phase !== "quarantined") return;
      releaseQuarantined(a, ctx.pool);
      end(state, key);
      return;
    }
  }
}

function reserve(state: DecodeState, msg: ReserveRequest, ctx: DecodeContext): void {
  const { pool, config, safety, out } = ctx;
  const key = attemptKey(msg.rid, msg.epoch);
  if (state.ended[key] !== undefined || state.attempts[key] !== undefined || below(state, msg.rid)) {
    state.stale++;
    return;
  }
  const poolTokens = pool.table.numPages * pool.pageSize;
  const limit = Math.min(config.maxModelLen, poolTokens);
  if (guardOn(safety, "admission-doors") && msg.promptLen + msg.maxTokens > limit) {
    reject(state, msg, contextLengthError(msg.promptLen, msg.maxTokens, limit), out);
    return;
  }
  const P = pool.pageSize;
  const leaseCount = Math.ceil(msg.promptLen / P);
  const count = decodeReservationPages(msg.promptLen, msg.maxTokens, P);
  const samples = msg.samples ?? [];
  if (samples.some((r, i) => r === msg.rid || samples.indexOf(r) !== i)) {
    reject(
      state,
      msg,
      { code: "internal", message: `The samples of request ${msg.rid} are not distinct` },
      out,
    );
    return;
  }
  // Decode's cached pages of the prompt first (held: never written by prefill), then its own.
  const leased = held.leaseWithHeld(ctx.prefix, pool, safety, msg, count);
  const siblings = leased === null ? null : reserveSiblings(pool, msg, count - Math.floor(msg.promptLen / P));
  if (leased === null || siblings === null) {
    if (leased !== null) held.dropLease(pool, safety, leased, msg);
    const total = decodeGroupPages(msg.promptLen, msg.maxTokens, P, 1 + samples.length);
    reject(state, msg, poolExhausted("decode", msg.rid, total), out);
    return;
  }
  const { pages, generations, held: heldPages } = leased;
  state.attempts[key] = {
    rid: msg.rid,
    epoch: msg.epoch,
    tenant: msg.tenant,
    promptLen: msg.promptLen,
    maxTokens: msg.maxTokens,
    phase: "reserved",
    pages,
    generations,
    leaseCount,
    generated: 0,
    writer: state.prefillIncarnation,
    checked: false,
    ...(heldPages === 0 ? {} : { held: heldPages }),
    ...(siblings.length === 0 ? {} : { siblings }),
  };
  const lease: LeasePage[] = [];
  for (let i = 0; i < leaseCount; i++) lease.push({ page: pages[i]!, generation: generations[i]! });
  out.push({
    kind: "send",
    to: "router",
    msg: {
      type: "lease",
      rid: msg.rid,
      epoch: msg.epoch,
      pages: lease,
      pageSize: P,
      layoutSignature: config.layoutSignature,
      incarnation: state.incarnation,
      writerIncarnation: state.prefillIncarnation,
      ...(heldPages === 0 ? {} : { held: heldPages }),
    },
  });
}

/** Each later sample's `own` pages, leased to its rid; null (nothing kept) when the pool has too few. */
function reserveSiblings(pool: KvPool, msg: ReserveRequest, own: number): SiblingReservation[] | null {
  const siblings: SiblingReservation[] = [];
  for (const rid of msg.samples ?? []) {
    const leased = leasePages(pool, own, { rid, epoch: msg.epoch, tenant: msg.tenant });
    if (leased === null) {
      for (const s of siblings) freePages(pool, s.pages, s.generations, s.rid, msg.epoch);
      return null;
    }
    siblings.push({ rid, ...leased });
  }
  return siblings;
}

function reject(state: DecodeState, msg: ReserveRequest, error: WireError, out: Effects): void {
  if (!below(state, msg.rid)) state.ended[attemptKey(msg.rid, msg.epoch)] = 1;
  out.push({
    kind: "send",
    to: "router",
    msg: { type: "rejected", rid: msg.rid, epoch: msg.epoch, from: "decode", error },
  });
}

function manifest(state: DecodeState, msg: Manifest, ctx: DecodeContext): void {
  const { pool, safety, out } = ctx;
  let key = attemptKey(msg.rid, msg.epoch);
  let a = state.attempts[key];
  if (faultOn(safety, "stale-commit") && a?.phase !== "reserved") {
    // The fault: match the manifest by request id alone, as a metadata slot keyed by rid would.
    for (const k in state.attempts) {
      const candidate = state.attempts[k]!;
      if (candidate.rid === msg.rid && candidate.phase === "reserved") {
        key = k;
        a = candidate;
        break;
      }
    }
  }
  if (a === undefined || a.phase !== "reserved") {
    state.stale++;
    return;
  }
  const error = verify(a, msg, ctx);
  if (error !== null) {
    if (error.code === "page_tag_mismatch") state.tagFailures++;
    fail(state, key, a, error, ctx);
    return;
  }
  for (let i = a.held ?? 0; i < a.leaseCount; i++)
    pool.table.markReady(a.pages[i]!, a.generations[i]!, a.rid, a.epoch);
  a.phase = "decoding";
  a.generated = 1;
  const siblings = a.siblings;
  delete a.siblings;
  const coverage = msg.tokenEnd - msg.tokenStart;
  if (siblings !== undefined) shareSiblingPages(a, siblings.length, pool);
  commitSample(a, coverage, msg.firstToken, out);
  out.push({ kind: "send", to: "prefill", msg: { type: "release", rid: msg.rid, epoch: msg.epoch } });
  const forked = siblings === undefined ? [] : fork(state, a, siblings, msg, ctx);
  if (a.generated >= a.maxTokens) finish(state, key, a, [], ctx);
  for (const sample of forked) {
    if (sample.generated >= sample.maxTokens)
      finish(state, attemptKey(sample.rid, sample.epoch), sample, [], ctx);
  }
}

/** The `commit` effect and the router's `committed` of one (sample's) attempt. */
function commitSample(a: DecodeAttempt, coverage: number, firstToken: number, out: Effects): void {
  const pages: LeasePage[] = [];
  for (let i = 0; i < a.pages.length; i++) pages.push({ page: a.pages[i]!, generation: a.generations[i]! });
  const h = a.held === undefined ? {} : { held: a.held };
  out.push({ kind: "commit", rid: a.rid, epoch: a.epoch, promptLen: a.promptLen, coverage, pages, ...h });
  out.push({
    kind: "send",
    to: "router",
    msg: { type: "committed", rid: a.rid, epoch: a.epoch, firstToken },
  });
}

/** The prompt's full pages of the first sample `a` become the request's sibling pages, a reference per sample. */
function shareSiblingPages(a: DecodeAttempt, later: number, pool: KvPool): void {
  const P = pool.pageSize;
  const full = Math.floor(a.promptLen / P);
  for (let i = 0; i < full; i++)
    pool.table.shareSiblings(a.pages[i]!, a.generations[i]!, a.rid, a.epoch, 1 + later, P);
  a.shared = full;
  a.group = a.rid;
}

/**
 * The commit of a request of n > 1 samples forks it: each later sample gets its copy of the partial
 * last prompt page (stamped as its own) and becomes an attempt of its own over the sibling pages and
 * its own, committed with its first token. A sample aborted before the commit gets nothing (its
 * pages and its sibling references are dropped). Returns the samples forked.
 */
function fork(
  state: DecodeState,
  a: DecodeAttempt,
  siblings: readonly SiblingReservation[],
  msg: Manifest,
  ctx: DecodeContext,
): DecodeAttempt[] {
  const { pool, out } = ctx;
  const table = pool.table;
  const full = a.shared ?? 0;
  const partial = a.promptLen - full * pool.pageSize;
  const forked: DecodeAttempt[] = [];
  siblings.forEach((s, j) => {
    const key = attemptKey(s.rid, a.epoch);
    const sample: DecodeAttempt = {
      rid: s.rid,
      epoch: a.epoch,
      tenant: a.tenant,
      promptLen: a.promptLen,
      maxTokens: a.maxTokens,
      phase: "decoding",
      pages: [...a.pages.slice(0, full), ...s.pages],
      generations: [...a.generations.slice(0, full), ...s.generations],
      leaseCount: a.leaseCount,
      generated: 1,
      writer: a.writer,
      checked: false,
      shared: full,
      group: a.rid,
    };
    if (state.ended[key] !== undefined || state.attempts[key] !== undefined || below(state, s.rid)) {
      freeAll(sample, ctx);
      return;
    }
    if (partial > 0) {
      out.push({ kind: "copy", from: a.pages[full]!, to: s.pages[0]!, tokens: partial });
      table.stampWriter(s.pages[0]!, s.rid, a.epoch, partial);
      table.markReady(s.pages[0]!, s.generations[0]!, s.rid, a.epoch);
    }
    state.attempts[key] = sample;
    commitSample(sample, msg.tokenEnd - msg.tokenStart, msg.sampleFirstTokens?.[j] ?? msg.firstToken, out);
    forked.push(sample);
  });
  return forked;
}

/** The commit check: coverage is the pages sent (all but the held), checksums match, held pages are decode's. */
function verify(a: DecodeAttempt, msg: Manifest, { pool, safety }: DecodeContext): WireError | null {
  const sent = a.leaseCount - (a.held ?? 0);
  const start = (a.held ?? 0) * pool.pageSize;
  if (
    guardOn(safety, "coverage") &&
    (msg.tokenStart !== start || msg.tokenEnd !== a.promptLen || msg.checksums.length !== sent)
  ) {
    return {
      code: "coverage_mismatch",
      message: `The transfer of request ${a.rid} covered tokens [${msg.tokenStart}, ${msg.tokenEnd}) in ${msg.checksums.length} pages, decode reserved: [${start}, ${a.promptLen}) in ${sent} pages`,
    };
  }
  const heldError = held.verifyHeld(a, pool, safety);
  if (heldError !== null) return heldError;
  if (guardOn(safety, "checksum")) {
    // Every reserved page needs its checksum: a page the manifest has none for was never written.
    for (let i = a.leaseCount - sent; i < a.leaseCount; i++) {
      const expected = msg.checksums[i - a.leaseCount + sent];
      if (expected === undefined || pool.pageChecksum(a.pages[i]!, a.rid, a.epoch, i) !== expected) {
        return {
          code: "checksum_mismatch",
          message: `The KV page ${i} of request ${a.rid} does not match its transfer checksum: ${expected ?? "none sent"}`,
        };
      }
    }
  }
  if (guardOn(safety, "page-tags")) {
    // The commit-time tag check: every leased page must hold this attempt's own writes (a page
    // reserved but never written still carries an earlier request's stamp), before any token of
    // it reaches the client.
    const table = pool.table;
    for (let i = a.leaseCount - sent; i < a.leaseCount; i++) {
      const page = a.pages[i]!;
      if (
        !table.checkWrite(page, a.generations[i]!, a.rid, a.epoch) ||
        table.writerRid(page) !== a.rid ||
        table.writerEpoch(page) !== a.epoch
      ) {
        return {
          code: "page_tag_mismatch",
          message: `The KV page ${i} of request ${a.rid} holds another request's data at commit: written by ${table.writerRid(page)}/${table.writerEpoch(page)}`,
        };
      }
    }
  }
  return null;
}

/** The attempt a `check` or `step` names, if it is decoding and has a token left to produce. */
function decoding(state: DecodeState, key: string): DecodeAttempt | undefined {
  const a = state.attempts[key];
  if (a === undefined || a.phase !== "decoding" || a.generated >= a.maxTokens) {
    state.stale++;
    return undefined;
  }
  return a;
}

/**
 * The page-tag check of the step that writes the KV of token `generated` at `position` and attends
 * over [0, position]: every page of the attempt, under the one rule set of `OwnershipTable.checkStep`.
 */
function check(state: DecodeState, key: string, ctx: DecodeContext): void {
  const a = decoding(state, key);
  if (a === undefined) return;
  if (guardOn(ctx.safety, "page-tags")) {
    const position = a.promptLen + a.generated - 1;
    const bad = ctx.pool.table.checkStep(
      ctx.pool.pageSize,
      a.pages,
      a.generations,
      a.pages.length,
      a.rid,
      a.epoch,
      position,
      position + 1,
      a.held === undefined ? undefined : held.heldMarks(a.held, a.pages.length),
      a.tenant,
      a.shared ?? 0,
      a.group ?? -1,
    );
    if (bad >= 0) {
      state.tagFailures++;
      const at =
        bad < a.pages.length
          ? `leased at generation ${a.generations[bad]}: ${ctx.pool.table.describe(a.pages[bad]!)}`
          : `${a.pages.length} pages cannot hold ${position + 1} tokens`;
      fail(
        state,
        key,
        a,
        {
          code: "page_tag_mismatch",
          message: `The KV page ${bad} of request ${a.rid} epoch ${a.epoch} is not its own, refusing to read it (${at})`,
        },
        ctx,
      );
      return;
    }
  }
  a.checked = true;
}

/** After the step's forward pass: stamp the page it wrote, then send the token (or finish). */
function step(state: DecodeState, key: string, token: number, ctx: DecodeContext): void {
  const a = decoding(state, key);
  if (a === undefined) return;
  if (!a.checked && guardOn(ctx.safety, "page-tags")) {
    // The host ran a step no check armed: fail closed rather than stamp unchecked pages.
    state.tagFailures++;
    fail(
      state,
      key,
      a,
      { code: "page_tag_mismatch", message: `A decode step of request ${a.rid} ran without its page check` },
      ctx,
    );
    return;
  }
  a.checked = false;
  const { pool, out } = ctx;
  const table = pool.table;
  const P = pool.pageSize;
  const position = a.promptLen + a.generated - 1;
  const last = Math.floor(position / P);
  const fresh = position % P === 0;
  table.stampWriter(a.pages[last]!, a.rid, a.epoch, (position % P) + 1);
  if (fresh) table.markReady(a.pages[last]!, a.generations[last]!, a.rid, a.epoch);
  pool.observeRead?.(a, last + 1, fresh ? last : -1);
  a.generated++;
  if (a.generated >= a.maxTokens) {
    finish(state, key, a, [token], ctx);
    return;
  }
  const send = ctx.tokenSend;
  send.msg.rid = a.rid;
  send.msg.epoch = a.epoch;
  send.msg.tokens[0] = token;
  out.push(send);
}

function finish(
  state: DecodeState,
  key: string,
  a: DecodeAttempt,
  tokens: number[],
  ctx: DecodeContext,
): void {
  freeAll(a, ctx, held.cacheComputed(ctx.prefix, a, ctx.pool.pageSize));
  end(state, key);
  ctx.out.push({
    kind: "send",
    to: "router",
    msg: {
      type: "finished",
      rid: a.rid,
      epoch: a.epoch,
      reason: "length",
      tokens,
      completionTokens: a.generated,
    },
  });
}

/** Decode-side failure: tell the router, and abort prefill's side so it acknowledges the drain. */
function fail(state: DecodeState, key: string, a: DecodeAttempt, error: WireError, ctx: DecodeContext): void {
  const { out } = ctx;
  out.push({ kind: "send", to: "router", msg: { type: "failed", rid: a.rid, epoch: a.epoch, error } });
  if (a.phase === "reserved") {
    out.push({ kind: "send", to: "prefill", msg: { type: "abort", rid: a.rid, epoch: a.epoch } });
    quarantineOrFree(state, key, a, ctx);
    return;
  }
  freeAll(a, ctx);
  end(state, key);
  out.push({ kind: "stop", rid: a.rid, epoch: a.epoch });
}

function abort(state: DecodeState, key: string, ctx: DecodeContext): void {
  const { pool, safety, out } = ctx;
  const a = state.attempts[key];
  if (a === undefined) {
    // Aborted before its reserve arrived (or after it ended): refuse a late reserve.
    if (!below(state, ridOf(key))) state.ended[key] = 1;
    return;
  }
  if (a.phase === "quarantined") return;
  if (a.phase === "decoding") {
    // Committed: prefill's writes all drained before its manifest. Its computed KV is verified:
    // the full pages go to the cache (a stop token ends an attempt this way too).
    freeAll(a, ctx, held.cacheComputed(ctx.prefix, a, pool.pageSize));
    end(state, key);
  } else {
    // Relay the abort: prefill stops writing and acknowledges once its writes drained.
    out.push({ kind: "send", to: "prefill", msg: { type: "abort", rid: a.rid, epoch: a.epoch } });
    if (faultOn(safety, "early-free")) {
      // The fault (SGLang #24527): free at once, without waiting for the ack.
      freeAll(a, ctx);
      end(state, key);
    } else quarantineOrFree(state, key, a, ctx);
  }
  out.push({ kind: "stop", rid: a.rid, epoch: a.epoch });
}

function quarantineOrFree(state: DecodeState, key: string, a: DecodeAttempt, ctx: DecodeContext): void {
  const { pool, safety } = ctx;
  if (state.acks[key] !== undefined || a.writer <= state.prefillLost) {
    // Prefill already acknowledged, or the only incarnation that could write the lease is gone.
    freeAll(a, ctx);
    end(state, key);
    return;
  }
  const table = pool.table;
  // Held pages were never leased to prefill's writes: their references go at once.
  held.releaseHeld(pool, safety, a.pages, a.generations, a.held ?? 0);
  for (let i = a.held ?? 0; i < a.pages.length; i++) {
    if (i < a.leaseCount) table.quarantine(a.pages[i]!, a.generations[i]!, a.rid, a.epoch);
    else table.free(a.pages[i]!, a.generations[i]!, a.rid, a.epoch);
  }
  // The later samples' own pages were never leased to prefill: nothing can write them.
  for (const s of a.siblings ?? []) freePages(pool, s.pages, s.generations, s.rid, a.epoch);
  delete a.siblings;
  a.phase = "quarantined";
}

function abortAck(state: DecodeState, key: string, pool: KvPool): void {
  const a = state.attempts[key];
  if (a === undefined) {
    if (state.ended[key] === undefined && !below(state, ridOf(key))) state.acks[key] = 1;
    else state.stale++;
    return;
  }
  if (a.phase !== "quarantined") {
    state.acks[key] = 1;
    return;
  }
  releaseQuarantined(a, pool);
  end(state, key);
}

function releaseQuarantined(a: DecodeAttempt, pool: KvPool): void {
  for (let i = a.held ?? 0; i < a.leaseCount; i++)
    pool.table.releaseQuarantine(a.pages[i]!, a.generations[i]!);
}

/**
 * Frees an attempt's pages: its own ones, its references to sibling pages and to held cache pages
 * (and to the pages `cached` marks: those the cache took at its end), its later samples' reservations.
 */
function freeAll(a: DecodeAttempt, { pool, safety }: DecodeContext, cached: number[] | null = null): void {
  const shared = a.shared ?? 0;
  held.releaseHeld(pool, safety, a.pages, a.generations, a.held ?? 0);
  for (let i = a.held ?? 0; i < a.pages.length; i++) {
    if (i < shared) pool.table.dropSibling(a.pages[i]!, a.generations[i]!, a.group!, a.epoch);
    else if (cached?.[i] === 1) pool.table.unref(a.pages[i]!, a.generations[i]!);
    else pool.table.free(a.pages[i]!, a.generations[i]!, a.rid, a.epoch);
  }
  for (const s of a.siblings ?? []) freePages(pool, s.pages, s.generations, s.rid, a.epoch);
}

function freePages(
  pool: KvPool,
  pages: readonly number[],
  generations: readonly number[],
  rid: number,
  epoch: number,
): void {
  for (let i = 0; i < pages.length; i++) pool.table.free(pages[i]!, generations[i]!, rid, epoch);
}

function end(state: DecodeState, key: string): void {
  const a = state.attempts[key];
  delete state.attempts[key];
  delete state.acks[key];
  if (a === undefined || !below(state, a.rid)) state.ended[key] = 1;
}

/** Whether `rid` is below the router's watermark: over at the router, no message of it to wait for. */
function below(state: DecodeState, rid: number): boolean {
  return belowWatermark(state.watermarks, rid);
}
