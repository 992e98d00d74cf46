import assert from "node:assert/strict";
import { test } from "node:test";
import { TestPool } from "../../testing/protocol-pool.js";
import type { Effect, WriteEffect } from "./effects.js";
import { initialPrefillState, type PrefillEvent, type PrefillState, prefillStep } from "./prefill-machine.js";
import { makeSafety, SAFE, type Safety } from "./safety.js";
import type { ControlMessage, PrefillRequest } from "./wire.js";

const CONFIG = { maxModelLen: 16, layoutSignature: "test" };

function harness(numPages = 3, safety: Safety = SAFE) {
  const pool = new TestPool(numPages);
  const state: PrefillState = initialPrefillState(1, 1);
  const run = (event: PrefillEvent): Effect[] => {
    const out: Effect[] = [];
    prefillStep(state, event, { pool, config: CONFIG, safety, out });
    return out;
  };
  const msg = (m: ControlMessage) => run({ type: "message", msg: m });
  return { pool, state, run, msg };
}

function request(rid = 1, epoch = 1, promptLen = 2, maxTokens = 1): PrefillRequest {
  const pages = Array.from({ length: Math.ceil(promptLen) }, (_, i) => ({ page: 10 + i, generation: 1 }));
  return {
    type: "prefill",
    rid,
    epoch,
    tenant: 0,
    promptLen,
    maxTokens,
    lease: {
      type: "lease",
      rid,
      epoch,
      pages,
      pageSize: 1,
      layoutSignature: "test",
      incarnation: 1,
      writerIncarnation: 1,
    },
  };
}

/** Runs prefill up to the issued writes, computing like the engine does. */
function startWriting(h: ReturnType<typeof harness>, req = request()): WriteEffect[] {
  const out = h.msg(req);
  const compute = out.find((e) => e.kind === "compute");
  assert.ok(compute !== undefined && compute.kind === "compute");
  compute.pages.forEach((p, i) => {
    h.pool.write(p.page, req.rid, req.epoch, i);
    h.pool.table.markReady(p.page, p.generation, req.rid, req.epoch);
  });
  return h
    .run({ type: "computed", rid: req.rid, epoch: req.epoch, firstToken: 5 })
    .filter((e) => e.kind === "write");
}

function sent(effects: Effect[]): ControlMessage[] {
  return effects.flatMap((e) => (e.kind === "send" ? [e.msg] : []));
}

