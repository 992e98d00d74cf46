import assert from "node:assert/strict";
import { test } from "node:test";
import { TestPool } from "../../testing/protocol-pool.js";
import { PageState } from "../kvcache/ownership-table.js";
import {
  type DecodeEvent,
  type DecodeState,
  decodeContext,
  decodeStep,
  initialDecodeState,
  leasedPage,
} from "./decode-machine.js";
import type { Effect, KvPool } from "./effects.js";
import { makeSafety, SAFE, type Safety } from "./safety.js";
import { attemptKey, type ControlMessage, type Manifest, type TransferLease } from "./wire.js";

const CONFIG = { maxModelLen: 16, layoutSignature: "test" };

function harness(numPages = 4, safety: Safety = SAFE) {
  const pool: TestPool & Pick<KvPool, "observeRead"> = new TestPool(numPages);
  const state: DecodeState = initialDecodeState(1, 1);
  /** Every read a step reports (`observeRead`), as its logical page count and fresh index. */
  const reads: { count: number; fresh: number }[] = [];
  pool.observeRead = (_attempt, count, fresh) => {
    reads.push({ count, fresh });
  };
  const run = (event: DecodeEvent): Effect[] => {
    const out: Effect[] = [];
    decodeStep(state, event, decodeContext(pool, CONFIG, safety, out));
    return out;
  };
  const msg = (m: ControlMessage) => run({ type: "message", msg: m });
  /** One engine step of `(rid, epoch)`: its check, then (if that passed) the step. */
  const decode = (rid: number, epoch: number, token: number): Effect[] => {
    const key = attemptKey(rid, epoch);
    const out = run({ type: "check", key });
    return state.attempts[key]?.phase === "decoding" ? [...out, ...run({ type: "step", key, token })] : out;
  };
  return { pool, state, run, msg, decode, reads };
}

function sent(effects: Effect[], to?: string): ControlMessage[] {
  return effects.flatMap((e) => (e.kind === "send" && (to === undefined || e.to === to) ? [e.msg] : []));
}

function reserve(
  h: ReturnType<typeof harness>,
  rid = 1,
  epoch = 1,
  promptLen = 2,
  maxTokens = 2,
): TransferLease {
  const out = h.msg({ type: "reserve", rid, epoch, tenant: 0, promptLen, maxTokens });
  const lease = sent(out, "router")[0];
  assert.equal(lease?.type, "lease");
  return lease as TransferLease;
}

function goodManifest(lease: TransferLease, promptLen = 2): Manifest {
  return {
    type: "manifest",
    rid: lease.rid,
    epoch: lease.epoch,
    tokenStart: 0,
    tokenEnd: promptLen,
    firstToken: 9,
    checksums: lease.pages.map((_, i) => TestPool.expectedChecksum(lease.rid, lease.epoch, i)),
  };
}

function writeLease(h: ReturnType<typeof harness>, lease: TransferLease): void {
  lease.pages.forEach((p, i) => {
    h.pool.write(p.page, lease.rid, lease.epoch, i);
  });
}

test("decodeStep() reserves, commits a verified transfer, decodes and frees at finish", () => {
  const h = harness();
  const lease = reserve(h);
  assert.equal(lease.pages.length, 2);
  assert.equal(lease.incarnation, 1);
  assert.deepEqual(h.pool.table.counts(), { free: 1, reserved: 3, ready: 0, quarantined: 0, total: 4 });
  writeLease(h, lease);
  const commit = h.msg(goodManifest(lease));
  assert.deepEqual(
    sent(commit).map((m) => m.type),
    ["committed", "release"],
  );
  for (const p of lease.pages) assert.equal(h.pool.table.state(p.page), PageState.READY);
  const step = h.decode(1, 1, 42);
  const finished = sent(step, "router")[0];
  assert.equal(finished?.type, "finished");
  assert.deepEqual(h.reads, [{ count: 3, fresh: 2 }]);
  assert.deepEqual(h.pool.table.counts(), { free: 4, reserved: 0, ready: 0, quarantined: 0, total: 4 });
});

