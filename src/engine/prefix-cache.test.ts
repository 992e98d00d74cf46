import assert from "node:assert/strict";
import { test } from "node:test";
import { makeEngine, prompt, recorder, request, runAll, runUntilIdle } from "../../testing/engine-harness.js";
import { BlockTable } from "../kvcache/block-table.js";
import { PageState } from "../kvcache/ownership-table.js";
import { makeSafety } from "../protocol/safety.js";
import type { Engine } from "./engine.js";

/** 30 tokens: 7 full pages of 4 and a partial one. */
const SYSTEM = prompt(30, 7);
const withTail = (tail: readonly number[]) => [...SYSTEM, ...tail];

/** Every page FREE or cached (SHARED, no reference), nothing waiting or running. */
function assertIdle(engine: Engine): void {
  const s = engine.stats();
  const t = engine.pool.table;
  for (let p = 0; p < t.numPages; p++) {
    const state = t.state(p);
    assert.ok(state === PageState.FREE || state === PageState.SHARED, `page ${p} is ${state}`);
    assert.equal(t.refcount(p), 0, `page ${p} is still referenced`);
  }
  assert.equal(s.pages.reserved + s.pages.ready + s.pages.quarantined, 0);
  assert.deepEqual(s.queue, { waiting: 0, running: 0, preempted: 0 });
}

test("prefix cache: a same-tenant repeat hits, reuses whole pages and gives the output of a miss", () => {
  const first = request(1, withTail([1, 2, 3]), 6);
  const again = request(2, withTail([1, 2, 3]), 6);
  const reference = runAll(makeEngine(), [first])[0]!;
  const engine = makeEngine({ prefixCache: true });
  const [miss] = runAll(engine, [first]);
  const promptBefore = engine.stats().counters;
  const [hit] = runAll(engine, [again]);
  assert.deepEqual(miss!.tokens, reference.tokens);
  assert.deepEqual(hit!.tokens, reference.tokens, "a hit gives the output of a miss");
  assert.equal((miss!.usage as { cachedTokens?: number }).cachedTokens, 0);
  // 33 prompt tokens: 8 full pages; a hit never covers the last prompt token, and the first
  // request also cached its generated tokens' full pages.
  assert.equal((hit!.usage as { cachedTokens?: number }).cachedTokens, 32);
  const stats = engine.prefixCacheStats()!;
  assert.equal(stats.hits, 1);
  assert.equal(stats.misses, 1);
  assert.ok(stats.sharedPages >= 8);
  assert.ok(promptBefore.promptTokens > 0);
  assertIdle(engine);
});

test("prefix cache: a request that shares only the system prompt reuses its full pages", () => {
  const engine = makeEngine({ prefixCache: true });
  const reference = runAll(makeEngine(), [request(9, withTail([40, 41]), 5)])[0]!;
  runAll(engine, [request(1, withTail([9, 9, 9, 9]), 5)]);
  const [o] = runAll(engine, [request(2, withTail([40, 41]), 5)]);
  assert.deepEqual(o!.tokens, reference.tokens);
  assert.equal((o!.usage as { cachedTokens?: number }).cachedTokens, 28, "the 7 full system-prompt pages");
  assertIdle(engine);
});

test("prefix cache: another tenant's identical prefix is a miss; so is another client salt", () => {
  const engine = makeEngine({ prefixCache: true });
  runAll(engine, [request(1, withTail([1]), 3)]);
  const [other] = runAll(engine, [request(2, withTail([1]), 3, { tenant: 1 })]);
  assert.equal((other!.usage as { cachedTokens?: number }).cachedTokens, 0);
  const [forged] = runAll(engine, [request(3, withTail([1]), 3, { tenant: 1, cacheSalt: "tenant:0" })]);
  assert.equal(
    (forged!.usage as { cachedTokens?: number }).cachedTokens,
    0,
    "a client salt cannot reach another tenant",
  );
  const [salted] = runAll(engine, [request(4, withTail([1]), 3, { cacheSalt: "s1" })]);
  assert.equal(
    (salted!.usage as { cachedTokens?: number }).cachedTokens,
    0,
    "a client salt narrows the namespace",
  );
  const [same] = runAll(engine, [request(5, withTail([1]), 3)]);
  assert.ok((same!.usage as { cachedTokens?: number }).cachedTokens! > 0);
  const [scoped] = runAll(engine, [request(6, withTail([1]), 3, { cacheScope: "key:1" })]);
  assert.equal((scoped!.usage as { cachedTokens?: number }).cachedTokens, 0, "the key scope narrows it too");
  assertIdle(engine);
});

test("prefix cache: concurrent hits share pages read-only while referenced; eviction frees only unreferenced pages", () => {
  // 24 pages of 4 tokens: the cached prompts must be evicted for later requests to fit.
  const engine = makeEngine({ prefixCache: true, numPages: 24 });
  const reference = (tail: number[]) => runAll(makeEngine(), [request(99, withTail(tail), 8)])[0]!.tokens;
  runAll(engine, [request(1, withTail([5]), 8)]);
  const batch = [2, 3, 4].map((rid) => request(rid, withTail([rid]), 8));
  const outs = runAll(engine, batch);
  outs.forEach((o, i) => {
    assert.equal(o.error, null);
    assert.deepEqual(o.tokens, reference([i + 2]));
    assert.equal((o.usage as { cachedTokens?: number }).cachedTokens, 28);
  });
  // Unrelated long prompts fill the pool: cached pages are evicted, never a referenced one.
  const fill = [10, 11, 12].map((rid) => request(rid, prompt(60, rid), 8));
  const filled = runAll(engine, fill);
  for (const o of filled) assert.equal(o.error, null);
  assert.ok(engine.prefixCacheStats()!.evictions > 0, "the small pool forces evictions");
  assertIdle(engine);
});

