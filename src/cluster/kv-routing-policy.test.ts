/**
 * Routing by where the KV lives, without links: a node's real `PrefixCache` (over a real
 * `OwnershipTable`) feeds its `CacheEventPublisher`, whose messages feed the router's `KvIndex`
 * and `KvRoutingPolicy` inside a real `PairPool`.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { BlockTable } from "../kvcache/block-table.js";
import { OwnershipTable } from "../kvcache/ownership-table.js";
import type { CacheEventsMessage, FromNode, NodeHello } from "../links/node-messages.js";
import { CacheEventPublisher } from "../node/cache-events.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { PrefixCache } from "../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../protocol/prefix-key.js";
import { makeSafety, SAFE, type Safety } from "../protocol/safety.js";
import { GREEDY_SAMPLING } from "../protocol/sampling-params.js";
import { KvIndex } from "./kv-index.js";
import { KvRoutingPolicy } from "./kv-routing-policy.js";
import { type PairDemand, PairPool, type RouterNode } from "./pair-pool.js";

const P = 16;

/** A node's prefix cache over its own pool, its events captured (flushed by hand). */
class CachingNode {
  readonly table = new OwnershipTable(64);
  readonly cache: PrefixCache;
  readonly sent: CacheEventsMessage[] = [];
  readonly events: CacheEventPublisher;
  readonly #safety: Safety;
  #rid = 1;

  constructor(safety: Safety = SAFE) {
    this.#safety = safety;
    this.cache = new PrefixCache(this.table, P, safety);
    this.events = new CacheEventPublisher((m: FromNode) => this.sent.push(m as CacheEventsMessage), 60_000);
    this.cache.observe(this.events);
  }

