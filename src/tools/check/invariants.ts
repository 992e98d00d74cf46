/**
 * The invariants `kvfence check` holds every world to (docs/design.md §7), over the real machines'
 * state, decode's real ownership table and the pages' ghost contents (ghost-pool.ts):
 *
 * 1. a decode step reads only pages holding its own request's data (`checkRead`);
 * 2. an HTTP 200 only after a truly good commit: full coverage, every page its own (`checkAnswer`,
 *    against the commits `goodCommit` recorded);
 * 3. a write that may still land targets a page still leased to it (`checkState`);
 * 4. a request over the effective context gets 400 `context_length_exceeded`, and one refused at
 *    the router's door reaches no node (`checkAnswer`, `checkDoorReject`);
 * 5. a QUARANTINED page belongs to an attempt still waiting for its ack (`checkState`);
 *
 * and, in a quiescent world, bounded liveness (everything answered, every page FREE) and bounded
 * protocol state (the machines hold nothing) (`checkQuiescent`). Each check pushes what it finds
 * onto the step's violations.
 */
import { NO_WRITER, type OwnershipTable, type PageCounts, PageState } from "../../kvcache/ownership-table.js";
import type { CommitEffect, Effect, ReadingAttempt } from "../../protocol/effects.js";
import { writeLands } from "../../protocol/page-write.js";
import type { RouterEvent } from "../../protocol/router-machine.js";
import { attemptKey, ROUTER_SLOTS } from "../../protocol/wire.js";
import { GHOST_WORDS } from "./ghost-pool.js";
import {
  type CheckRequest,
  FIRST_TOKEN,
  type InflightWrite,
  landingSite,
  type ModelConfig,
  STEP_TOKEN,
  type Violation,
  type World,
} from "./world-state.js";

/** What the checks read beside the world. */
export interface InvariantContext {
  readonly config: ModelConfig;
  /** Decode's real table, loaded with the world being checked. */
  readonly decodeTable: OwnershipTable;
  /** The longest request the system can serve: the window, and each pool's capacity. */
  readonly effectiveContext: number;
}

/**
 * A commit is good when its prompt pages hold its request's transfer (a sample's: its group's),
 * and its first `held` pages (decode-side reuse) the KV of its own prefix (`heldOk`).
 */
export function goodCommit(
  content: readonly number[],
  { promptLen, coverage, pages, epoch }: CommitEffect,
  group: number,
  pageSize: number,
  held = 0,
  heldOk: (i: number) => boolean = () => false,
): boolean {
  const leaseCount = Math.ceil(promptLen / pageSize);
  let good = coverage === promptLen - held * pageSize;
  for (let i = 0; i < held && good; i++) good = heldOk(i);
  for (let i = held; i < leaseCount && good; i++) {
    const at = pages[i]!.page * GHOST_WORDS;
    good =
      content[at] === group && content[at + 1] === epoch && content[at + 2] === i && content[at + 3] === 0;
  }
  return good;
}

/** The request rid `rid` went out as (see `World.order`). */
export function requestOf(w: World, config: ModelConfig, rid: number): CheckRequest | undefined {
  return config.requests[w.order[Math.floor(rid / ROUTER_SLOTS) - 1]!];
}

/**
 * Decode-side reuse: decode page `page`, read as logical page `i` by request `rid`, holds the KV
 * of exactly that request's tokens `[0, (i + 1)·P)` computed for its tenant — page `i` of a
 * request of the same tenant whose tokens (prompt, then generated) start the same way.
 */
export function holdsPrefix(w: World, ctx: InvariantContext, page: number, rid: number, i: number): boolean {
  const { config } = ctx;
  const at = page * GHOST_WORDS;
  const c = w.dContent;
  if (c[at] === -1 || c[at + 2] !== i || c[at + 3] !== 0) return false;
  const reader = requestOf(w, config, rid);
  const writer = requestOf(w, config, c[at]!);
  if (reader?.tokens === undefined || writer?.tokens === undefined || reader.tenant !== writer.tenant)
    return false;
  const n = (i + 1) * config.pageSize;
  for (let k = 0; k < n; k++) if (tokenAt(reader, k) !== tokenAt(writer, k)) return false;
  return true;
}

/** Token `k` of a request's sequence: its prompt, then the first token and the step tokens. */
function tokenAt(r: CheckRequest, k: number): number {
  const prompt = r.tokens!;
  return k < prompt.length ? prompt[k]! : k === prompt.length ? FIRST_TOKEN : STEP_TOKEN;
}

