/**
 * The router's default `PairPolicy` (src/cluster/pair-pool.ts): routing by where the KV lives
 * (issue #35 item 3, docs/topologies.md "Routing by where the KV lives").
 *
 * The nodes publish the chain keys their caches hold (src/node/cache-events.ts); the policy keeps
 * them in a `KvIndex` per tenant namespace (kv-index.ts). For a request it computes the prompt's
 * chain keys as its prefill node will (`prefixCacheSalt` of the request's tenant, cache scope and
 * `cache_salt`, then `prefixBlockKey` page by page; at most the pages a lookup may reuse, never the
 * last prompt token's), only once the index knows the tenant's namespace, and finds per node the
 * pages it holds consecutively from the first (`matched`, tier-weighted). Then, among the pairs
 * that can take the request (usable, with room by the ledger, in round-robin order):
 *
 * - prefill: the node with the highest `matched − LOAD_WEIGHT · booked`, `booked` being the pages
 *   the router's ledger books on it (prompts dispatched and not yet committed); the first in
 *   round-robin order on a tie. Both terms are pages of prefill compute: a matched page is one the
 *   node need not compute, a booked page one it computes before or beside this prompt, so the rule
 *   picks the node that would finish this prompt's prefill first — hence `LOAD_WEIGHT` = 1. A
 *   node holding the longest prefix is left only for one with that much less work booked;
 * - decode: among the pairs of that prefill node, the decode node holding the longest prefix (its
 *   own cached pages are not sent again, decode-side reuse), then the fewest requests running,
 *   then round-robin order.
 *
 * A decision's reason is `cache_hit` (the chosen prefill node holds the longest prefix any
 * candidate holds), `load` (another held a longer one, the load weighed more), or `fallback`
 * (no candidate holds a page of it, or the index knows nothing of its tenant yet): then
 * `PrefixAffinityPolicy` picks, as before the events (its affinity also covers prompts whose
 * first pages are still being computed).
 */

import type { CacheEventsMessage } from "../links/node-messages.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { prefixBlockKey, prefixCacheSalt, prefixRootKey } from "../protocol/prefix-key.js";
import type { Safety } from "../protocol/safety.js";
import { KvIndex } from "./kv-index.js";
import type {
  NodePair,
  NodeSlot,
  PairDemand,
  PairPolicy,
  PromptChain,
  RoutingReason,
  RoutingReport,
} from "./pair-pool.js";
import { PrefixAffinityPolicy } from "./prefix-affinity-policy.js";

/** Pages of booked prefill work one matched page is worth (see the module header). */
export const LOAD_WEIGHT = 1;
/** A prompt's chain keys computed at most (past them a longer match changes no choice in practice). */
const MAX_CHAIN_PAGES = 4096;

export interface KvRoutingOptions {
  /** The router's guards and faults: the salt and keys as the nodes compute them. */
  readonly safety: Safety;
  /** See `KvIndex` (default `KV_INDEX_KEYS_PER_NODE`). */
  readonly maxKeysPerNode?: number;
}

export class KvRoutingPolicy implements PairPolicy {
  readonly index: KvIndex;
  readonly #safety: Safety;
  readonly #affinity = new PrefixAffinityPolicy();
  readonly #decisions: Record<RoutingReason, number> = { cache_hit: 0, load: 0, fallback: 0 };

  constructor(options: KvRoutingOptions) {
    this.#safety = options.safety;
    this.index = new KvIndex({
      safety: options.safety,
      ...(options.maxKeysPerNode === undefined ? {} : { maxKeysPerNode: options.maxKeysPerNode }),
    });
  }

  affinityKey(request: GenerationRequest, pageSize: number): string | null {
    return this.#affinity.affinityKey(request, pageSize);
  }

  chainOf(request: GenerationRequest, pageSize: number): PromptChain | null {
    const pages = Math.min(MAX_CHAIN_PAGES, Math.floor((request.promptTokens.length - 1) / pageSize));
    if (pages <= 0) return null;
    const safety = this.#safety;
    let keys: string[] | null = null;
    return {
      tenant: request.tenant,
      keys() {
        if (keys !== null) return keys;
        const salt = prefixCacheSalt(
          safety,
          request.tenant,
          request.cacheSalt ?? null,
          request.cacheScope ?? "",
        );
        keys = [];
        let parent = prefixRootKey(salt);
        for (let i = 0; i < pages; i++) {
          parent = prefixBlockKey(
            parent,
            request.promptTokens.subarray(i * pageSize, (i + 1) * pageSize),
            safety,
          );
          keys.push(parent);
        }
        return keys;
      },
    };
  }

  cacheEvents(node: string, message: CacheEventsMessage): void {
    this.index.apply(node, message);
  }

  nodeLost(node: string): void {
    this.index.dropNode(node);
  }

  indexedKeys(node: string): number {
    return this.index.sizeOf(node);
  }

  routing(): RoutingReport {
    return { indexKeys: this.index.size, decisions: { ...this.#decisions } };
  }

  pick(candidates: readonly NodePair[], demand: PairDemand): NodePair | null {
    const chain = demand.chain ?? null;
    const matched =
      chain === null || !this.index.knows(chain.tenant)
        ? null
        : this.index.matches(chain.tenant, chain.keys());
    const choice = matched === null || matched.size === 0 ? null : byCache(candidates, matched);
    if (choice === null) {
      this.#decisions.fallback++;
      const pair = this.#affinity.pick(candidates, demand);
      return pair === null || matched === null ? pair : withDecode(candidates, pair.prefill, matched);
    }
    this.#decisions[choice.reason]++;
    this.#affinity.remember(demand, choice.pair);
    return choice.pair;
  }
}

/** The pair by the nodes' matched prefixes and the ledger (null: no candidate holds a page of it). */
function byCache(
  candidates: readonly NodePair[],
  matched: ReadonlyMap<string, number>,
): { pair: NodePair; reason: RoutingReason } | null {
  let best: NodeSlot | null = null;
  let bestScore = Number.NEGATIVE_INFINITY;
  let longest = 0;
  for (const { prefill } of candidates) {
    const m = matched.get(prefill.id) ?? 0;
    longest = Math.max(longest, m);
    const score = m - LOAD_WEIGHT * prefill.usedPages;
    if (score > bestScore) {
      best = prefill;
      bestScore = score;
    }
  }
  if (best === null || longest === 0) return null;
  const reason = (matched.get(best.id) ?? 0) === longest ? "cache_hit" : "load";
  return { pair: withDecode(candidates, best, matched), reason };
}

/**
 * Among the candidates of prefill node `prefill`: the one whose decode node holds the longest
 * prefix, then the fewest running, then the first in round-robin order.
 */
function withDecode(
  candidates: readonly NodePair[],
  prefill: NodeSlot,
  matched: ReadonlyMap<string, number>,
): NodePair {
  let best: NodePair | null = null;
  for (const pair of candidates) {
    if (pair.prefill !== prefill) continue;
    if (best === null) {
      best = pair;
      continue;
    }
    const m = matched.get(pair.decode.id) ?? 0;
    const b = matched.get(best.decode.id) ?? 0;
    if (m > b || (m === b && pair.decode.running < best.decode.running)) best = pair;
  }
  return best!;
}
