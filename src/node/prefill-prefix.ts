/**
 * The prefill node's prefix cache (docs/design.md §3a, disaggregated): the prefill state machine's
 * `PrefillPrefixCache` over the engine's `PrefixCache` (one per pool). A prefill request's prompt
 * is looked up under the salt of its authenticated tenant (plus the server's scope and the
 * client's `cache_salt`, `prefixCacheSalt`); the hit's pages are references the machine holds as
 * the first source pages, and after the compute the attempt's full pages are offered to the cache.
 * Decode still receives every page of the request, so the transfer, its checksums, coverage and
 * page tags are unchanged; only the prefill compute shrinks to the uncached suffix.
 *
 * With KV tiers (`--cache-ram`, `--cache-disk`, docs/design.md §3b), `prefetch` loads the pages of a
 * prompt that the tiers hold back into the cache first; the node feeds the `prefill` message to its
 * machine only when they have settled, so the machine's lookup hits them and no step waits on a tier.
 */
import type { TierPrefetch } from "../engine/tier-prefetch.js";
import { BlockTable } from "../kvcache/block-table.js";
import type { PrefillAttempt, PrefillPrefixCache } from "../protocol/prefill-machine.js";
import type { PrefixCache } from "../protocol/prefix-cache.js";
import { prefixCacheSalt } from "../protocol/prefix-key.js";
import type { Safety } from "../protocol/safety.js";
import { attemptKey, type PrefillRequest } from "../protocol/wire.js";

/** What an attempt brought: the prompt and the salt its keys are under. */
interface CacheInput {
  readonly tokens: Int32Array;
  readonly salt: string;
  readonly cacheEpoch: number;
}

export class PrefillPrefix implements PrefillPrefixCache {
  readonly #cache: PrefixCache;
  readonly #safety: Safety;
  readonly #pageSize: number;
  readonly #inputs = new Map<string, CacheInput>();

  /** Whether an attempt computes its whole prompt (it asked for the prompt's log-probabilities). */
  readonly #wholePrompt: (key: string) => boolean;

  /** The KV tiers' loader (null without tiers). */
  readonly #tiers: TierPrefetch | null;

  constructor(
    cache: PrefixCache,
    safety: Safety,
    pageSize: number,
    wholePrompt: (key: string) => boolean,
    tiers: TierPrefetch | null = null,
  ) {
    this.#cache = cache;
    this.#safety = safety;
    this.#pageSize = pageSize;
    this.#wholePrompt = wholePrompt;
    this.#tiers = tiers;
  }

  /**
   * Loads the pages of `msg`'s prompt that the KV tiers hold (after the pool's run) back into the
   * cache; null when there are none (feed the message now), else settles when they are in (or at
   * the deadline).
   */
  prefetch(msg: PrefillRequest): Promise<void> | null {
    const tokens = msg.promptTokens;
    if (this.#tiers === null || tokens === undefined || tokens.length !== msg.promptLen) return null;
    if (this.#wholePrompt(attemptKey(msg.rid, msg.epoch))) return null;
    return this.#tiers.prefetch({
      salt: this.#saltOf(msg),
      tokens,
      maxPages: Math.floor((msg.promptLen - 1) / this.#pageSize),
      tenant: msg.tenant,
      cacheEpoch: msg.cacheEpoch ?? 0,
    });
  }

  #saltOf(msg: PrefillRequest): string {
    return prefixCacheSalt(
      this.#safety,
      msg.tenant,
      msg.cacheSalt ?? null,
      msg.cacheScope ?? "",
      msg.cacheEpoch ?? 0,
    );
  }

  lookup(msg: PrefillRequest, maxPages: number): { pages: number[]; generations: number[] } {
    const tokens = msg.promptTokens ?? new Int32Array(0);
    const salt = this.#saltOf(msg);
    const key = attemptKey(msg.rid, msg.epoch);
    this.#inputs.set(key, { tokens, salt, cacheEpoch: msg.cacheEpoch ?? 0 });
    const table = new BlockTable(Math.max(1, maxPages));
    // A prompt whose log-probabilities were asked is computed whole (a hit would skip its rows).
    if (tokens.length === msg.promptLen && !this.#wholePrompt(key))
      this.#cache.lookup(salt, tokens, maxPages, table);
    return {
      pages: Array.from(table.pages.subarray(0, table.length)),
      generations: Array.from(table.generations.subarray(0, table.length)),
    };
  }

  insert(a: PrefillAttempt): void {
    const key = attemptKey(a.rid, a.epoch);
    const input = this.#inputs.get(key);
    this.#inputs.delete(key);
    if (input === undefined || input.tokens.length !== a.promptLen) return;
    const table = new BlockTable(a.pages.length);
    for (let i = 0; i < a.pages.length; i++) table.push(a.pages[i]!, a.generations[i]!, a.shared[i] === 1);
    this.#cache.insert(input.salt, input.tokens, Math.floor(a.promptLen / this.#pageSize), table, {
      rid: a.rid,
      epoch: a.epoch,
      tenant: a.tenant,
      cacheEpoch: input.cacheEpoch,
    });
    for (let i = 0; i < a.pages.length; i++) a.shared[i] = table.shared[i]!;
  }

  evict(count: number): number {
    return this.#cache.evict(count);
  }

  /** The attempt ended before its compute finished: forget its input. */
  forget(rid: number, epoch: number): void {
    this.#inputs.delete(attemptKey(rid, epoch));
  }
}