/** Invariant 4 at the door: a submit the router answered at once must not have contacted a node. */
export function checkDoorReject(event: RouterEvent, out: readonly Effect[], violations: Violation[]): void {
  if (
    event.type === "submit" &&
    out.some((e) => e.kind === "respond") &&
    out.some((e) => e.kind === "send")
  ) {
    violations.push({
      invariant: "4",
      message: `The router rejected request ${event.rid} at its door but still contacted a node`,
    });
  }
}

/** Invariant 1: the first `count` pages a decode step of `attempt` reads hold its own data. */
export function checkRead(
  w: World,
  ctx: InvariantContext,
  attempt: ReadingAttempt,
  count: number,
  violations: Violation[],
): void {
  const { rid, epoch, pages, generations } = attempt;
  // A sample of n > 1 reads its group's sibling pages (the first `shared`), and its group's data
  // in them and in its copy of the partial page; never another request's, nor another sample's.
  const { group = rid, shared = 0, held = 0 } = attempt as { group?: number; shared?: number; held?: number };
  const table = ctx.decodeTable;
  const tenant = requestOf(w, ctx.config, rid)?.tenant ?? -1;
  for (let i = 0; i < held && i < count; i++) {
    // A held page (decode-side reuse): a cache page of the reader's tenant it references, never
    // freed or rewritten since, holding the KV of the reader's own prefix.
    const page = pages[i]!;
    if (
      table.checkShared(page, generations[i]!, tenant) &&
      table.ownerEpoch(page) === NO_WRITER &&
      holdsPrefix(w, ctx, page, rid, i)
    )
      continue;
    const at = page * GHOST_WORDS;
    violations.push({
      invariant: "1",
      message: `Decode step of request ${rid} (tenant ${tenant}) read held decode page ${page} (its page ${i}), which is ${describePage(table, page)} holding ${w.dContent[at] === -1 ? "never-written bytes" : `the KV of request ${w.dContent[at]} epoch ${w.dContent[at + 1]} page ${w.dContent[at + 2]}`}: a held page must be a cached page of the reader's tenant that it references, holding its own prefix's KV`,
    });
    return;
  }
  for (let i = held; i < count; i++) {
    const page = pages[i]!;
    const generation = generations[i]!;
    const at = page * GHOST_WORDS;
    const c = w.dContent;
    const owner = i < shared ? group : rid;
    const ok =
      table.state(page) === (i < shared ? PageState.SHARED : PageState.READY) &&
      table.generation(page) === generation &&
      table.owner(page) === owner &&
      table.ownerEpoch(page) === epoch &&
      (c[at] === owner || c[at] === group) &&
      c[at + 1] === epoch &&
      c[at + 2] === i;
    if (!ok) {
      const holder =
        c[at] === -1
          ? "never-written bytes"
          : `the KV of request ${c[at]} epoch ${c[at + 1]} page ${c[at + 2]}`;
      violations.push({
        invariant: "1",
        message: `Decode step of request ${rid} epoch ${epoch} read decode page ${page} (its page ${i}), which holds ${holder}`,
      });
      return;
    }
  }
}

/** Invariants 2 and 4 on a client's answer: a 200 needs a good commit; an oversized request gets 400. */
export function checkAnswer(
  w: World,
  ctx: InvariantContext,
  { rid, epoch, status, code }: { rid: number; epoch: number; status: number; code: string | null },
  violations: Violation[],
): void {
  const r = requestOf(w, ctx.config, rid)!;
  const oversized = r.promptLen + r.maxTokens > ctx.effectiveContext;
  if (status === 200 && !w.good.includes(attemptKey(rid, epoch))) {
    violations.push({
      invariant: "2",
      message: `Request ${rid} got HTTP 200 without a good commit of epoch ${epoch} (coverage short or a page not holding its own data)`,
    });
  }
  if (
    oversized &&
    (status !== 400 || code !== "context_length_exceeded") &&
    (status === 200 || code !== "aborted")
  ) {
    violations.push({
      invariant: "4",
      message: `Request ${rid} (prompt ${r.promptLen} + max_tokens ${r.maxTokens} over the effective context ${ctx.effectiveContext}) got ${status}${code === null ? "" : ` ${code}`} instead of 400 context_length_exceeded`,
    });
  }
}

