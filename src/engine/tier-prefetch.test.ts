import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import {
  makeEngine,
  type Outcome,
  prompt,
  recorder,
  request,
  runAll,
  stepUntilIdle,
} from "../../testing/engine-harness.js";
import { KvTiers, type KvTiersOptions } from "../kvcache/kv-tiers.js";
import { PageState } from "../kvcache/ownership-table.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { prefixBlockKey, prefixCacheSalt, prefixRootKey } from "../protocol/prefix-key.js";
import { type FaultName, makeSafety, SAFE } from "../protocol/safety.js";
import type { Engine } from "./engine.js";

const roots: string[] = [];
after(() => {
  for (const r of roots) rmSync(r, { recursive: true, force: true });
});

/** 30 tokens: 7 full pages of 4 and a partial one (the conversation's first turn). */
const TURN = prompt(30, 7);
/** Unrelated long prompts that take the whole 24-page pool: every cached page is evicted. */
const FILL = [10, 11, 12].map((rid) => request(rid, prompt(60, rid), 8));

async function runAsync(engine: Engine, requests: readonly GenerationRequest[]): Promise<Outcome[]> {
  const outcomes = requests.map((r) => {
    const { events, outcome } = recorder();
    engine.submit(r, events);
    return outcome;
  });
  await stepUntilIdle(engine);
  return outcomes;
}

const cachedTokens = (o: Outcome) => (o.usage as { cachedTokens?: number }).cachedTokens ?? 0;

async function tieredEngine(
  tiers: Partial<KvTiersOptions>,
  faults: readonly FaultName[] = [],
): Promise<Engine> {
  const probe = makeEngine();
  const opened = await KvTiers.open({
    ramBytes: 0,
    layout: "test",
    pageBytes: probe.pool.pageBytes,
    ...tiers,
  });
  return makeEngine({ prefixCache: true, numPages: 24, tiers: opened, safety: makeSafety({ faults }) });
}

/** Turn 1, then the fill (evicting turn 1's pages into the tiers), then turn 1 again: its outcome. */
async function evictedThenAgain(engine: Engine): Promise<Outcome> {
  await runAsync(engine, [request(1, TURN, 6)]);
  for (const o of await runAsync(engine, FILL)) assert.equal(o.error, null);
  assert.ok(engine.prefixCacheStats()!.evictions >= 7, "the fill evicted turn 1's pages");
  const [again] = await runAsync(engine, [request(2, TURN, 6)]);
  assert.equal(again!.error, null);
  assert.notEqual(again!.usage, null, `finished: ${JSON.stringify(again)}`);
  return again!;
}

test("Engine with a RAM tier: pages evicted from the pool load back and the repeat hits with the output of a miss", async () => {
  const reference = runAll(makeEngine(), [request(9, TURN, 6)])[0]!;
  const engine = await tieredEngine({ ramBytes: 1 << 20 });
  const again = await evictedThenAgain(engine);
  assert.equal(cachedTokens(again), 28, "the 7 full pages, from the RAM tier");
  assert.deepEqual(again.tokens, reference.tokens, "a tier hit answers as a miss");
  assert.equal(engine.tierPrefetch!.counters.promoted.ram, 7);
  assert.ok(engine.tierPrefetch!.tiers.stats().spills >= 7);
  for (let p = 0; p < engine.pool.numPages; p++) {
    const state = engine.pool.table.state(p);
    assert.ok(state === PageState.FREE || state === PageState.SHARED, `page ${p} is ${state}`);
    assert.equal(engine.pool.table.refcount(p), 0);
  }
});

test("Engine with a disk tier only: the repeat's pages are read from files, verified and hit", async () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-tier-engine-"));
  roots.push(dir);
  const reference = runAll(makeEngine(), [request(9, TURN, 6)])[0]!;
  const engine = await tieredEngine({
    disk: { dir: join(dir, "tier"), maxBytes: 1 << 20 },
    secretKey: randomBytes(32),
  });
  const again = await evictedThenAgain(engine);
  assert.equal(cachedTokens(again), 28);
  assert.deepEqual(again.tokens, reference.tokens);
  assert.equal(engine.tierPrefetch!.counters.promoted.disk, 7);
  await engine.tierPrefetch!.tiers.close();
});

/** The bytes the tiers hold for turn 1's full prompt pages (tenant 0, no client salt), by page. */
async function turnInTiers(engine: Engine): Promise<Map<number, string>> {
  const tiers = engine.tierPrefetch!.tiers;
  const out = new Map<number, string>();
  let parentKey = prefixRootKey(prefixCacheSalt(SAFE, 0, null));
  for (let j = 0; j < 7; j++) {
    const tokens = Int32Array.from(TURN.slice(j * 4, (j + 1) * 4));
    const key = prefixBlockKey(parentKey, tokens);
    const loaded = await tiers.load({ key, parentKey, tenant: 0, tokens, cacheEpoch: 0 });
    if (loaded !== null) out.set(j, Buffer.from(loaded.bytes).toString("hex"));
    parentKey = key;
  }
  return out;
}

test("Engine under the spill-race fault with the tier-spill-copy guard off: a spill reads the pool page after its reuse, and the tier holds another request's KV under turn 1's keys", async () => {
  // One long prompt: each step that evicts a cached page writes it in the same step (its chunk).
  const fill = request(10, prompt(88, 10), 4);
  const spilled: Map<number, string>[] = [];
  for (const guardOn of [true, false]) {
    const engine = await tieredEngine({ ramBytes: 1 << 20, spillCopy: guardOn }, ["spill-race"]);
    await runAsync(engine, [request(1, TURN, 6)]);
    const [o] = await runAsync(engine, [fill]);
    assert.equal(o!.error, null);
    spilled.push(await turnInTiers(engine));
  }
  const [copied, late] = spilled as [Map<number, string>, Map<number, string>];
  assert.ok(copied.size >= 6, `turn 1's pages spilled: ${copied.size}`);
  assert.deepEqual([...late.keys()], [...copied.keys()]);
  const differ = [...copied].filter(([j, bytes]) => late.get(j) !== bytes).length;
  assert.equal(differ, copied.size, "with the guard off, every spilled page holds the fill's KV (valid MAC)");
});

test("Engine.abort() of a request waiting for its tier loads ends it: nothing runs, nothing is held", async () => {
  const engine = await tieredEngine({ ramBytes: 1 << 20 });
  await runAsync(engine, [request(1, TURN, 6)]);
  await runAsync(engine, FILL);
  const { events, outcome } = recorder();
  engine.submit(request(2, TURN, 6), events);
  assert.equal(engine.busy, true, "waiting for its loads");
  engine.abort(2);
  await stepUntilIdle(engine);
  assert.equal(outcome.tokens.length, 0);
  assert.equal(engine.stats().counters.aborts, 1);
  assert.equal(engine.pool.counts().reserved + engine.pool.counts().ready, 0);
});
