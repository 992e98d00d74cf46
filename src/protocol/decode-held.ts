/**
 * Decode-side reuse (issue #35, docs/design.md §3a): a decode node keeps its own tenant-fenced
 * `PrefixCache` on its pool (the same class and salt function as prefill's), and a transfer sends
 * only the pages decode lacks. The decode machine's parts of it, in one place:
 *
 * - **reserve**: decode looks the prompt up (`DecodePrefixCache.lookup`, at most the full pages
 *   before the prompt's last token, so at least one page is always sent) and takes a reference on
 *   each page of the hit; those pages are the lease's first `held` pages (`TransferLease.held`).
 *   Prefill writes nothing into them, its manifest covers the rest (`[held·P, promptLen)`, one
 *   checksum per page sent), and the TCP receiver's lease check refuses a write into one
 *   (`leasedPage` is -1 for them). A pool short of free pages evicts unreferenced cached pages
 *   first, as on prefill.
 * - **commit** (`verifyHeld`, guards `held-pages` and `page-tags`): each held page must be a prefix-cache page of
 *   the request's tenant that decode holds, SHARED at the leased generation and referenced
 *   (`OwnershipTable.checkShared`) — a lease that claims pages decode does not hold is refused
 *   (500 `page_tag_mismatch`). Every step reads them under the same rule (`heldMarks` for
 *   `checkStep`, the `page-tags` guard).
 * - **end**: an attempt that ends after its commit (finished, stopped, or aborted: its KV is
 *   verified and computed) offers its full pages — prompt and generated tokens, as far as their KV
 *   is written — to decode's cache (`cacheComputed`), so the next turn of the conversation (the
 *   previous prompt, the answer, the new message) holds them. The pages the cache took are dropped
 *   by reference (`unref`), the others freed.
 * - `n` > 1 requests neither look up nor insert (their prompt pages become sibling pages).
 *
 * The fault `held-unpinned` drops the hit's references at once while the lease still calls the
 * pages held (a lookup that does not pin, as a hit racing an eviction): an eviction may hand them
 * to another request before the commit.
 */
import { BlockTable } from "../kvcache/block-table.js";
import type { WireError } from "../lib/errors.js";
import { type KvPool, leaseOrEvict } from "./effects.js";
import type { PrefixCache } from "./prefix-cache.js";
import { faultOn, guardOn, type Safety } from "./safety.js";
import type { ReserveRequest } from "./wire.js";

/** What the decode machine knows of an attempt, as far as its held pages go. */
export interface HeldAttempt {
  readonly rid: number;
  readonly epoch: number;
  readonly tenant: number;
  readonly promptLen: number;
  readonly generated: number;
  readonly pages: readonly number[];
  readonly generations: readonly number[];
  /** The first `held` pages are decode's prefix-cache references (absent: none). */
  readonly held?: number;
}

/** What the decode machine asks of its node's prefix cache (`DecodePrefix` over a `PrefixCache`). */
export interface DecodePrefixCache {
  /**
   * Takes a reference on each cached full page `msg`'s prompt starts with (at most `maxPages`) and
   * returns them in order.
   */
  lookup(msg: ReserveRequest, maxPages: number): { pages: number[]; generations: number[] };
  /**
   * Offers the first `fullPages` pages of ended attempt `a` (full, computed) to the cache; returns,
   * per page of `a`, 1 where the attempt now holds a reference instead of the page.
   */
  insert(a: HeldAttempt, fullPages: number): number[];
  /** Evicts up to `count` unreferenced cached pages (the pool is short); returns how many. */
  evict(count: number): number;
}

const NO_HIT = { pages: [] as number[], generations: [] as number[] };

/**
 * The `count` pages of reserve `msg`: its prompt's cached full pages first (`held` of them,
 * references), then pages leased to it (evicting unreferenced cached pages when the pool is
 * short). Null, holding nothing, when the pool has too few.
 */
export function leaseWithHeld(
  prefix: DecodePrefixCache | undefined,
  pool: KvPool,
  safety: Safety,
  msg: ReserveRequest,
  count: number,
): { pages: number[]; generations: number[]; held: number } | null {
  const hit = holdPrefix(prefix, pool, safety, msg);
  const held = hit.pages.length;
  const leased = leaseOrEvict(pool, prefix, count - held, msg);
  if (leased === null) {
    releaseHeld(pool, safety, hit.pages, hit.generations, held);
    return null;
  }
  return {
    pages: [...hit.pages, ...leased.pages],
    generations: [...hit.generations, ...leased.generations],
    held,
  };
}

/** Gives back what `leaseWithHeld` took for `msg` (the reservation failed after it). */
export function dropLease(
  pool: KvPool,
  safety: Safety,
  leased: {
    readonly pages: readonly number[];
    readonly generations: readonly number[];
    readonly held: number;
  },
  msg: ReserveRequest,
): void {
  releaseHeld(pool, safety, leased.pages, leased.generations, leased.held);
  for (let i = leased.held; i < leased.pages.length; i++)
    pool.table.free(leased.pages[i]!, leased.generations[i]!, msg.rid, msg.epoch);
}

