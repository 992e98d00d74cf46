/**
 * `PairPool` and its default policy, `PrefixAffinityPolicy`, without links: which pairs a policy
 * is offered, what the ledger books, and which pair prefix affinity picks.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import type { NodeHello } from "../links/node-messages.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { GREEDY_SAMPLING } from "../protocol/sampling-params.js";
import { type NodePair, type PairDemand, type PairPolicy, PairPool, type RouterNode } from "./pair-pool.js";
import { PrefixAffinityPolicy } from "./prefix-affinity-policy.js";

function node(id: string, role: "prefill" | "decode", extra: Partial<NodeHello> = {}): RouterNode {
  const hello: NodeHello = {
    kind: "hello",
    role,
    poolTokens: 160,
    pageSize: 16,
    maxModelLen: 2048,
    layoutSignature: "x",
    incarnation: 1,
    ...extra,
  };
  const link = { send() {}, onMessage() {}, onClose() {}, close() {} };
  return { id, url: `fake:${id}`, hello, link };
}

/** A policy that takes the last candidate and records what it was offered. */
class LastPolicy implements PairPolicy {
  readonly offered: string[][] = [];
  pick(candidates: readonly NodePair[]): NodePair | null {
    this.offered.push(candidates.map((p) => p.key));
    return candidates.at(-1) ?? null;
  }
}

function pool(policy: PairPolicy, prefill = [node("p0", "prefill"), node("p1", "prefill")]) {
  const pairs = new PairPool({
    prefill,
    decode: [node("d0", "decode")],
    admitted: { poolTokens: 160, maxModelLen: 160 },
    policy,
  });
  for (const pair of pairs.pairs) pair.up = true;
  return pairs;
}

const demand = (decodePages: number, prefillPages = 1, affinityKey: string | null = null): PairDemand => ({
  decodePages,
  prefillPages,
  affinityKey,
});

test("PairPool.take() offers the policy the usable pairs with room, round-robin from after the last one taken", () => {
  const policy = new LastPolicy();
  const pairs = pool(policy);
  assert.equal(pairs.take(demand(2))?.key, "p1|d0");
  assert.deepEqual(policy.offered[0], ["p0|d0", "p1|d0"]);
  // The pass after `p1|d0` starts at `p0|d0`.
  pairs.take(demand(2));
  assert.deepEqual(policy.offered[1], ["p0|d0", "p1|d0"]);
  // A node that is not answering, not a member, or refused for want of pages takes nothing.
  pairs.slots[0]!.answering = false;
  pairs.take(demand(2));
  assert.deepEqual(policy.offered[2], ["p1|d0"]);
  pairs.slots[0]!.answering = true;
  pairs.setMember("p1", false);
  pairs.take(demand(2));
  assert.deepEqual(policy.offered[3], ["p0|d0"]);
  pairs.setMember("p1", true);
  assert.equal(pairs.refusedForPages(pairs.slots[0]!, 10), true);
  pairs.take(demand(2));
  assert.deepEqual(policy.offered[4], ["p1|d0"]);
  // Nothing to offer: the policy is not asked.
  assert.equal(pairs.refusedForPages(pairs.slots[2]!, 10), true);
  assert.equal(pairs.take(demand(2)), null);
  assert.equal(policy.offered.length, 5);
});

test("PairPool.take() offers a request whose attempt failed on a pair only the pairs sharing neither node, while there are any", () => {
  const policy = new LastPolicy();
  const pairs = new PairPool({
    prefill: [node("p0", "prefill"), node("p1", "prefill")],
    decode: [node("d0", "decode"), node("d1", "decode")],
    admitted: { poolTokens: 160, maxModelLen: 160 },
    policy,
  });
  for (const pair of pairs.pairs) pair.up = true;
  const failed = pairs.pairs.find((p) => p.key === "p0|d0")!;
  // p0 is dead but its link has not closed yet: every pair is still usable to the router.
  assert.equal(pairs.take({ ...demand(2), avoid: failed })?.key, "p1|d1");
  assert.deepEqual(policy.offered[0], ["p1|d1"]);
  // No pair apart from it can take one: the usable ones are offered as before.
  pairs.slots.find((s) => s.id === "d1")!.answering = false;
  pairs.take({ ...demand(2), avoid: failed });
  assert.deepEqual(policy.offered[1], ["p0|d0", "p1|d0"]);
});

