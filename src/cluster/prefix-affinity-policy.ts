/**
 * The router's `PairPolicy` (src/cluster/pair-pool.ts) before its nodes' cache events are known:
 * prefix affinity over the prefill nodes that keep a prefix cache, round-robin over those that do
 * not. The default policy (src/cluster/kv-routing-policy.ts) falls back to it.
 *
 * A prompt's affinity key is its tenant, cache namespace and the token ids of its first full pages
 * (at most `AFFINITY_PAGES`, never the last prompt token, as a cache hit), hashed. Among the pairs
 * that can take a request, in the pool's round-robin order: with prefix-caching prefill nodes, the
 * one whose prefill node last took a prompt with the same key (its cache likely holds the prefix),
 * else the one whose prefill node holds the fewest pages by the ledger; without, the first one.
 * The policy remembers the newest `AFFINITY_ENTRIES` keys, forgetting the oldest first.
 */

import { createHash } from "node:crypto";
import type { GenerationRequest } from "../protocol/engine-api.js";
import type { NodePair, PairDemand, PairPolicy } from "./pair-pool.js";

/** Prefix-affinity keys remembered (the oldest is forgotten first). */
const AFFINITY_ENTRIES = 10_000;
/** Full pages of a prompt its prefix-affinity key covers. */
const AFFINITY_PAGES = 4;

export class PrefixAffinityPolicy implements PairPolicy {
  /** A prompt's first-pages key → the prefill node that last took it (oldest first). */
  readonly #affinity = new Map<string, string>();

  /**
   * The prefix-affinity key of `request`, or null when the prompt has no full page to reuse.
   */
  affinityKey(request: GenerationRequest, pageSize: number): string | null {
    const pages = Math.min(AFFINITY_PAGES, Math.floor((request.promptTokens.length - 1) / pageSize));
    if (pages <= 0) return null;
    const hash = createHash("sha256").update(
      `${request.tenant}\u0000${request.cacheScope ?? ""}\u0000${request.cacheSalt ?? ""}\u0000`,
    );
    hash.update(
      new Uint8Array(request.promptTokens.buffer, request.promptTokens.byteOffset, pages * pageSize * 4),
    );
    return hash.digest("base64");
  }

  pick(candidates: readonly NodePair[], demand: PairDemand): NodePair | null {
    const preferred = demand.affinityKey === null ? undefined : this.#affinity.get(demand.affinityKey);
    let pair: NodePair | null = null;
    for (const candidate of candidates) {
      const caching = candidate.prefill.node.hello.prefixCache === true;
      if (pair === null || (caching && candidate.prefill.usedPages < pair.prefill.usedPages))
        pair = candidate;
      if (!caching || candidate.prefill.id === preferred) {
        pair = candidate;
        break;
      }
    }
    if (pair !== null) this.remember(demand, pair);
    return pair;
  }

  /** `pair` took `demand`: a prompt with its key prefers its prefill node (when it caches). */
  remember(demand: PairDemand, pair: NodePair): void {
    if (demand.affinityKey === null || pair.prefill.node.hello.prefixCache !== true) return;
    this.#affinity.delete(demand.affinityKey);
    this.#affinity.set(demand.affinityKey, pair.prefill.id);
    if (this.#affinity.size > AFFINITY_ENTRIES) this.#affinity.delete(this.#affinity.keys().next().value!);
  }
}