/** The hit decode holds for reserve `msg` (none for n > 1). */
function holdPrefix(
  prefix: DecodePrefixCache | undefined,
  pool: KvPool,
  safety: Safety,
  msg: ReserveRequest,
): { pages: number[]; generations: number[] } {
  if (prefix === undefined || (msg.samples?.length ?? 0) > 0) return NO_HIT;
  const hit = prefix.lookup(msg, Math.floor((msg.promptLen - 1) / pool.pageSize));
  // The fault: the lease calls them held, but no reference keeps them.
  if (faultOn(safety, "held-unpinned"))
    for (let i = 0; i < hit.pages.length; i++) pool.table.unref(hit.pages[i]!, hit.generations[i]!);
  return hit;
}

/** Drops the references of the first `count` of `pages` (an attempt's held pages). */
export function releaseHeld(
  pool: KvPool,
  safety: Safety,
  pages: readonly number[],
  generations: readonly number[],
  count: number,
): void {
  if (faultOn(safety, "held-unpinned")) return; // never taken
  for (let i = 0; i < count; i++) pool.table.unref(pages[i]!, generations[i]!);
}

/**
 * The commit check of the held pages (guard `held-pages`; the commit-time page tags, `page-tags`,
 * check them too, as they check every page transferred): each one is a cached page of the
 * attempt's tenant, SHARED at its leased generation and referenced. Null when they all are.
 */
export function verifyHeld(a: HeldAttempt, pool: KvPool, safety: Safety): WireError | null {
  if (!guardOn(safety, "held-pages") && !guardOn(safety, "page-tags")) return null;
  const table = pool.table;
  for (let i = 0; i < (a.held ?? 0); i++) {
    if (!table.checkShared(a.pages[i]!, a.generations[i]!, a.tenant)) {
      return {
        code: "page_tag_mismatch",
        message: `The KV page ${i} of request ${a.rid} is leased as held by decode's prefix cache but is not a cached page of its tenant that decode holds: ${table.describe(a.pages[i]!)}`,
      };
    }
  }
  return null;
}

let marks = new Uint8Array(64);

/**
 * `checkStep`'s shared marks for an attempt of `count` pages whose first `held` are cache
 * references (a scratch array, rewritten by the next call: read it at once). Allocates only to grow.
 */
export function heldMarks(held: number, count: number): Uint8Array {
  if (count > marks.length) marks = new Uint8Array(Math.max(count, 2 * marks.length));
  marks.fill(1, 0, held);
  marks.fill(0, held, count);
  return marks;
}

/**
 * Attempt `a` ended after its commit: its full computed pages go to decode's cache. Returns per
 * page 1 where `a` now holds a reference (its held pages, the pages the cache took), or null
 * when nothing was offered (no cache, a sample of n > 1).
 */
export function cacheComputed(
  prefix: DecodePrefixCache | undefined,
  a: HeldAttempt & { readonly group?: number },
  pageSize: number,
): number[] | null {
  if (prefix === undefined || a.group !== undefined) return null;
  const kvTokens = a.promptLen + a.generated - 1;
  return prefix.insert(a, Math.floor(kvTokens / pageSize));
}

/** Where `DecodePrefix` finds a request's tokens and the salt of its keys. */
export interface HeldInputs {
  /** The prompt of reserve `msg` and its salt; null: it cannot be looked up (no tokens sent). */
  prompt(msg: ReserveRequest): { readonly tokens: Int32Array; readonly salt: string } | null;
  /** Attempt `a`'s token ids (prompt, then generated) and salt; null: unknown. */
  sequence(a: HeldAttempt): { readonly tokens: Int32Array; readonly salt: string } | null;
}

/** `DecodePrefixCache` over a pool's `PrefixCache`, with the tokens from `inputs` (a node's, the model checker's). */
export class DecodePrefix implements DecodePrefixCache {
  readonly #cache: PrefixCache;
  readonly #inputs: HeldInputs;

  constructor(cache: PrefixCache, inputs: HeldInputs) {
    this.#cache = cache;
    this.#inputs = inputs;
  }

  lookup(msg: ReserveRequest, maxPages: number): { pages: number[]; generations: number[] } {
    const input = this.#inputs.prompt(msg);
    if (input === null || maxPages < 1 || input.tokens.length !== msg.promptLen) return NO_HIT;
    const table = new BlockTable(maxPages);
    this.#cache.lookup(input.salt, input.tokens, maxPages, table);
    return {
      pages: Array.from(table.pages.subarray(0, table.length)),
      generations: Array.from(table.generations.subarray(0, table.length)),
    };
  }

  insert(a: HeldAttempt, fullPages: number): number[] {
    const held = a.held ?? 0;
    const shared = a.pages.map((_, i): number => (i < held ? 1 : 0));
    const input = this.#inputs.sequence(a);
    const P = this.#pageSizeOf(input, fullPages);
    if (input === null || P === 0) return shared;
    const table = new BlockTable(a.pages.length);
    for (let i = 0; i < a.pages.length; i++) table.push(a.pages[i]!, a.generations[i]!, i < held);
    this.#cache.insert(input.salt, input.tokens, fullPages, table, a);
    for (let i = 0; i < a.pages.length; i++) shared[i] = table.shared[i]!;
    return shared;
  }

  evict(count: number): number {
    return this.#cache.evict(count);
  }

  /** The cache's page size when `input` covers `fullPages` full pages, else 0 (nothing to offer). */
  #pageSizeOf(input: { readonly tokens: Int32Array } | null, fullPages: number): number {
    const P = this.#cache.pageSize;
    return input !== null && fullPages > 0 && input.tokens.length >= fullPages * P ? P : 0;
  }
}
