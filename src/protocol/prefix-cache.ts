/**
 * The tenant-fenced prefix cache of one KV pool (docs/design.md §3a): full pages of finished
 * prefills kept as SHARED, reference-counted pages of the node's real `OwnershipTable`, found by
 * the SHA-256 key chain of `prefix-key.ts` (salted with the authenticated tenant).
 *
 * - `lookup` walks a prompt's full pages from the first, key by key, and stops at the first miss;
 *   a hit takes a reference on each page (`OwnershipTable.ref`) and appends it to the request's
 *   block table marked as shared. It never covers the prompt's last token (its logits are needed),
 *   so the request computes — and writes — only its own pages, from the first page after the hit
 *   on: cached pages are always full, so no partial page is ever shared or needs copying. Each hit
 *   also compares the stored token ids and parent entry with the request's (`prefix-tokens`), so a
 *   key collision is a miss, never another prefix's KV.
 * - `insert` hands the request's full, computed pages to new cache entries (`OwnershipTable.share`:
 *   READY → SHARED, the request keeps a reference), chaining under entries already cached for the
 *   same tokens; a page whose key is already cached by another page stays the request's own.
 * - `evict` frees least recently used pages that no request references, leaves of the chain first,
 *   when the pool runs short (`OwnershipTable.evict`: SHARED with refcount 0 → FREE).
 *
 * - `observer` (optional) hears of each page the cache gains (`stored`) and of each page it is about
 *   to free (`evicting`, called while the page still holds the entry's KV): the KV tiers spill from
 *   it (docs/design.md §3b) and the node publishes its cache events to the routers from it.
 * - `promote` brings a page loaded back from a KV tier (verified there) into the pool as an
 *   unreferenced cached entry under its parent: a later `lookup` hits it like any other.
 *
 * The read guard (page tags) is not here: `OwnershipTable.checkStep` accepts a shared page only
 * for a request of its tenant whose block table holds the reference (`checkShared`). Sans-IO: plain
 * data over the table, no clock (a use counter orders the LRU), so the model checker can drive it.
 * The lookup and insert paths hash (they allocate); nothing here runs per decode step.
 */
import type { OwnershipTable } from "../kvcache/ownership-table.js";
import { prefixBlockKey, prefixRootKey } from "./prefix-key.js";
import { guardOn, type Safety } from "./safety.js";

/** What a request's block table must offer the cache (the engine's `BlockTable`). */
export interface CacheBlockTable {
  readonly pages: Int32Array;
  readonly generations: Uint32Array;
  readonly shared: Uint8Array;
  readonly length: number;
  push(page: number, generation: number, shared?: boolean): void;
}

/** A cached page as the cache's observer sees it (read-only views; valid during the call). */
export interface CachedPage {
  /** The page's chain key (`prefixBlockKey`), opaque: salted with its tenant's namespace. */
  readonly key: string;
  /** The previous page's key, or the root key (`prefixRootKey(salt)`) for a chain's first page. */
  readonly parentKey: string;
  readonly tenant: number;
  /** The page's token ids. */
  readonly tokens: Int32Array;
  /** Its place in the pool, and the generation it holds the entry's KV at. */
  readonly page: number;
  readonly generation: number;
  /** 0 for a chain's first page. */
  readonly depth: number;
  /** The tenant's cache epoch the page was computed under (keys file `cache_epoch`). */
  readonly cacheEpoch: number;
}

/** A page a KV tier loaded back, to become a cache entry (`PrefixCache.promote`). */
export interface PromotedPage {
  readonly key: string;
  readonly parentKey: string;
  readonly tenant: number;
  readonly tokens: Int32Array;
  readonly cacheEpoch: number;
  /** 0 for a chain's first page (its parent is the root key); else its parent must be cached. */
  readonly depth: number;
}

/** The lease holder of a page being promoted (never a request's rid: rids stay below it). */
export const PROMOTE_RID = 0xfffffffe;

/** Hears what a `PrefixCache` gains and loses; called synchronously, inside the cache's own calls. */
export interface PrefixCacheObserver {
  /** `page` became a cache entry. */
  stored(page: CachedPage): void;
  /** `page` is about to be freed by eviction: it still holds the entry's KV during this call. */
  evicting(page: CachedPage): void;
}