test("decodeStep() rejects a prompt over its pool at its door and allocates nothing", () => {
  const h = harness(4);
  const out = h.msg({ type: "reserve", rid: 1, epoch: 1, tenant: 0, promptLen: 3, maxTokens: 2 });
  const rejected = sent(out, "router")[0];
  assert.equal(rejected?.type, "rejected");
  assert.equal(rejected?.type === "rejected" ? rejected.error.code : "", "context_length_exceeded");
  assert.match(
    rejected?.type === "rejected" ? rejected.error.message : "",
    /Prompt of 3 tokens plus max_tokens 2 .*: 4/,
  );
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() answers pool_exhausted when the pool is busy, allocating nothing", () => {
  const h = harness(4);
  reserve(h, 1, 1, 2, 2);
  const out = h.msg({ type: "reserve", rid: 2, epoch: 1, tenant: 0, promptLen: 1, maxTokens: 2 });
  const rejected = sent(out, "router")[0];
  assert.equal(rejected?.type === "rejected" ? rejected.error.code : "", "pool_exhausted");
  assert.equal(h.pool.table.counts().free, 1);
});

test("decodeStep() fails a manifest whose coverage differs from the reservation", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  const short = { ...goodManifest(lease), tokenEnd: 1, checksums: [TestPool.expectedChecksum(1, 1, 0)] };
  const out = h.msg(short);
  const failed = sent(out, "router")[0];
  assert.equal(failed?.type === "failed" ? failed.error.code : "", "coverage_mismatch");
  assert.equal(sent(out, "prefill")[0]?.type, "abort");
  for (const p of lease.pages) assert.equal(h.pool.table.state(p.page), PageState.QUARANTINED);
});

test("decodeStep() fails a manifest whose checksum does not match the page it holds", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  h.pool.write(lease.pages[1]!.page, 7, 1, 1); // another request's data
  const failed = sent(h.msg(goodManifest(lease)), "router")[0];
  assert.equal(failed?.type === "failed" ? failed.error.code : "", "checksum_mismatch");
});

test("decodeStep() ignores and counts a manifest of another epoch", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  const out = h.msg({ ...goodManifest(lease), epoch: 2 });
  assert.deepEqual(out, []);
  assert.equal(h.state.stale, 1);
  assert.equal(h.pool.table.state(lease.pages[0]!.page), PageState.RESERVED);
});