  /** `tenant` prefills `tokens`: its full pages are cached, then it ends (its references dropped). */
  prefill(tenant: number, tokens: Int32Array): void {
    const rid = this.#rid++;
    const salt = prefixCacheSalt(this.#safety, tenant, null);
    const t = new BlockTable(Math.ceil(tokens.length / P));
    const hit = this.cache.lookup(salt, tokens, Math.floor((tokens.length - 1) / P), t);
    const need = Math.ceil(tokens.length / P) - hit;
    const pages = new Int32Array(need);
    const generations = new Uint32Array(need);
    assert.ok(this.table.allocate(need, rid, 0, tenant, pages, generations));
    for (let i = 0; i < need; i++) {
      t.push(pages[i]!, generations[i]!);
      this.table.stampWriter(pages[i]!, rid, 0, Math.min(P, tokens.length - (hit + i) * P));
      this.table.markReady(pages[i]!, generations[i]!, rid, 0);
    }
    this.cache.insert(salt, tokens, Math.floor(tokens.length / P), t, { rid, epoch: 0, tenant });
    for (let j = 0; j < t.length; j++) {
      if (t.shared[j] === 1) this.table.unref(t.pages[j]!, t.generations[j]!);
      else this.table.free(t.pages[j]!, t.generations[j]!, rid, 0);
    }
  }

  /** The events since the last call (flushed now). */
  take(): CacheEventsMessage[] {
    this.events.flush();
    return this.sent.splice(0);
  }
}

const tokens = (n: number, seed = 0) => Int32Array.from({ length: n }, (_, i) => 1000 + seed * 7919 + i);

function node(id: string, role: "prefill" | "decode"): RouterNode {
  const hello: NodeHello = {
    kind: "hello",
    role,
    poolTokens: 1024,
    pageSize: P,
    maxModelLen: 1024,
    layoutSignature: "x",
    incarnation: 1,
    ...(role === "prefill" ? { prefixCache: true } : {}),
  };
  return { id, url: `fake:${id}`, hello, link: { send() {}, onMessage() {}, onClose() {}, close() {} } };
}

function cluster(safety: Safety = SAFE, decode = ["d0"]) {
  const policy = new KvRoutingPolicy({ safety });
  const pool = new PairPool({
    prefill: [node("p0", "prefill"), node("p1", "prefill")],
    decode: decode.map((id) => node(id, "decode")),
    admitted: { poolTokens: 1024, maxModelLen: 1024 },
    policy,
  });
  for (const pair of pool.pairs) pair.up = true;
  const slot = (id: string) => pool.slots.find((s) => s.id === id)!;
  const demand = (tenant: number, prompt: Int32Array): PairDemand => {
    const request: GenerationRequest = {
      rid: 1,
      tenant,
      promptTokens: prompt,
      maxTokens: 4,
      sampling: GREEDY_SAMPLING,
    };
    return {
      decodePages: 1,
      prefillPages: 1,
      affinityKey: pool.affinityKey(request, P),
      chain: pool.chainOf(request, P),
    };
  };
  /** Takes a pair for `d` and releases it at once (the ledger back to empty). */
  const route = (d: PairDemand) => {
    const pair = pool.take(d)!;
    pool.releaseDecode(pair, d);
    pool.releasePrefill(pair, d);
    return pair.key;
  };
  return { policy, pool, slot, demand, route };
}

test("CacheEventPublisher.flush() sends one message of keys per tenant and tier, never a token id", () => {
  const n = new CachingNode();
  n.prefill(1, tokens(50));
  n.prefill(2, tokens(40, 1));
  const [message, ...more] = n.take();
  assert.equal(more.length, 0, "one message for every change since the last");
  assert.equal(message!.kind, "cache_events");
  const byTenant = new Map(message!.batches.map((b) => [b.tenant, b]));
  assert.deepEqual([...byTenant.keys()].sort(), [1, 2]);
  assert.equal(byTenant.get(1)!.stored.length, 3, "tenant 1's three full pages");
  assert.equal(byTenant.get(2)!.stored.length, 2);
  for (const b of message!.batches) {
    assert.equal(b.tier, "pool");
    for (const key of b.stored) assert.match(key, /^[0-9a-f]{16}$/);
  }
  assert.doesNotMatch(JSON.stringify(message), /100[0-9]\b/, "no token id in any event");
  // Evicted: removed; stored and evicted within one interval: its newest state only.
  n.cache.evict(64);
  const [evicted] = n.take();
  assert.deepEqual(evicted!.batches.map((b) => [b.tenant, b.stored.length, b.removed.length]).sort(), [
    [1, 0, 3],
    [2, 0, 2],
  ]);
  n.prefill(3, tokens(20, 2));
  n.cache.evict(64);
  const [flapped] = n.take();
  assert.deepEqual(flapped!.batches, [
    { tenant: 3, tier: "pool", stored: [], removed: flapped!.batches[0]!.removed },
  ]);
  assert.equal(n.take().length, 0, "nothing changed: nothing sent");
});

test("CacheEventPublisher.record() coalesces changes into at most one message per interval", async () => {
  const sent: FromNode[] = [];
  const events = new CacheEventPublisher((m) => sent.push(m), 40);
  for (let i = 0; i < 500; i++)
    events.record(1, `${i}`.padStart(16, "0"), i % 2 === 0 ? "pool" : "ram", true);
  assert.equal(sent.length, 0, "nothing before the interval");
  await sleep(120);
  assert.equal(sent.length, 1, "500 changes, one message");
  const batches = (sent[0] as CacheEventsMessage).batches;
  assert.deepEqual(batches.map((b) => [b.tier, b.stored.length]).sort(), [
    ["pool", 250],
    ["ram", 250],
  ]);
  events.close();
});

test("CacheEventPublisher.snapshot() gives a router everything held, which replaces what it knew", () => {
  const n = new CachingNode();
  n.prefill(1, tokens(50));
  n.prefill(1, tokens(33, 1));
  const index = new KvIndex({ safety: SAFE });
  index.apply("p0", {
    kind: "cache_snapshot",
    batches: [{ tenant: 1, tier: "pool", stored: ["stale"], removed: [] }],
  });
  const snapshot = n.events.snapshot();
  assert.equal(snapshot[0]!.kind, "cache_snapshot");
  for (const m of snapshot) index.apply("p0", m);
  assert.equal(index.sizeOf("p0"), 5, "the node's 5 pages, the stale key gone");
});

test("KvIndex keeps each node's newest keys, forgets the oldest first, and drops a lost node", () => {
  const index = new KvIndex({ safety: SAFE, maxKeysPerNode: 3 });
  const batch = (stored: string[], removed: string[] = []) => ({
    kind: "cache_events" as const,
    batches: [{ tenant: 1, tier: "pool" as const, stored, removed }],
  });
  index.apply("p0", batch(["a", "b", "c"]));
  index.apply("p1", batch(["a", "b"]));
  assert.deepEqual(
    [...index.matches(1, ["a", "b", "c"])],
    [
      ["p0", 3],
      ["p1", 2],
    ],
  );
  index.apply("p0", batch(["a", "d"])); // `a` is the newest again: `b` is the oldest, forgotten
  assert.equal(index.sizeOf("p0"), 3);
  assert.deepEqual(
    [...index.matches(1, ["a", "b", "c"])],
    [
      ["p0", 1],
      ["p1", 2],
    ],
  );
  assert.equal(index.matches(2, ["a"]).size, 0, "another tenant's namespace holds nothing");
  index.apply("p1", batch([], ["a"]));
  assert.deepEqual([...index.matches(1, ["a", "b"])], [["p0", 1]], "a prefix counts from the first page");
  // On disk alone a page counts half; in the pool and on disk, as the pool's.
  index.apply("p1", {
    kind: "cache_events",
    batches: [{ tenant: 1, tier: "disk", stored: ["a", "b"], removed: [] }],
  });
  assert.deepEqual(
    [...index.matches(1, ["a", "b"])],
    [
      ["p0", 1],
      ["p1", 1.5],
    ],
  );
  index.dropNode("p0");
  assert.equal(index.sizeOf("p0"), 0);
  assert.equal(index.size, 2);
  assert.deepEqual([...index.matches(1, ["a"])], [["p1", 0.5]]);
});

test("KvRoutingPolicy.pick() sends a prompt to the prefill node holding its longest prefix, weighed against its booked pages", () => {
  const { policy, slot, demand, route } = cluster();
  const conversation = tokens(100);
  const turn1 = conversation.subarray(0, 60);
  // No events yet: prefix affinity (round-robin, the least loaded) as before.
  assert.equal(route(demand(1, turn1)), "p0|d0");
  assert.equal(policy.routing().decisions.fallback, 1);
  // Turn 1 was cached on p1 (say another router sent it there): p1 publishes it.
  const p1 = new CachingNode();
  p1.prefill(1, turn1);
  for (const m of p1.take()) policy.cacheEvents("p1", m);
  // Round-robin and affinity would pick p0; p1 holds 3 pages of turn 2's prefix.
  assert.equal(route(demand(1, conversation)), "p1|d0");
  assert.deepEqual(policy.routing().decisions, { cache_hit: 1, load: 0, fallback: 1 });
  // p1 has 4 pages of prefill booked (more than the 3 it would save): p0 finishes first.
  slot("p1").usedPages = 4;
  assert.equal(route(demand(1, conversation)), "p0|d0");
  slot("p1").usedPages = 2;
  assert.equal(route(demand(1, conversation)), "p1|d0", "2 booked < 3 saved: still p1");
  assert.deepEqual(policy.routing().decisions, { cache_hit: 2, load: 1, fallback: 1 });
  slot("p1").usedPages = 0;
  // p1 lost: its keys are gone, the choice falls back.
  policy.nodeLost("p1");
  assert.equal(policy.routing().indexKeys, 0);
  route(demand(1, conversation));
  assert.equal(policy.routing().decisions.fallback, 2);
});

test("KvRoutingPolicy.pick() picks the decode node that holds the longest prefix (decode-side reuse)", () => {
  const { policy, demand, route } = cluster(SAFE, ["d0", "d1"]);
  const prompt = tokens(70);
  const p0 = new CachingNode();
  const d1 = new CachingNode();
  p0.prefill(1, prompt);
  d1.prefill(1, prompt.subarray(0, 40));
  for (const m of p0.take()) policy.cacheEvents("p0", m);
  for (const m of d1.take()) policy.cacheEvents("d1", m);
  assert.equal(route(demand(1, prompt)), "p0|d1");
});

test("KvRoutingPolicy.pick() never routes a tenant's prompt by another tenant's keys, even when keys collide (route-namespace)", () => {
  // Keys cut to 2 bits (prefix-collision): tenant 2's own prompt has tenant 1's keys.
  for (const guard of ["on", "off"] as const) {
    const safety = makeSafety({
      faults: ["prefix-collision"],
      disabledGuards: guard === "on" ? [] : ["route-namespace"],
    });
    const { policy, demand, route } = cluster(safety);
    const p1 = new CachingNode(safety);
    for (let i = 0; i < 4; i++) p1.prefill(1, tokens(200, i));
    for (const m of p1.take()) policy.cacheEvents("p1", m);
    const key = route(demand(2, tokens(120, 9)));
    if (guard === "on") {
      assert.equal(key, "p0|d0", "tenant 2 is routed as if nothing were cached");
      assert.deepEqual(policy.routing().decisions, { cache_hit: 0, load: 0, fallback: 1 });
    } else {
      // The bug the guard stops: tenant 1's pages steer tenant 2's prompt.
      assert.equal(key, "p1|d0");
      assert.equal(policy.routing().decisions.cache_hit, 1);
    }
  }
});