/** Invariants 3 and 5 on the state after an event. */
export function checkState(w: World, ctx: InvariantContext, violations: Violation[]): void {
  const table = ctx.decodeTable;
  // Invariant 3: a write that may still land targets the page leased for it, still leased to
  // that write's attempt (RESERVED, or QUARANTINED waiting for the drain).
  for (const s of w.writes) {
    const { header: h } = JSON.parse(s) as InflightWrite;
    if (!writeLands(table, h, landingSite(w, h, ctx.config))) {
      continue;
    }
    const state = table.state(h.page);
    const attempt = w.decode.attempts[attemptKey(h.rid, h.epoch)];
    const leased =
      attempt === undefined || (h.index < attempt.leaseCount && attempt.pages[h.index] === h.page);
    const live =
      leased &&
      (state === PageState.RESERVED || state === PageState.QUARANTINED) &&
      table.generation(h.page) === h.generation &&
      table.owner(h.page) === h.rid &&
      table.ownerEpoch(h.page) === h.epoch;
    if (!live) {
      violations.push({
        invariant: "3",
        message: `A write of request ${h.rid} epoch ${h.epoch} (its page ${h.index}) may still land in decode page ${h.page}, which is ${leased ? "" : "outside its lease and "}${describePage(table, h.page)}`,
      });
      break;
    }
  }
  // Invariant 5 (second half): a QUARANTINED page belongs to an attempt still waiting for its ack.
  for (let p = 0; p < ctx.config.decodePages; p++) {
    if (table.state(p) !== PageState.QUARANTINED) continue;
    const a = w.decode.attempts[attemptKey(table.owner(p), table.ownerEpoch(p))];
    if (a === undefined || a.phase !== "quarantined") {
      violations.push({
        invariant: "5",
        message: `Decode page ${p} is QUARANTINED for request ${table.owner(p)} epoch ${table.ownerEpoch(p)}, which waits for no acknowledgement`,
      });
      break;
    }
  }
}

/**
 * Bounded liveness: a quiescent world (`d` and `p` its pools' page counts) must be idle —
 * everything answered, every page FREE — and then hold no protocol state.
 */
export function checkQuiescent(
  w: World,
  config: ModelConfig,
  d: PageCounts,
  p: PageCounts,
  decodeCached = 0,
): Violation | null {
  if (w.lossy === 1) return null;
  const busy: string[] = [];
  for (const router of w.routers) {
    for (const key in router.requests) {
      if (router.requests[key]!.phase !== "done") busy.push(`request ${key} never answered`);
    }
  }
  // Decode's cached pages that no request references (decode-side reuse) are idle too.
  if (d.free + decodeCached !== config.decodePages)
    busy.push(`decode pool not all FREE (${describeCounts(d)})`);
  if (p.free !== config.prefillPages) busy.push(`prefill pool not all FREE (${describeCounts(p)})`);
  if (busy.length === 0) return checkBound(w);
  return {
    invariant: "liveness",
    message: `The system is stuck with no message, write or step left to make progress: ${busy.join("; ")}`,
  };
}

/**
 * Bounded protocol state: with every request answered and nothing in flight, the node machines
 * hold no attempt and no record of one (the router's watermark reached both and pruned them).
 */
function checkBound(w: World): Violation | null {
  const held: string[] = [];
  const count = (what: string, record: object) => {
    const n = Object.keys(record).length;
    if (n > 0) held.push(`${what} ${n} (${Object.keys(record).join(", ")})`);
  };
  count("decode attempts", w.decode.attempts);
  count("decode tombstones", w.decode.ended);
  count("decode early acks", w.decode.acks);
  count("prefill attempts", w.prefill.attempts);
  count("prefill tombstones", w.prefill.ended);
  if (held.length === 0) return null;
  return {
    invariant: "bound",
    message: `The system is idle but the node machines still hold protocol state: ${held.join("; ")}`,
  };
}

function describePage(table: OwnershipTable, page: number): string {
  const s = table.state(page);
  const name = ["FREE", "RESERVED", "READY", "QUARANTINED", "SHARED"][s]!;
  if (s === PageState.SHARED && table.ownerEpoch(page) === NO_WRITER)
    return `a cached page of tenant ${table.tenant(page)} with ${table.refcount(page)} references`;
  return s === PageState.FREE
    ? "FREE"
    : `${name} for request ${table.owner(page)} epoch ${table.ownerEpoch(page)}`;
}

function describeCounts(c: PageCounts): string {
  return `free ${c.free}, reserved ${c.reserved}, ready ${c.ready}, quarantined ${c.quarantined}`;
}
