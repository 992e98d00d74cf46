/**
 * The prefill node's prefix cache (docs/design.md §3a, disaggregated): the prefill state machine's
 * `PrefillPrefixCache` over the engine's `PrefixCache` (one per pool). A prefill request's prompt
 * is looked up under the salt of its authenticated tenant (plus the server's scope and the
 * client's `cache_salt`, `prefixCacheSalt`); the hit's pages are references the machine holds as
 * the first source pages, and after the compute the attempt's full pages are offered to the cache.
 * Decode still receives every page of the request, so the transfer, its checksums, coverage and
 * page tags are unchanged; only the prefill compute shrinks to the uncached suffix.
 */
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
}

export class PrefillPrefix implements PrefillPrefixCache {
  readonly #cache: PrefixCache;
  readonly #safety: Safety;
  readonly #pageSize: number;
  readonly #inputs = new Map<string, CacheInput>();

  /** Whether an attempt computes its whole prompt (it asked for the prompt's log-probabilities). */
  readonly #wholePrompt: (key: string) => boolean;

  constructor(cache: PrefixCache, safety: Safety, pageSize: number, wholePrompt: (key: string) => boolean) {
    this.#cache = cache;
    this.#safety = safety;
    this.#pageSize = pageSize;
    this.#wholePrompt = wholePrompt;
  }

  lookup(msg: PrefillRequest, maxPages: number): { pages: number[]; generations: number[] } {
    const tokens = msg.promptTokens ?? new Int32Array(0);
    const salt = prefixCacheSalt(this.#safety, msg.tenant, msg.cacheSalt ?? null, msg.cacheScope ?? "");
    const key = attemptKey(msg.rid, msg.epoch);
    this.#inputs.set(key, { tokens, salt });
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
    this.#cache.insert(input.salt, input.tokens, Math.floor(a.promptLen / this.#pageSize), table, a);
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