test("prefix cache: aborts and preemption drop references exactly once", () => {
  const engine = makeEngine({ prefixCache: true, numPages: 20 });
  runAll(engine, [request(1, withTail([5]), 4)]);
  const { events } = { events: { onTokens() {}, onFinish() {}, onError() {} } };
  engine.submit(request(2, withTail([6]), 30), events);
  engine.step();
  engine.abort(2);
  const [o] = runAll(engine, [request(3, withTail([5]), 4)]);
  assert.ok((o!.usage as { cachedTokens?: number }).cachedTokens! > 0);
  // Several long requests against a small pool preempt one another; outputs stay a miss's.
  const reqs = [4, 5, 6].map((rid) => request(rid, withTail([rid, rid]), 24));
  const alone = reqs.map((r) => runAll(makeEngine(), [r])[0]!.tokens);
  const outs = runAll(engine, reqs);
  assert.deepEqual(
    outs.map((x) => x.tokens),
    alone,
  );
  assert.ok(engine.stats().counters.preemptions > 0, "the small pool forces preemptions");
  assertIdle(engine);
});

test("prefix cache: the page-tag check refuses a shared page to another tenant (shared-prefix fault)", () => {
  const leaky = makeSafety({ faults: ["shared-prefix"], disabledGuards: ["tenant-salt"] });
  const engine = makeEngine({ prefixCache: true, safety: leaky });
  runAll(engine, [request(1, withTail([1]), 3)]);
  const [b] = runAll(engine, [request(2, withTail([1]), 3, { tenant: 1 })]);
  assert.equal(b!.error?.code, "page_tag_mismatch");
  assert.equal(engine.stats().counters.tagCheckFailures, 1);
  // Without the page-tag guard the other tenant is served from tenant 0's pages: the bug.
  const open = makeEngine({
    prefixCache: true,
    safety: makeSafety({ faults: ["shared-prefix"], disabledGuards: ["tenant-salt", "page-tags"] }),
  });
  runAll(open, [request(1, withTail([1]), 3)]);
  const [leak] = runAll(open, [request(2, withTail([1]), 3, { tenant: 1 })]);
  assert.ok((leak!.usage as { cachedTokens?: number }).cachedTokens! > 0);
  assertIdle(engine);
});

test("prefix cache: truncated keys collide; the stored token ids turn a collision into a miss", () => {
  const colliding = makeSafety({ faults: ["prefix-collision"] });
  const engine = makeEngine({ prefixCache: true, safety: colliding });
  const reference = runAll(makeEngine(), [request(9, prompt(30, 3), 4)])[0]!.tokens;
  runAll(engine, [request(1, prompt(30, 2), 4)]);
  const [o] = runAll(engine, [request(2, prompt(30, 3), 4)]);
  assert.deepEqual(o!.tokens, reference);
  assert.ok(engine.prefixCacheStats()!.collisions > 0, "the 2-bit keys collide");
  // With the token comparison off, another prompt's KV serves it.
  const open = makeEngine({
    prefixCache: true,
    safety: makeSafety({ faults: ["prefix-collision"], disabledGuards: ["prefix-tokens"] }),
  });
  runAll(open, [request(1, prompt(30, 2), 4)]);
  const [wrong] = runAll(open, [request(2, prompt(30, 3), 4)]);
  assert.ok((wrong!.usage as { cachedTokens?: number }).cachedTokens! > 0, "served from a colliding page");
  assertIdle(engine);
});

test("prefix cache: a prefill node's request computes only after its cached pages, also when it waits for budget", () => {
  // 4 tokens per step: the second request waits a step with its references held by the host.
  const engine = makeEngine({ prefixCache: true, maxBatchTokens: 4 });
  const tokens = withTail([3, 4]);
  const [local] = runAll(engine, [request(1, tokens, 1)]);
  const cache = engine.prefixCache!;
  const hosts = [10, 11].map((rid) => {
    const table = new BlockTable(16);
    const hit = cache.lookup("tenant:0", Int32Array.from(tokens), Math.floor((tokens.length - 1) / 4), table);
    const own = Math.ceil(tokens.length / 4) - hit;
    const pages = new Int32Array(own);
    const generations = new Uint32Array(own);
    assert.ok(engine.pool.table.allocate(own, rid, 0, 0, pages, generations));
    const all = [
      ...Array.from(table.pages.subarray(0, hit), (page, i) => ({ page, generation: table.generations[i]! })),
      ...Array.from(pages, (page, i) => ({ page, generation: generations[i]! })),
    ];
    const r = recorder();
    engine.submitPrefill(request(rid, tokens, 1), { epoch: 0, pages: all, cachedPages: hit }, r.events);
    return { hit, all, outcome: r.outcome };
  });
  runUntilIdle(engine);
  for (const h of hosts) {
    assert.ok(h.hit > 0);
    assert.equal(h.outcome.error, null);
    assert.deepEqual(h.outcome.tokens, local!.tokens, "the first token of a miss");
    for (let i = 0; i < h.hit; i++) assert.equal(engine.pool.table.refcount(h.all[i]!.page) > 0, true);
  }
});
