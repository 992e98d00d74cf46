import assert from "node:assert/strict";
import { test } from "node:test";
import { TestPool } from "../../testing/protocol-pool.js";
import { DecodePrefix, type HeldAttempt } from "./decode-held.js";
import { decodeContext, decodeStep, initialDecodeState, leasedPage } from "./decode-machine.js";
import type { Effect, KvPool } from "./effects.js";
import { initialPrefillState, prefillStep } from "./prefill-machine.js";
import { PrefixCache } from "./prefix-cache.js";
import { prefixCacheSalt } from "./prefix-key.js";
import { makeSafety, SAFE, type Safety } from "./safety.js";
import { attemptKey, type ControlMessage, type Manifest, type TransferLease } from "./wire.js";

const CONFIG = { maxModelLen: 16, layoutSignature: "test" };
const FIRST = 9;
const STEP = 5;

/** A decode node's machine over a pool with a prefix cache; requests' tokens by rid. */
function harness(numPages: number, safety: Safety = SAFE) {
  const pool: TestPool & Pick<KvPool, "observeRead"> = new TestPool(numPages);
  const cache = new PrefixCache(pool.table, 1, safety);
  const prompts = new Map<number, number[]>();
  const sequence = (rid: number, tenant: number, length: number) => {
    const prompt = prompts.get(rid);
    if (prompt === undefined) return null;
    const tokens = Int32Array.from({ length }, (_, i) =>
      i < prompt.length ? prompt[i]! : i === prompt.length ? FIRST : STEP,
    );
    return { tokens, salt: prefixCacheSalt(safety, tenant, null) };
  };
  const prefix = new DecodePrefix(cache, {
    prompt: (msg) => sequence(msg.rid, msg.tenant, msg.promptLen),
    sequence: (a: HeldAttempt) => sequence(a.rid, a.tenant, a.promptLen + a.generated),
  });
  const state = initialDecodeState(1, 1);
  /** What each step read: the content of every page it read. */
  const reads: string[][] = [];
  pool.observeRead = (attempt, count) => {
    reads.push(attempt.pages.slice(0, count).map((p) => pool.content[p]!));
  };
  const run = (msg: ControlMessage): Effect[] => {
    const out: Effect[] = [];
    decodeStep(state, { type: "message", msg }, decodeContext(pool, CONFIG, safety, out, prefix));
    return out;
  };
  const step = (rid: number): Effect[] => {
    const out: Effect[] = [];
    const ctx = decodeContext(pool, CONFIG, safety, out, prefix);
    const key = attemptKey(rid, 1);
    decodeStep(state, { type: "check", key }, ctx);
    if (state.attempts[key]?.phase === "decoding") decodeStep(state, { type: "step", key, token: STEP }, ctx);
    return out;
  };
  /** Reserves `prompt` for `rid` of `tenant` and returns decode's lease. */
  const reserve = (rid: number, tenant: number, prompt: number[], maxTokens: number): TransferLease => {
    prompts.set(rid, prompt);
    const out = run({ type: "reserve", rid, epoch: 1, tenant, promptLen: prompt.length, maxTokens });
    const lease = sent(out)[0];
    assert.equal(lease?.type, "lease", JSON.stringify(lease));
    return lease as TransferLease;
  };
  /** Prefill's writes of the pages the lease does not hold, then its manifest. */
  const transfer = (lease: TransferLease, promptLen: number): Effect[] => {
    const held = lease.held ?? 0;
    const checksums: string[] = [];
    for (let i = held; i < lease.pages.length; i++) {
      pool.write(lease.pages[i]!.page, lease.rid, 1, i);
      checksums.push(TestPool.expectedChecksum(lease.rid, 1, i));
    }
    const manifest: Manifest = {
      type: "manifest",
      rid: lease.rid,
      epoch: 1,
      tokenStart: held,
      tokenEnd: promptLen,
      firstToken: FIRST,
      checksums,
    };
    return run(manifest);
  };
  return { pool, cache, state, run, step, reserve, transfer, reads };
}

