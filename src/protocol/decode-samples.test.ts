/**
 * n > 1 on a decode node (issue #17): one transfer of the prompt, then the decode machine forks the
 * attempt into the request's samples, which share the prompt's full pages read-only and own a copy
 * of its partial last page and their tails. The page tags accept exactly the samples of the same
 * request on those pages, and nothing else.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { TestPool } from "../../testing/protocol-pool.js";
import { PageState } from "../kvcache/ownership-table.js";
import {
  type DecodeEvent,
  type DecodeState,
  decodeContext,
  decodeGroupPages,
  decodeStep,
  initialDecodeState,
} from "./decode-machine.js";
import type { CopyEffect, Effect } from "./effects.js";
import { makeSafety, SAFE, type Safety } from "./safety.js";
import { attemptKey, type ControlMessage, type Manifest, type TransferLease } from "./wire.js";

const CONFIG = { maxModelLen: 64, layoutSignature: "test" };
const P = 2;

function harness(numPages: number, safety: Safety = SAFE) {
  const pool = new TestPool(numPages, P);
  const state: DecodeState = initialDecodeState(1, 1);
  const run = (event: DecodeEvent): Effect[] => {
    const out: Effect[] = [];
    decodeStep(state, event, decodeContext(pool, CONFIG, safety, out));
    return out;
  };
  const msg = (m: ControlMessage) => run({ type: "message", msg: m });
  /** One engine step of `(rid, 1)`: its check, then (if that passed) the step. */
  const decode = (rid: number, token: number): Effect[] => {
    const key = attemptKey(rid, 1);
    const out = run({ type: "check", key });
    return state.attempts[key]?.phase === "decoding" ? [...out, ...run({ type: "step", key, token })] : out;
  };
  return { pool, state, msg, decode };
}

function sent(effects: Effect[]): ControlMessage[] {
  return effects.flatMap((e) => (e.kind === "send" ? [e.msg] : []));
}

/** Reserves request `rid` (epoch 1) of prompt 5 (two full pages of 2 and one token), its samples' rids. */
function reserve(h: ReturnType<typeof harness>, rid: number, samples: number[], maxTokens = 3): Effect[] {
  return h.msg({ type: "reserve", rid, epoch: 1, tenant: 0, promptLen: 5, maxTokens, samples });
}

/** Prefill's writes of the lease (stamped as prefill's engine does), then its manifest. */
function transfer(
  h: ReturnType<typeof harness>,
  lease: TransferLease,
  sampleFirstTokens?: number[],
): Effect[] {
  lease.pages.forEach((p, i) => {
    h.pool.write(p.page, lease.rid, lease.epoch, i, Math.min(P, 5 - i * P));
  });
  const manifest: Manifest = {
    type: "manifest",
    rid: lease.rid,
    epoch: lease.epoch,
    tokenStart: 0,
    tokenEnd: 5,
    firstToken: 9,
    ...(sampleFirstTokens === undefined ? {} : { sampleFirstTokens }),
    checksums: lease.pages.map((_, i) => TestPool.expectedChecksum(lease.rid, lease.epoch, i)),
  };
  return h.msg(manifest);
}

test("n=3: one lease for the prompt, one commit that forks 3 samples over the shared full pages; each decodes alone, the last frees them", () => {
  const h = harness(16);
  const lease = sent(reserve(h, 1, [2, 3]))[0] as TransferLease;
  assert.equal(lease.type, "lease");
  // The transfer lease is the prompt's pages only, once; the samples' own pages are reserved beside it.
  assert.equal(lease.pages.length, 3);
  assert.equal(decodeGroupPages(5, 3, P, 3), 4 + 2 * 2);
  assert.equal(h.pool.table.counts().reserved, 8);
  const out = transfer(h, lease, [10, 11]);
  assert.deepEqual(
    sent(out).map((m) => (m.type === "committed" ? `${m.type} ${m.rid} ${m.firstToken}` : m.type)),
    ["committed 1 9", "release", "committed 2 10", "committed 3 11"],
  );
  const copies = out.filter((e): e is CopyEffect => e.kind === "copy");
  assert.deepEqual(
    copies.map((c) => [c.from, c.tokens]),
    [
      [lease.pages[2]!.page, 1],
      [lease.pages[2]!.page, 1],
    ],
  );
  const table = h.pool.table;
  const shared = lease.pages.slice(0, 2).map((p) => p.page);
  for (const page of shared) {
    assert.equal(table.state(page), PageState.SHARED);
    assert.equal(table.refcount(page), 3);
  }
  // Each sample: the shared pages first, then its own (sample 0 keeps the partial page).
  const sample = (rid: number) => h.state.attempts[attemptKey(rid, 1)]!;
  for (const rid of [1, 2, 3]) assert.deepEqual(sample(rid).pages.slice(0, 2), shared, `sample ${rid}`);
  assert.equal(sample(1).pages[2], lease.pages[2]!.page);
  for (const [i, rid] of [2, 3].entries()) {
    assert.equal(sample(rid).pages[2], copies[i]!.to);
    assert.equal(table.state(copies[i]!.to), PageState.READY);
    assert.equal(table.writerRid(copies[i]!.to), rid);
  }
  // Sample 2 finishes first (two steps: max_tokens 3 with prefill's first token); the pages stay shared.
  h.decode(2, 20);
  assert.deepEqual(
    sent(h.decode(2, 21)).map((m) => m.type),
    ["finished"],
  );
  for (const page of shared) assert.equal(table.refcount(page), 2);
  for (const rid of [1, 3]) {
    const first = sent(h.decode(rid, 30 + rid));
    assert.deepEqual(
      first.map((m) => (m.type === "tokens" ? `${m.rid} ${m.tokens}` : m.type)),
      [`${rid} ${30 + rid}`],
    );
  }
  h.decode(1, 41);
  for (const page of shared) assert.equal(table.state(page), PageState.SHARED, "sample 3 still reads them");
  assert.deepEqual(
    sent(h.decode(3, 43)).map((m) => m.type),
    ["finished"],
  );
  assert.deepEqual(table.counts(), { free: 16, reserved: 0, ready: 0, quarantined: 0, total: 16 });
  assert.equal(table.sharedPages(), 0);
  assert.deepEqual(h.state.attempts, {});
});