test("decodeStep() quarantines on abort and releases only on the ack, never on other events", () => {
  const h = harness();
  const lease = reserve(h);
  const out = h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(sent(out, "prefill")[0]?.type, "abort");
  for (const p of lease.pages) assert.equal(h.pool.table.state(p.page), PageState.QUARANTINED);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  h.msg({ type: "abort_ack", rid: 1, epoch: 2 });
  h.run({ type: "quarantine_timeout", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().quarantined, 2);
  h.msg({ type: "abort_ack", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() releases quarantined pages when prefill is fenced", () => {
  const h = harness();
  reserve(h);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().quarantined, 2);
  h.run({ type: "peer_lost", role: "prefill", incarnation: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() keeps a lease granted for a newer prefill when an older one is fenced", () => {
  const h = harness();
  h.run({ type: "peer_up", role: "prefill", incarnation: 2 });
  const lease = reserve(h);
  assert.equal(lease.writerIncarnation, 2);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  h.run({ type: "peer_lost", role: "prefill", incarnation: 1 });
  assert.equal(h.pool.table.counts().quarantined, 2);
  h.run({ type: "peer_lost", role: "prefill", incarnation: 2 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() quarantines a lease of a prefill incarnation that reconnected after it was fenced", () => {
  // Decode's transfer connection to a live prefill node dropped (peer_lost 1) and decode connected
  // again to the same incarnation (peer_up 1): a lease granted now can be written over the new
  // connection, so an abort must quarantine its pages until prefill's ABORT_ACK.
  const h = harness();
  h.run({ type: "peer_lost", role: "prefill", incarnation: 1 });
  h.run({ type: "peer_up", role: "prefill", incarnation: 1 });
  const lease = reserve(h);
  assert.equal(lease.writerIncarnation, 1);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().quarantined, 2);
  h.msg({ type: "abort_ack", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() frees at once on abort when prefill already acknowledged", () => {
  const h = harness();
  reserve(h);
  h.msg({ type: "abort_ack", rid: 1, epoch: 1 });
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() frees a committed request at once on abort", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  h.msg(goodManifest(lease));
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() refuses a reserve that arrives after its abort", () => {
  const h = harness();
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  const out = h.msg({ type: "reserve", rid: 1, epoch: 1, tenant: 0, promptLen: 1, maxTokens: 1 });
  assert.deepEqual(out, []);
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() fails a step whose page holds another request's data (page tags)", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  h.msg(goodManifest(lease));
  h.pool.write(lease.pages[0]!.page, 5, 1, 0); // a late write of request 5 lands
  const out = h.decode(1, 1, 1);
  const failed = sent(out, "router")[0];
  assert.equal(failed?.type === "failed" ? failed.error.code : "", "page_tag_mismatch");
  assert.deepEqual(h.reads, []);
  assert.equal(h.state.tagFailures, 1);
});

test("decodeStep() checks every page of a step under the engine's rule: a page short of the tokens read fails", () => {
  // Page size 2: prompt of 3 tokens (pages 0 and 1, page 1 half full), then steps at positions 3, 4.
  const pool = new TestPool(4, 2);
  const state = initialDecodeState(1, 1);
  const run = (event: DecodeEvent): Effect[] => {
    const out: Effect[] = [];
    decodeStep(state, event, decodeContext(pool, { maxModelLen: 8, layoutSignature: "test" }, SAFE, out));
    return out;
  };
  const lease = sent(
    run({
      type: "message",
      msg: { type: "reserve", rid: 1, epoch: 1, tenant: 0, promptLen: 3, maxTokens: 3 },
    }),
    "router",
  )[0] as TransferLease;
  pool.write(lease.pages[0]!.page, 1, 1, 0, 2);
  pool.write(lease.pages[1]!.page, 1, 1, 1, 1);
  const manifest = { ...goodManifest(lease, 3) };
  run({ type: "message", msg: manifest });
  const key = attemptKey(1, 1);
  // The step at position 3 reads slot 2, the one token prefill wrote into page 1: it passes.
  run({ type: "check", key });
  run({ type: "step", key, token: 5 });
  assert.equal(pool.table.filledTokens(lease.pages[1]!.page), 2);
  // Now the page's stamp claims fewer tokens than the next step (position 4) reads: fail closed.
  pool.table.stampWriter(lease.pages[1]!.page, 1, 1, 1);
  const out = run({ type: "check", key });
  const failed = sent(out, "router")[0];
  assert.equal(failed?.type === "failed" ? failed.error.code : "", "page_tag_mismatch");
  assert.equal(state.tagFailures, 1);
});

test("decodeStep() fails closed on a step that no passed check armed", () => {
  const h = harness();
  const lease = reserve(h);
  writeLease(h, lease);
  h.msg(goodManifest(lease));
  const out = h.run({ type: "step", key: attemptKey(1, 1), token: 1 });
  const failed = sent(out, "router")[0];
  assert.equal(failed?.type === "failed" ? failed.error.code : "", "page_tag_mismatch");
  assert.deepEqual(h.reads, []);
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() reads the foreign page when the page-tags guard is off", () => {
  const h = harness(4, makeSafety({ disabledGuards: ["page-tags"] }));
  const lease = reserve(h);
  writeLease(h, lease);
  h.msg(goodManifest(lease));
  h.pool.write(lease.pages[0]!.page, 5, 1, 0);
  h.decode(1, 1, 1);
  assert.deepEqual(h.reads, [{ count: 3, fresh: 2 }]);
});

test("decodeStep() under early-free frees reserved pages on abort without the ack", () => {
  const h = harness(4, makeSafety({ faults: ["early-free"] }));
  reserve(h);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() honours the release timer only with the quarantine guard off", () => {
  const h = harness(4, makeSafety({ disabledGuards: ["quarantine"] }));
  reserve(h);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  h.run({ type: "quarantine_timeout", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() under stale-commit commits a newer epoch with an older manifest", () => {
  const h = harness(8, makeSafety({ faults: ["stale-commit"], disabledGuards: ["checksum", "page-tags"] }));
  const old = reserve(h, 1, 1);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  reserve(h, 1, 2);
  const out = h.msg(goodManifest(old));
  assert.equal(sent(out, "router")[0]?.type, "committed");
  assert.equal(sent(out, "router")[0]?.epoch, 2);
});

test("decodeStep() without stale-commit ignores an older epoch's manifest", () => {
  const h = harness(8);
  const old = reserve(h, 1, 1);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  reserve(h, 1, 2);
  assert.deepEqual(h.msg(goodManifest(old)), []);
});

test("leasedPage() names only the leased prompt pages of an attempt awaiting its transfer", () => {
  const h = harness();
  const lease = reserve(h, 1, 1, 2, 2);
  assert.equal(leasedPage(h.state, 1, 1, 0), lease.pages[0]!.page);
  assert.equal(leasedPage(h.state, 1, 1, 1), lease.pages[1]!.page);
  assert.equal(leasedPage(h.state, 1, 1, 2), -1); // the tail page for generated tokens
  assert.equal(leasedPage(h.state, 1, 2, 0), -1);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(leasedPage(h.state, 1, 1, 0), -1);
});

test("decodeStep() frees at once on abort when the lease's prefill incarnation is already gone", () => {
  const h = harness();
  h.run({ type: "peer_lost", role: "prefill", incarnation: 1 });
  reserve(h);
  h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 4);
});

test("decodeStep() forgets tombstones and early acks below the router's watermark, and records nothing below it", () => {
  const h = harness();
  const lease = reserve(h, 16);
  writeLease(h, lease);
  h.msg(goodManifest(lease));
  h.decode(16, 1, 9);
  h.msg({ type: "abort", rid: 32, epoch: 1 });
  h.msg({ type: "abort_ack", rid: 48, epoch: 1 });
  h.msg({ type: "abort", rid: 80, epoch: 1 });
  assert.deepEqual(Object.keys(h.state.ended).sort(), ["16:1", "32:1", "80:1"]);
  assert.deepEqual(Object.keys(h.state.acks), ["48:1"]);
  // Still in flight at or above the watermark: rid 64 keeps its lease, rid 80 its tombstone.
  reserve(h, 64, 1, 1, 1);
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 64 });
  assert.deepEqual(Object.keys(h.state.ended), ["80:1"]);
  assert.deepEqual(h.state.acks, {});
  assert.ok(h.state.attempts["64:1"] !== undefined);
  // Below it: stale, and no record is left.
  const stale = h.state.stale;
  assert.deepEqual(h.msg({ type: "reserve", rid: 48, epoch: 2, tenant: 0, promptLen: 1, maxTokens: 1 }), []);
  h.msg({ type: "abort_ack", rid: 32, epoch: 2 });
  h.msg({ type: "abort", rid: 48, epoch: 3 });
  assert.equal(h.state.stale, stale + 2);
  assert.deepEqual(Object.keys(h.state.ended), ["80:1"]);
  assert.deepEqual(h.state.acks, {});
  // An attempt below it that ends leaves no tombstone; an older watermark is stale.
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 96 });
  h.msg({ type: "abort", rid: 64, epoch: 1 });
  h.msg({ type: "abort_ack", rid: 64, epoch: 1 });
  assert.deepEqual(h.state.attempts, {});
  assert.deepEqual(h.state.ended, {});
  assert.equal(h.pool.table.counts().free, 4);
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 80 });
  assert.deepEqual(h.state.watermarks, { 0: 96 });
});

test("decodeStep() compares rids across the u32 wrap (serial order)", () => {
  const h = harness();
  h.msg({ type: "abort", rid: 0xffff_ffe0, epoch: 1 });
  h.msg({ type: "abort", rid: 32, epoch: 1 });
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 16 });
  assert.deepEqual(Object.keys(h.state.ended), ["32:1"]);
});