function sent(effects: Effect[]): ControlMessage[] {
  return effects.flatMap((e) => (e.kind === "send" ? [e.msg] : []));
}

/** Turn 1 of tenant 0's conversation: prompt [1, 2], two tokens; its 3 computed pages get cached. */
function firstTurn(h: ReturnType<typeof harness>): void {
  const lease = h.reserve(1, 0, [1, 2], 2);
  assert.equal(lease.held, undefined, "nothing cached yet");
  h.transfer(lease, 2);
  const out = h.step(1);
  assert.equal(sent(out).at(-1)?.type, "finished");
  assert.equal(h.cache.size, 3, "prompt pages and the first token's page are cached");
  assert.equal(h.pool.table.counts().free, h.pool.table.numPages - 3);
}

test("decodeStep() holds a conversation's cached pages for its next turn: only the rest is leased to prefill's writes", () => {
  const h = harness(5);
  firstTurn(h);
  // Turn 2: the previous prompt, the answer's first token, a new token.
  const lease = h.reserve(2, 0, [1, 2, FIRST, 3], 1);
  assert.equal(lease.held, 3, "the 3 cached pages before the prompt's last token are held");
  assert.equal(lease.pages.length, 4);
  // The TCP receiver's lease check refuses a write into a held page.
  for (let i = 0; i < 3; i++) assert.equal(leasedPage(h.state, 2, 1, i), -1);
  assert.equal(leasedPage(h.state, 2, 1, 3), lease.pages[3]!.page);
  for (let i = 0; i < 3; i++) assert.equal(h.pool.table.refcount(lease.pages[i]!.page), 1);
  const out = h.transfer(lease, 4);
  const commit = out.find((e) => e.kind === "commit");
  assert.equal(commit?.kind === "commit" && commit.held, 3);
  assert.equal(commit?.kind === "commit" && commit.coverage, 1);
  // max_tokens 1: finished at the commit; turn 2's own page joins the chain, the held ones stay cached.
  assert.equal(sent(out).at(-1)?.type, "finished");
  assert.equal(h.cache.size, 4);
  for (let i = 0; i < 4; i++) assert.equal(h.pool.table.refcount(lease.pages[i]!.page), 0);
  // Another tenant's identical prompt holds nothing.
  const other = h.reserve(3, 1, [1, 2, FIRST, 3], 1);
  assert.equal(other.held, undefined);
});

test("decodeStep() refuses a commit whose coverage counts the held pages as sent", () => {
  const h = harness(5);
  firstTurn(h);
  const lease = h.reserve(2, 0, [1, 2, FIRST, 3], 1);
  for (let i = 0; i < 4; i++) h.pool.write(lease.pages[i]!.page, 2, 1, i);
  const out = h.run({
    type: "manifest",
    rid: 2,
    epoch: 1,
    tokenStart: 0,
    tokenEnd: 4,
    firstToken: FIRST,
    checksums: [0, 1, 2, 3].map((i) => TestPool.expectedChecksum(2, 1, i)),
  });
  const failed = sent(out).find((m) => m.type === "failed");
  assert.equal(failed?.type === "failed" && failed.error.code, "coverage_mismatch");
});

/**
 * The held-unpinned fault: turn 2's lease calls its pages held without references; another
 * tenant's reservation evicts them and its data lands there before turn 2 commits.
 */
function unpinnedRace(disabledGuards: string[]) {
  const h = harness(6, makeSafety({ faults: ["held-unpinned"], disabledGuards }));
  firstTurn(h);
  const lease = h.reserve(2, 0, [1, 2, FIRST, 3], 2);
  assert.equal(lease.held, 3);
  assert.equal(h.pool.table.refcount(lease.pages[0]!.page), 0, "the fault: no reference");
  // Tenant 1 needs 3 pages, 1 is free: the cache evicts 2 unreferenced pages for it (turn 2's
  // held pages 2 and 1, leaves first).
  const other = h.reserve(3, 1, [8, 8], 2);
  h.transfer(other, 2);
  const out = h.transfer(lease, 4);
  return { h, lease, other, out };
}