test("prefillStep() computes, writes every leased page, then sends the manifest and holds its pages", () => {
  const h = harness();
  const writes = startWriting(h);
  assert.deepEqual(
    writes.map((w) => [w.header.index, w.header.page, w.corrupt]),
    [
      [0, 10, false],
      [1, 11, false],
    ],
  );
  assert.deepEqual(h.run({ type: "write_done", rid: 1, epoch: 1, index: 0 }), []);
  const manifest = sent(h.run({ type: "write_done", rid: 1, epoch: 1, index: 1 }))[0];
  assert.ok(manifest?.type === "manifest");
  assert.equal(manifest.tokenEnd, 2);
  assert.deepEqual(manifest.checksums, [
    TestPool.expectedChecksum(1, 1, 0),
    TestPool.expectedChecksum(1, 1, 1),
  ]);
  assert.equal(h.pool.table.counts().ready, 2);
  h.msg({ type: "release", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 3);
});

test("prefillStep() refuses a prompt over its pool with the original error, never a placeholder", () => {
  const h = harness(3);
  const out = h.msg(request(1, 1, 3, 1));
  const rejected = sent(out)[0];
  assert.ok(rejected?.type === "rejected");
  assert.equal(rejected.error.code, "context_length_exceeded");
  assert.ok(!out.some((e) => e.kind === "compute"));
  assert.equal(h.pool.table.counts().free, 3);
});

test("prefillStep() under placeholder-reject computes one token and reports it complete", () => {
  const h = harness(3, makeSafety({ faults: ["placeholder-reject"] }));
  const writes = startWriting(h, request(1, 1, 3, 1));
  assert.equal(writes.length, 1);
  const manifest = sent(h.run({ type: "write_done", rid: 1, epoch: 1, index: 0 }))[0];
  assert.ok(manifest?.type === "manifest");
  assert.equal(manifest.tokenEnd, 1);
});

test("prefillStep() acknowledges an abort only after its outstanding writes drained", () => {
  const h = harness();
  startWriting(h);
  assert.deepEqual(h.msg({ type: "abort", rid: 1, epoch: 1 }), []);
  assert.deepEqual(h.run({ type: "write_done", rid: 1, epoch: 1, index: 0 }), []);
  const ack = sent(h.run({ type: "write_done", rid: 1, epoch: 1, index: 1 }))[0];
  assert.deepEqual(ack, { type: "abort_ack", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 3);
});

test("prefillStep() under late-write acknowledges while writes are still in flight", () => {
  const h = harness(3, makeSafety({ faults: ["late-write"] }));
  startWriting(h);
  assert.equal(sent(h.msg({ type: "abort", rid: 1, epoch: 1 }))[0]?.type, "abort_ack");
});

test("prefillStep() acknowledges an abort of an attempt it never saw and refuses it afterwards", () => {
  const h = harness();
  assert.deepEqual(sent(h.msg({ type: "abort", rid: 4, epoch: 2 })), [
    { type: "abort_ack", rid: 4, epoch: 2 },
  ]);
  assert.deepEqual(h.msg(request(4, 2)), []);
  assert.equal(h.state.stale, 1);
  assert.equal(h.pool.table.counts().free, 3);
});

test("prefillStep() under drop-abort-ack never acknowledges", () => {
  const h = harness(3, makeSafety({ faults: ["drop-abort-ack"] }));
  assert.deepEqual(h.msg({ type: "abort", rid: 4, epoch: 2 }), []);
});

test("prefillStep() refuses a lease of another layout or of a restarted decode node", () => {
  const h = harness();
  const layout = request();
  const badLayout = sent(h.msg({ ...layout, lease: { ...layout.lease, layoutSignature: "other" } }))[0];
  assert.ok(badLayout?.type === "rejected" && badLayout.error.code === "layout_mismatch");
  const old = request(2);
  const badIncarnation = sent(h.msg({ ...old, lease: { ...old.lease, incarnation: 0 } }))[0];
  assert.ok(badIncarnation?.type === "rejected" && badIncarnation.error.code === "node_unavailable");
  const other = request(3);
  const badWriter = sent(h.msg({ ...other, lease: { ...other.lease, writerIncarnation: 2 } }))[0];
  assert.ok(badWriter?.type === "rejected" && badWriter.error.code === "node_unavailable");
});

test("prefillStep() under corrupt-transfer and misaddressed-write marks the first write", () => {
  const corrupt = startWriting(harness(3, makeSafety({ faults: ["corrupt-transfer"] })));
  assert.deepEqual(
    corrupt.map((w) => w.corrupt),
    [true, false],
  );
  const misaddressed = startWriting(harness(3, makeSafety({ faults: ["misaddressed-write"] })));
  assert.deepEqual(
    misaddressed.map((w) => w.header.page),
    [11, 11],
  );
});

test("prefillStep() frees everything when decode is fenced", () => {
  const h = harness();
  startWriting(h);
  h.run({ type: "peer_lost", role: "decode", incarnation: 2 });
  assert.equal(h.pool.table.counts().ready, 2, "another decode incarnation's loss frees nothing");
  h.run({ type: "peer_lost", role: "decode", incarnation: 1 });
  assert.equal(h.pool.table.counts().free, 3);
  assert.deepEqual(h.state.attempts, {});
});

test("prefillStep() refuses a lease of a decode incarnation it saw go, before the new one connects", () => {
  const h = harness();
  h.run({ type: "peer_lost", role: "decode", incarnation: 1 });
  const rejected = sent(h.msg(request()))[0];
  assert.ok(rejected?.type === "rejected" && rejected.error.code === "node_unavailable");
  assert.equal(h.pool.table.counts().free, 3);
});

test("prefillStep() forgets tombstones below the router's watermark; below it an abort is acknowledged and leaves none", () => {
  const h = harness();
  h.msg({ type: "abort", rid: 16, epoch: 1 });
  h.msg({ type: "abort", rid: 48, epoch: 1 });
  h.msg({ type: "release", rid: 32, epoch: 1 });
  assert.deepEqual(Object.keys(h.state.ended).sort(), ["16:1", "48:1"]);
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 48 });
  assert.deepEqual(Object.keys(h.state.ended), ["48:1"]);
  // A late relayed abort below the watermark: acknowledged at once, nothing kept.
  const out = h.msg({ type: "abort", rid: 32, epoch: 1 });
  assert.deepEqual(sent(out), [{ type: "abort_ack", rid: 32, epoch: 1 }]);
  assert.deepEqual(Object.keys(h.state.ended), ["48:1"]);
  // A prefill below it (a duplicate: the router sends none after its watermark) is stale.
  assert.deepEqual(h.msg(request(32, 2)), []);
  assert.equal(h.pool.table.counts().free, 3);
  // An attempt in flight across the watermark ends without a tombstone.
  const writes = startWriting(h, request(64, 1));
  h.msg({ type: "watermark", rid: 0, epoch: 0, below: 80 });
  for (const w of writes) h.run({ type: "write_done", rid: 64, epoch: 1, index: w.header.index });
  h.msg({ type: "release", rid: 64, epoch: 1 });
  assert.deepEqual(h.state.attempts, {});
  assert.deepEqual(h.state.ended, {});
  assert.equal(h.pool.table.counts().free, 3);
});