test("decodeStep() keeps two routers apart: a router's loss aborts only its attempts, watermarks are per router slot", () => {
  const h = harness(8);
  // Router slot 0 hands out rids 16, 32, …; router slot 1 rids 17, 33, ….
  const a = reserve(h, 16, 1, 2, 2);
  const b = reserve(h, 17, 1, 2, 1);
  const out = h.run({ type: "router_lost", slot: 1 });
  // Router 1's attempt: the abort relayed to prefill, its lease quarantined until the ABORT_ACK.
  assert.deepEqual(
    out.filter((e) => e.kind === "send"),
    [{ kind: "send", to: "prefill", msg: { type: "abort", rid: 17, epoch: 1 } }],
  );
  assert.equal(h.state.attempts["17:1"]?.phase, "quarantined");
  assert.equal(h.state.attempts["16:1"]?.phase, "reserved");
  assert.equal(h.pool.table.counts().quarantined, b.pages.length);
  h.msg({ type: "abort_ack", rid: 17, epoch: 1 });
  assert.equal(h.state.attempts["17:1"], undefined);
  // Router 0's watermark does not reach router 1's records (17 < 48 in serial order).
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 48 });
  assert.deepEqual(Object.keys(h.state.ended), ["17:1"]);
  assert.ok(h.state.attempts["16:1"] !== undefined, "in flight: untouched");
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 33 });
  assert.deepEqual(h.state.ended, {});
  assert.deepEqual(h.state.watermarks, { 0: 48, 1: 33 });
  // Router 0's attempt still commits.
  writeLease(h, a);
  h.msg(goodManifest(a));
  assert.equal(h.state.attempts["16:1"]?.phase, "decoding");
});
