/**
 * Loads a prompt's pages back from the KV tiers into the pool before the request is admitted
 * (docs/design.md §3b). The prompt's chain keys are walked from the first page: past the run the
 * pool's prefix cache holds, each following page a tier holds is loaded (all at once: RAM at once,
 * disk by file reads off the step), verified there (`KvTiers.load`: MAC, owner, epoch — before any
 * byte is handed out) and promoted, in chain order, into the cache as an unreferenced entry
 * (`PrefixCache.promote`); the first page that is missing or fails ends the run. The host then
 * admits the request, whose ordinary `lookup` hits the promoted pages (a page evicted again before
 * that is a plain miss). The host never holds a step for it: the single engine keeps the request
 * out of its scheduler until `prefetch` settles, the prefill node defers feeding its `prefill`
 * message to the machine (src/node/prefill-tiers.ts). Past `TIER_LOAD_DEADLINE_MS` the request goes
 * ahead with what has loaded (later pages still promote when they arrive).
 */

import type { KvTiers, TierName } from "../kvcache/kv-tiers.js";
import type { PagePool } from "../kvcache/page-pool.js";
import type { EngineTierStats } from "../protocol/engine-api.js";
import type { PrefixCache, PromotedPage } from "../protocol/prefix-cache.js";
import { prefixBlockKey, prefixRootKey } from "../protocol/prefix-key.js";
import type { Safety } from "../protocol/safety.js";

/** How long a request waits for its pages to come back from the tiers before it goes ahead. */
export const TIER_LOAD_DEADLINE_MS = 2000;

/** A prompt to look up below the pool. */
export interface TierLookup {
  /** The prefix-cache salt (`prefixCacheSalt`) its keys are under. */
  readonly salt: string;
  readonly tokens: Int32Array;
  /** Full pages the lookup may reuse (never the prompt's last token's). */
  readonly maxPages: number;
  readonly tenant: number;
  readonly cacheEpoch: number;
}

/** Pages promoted from each tier, and prompt tokens those pages cover. */
export interface TierPrefetchCounters {
  promoted: Record<TierName, number>;
  promotedTokens: Record<TierName, number>;
}

export class TierPrefetch {
  readonly tiers: KvTiers;
  readonly #cache: PrefixCache;
  readonly #pool: PagePool;
  readonly #safety: Safety;
  readonly counters: TierPrefetchCounters = {
    promoted: { ram: 0, disk: 0 },
    promotedTokens: { ram: 0, disk: 0 },
  };

  constructor(cache: PrefixCache, tiers: KvTiers, pool: PagePool, safety: Safety) {
    this.#cache = cache;
    this.tiers = tiers;
    this.#pool = pool;
    this.#safety = safety;
  }

  /** The tiers' pages, bytes and counters, with the tokens this loader's promotions served. */
  stats(): EngineTierStats {
    const t = this.tiers.stats();
    return {
      pages: { ram: t.ram.pages, disk: t.disk?.pages ?? 0 },
      bytes: { ram: t.ram.bytes, disk: t.disk?.bytes ?? 0 },
      spills: t.spills,
      loads: { ...t.loads },
      hitTokens: { ...this.counters.promotedTokens },
      rejected: { ...t.rejected },
      dropped: t.dropped,
    };
  }

  /**
   * Starts loading the pages of `lookup` that the tiers hold after the pool's run. Null when there
   * are none (admit now); else a promise that resolves when they are promoted (or failed), or at
   * the deadline. Never rejects.
   */
  prefetch(lookup: TierLookup): Promise<void> | null {
    const wanted = this.#below(lookup);
    if (wanted.length === 0) return null;
    const loads = wanted.map((page) => this.tiers.load(page).catch(() => null));
    const promoted = (async () => {
      for (let i = 0; i < wanted.length; i++) {
        const loaded = await loads[i]!;
        if (loaded === null || !this.#cache.promote(wanted[i]!, (page) => this.#write(page, loaded.bytes)))
          return;
        this.counters.promoted[loaded.tier]++;
        this.counters.promotedTokens[loaded.tier] += this.#pool.pageSize;
      }
    })();
    let timer: NodeJS.Timeout | undefined;
    const deadline = new Promise<void>((resolve) => {
      timer = setTimeout(resolve, TIER_LOAD_DEADLINE_MS);
    });
    return Promise.race([promoted, deadline]).finally(() => clearTimeout(timer));
  }

  /** The pages after the pool's run that a tier holds, in chain order (the run ends at a gap). */
  #below(lookup: TierLookup): PromotedPage[] {
    const P = this.#pool.pageSize;
    const out: PromotedPage[] = [];
    let parentKey = prefixRootKey(lookup.salt);
    for (let j = 0; j < lookup.maxPages; j++) {
      const block = lookup.tokens.subarray(j * P, (j + 1) * P);
      const key = prefixBlockKey(parentKey, block, this.#safety);
      if (out.length === 0 && this.#cache.holds(key)) {
        parentKey = key;
        continue;
      }
      if (this.tiers.find(key) === null) break;
      out.push({
        key,
        parentKey,
        tenant: lookup.tenant,
        tokens: block,
        cacheEpoch: lookup.cacheEpoch,
        depth: j,
      });
      parentKey = key;
    }
    return out;
  }

  /** The verified bytes into pool page `page` (the pool's layout: one contiguous range a page). */
  #write(page: number, bytes: Uint8Array): void {
    poolPageView(this.#pool, page).set(bytes);
  }
}

/** The bytes of pool page `page` (a view, no copy): what a spill seals. */
export function poolPageView(pool: PagePool, page: number): Uint8Array {
  return new Uint8Array(pool.data.buffer, pool.data.byteOffset + page * pool.pageBytes, pool.pageBytes);
}