/** What an entry and its saved form (`SavedEntry`) hold alike. */
export interface EntryFields {
  readonly id: number;
  readonly key: string;
  readonly parentKey: string;
  readonly page: number;
  readonly generation: number;
  readonly tenant: number;
  readonly cacheEpoch: number;
  readonly depth: number;
  children: number;
  lastUse: number;
}

interface Entry extends EntryFields {
  /** The page's token ids (compared on every hit). */
  readonly tokens: Int32Array;
  readonly parent: Entry | null;
}

/** A cache's state as plain data (`PrefixCache.save`): entries parents first, each parent named by its key. */
export interface SavedPrefixCache {
  readonly nextId: number;
  readonly clock: number;
  readonly entries: readonly SavedEntry[];
}

/** One entry of a `SavedPrefixCache`. */
export interface SavedEntry extends Readonly<EntryFields> {
  readonly tokens: readonly number[];
  /** The parent entry's key, or null for a chain's first page. */
  readonly parent: string | null;
}

/** Counters of one cache, for metrics. */
export interface PrefixCacheCounters {
  /** Lookups that reused at least one page. */
  hits: number;
  /** Lookups that reused none. */
  misses: number;
  /** Prompt tokens served from the cache. */
  hitTokens: number;
  /** Pages evicted. */
  evictions: number;
  /** Hits refused because the stored tokens or parent differ (a key collision). */
  collisions: number;
}

export class PrefixCache {
  readonly #table: OwnershipTable;
  readonly #pageSize: number;
  readonly #safety: Safety;
  #observer: PrefixCacheObserver | null;
  readonly #byKey = new Map<string, Entry>();
  /** The entry owning each physical page, or undefined. */
  readonly #byPage: (Entry | undefined)[];
  #nextId = 1;
  #clock = 0;
  /** The epoch of the next promotion's lease (`PROMOTE_RID`). */
  #promotions = 0;
  readonly #promotePage = new Int32Array(1);
  readonly #promoteGeneration = new Uint32Array(1);
  readonly counters: PrefixCacheCounters = { hits: 0, misses: 0, hitTokens: 0, evictions: 0, collisions: 0 };

  constructor(table: OwnershipTable, pageSize: number, safety: Safety, observer?: PrefixCacheObserver) {
    this.#table = table;
    this.#pageSize = pageSize;
    this.#safety = safety;
    this.#observer = observer ?? null;
    this.#byPage = new Array<Entry | undefined>(table.numPages).fill(undefined);
  }

  /**
   * Adds `observer` beside the one given to the constructor (each hears every call, in the order
   * added): the node's cache-event publisher joins the tiers' observer this way.
   */
  observe(observer: PrefixCacheObserver): void {
    const first = this.#observer;
    this.#observer =
      first === null
        ? observer
        : {
            stored: (page) => {
              first.stored(page);
              observer.stored(page);
            },
            evicting: (page) => {
              first.evicting(page);
              observer.evicting(page);
            },
          };
  }

  /** Tokens per page. */
  get pageSize(): number {
    return this.#pageSize;
  }

  /** Pages the cache holds. */
  get size(): number {
    return this.#byKey.size;
  }