test("decodeStep() under held-unpinned with held-pages and page-tags off reads another tenant's KV as its prompt's", () => {
  const { h, out } = unpinnedRace(["held-pages", "page-tags"]);
  assert.equal(sent(out).find((m) => m.type === "committed")?.type, "committed");
  h.step(2);
  const read = h.reads.at(-1)!;
  assert.ok(
    read.some((c) => c.startsWith("3:")),
    `turn 2 reads tenant 1's pages: ${JSON.stringify(read)}`,
  );
});

for (const guard of ["held-pages", "page-tags"] as const) {
  test(`decodeStep() under held-unpinned refuses the commit with ${guard} alone on (500 page_tag_mismatch)`, () => {
    const { h, out } = unpinnedRace([guard === "held-pages" ? "page-tags" : "held-pages"]);
    const failed = sent(out).find((m) => m.type === "failed");
    assert.equal(failed?.type === "failed" && failed.error.code, "page_tag_mismatch");
    assert.match(failed?.type === "failed" ? failed.error.message : "", /not a cached page of its tenant/);
    assert.equal(h.state.attempts[attemptKey(2, 1)]?.phase, "quarantined");
    assert.equal(h.reads.length, 1, "only turn 1 read");
  });
}

test("prefillStep() writes only the pages after the lease's held ones and its manifest covers exactly them", () => {
  const pool = new TestPool(5);
  const state = initialPrefillState(1, 1);
  const out: Effect[] = [];
  const ctx = { pool, config: CONFIG, safety: SAFE, out };
  const lease: TransferLease = {
    type: "lease",
    rid: 2,
    epoch: 1,
    pages: [0, 1, 2, 3].map((page) => ({ page, generation: 1 })),
    pageSize: 1,
    layoutSignature: "test",
    incarnation: 1,
    writerIncarnation: 1,
    held: 3,
  };
  prefillStep(
    state,
    {
      type: "message",
      msg: { type: "prefill", rid: 2, epoch: 1, tenant: 0, promptLen: 4, maxTokens: 1, lease },
    },
    ctx,
  );
  const compute = out.find((e) => e.kind === "compute");
  assert.ok(compute?.kind === "compute");
  for (let i = 0; i < 4; i++) {
    pool.write(compute.pages[i]!.page, 2, 1, i);
    pool.table.markReady(compute.pages[i]!.page, compute.pages[i]!.generation, 2, 1);
  }
  out.length = 0;
  prefillStep(state, { type: "computed", rid: 2, epoch: 1, firstToken: FIRST }, ctx);
  const writes = out.filter((e) => e.kind === "write");
  assert.deepEqual(
    writes.map((w) => w.kind === "write" && w.header.index),
    [3],
    "nothing is written into a held page",
  );
  out.length = 0;
  prefillStep(state, { type: "write_done", rid: 2, epoch: 1, index: 3 }, ctx);
  const manifest = sent(out)[0];
  assert.ok(manifest?.type === "manifest");
  assert.deepEqual([manifest.tokenStart, manifest.tokenEnd, manifest.checksums.length], [3, 4, 1]);
  // A lease that holds every page (nothing left to write) is refused.
  out.length = 0;
  prefillStep(
    state,
    {
      type: "message",
      msg: {
        type: "prefill",
        rid: 3,
        epoch: 1,
        tenant: 0,
        promptLen: 4,
        maxTokens: 1,
        lease: { ...lease, rid: 3, held: 4 },
      },
    },
    ctx,
  );
  const rejected = sent(out)[0];
  assert.equal(rejected?.type === "rejected" && rejected.error.code, "transfer_failed");
});