test("the sibling pages pass the page tags for the request's samples only: another request reading one fails its check", () => {
  for (const guarded of [true, false]) {
    const h = harness(16, guarded ? SAFE : makeSafety({ disabledGuards: ["page-tags"] }));
    transfer(h, sent(reserve(h, 1, [2]))[0] as TransferLease);
    // Another request of the same tenant, committed normally (one sample).
    const other = sent(reserve(h, 5, []))[0] as TransferLease;
    transfer(h, other);
    const table = h.pool.table;
    const sibling = h.state.attempts["1:1"]!.pages[0]!;
    const generation = h.state.attempts["1:1"]!.generations[0]!;
    assert.ok(table.checkSibling(sibling, generation, 1, 1), "the group's own rule");
    assert.ok(!table.checkSibling(sibling, generation, 5, 1), "another request as the group");
    assert.ok(!table.checkSibling(sibling, generation, 1, 2), "another epoch of the request");
    assert.ok(!table.checkShared(sibling, generation, 0), "the prefix cache's rule (same tenant)");
    assert.ok(!table.checkRead(sibling, generation, 5, 1), "an owner's read by the other request");
    assert.ok(!table.checkRead(sibling, generation, 2, 1), "an owner's read by a sample");
    // The other request's block table names the sibling page (a misaddressed block table): its
    // step's check must refuse it, and does only while the page-tag guard is on.
    const victim = h.state.attempts["5:1"]!;
    victim.pages[0] = sibling;
    victim.generations[0] = generation;
    const out = h.decode(5, 7);
    const failed = sent(out).find((m) => m.type === "failed");
    if (guarded) {
      assert.equal(failed?.type === "failed" ? failed.error.code : "", "page_tag_mismatch");
      assert.equal(h.state.tagFailures, 1);
    } else {
      assert.equal(failed, undefined, "without the guard the read goes through");
      assert.equal(h.state.tagFailures, 0);
    }
    // The samples themselves read them.
    for (const rid of [1, 2]) {
      assert.ok(
        !sent(h.decode(rid, 8)).some((m) => m.type === "failed"),
        `sample ${rid} reads its sibling pages`,
      );
    }
  }
});

test("n > 1 before the commit: an abort frees every sample's pages; a sample aborted alone is not forked", () => {
  const h = harness(16);
  const lease = sent(reserve(h, 1, [2, 3]))[0] as TransferLease;
  const out = h.msg({ type: "abort", rid: 1, epoch: 1 });
  assert.deepEqual(
    sent(out).map((m) => m.type),
    ["abort"],
  );
  // The lease waits for prefill's ack in quarantine; the samples' own pages were never leased out.
  assert.deepEqual(h.pool.table.counts(), { free: 13, reserved: 0, ready: 0, quarantined: 3, total: 16 });
  h.msg({ type: "abort_ack", rid: 1, epoch: 1 });
  assert.equal(h.pool.table.counts().free, 16);
  void lease;

  const g = harness(16);
  const second = sent(reserve(g, 11, [12, 13]))[0] as TransferLease;
  g.msg({ type: "abort", rid: 12, epoch: 1 });
  const committed = sent(transfer(g, second)).filter((m) => m.type === "committed");
  assert.deepEqual(
    committed.map((m) => m.rid),
    [11, 13],
  );
  assert.equal(g.state.attempts["12:1"], undefined);
  const shared = g.state.attempts["11:1"]!.pages[0]!;
  assert.equal(g.pool.table.refcount(shared), 2, "the aborted sample's reference is dropped");
  for (const rid of [11, 13]) g.msg({ type: "abort", rid, epoch: 1 });
  assert.equal(g.pool.table.counts().free, 16);
});

test("n > 1 needs room for every sample: a pool too small for the later samples answers pool_exhausted and keeps nothing", () => {
  const h = harness(7);
  const out = reserve(h, 1, [2, 3]);
  const rejected = sent(out)[0];
  assert.equal(rejected?.type, "rejected");
  assert.equal(rejected?.type === "rejected" ? rejected.error.code : "", "pool_exhausted");
  assert.match(rejected?.type === "rejected" ? rejected.error.message : "", /8 pages needed/);
  assert.equal(h.pool.table.counts().free, 7);
  const duplicate = sent(reserve(h, 4, [4]))[0];
  assert.equal(duplicate?.type === "rejected" ? duplicate.error.code : "", "internal");
});