  /**
   * Finds the longest cached run of `tokens`' full pages (at most `maxPages`), takes a reference
   * on each and appends them, marked shared, to the empty `blockTable`. Returns the pages reused.
   */
  lookup(salt: string, tokens: Int32Array, maxPages: number, blockTable: CacheBlockTable): number {
    const P = this.#pageSize;
    const checkTokens = guardOn(this.#safety, "prefix-tokens");
    let parentKey = prefixRootKey(salt);
    let parent: Entry | null = null;
    let hit = 0;
    const use = ++this.#clock;
    while (hit < maxPages) {
      const block = tokens.subarray(hit * P, (hit + 1) * P);
      const key = prefixBlockKey(parentKey, block, this.#safety);
      const entry = this.#byKey.get(key);
      if (entry === undefined) break;
      if (checkTokens && (entry.parent !== parent || !sameTokens(entry.tokens, block))) {
        this.counters.collisions++;
        break;
      }
      if (!this.#table.ref(entry.page, entry.generation)) break;
      blockTable.push(entry.page, entry.generation, true);
      entry.lastUse = use;
      parentKey = key;
      parent = entry;
      hit++;
    }
    if (hit > 0) {
      this.counters.hits++;
      this.counters.hitTokens += hit * P;
    } else this.counters.misses++;
    return hit;
  }

  /**
   * Caches the first `fullPages` pages of `blockTable` (full, computed by `(rid, epoch)` of
   * `tenant` from `tokens`): each page not yet shared becomes a new entry under the previous page's
   * (the request keeps a reference and its block table marks it shared), unless its key is
   * cached already (then it stays the request's own and the chain goes on under the cached one).
   */
  insert(
    salt: string,
    tokens: Int32Array,
    fullPages: number,
    blockTable: CacheBlockTable,
    owner: {
      readonly rid: number;
      readonly epoch: number;
      readonly tenant: number;
      readonly cacheEpoch?: number;
    },
  ): void {
    const P = this.#pageSize;
    let parentKey = prefixRootKey(salt);
    let parent: Entry | null = null;
    const use = ++this.#clock;
    for (let j = 0; j < fullPages && j < blockTable.length; j++) {
      const page = blockTable.pages[j]!;
      if (blockTable.shared[j] === 1) {
        const own = this.#byPage[page];
        if (own === undefined) return; // a reference the cache no longer knows: stop the chain
        own.lastUse = use;
        parentKey = own.key;
        parent = own;
        continue;
      }
      const block = tokens.subarray(j * P, (j + 1) * P);
      const key = prefixBlockKey(parentKey, block, this.#safety);
      const cached = this.#byKey.get(key);
      if (cached !== undefined) {
        if (cached.parent !== parent || !sameTokens(cached.tokens, block)) return; // a collision
        cached.lastUse = use;
        parentKey = key;
        parent = cached;
        continue;
      }
      const generation = blockTable.generations[j]!;
      const id = this.#nextId++;
      if (!this.#table.share(page, generation, owner.rid, owner.epoch, id, P)) return;
      blockTable.shared[j] = 1;
      const entry: Entry = {
        id,
        key,
        parentKey,
        page,
        generation,
        tenant: owner.tenant,
        tokens: Int32Array.from(block),
        parent,
        depth: parent === null ? 0 : parent.depth + 1,
        cacheEpoch: owner.cacheEpoch ?? 0,
        children: 0,
        lastUse: use,
      };
      this.#add(entry);
      parentKey = key;
      parent = entry;
    }
  }

  /** True when `key` is cached in the pool. */
  holds(key: string): boolean {
    return this.#byKey.has(key);
  }

  /**
   * Makes `loaded` a cache entry: a free page (evicting the least recently used if none is) is
   * leased to `PROMOTE_RID`, filled by `write(page)` with the page's verified KV, stamped, marked
   * READY and handed to the cache with no reference. True when it is cached (now or already); false
   * when its parent is not (a chain never has a gap) or no page can be had.
   */
  promote(loaded: PromotedPage, write: (page: number) => void): boolean {
    if (this.#byKey.has(loaded.key)) return true;
    const parent = loaded.depth === 0 ? null : (this.#byKey.get(loaded.parentKey) ?? null);
    if (loaded.depth > 0 && (parent === null || parent.depth !== loaded.depth - 1)) return false;
    const use = ++this.#clock;
    if (parent !== null) parent.lastUse = use; // never this promotion's victim
    const table = this.#table;
    const rid = PROMOTE_RID;
    const epoch = this.#promotions++ >>> 0;
    const pages = this.#promotePage;
    const generations = this.#promoteGeneration;
    if (!table.allocate(1, rid, epoch, loaded.tenant, pages, generations)) {
      if (this.evict(1) === 0 || !table.allocate(1, rid, epoch, loaded.tenant, pages, generations))
        return false;
      if (parent !== null && this.#byKey.get(parent.key) !== parent) {
        table.free(pages[0]!, generations[0]!, rid, epoch);
        return false;
      }
    }
    const page = pages[0]!;
    const generation = generations[0]!;
    const P = this.#pageSize;
    write(page);
    table.stampWriter(page, rid, epoch, P);
    const id = this.#nextId++;
    if (!table.markReady(page, generation, rid, epoch) || !table.share(page, generation, rid, epoch, id, P)) {
      table.free(page, generation, rid, epoch);
      return false;
    }
    table.unref(page, generation);
    this.#add({
      id,
      key: loaded.key,
      parentKey: loaded.parentKey,
      page,
      generation,
      tenant: loaded.tenant,
      tokens: Int32Array.from(loaded.tokens),
      parent,
      depth: loaded.depth,
      cacheEpoch: loaded.cacheEpoch,
      children: 0,
      lastUse: use,
    });
    return true;
  }

  /**
   * Frees up to `count` cached pages no request references, least recently used first (leaves of
   * a chain before their parents, so a cached run stays a run). Returns the pages freed.
   */
  evict(count: number): number {
    let freed = 0;
    while (freed < count) {
      const victim = this.#victim();
      if (victim === null) break;
      this.#remove(victim);
      freed++;
    }
    this.counters.evictions += freed;
    return freed;
  }

  /** Cached pages with no reference (what `evict` could free now). O(size). */
  evictable(): number {
    let n = 0;
    for (const e of this.#byKey.values()) if (this.#table.refcount(e.page) === 0) n++;
    return n;
  }

  /** Cached pages per tenant, for `/kvfence/nodes` and metrics (allocates). */
  pagesByTenant(): Map<number, number> {
    const out = new Map<number, number>();
    for (const e of this.#byKey.values()) out.set(e.tenant, (out.get(e.tenant) ?? 0) + 1);
    return out;
  }

  /** The cache's entries in LRU order (`page@key` prefixes), for the model checker's state key. */
  snapshot(): string {
    return [...this.#byKey.values()]
      .sort((a, b) => a.lastUse - b.lastUse || b.depth - a.depth)
      .map((e) => `${e.page}@${e.key.slice(0, 8)}`)
      .join(",");
  }

  /**
   * The cache's entries and clocks as plain data (the model checker keeps them with each world it
   * explores); `restore` puts exactly that state back, over the table the entries' pages are in.
   */
  save(): SavedPrefixCache {
    const entries = [...this.#byKey.values()]
      .sort((a, b) => a.depth - b.depth || a.id - b.id)
      .map((e) => ({ ...e, parent: e.parent?.key ?? null, tokens: Array.from(e.tokens) }));
    return { nextId: this.#nextId, clock: this.#clock, entries };
  }

  /** Replaces the cache's state with `saved` (from `save`; the table is restored by its owner). */
  restore(saved: SavedPrefixCache): void {
    this.#byKey.clear();
    this.#byPage.fill(undefined);
    this.#nextId = saved.nextId;
    this.#clock = saved.clock;
    for (const e of saved.entries) {
      const parent = e.parent === null ? null : this.#byKey.get(e.parent)!;
      const entry: Entry = { ...e, parent, tokens: Int32Array.from(e.tokens) };
      this.#byKey.set(e.key, entry);
      this.#byPage[e.page] = entry;
    }
  }

  #victim(): Entry | null {
    let best: Entry | null = null;
    for (const e of this.#byKey.values()) {
      if (e.children > 0 || this.#table.refcount(e.page) !== 0) continue;
      if (best === null || e.lastUse < best.lastUse || (e.lastUse === best.lastUse && e.depth > best.depth))
        best = e;
    }
    return best;
  }

  #add(entry: Entry): void {
    if (entry.parent !== null) entry.parent.children++;
    this.#byKey.set(entry.key, entry);
    this.#byPage[entry.page] = entry;
    this.#observer?.stored(entry);
  }

  #remove(entry: Entry): void {
    this.#observer?.evicting(entry);
    this.#table.evict(entry.page, entry.generation);
    this.#byKey.delete(entry.key);
    this.#byPage[entry.page] = undefined;
    if (entry.parent !== null) entry.parent.children--;
  }
}

function sameTokens(a: Int32Array, b: Int32Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}