test("PairPool.take() books a demand in the ledger and takes nothing the decode pool has no room for", () => {
  const pairs = pool(new LastPolicy());
  const decode = pairs.slots[2]!;
  const first = pairs.take(demand(6, 2))!;
  assert.equal(decode.usedPages, 6);
  assert.equal(decode.running, 1);
  assert.equal(first.prefill.usedPages, 2);
  // 6 + 6 pages is over decode's 10: no pair has room.
  assert.equal(pairs.take(demand(6, 2)), null);
  pairs.releasePrefill(first, demand(6, 2));
  pairs.releaseDecode(first, demand(6, 2));
  assert.deepEqual([decode.usedPages, decode.running, first.prefill.usedPages], [0, 0, 0]);
  // An empty node always takes one: a request larger than its pool is refused at its door.
  assert.notEqual(pairs.take(demand(50)), null);
  assert.equal(pairs.refusedForPages(decode, 11), false, "a request larger than the pool never waits");
});

test("PrefixAffinityPolicy.pick() sends a prompt's prefix back to its prefill node, else to the least loaded", () => {
  const caching = [
    node("p0", "prefill", { prefixCache: true }),
    node("p1", "prefill", { prefixCache: true }),
  ];
  const policy = new PrefixAffinityPolicy();
  const pairs = pool(policy, caching);
  const request = (tenant: number): GenerationRequest => ({
    rid: 1,
    tenant,
    promptTokens: Int32Array.from({ length: 40 }, (_, i) => i),
    maxTokens: 4,
    sampling: GREEDY_SAMPLING,
  });
  const key = policy.affinityKey(request(0), 16);
  assert.notEqual(key, null);
  assert.notEqual(policy.affinityKey(request(1), 16), key, "another tenant's prompt has another key");
  const short = { ...request(0), promptTokens: Int32Array.from([1, 2, 3]) };
  assert.equal(policy.affinityKey(short, 16), null, "no full page: no key");
  const first = pairs.take(demand(1, 3, key))!;
  assert.equal(first.prefill.id, "p0");
  // The other prefill node holds fewer pages now, but the same prefix goes back to p0.
  assert.equal(pairs.take(demand(1, 1, key))!.prefill.id, "p0");
  // Without a remembered prefix: the prefill node with the fewest pages.
  assert.equal(pairs.take(demand(1, 1, null))!.prefill.id, "p1");
});

test("PairPool.remove() drops a lost node's slot and pairs (a role switch); refuses a node that is not lost or has requests in flight", () => {
  const pairs = pool(new LastPolicy());
  assert.equal(pairs.remove("p1"), "node p1 is not lost");
  const p1 = pairs.slots.find((s) => s.id === "p1")!;
  p1.lost = true;
  pairs.pairs.find((p) => p.key === "p1|d0")!.state.requests["7"] = {} as never;
  assert.equal(pairs.remove("p1"), "node p1 still has requests in flight");
  delete pairs.pairs.find((p) => p.key === "p1|d0")!.state.requests["7"];
  assert.equal(pairs.remove("p1"), null);
  assert.deepEqual(
    pairs.slots.map((s) => s.id),
    ["p0", "d0"],
  );
  assert.deepEqual(
    pairs.pairs.map((p) => p.key),
    ["p0|d0"],
  );
  assert.equal(pairs.take(demand(2))?.key, "p0|d0", "the pairs left still serve");
  // The same address back in the other role is a new node, paired anew.
  assert.ok(typeof pairs.add(node("d1", "decode")) !== "string");
  assert.deepEqual(
    pairs.pairs.map((p) => p.key),
    ["p0|d0", "p0|d1"],
  );
});
