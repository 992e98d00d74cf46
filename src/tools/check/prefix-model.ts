/**
 * The prefix cache's model (docs/protocol.md §5a): the real `PrefixCache` over a real
 * `OwnershipTable` of a small pool (5 pages of 2 tokens), explored in every order of three requests of two
 * tenants — each arrives (looks its prompt up, leases its own pages, computes them, caches its full
 * pages, reads every page it holds), finishes (drops its references, frees its own pages) or is
 * aborted mid-way — interleaved with evictions under pool pressure. The pool's page contents are
 * modelled as the prefix each page's KV was computed from (KV of a position depends on every token
 * before it) and the tenant that computed it.
 *
 * Invariants, checked after every step, on every page a live request's block table holds:
 * - **P1** a shared page is read only by a request of its tenant that holds a reference;
 * - **P2** a referenced shared page is never freed, rewritten or handed out (it stays SHARED at the
 *   generation the reader holds, with the content it had);
 * - **P3** a hit serves exactly the request's own prefix (never another prompt's KV).
 * The read check of the engine (`OwnershipTable.checkStep`, the `page-tags` guard) runs before the
 * read: a request it refuses ends with an error and reads nothing.
 *
 * Faults: `shared-prefix` (the salt is the client's field alone, `tenant-salt` off) breaks P1;
 * `prefix-collision` (keys cut to 2 bits, `prefix-tokens` off) breaks P3. With the guards kept the
 * search is complete and clean.
 *
 * With the KV tiers (`tiers: true`, the tier faults), an abstract tier below the pool keeps what
 * evictions spill, a request's pages load back from it (promoted into the cache) before it arrives,
 * an adversary corrupts or plants records, and (under `stale-epoch`) tenant 1's cache epoch is raised
 * once across a restart (src/tools/check/tier-model.ts). The invariants cover the loaded pages: P3 compares the
 * whole content (tenant, epoch and tokens), so a page of another tenant, of before the rotation or
 * with flipped bytes breaks it. Faults: `tier-corrupt` (`tier-mac` off), `tier-planted` (`tier-owner`
 * off), `stale-epoch` (`tier-epoch` off), `spill-race` (`tier-spill-copy` off).
 */

import { OwnershipTable, PageState } from "../../kvcache/ownership-table.js";
import { PrefixCache, type PromotedPage } from "../../protocol/prefix-cache.js";
import { prefixBlockKey, prefixCacheSalt, prefixRootKey } from "../../protocol/prefix-key.js";
import { faultOn, guardOn, makeSafety, type Safety } from "../../protocol/safety.js";
import type { Counterexample, ExploreResult } from "./explore.js";
import { AbstractTier, type TierAction } from "./tier-model.js";

const PAGE_SIZE = 2;
const POOL_PAGES = 5;
/** With the tiers, a pool of 4: a finished prompt's cached pages are evicted by the next one. */
const TIER_POOL_PAGES = 4;

interface ModelRequest {
  readonly tenant: number;
  readonly clientSalt: string | null;
  readonly tokens: readonly number[];
}

/** Requests whose prompts share pages across and within tenants. */
const REQUESTS: readonly ModelRequest[] = [
  { tenant: 0, clientSalt: null, tokens: [11, 12, 13, 14, 15] },
  { tenant: 1, clientSalt: null, tokens: [11, 12, 13, 14, 16] },
  // Its second page collides with request 0's under 2-bit keys (prefix-collision).
  { tenant: 0, clientSalt: null, tokens: [11, 12, 21, 22, 26] },
];

/** With the tiers: tenant 1's second prompt shares its first two pages with its first (a load). */
const TIER_REQUESTS: readonly ModelRequest[] = [
  { tenant: 0, clientSalt: null, tokens: [11, 12, 13, 14, 15] },
  { tenant: 1, clientSalt: null, tokens: [11, 12, 13, 14, 16] },
  { tenant: 1, clientSalt: null, tokens: [11, 12, 13, 14, 17] },
];

type Action =
  | { readonly kind: "arrive"; readonly r: number }
  | { readonly kind: "finish"; readonly r: number }
  | { readonly kind: "abort"; readonly r: number }
  | { readonly kind: "evict" }
  | TierAction;

/** One request's block table (the cache's `CacheBlockTable`). */
class Table {
  readonly pages = new Int32Array(8);
  readonly generations = new Uint32Array(8);
  readonly shared = new Uint8Array(8);
  length = 0;
  push(page: number, generation: number, shared = false): void {
    this.pages[this.length] = page;
    this.generations[this.length] = generation;
    this.shared[this.length] = shared ? 1 : 0;
    this.length++;
  }
}

interface Live {
  readonly table: Table;
  /** What each held page's content was when the request read it. */
  readonly seen: string[];
}

/** The world after a sequence of actions (rebuilt from scratch: the state is the action list). */
class PrefixWorld {
  readonly poolPages: number;
  table: OwnershipTable;
  cache: PrefixCache;
  /** The prefix (tenant[@epoch]|tokens) each page's KV was computed from. */
  content: string[];
  readonly live = new Map<number, Live>();
  readonly ended = new Set<number>();
  readonly safety: Safety;
  /** The abstract tier below the pool (null: the prefix cache alone), and each tenant's cache epoch. */
  readonly tier: AbstractTier | null;
  readonly epochs = [0, 0];
  rotated = false;
  /** Requests whose pages were loaded from the tier (once each: the pool's generations never repeat). */
  readonly loaded = new Set<number>();
  readonly requests: readonly ModelRequest[];
  readonly #out = { pages: new Int32Array(8), generations: new Uint32Array(8) };

  constructor(safety: Safety, tiered: boolean) {
    this.safety = safety;
    this.tier = tiered ? new AbstractTier(safety) : null;
    this.requests = tiered ? TIER_REQUESTS : REQUESTS;
    this.poolPages = tiered ? TIER_POOL_PAGES : POOL_PAGES;
    this.table = new OwnershipTable(this.poolPages);
    this.content = new Array<string>(this.poolPages).fill("-");
    this.cache = this.#newCache();
  }

  #newCache(): PrefixCache {
    const tier = this.tier;
    return new PrefixCache(
      this.table,
      PAGE_SIZE,
      this.safety,
      tier === null
        ? undefined
        : { stored: () => {}, evicting: (page) => tier.spill(page, this.content[page.page]!) },
    );
  }

  enabled(): Action[] {
    const out: Action[] = [];
    this.requests.forEach((_, r) => {
      if (this.live.has(r)) out.push({ kind: "finish", r }, { kind: "abort", r });
      else if (!this.ended.has(r)) {
        out.push({ kind: "arrive", r });
        if (this.tier !== null && !this.loaded.has(r) && this.#below(r).length > 0)
          out.push({ kind: "load", r });
      }
    });
    if (this.cache.evictable() > 0) out.push({ kind: "evict" });
    if (this.tier !== null) {
      out.push(...this.tier.adversary());
      // A rotation is an operator's act, explored where its fault is (to keep each search small).
      if (faultOn(this.safety, "stale-epoch") && !this.rotated && this.live.size === 0)
        out.push({ kind: "rotate" });
    }
    return out;
  }

  apply(a: Action): string {
    const event = this.#apply(a);
    this.tier?.settle((page) => this.content[page]!);
    return event;
  }

  #apply(a: Action): string {
    if (a.kind === "evict") return `evict: ${this.cache.evict(1)} page`;
    if (a.kind === "arrive") return this.#arrive(a.r);
    if (a.kind === "load") return this.#load(a.r);
    if (a.kind === "rotate") return this.#rotate();
    if (a.kind === "corrupt" || a.kind === "plant") return this.tier!.write(a);
    const live = this.live.get(a.r)!;
    if (a.kind === "finish") this.#cacheAll(a.r, live.table);
    this.#release(a.r, live.table);
    this.live.delete(a.r);
    this.ended.add(a.r);
    return `request ${a.r} ${a.kind === "finish" ? "finishes (caches its full pages, drops its references)" : "is aborted"}`;
  }

  #salt(r: number): string {
    const q = this.requests[r]!;
    return prefixCacheSalt(this.safety, q.tenant, q.clientSalt, "", this.epochs[q.tenant]);
  }

  /** The pages of request `r` after the pool's run that the tier holds, in chain order (`TierPrefetch`). */
  #below(r: number): PromotedPage[] {
    const q = this.requests[r]!;
    const out: PromotedPage[] = [];
    let parentKey = prefixRootKey(this.#salt(r));
    for (let j = 0; j < Math.floor((q.tokens.length - 1) / PAGE_SIZE); j++) {
      const tokens = Int32Array.from(q.tokens.slice(j * PAGE_SIZE, (j + 1) * PAGE_SIZE));
      const key = prefixBlockKey(parentKey, tokens, this.safety);
      if (out.length === 0 && this.cache.holds(key)) {
        parentKey = key;
        continue;
      }
      if (!this.tier!.records.has(key)) break;
      out.push({ key, parentKey, tenant: q.tenant, tokens, cacheEpoch: this.epochs[q.tenant]!, depth: j });
      parentKey = key;
    }
    return out;
  }

  /** Request `r`'s pages come back from the tier, verified, and are promoted (before it arrives). */
  #load(r: number): string {
    this.loaded.add(r);
    const loaded: string[] = [];
    for (const page of this.#below(r)) {
      const content = this.tier!.load(page);
      if (content === null) {
        loaded.push("a record refused (deleted)");
        break;
      }
      const write = (p: number): void => {
        this.content[p] = content;
      };
      if (!this.cache.promote(page, write)) break;
      loaded.push(content);
    }
    return `tenant ${this.requests[r]!.tenant} request ${r}'s pages load from the tier: ${loaded.join(", ")}`;
  }

  /** A restart with tenant 1's cache epoch raised: the pool empties, the tier stays. */
  #rotate(): string {
    this.rotated = true;
    this.epochs[1] = 1;
    this.table = new OwnershipTable(this.poolPages);
    this.cache = this.#newCache();
    this.content = new Array<string>(this.poolPages).fill("-");
    return "the node restarts with tenant 1's cache_epoch raised to 1 (the pool empties, the tier stays)";
  }

  #arrive(r: number): string {
    const q = this.requests[r]!;
    const t = new Table();
    const tokens = Int32Array.from(q.tokens);
    const hit = this.cache.lookup(this.#salt(r), tokens, Math.floor((tokens.length - 1) / PAGE_SIZE), t);
    const need = Math.ceil(tokens.length / PAGE_SIZE) - hit;
    const label = `tenant ${q.tenant} request ${r} [${q.tokens.join(",")}]${q.clientSalt === null ? "" : ` cache_salt "${q.clientSalt}"`}: hits ${hit} page(s)`;
    if (need > this.table.counts().free) this.cache.evict(need - this.table.counts().free);
    if (!this.table.allocate(need, r, 0, q.tenant, this.#out.pages, this.#out.generations)) {
      this.#release(r, t);
      this.ended.add(r);
      return `${label}, pool exhausted: refused`;
    }
    for (let i = 0; i < need; i++) t.push(this.#out.pages[i]!, this.#out.generations[i]!);
    // The read check of the first step (page tags), then the compute of its own pages.
    if (
      guardOn(this.safety, "page-tags") &&
      this.table.checkStep(
        PAGE_SIZE,
        t.pages,
        t.generations,
        t.length,
        r,
        0,
        hit * PAGE_SIZE,
        tokens.length,
        t.shared,
        q.tenant,
      ) >= 0
    ) {
      this.#release(r, t);
      this.ended.add(r);
      return `${label}; the page-tag check refuses a page: request fails, reads nothing`;
    }
    for (let j = hit; j < t.length; j++) {
      const page = t.pages[j]!;
      const filled = Math.min(PAGE_SIZE, tokens.length - j * PAGE_SIZE);
      this.content[page] = prefixOf(q, (j + 1) * PAGE_SIZE, this.epochs[q.tenant]);
      this.table.stampWriter(page, r, 0, filled);
      this.table.markReady(page, t.generations[j]!, r, 0);
    }
    this.cache.insert(this.#salt(r), tokens, Math.floor(tokens.length / PAGE_SIZE), t, {
      rid: r,
      epoch: 0,
      tenant: q.tenant,
      cacheEpoch: this.epochs[q.tenant]!,
    });
    const seen: string[] = [];
    for (let j = 0; j < t.length; j++) seen.push(this.content[t.pages[j]!]!);
    this.live.set(r, { table: t, seen });
    return label;
  }

  #cacheAll(r: number, t: Table): void {
    const q = this.requests[r]!;
    this.cache.insert(this.#salt(r), Int32Array.from(q.tokens), Math.floor(q.tokens.length / PAGE_SIZE), t, {
      rid: r,
      epoch: 0,
      tenant: q.tenant,
      cacheEpoch: this.epochs[q.tenant]!,
    });
  }

  #release(r: number, t: Table): void {
    for (let j = 0; j < t.length; j++) {
      if (t.shared[j] === 1) this.table.unref(t.pages[j]!, t.generations[j]!);
      else this.table.free(t.pages[j]!, t.generations[j]!, r, 0);
    }
    t.length = 0;
  }

  /** The first invariant a live request breaks, or null. */
  violation(): { invariant: string; message: string } | null {
    for (const [r, live] of this.live) {
      const q = this.requests[r]!;
      const t = live.table;
      for (let j = 0; j < t.length; j++) {
        const page = t.pages[j]!;
        if (t.shared[j] === 1 && this.table.tenant(page) !== q.tenant)
          return {
            invariant: "P1",
            message: `tenant ${q.tenant}'s request ${r} reads shared page ${page} of tenant ${this.table.tenant(page)}: another tenant's KV (and a hit's timing) serves it`,
          };
        if (
          t.shared[j] === 1 &&
          (this.table.state(page) !== PageState.SHARED ||
            this.table.generation(page) !== t.generations[j] ||
            this.content[page] !== live.seen[j])
        )
          return {
            invariant: "P2",
            message: `request ${r} holds a reference to page ${page}, which was freed, rewritten or handed out`,
          };
        // The whole content: its own tokens, tenant and (after a rotation) epoch, never flipped bytes.
        const want = prefixOf(q, (j + 1) * PAGE_SIZE, this.epochs[q.tenant]);
        if (live.seen[j] !== want)
          return {
            invariant: "P3",
            message: `request ${r}'s page ${j} holds the KV of prefix ${live.seen[j]}, not of its own ${want}: another prompt's KV serves it`,
          };
      }
    }
    return null;
  }

  /** Everything the future depends on: pages, contents, live and ended requests, the cache's LRU. */
  signature(): string {
    const live = [...this.live.entries()]
      .sort((a, b) => a[0] - b[0])
      .map(([r, l]) => `${r}:${Array.from(l.table.pages.subarray(0, l.table.length)).join(".")}`);
    return `${this.describe()}|${Array.from(this.table.bytes).join(",")}|${live.join(";")}|${[...this.ended].sort().join(",")}|${this.cache.snapshot()}|${this.tier === null ? "" : `${this.tier.signature()}|${this.epochs.join(",")}|${[...this.loaded].sort().join(",")}`}`;
  }

  describe(): string {
    const parts: string[] = [];
    for (let p = 0; p < this.poolPages; p++) {
      const s = this.table.state(p);
      const tag = ["F", "R", "Y", "Q", "S"][s]!;
      parts.push(
        `${tag}${s === PageState.SHARED ? `:t${this.table.tenant(p)}x${this.table.refcount(p)}` : ""}(${this.content[p]})`,
      );
    }
    return this.tier === null ? parts.join(" ") : `${parts.join(" ")} ; ${this.tier.describe()}`;
  }
}

/** `tenant[@epoch]|tokens` of the first `n` tokens (clipped to the prompt), under the tenant's cache epoch. */
function prefixOf(q: ModelRequest, n: number, epoch = 0): string {
  return `t${q.tenant}${epoch === 0 ? "" : `@${epoch}`}|${q.tokens.slice(0, Math.min(n, q.tokens.length)).join(",")}`;
}

/**
 * Explores every order of the actions, breadth first (shortest counterexample first), up to
 * `maxStates` action sequences; the world is rebuilt from each sequence.
 */
export function explorePrefixCache(options: {
  readonly faults: readonly string[];
  readonly disabledGuards: readonly string[];
  readonly maxStates?: number;
  /** The KV tiers below the pool (tier-model.ts). */
  readonly tiers?: boolean;
}): ExploreResult {
  const started = performance.now();
  const safety = makeSafety({ faults: options.faults, disabledGuards: options.disabledGuards });
  const tiered = options.tiers === true;
  const maxStates = options.maxStates ?? 200_000;
  let frontier: Action[][] = [[]];
  const seen = new Set<string>();
  let states = 1;
  let transitions = 0;
  let depth = 0;
  while (frontier.length > 0) {
    const next: Action[][] = [];
    for (const path of frontier) {
      const world = replay(path, safety, tiered);
      for (const a of world.enabled()) {
        transitions++;
        const extended = [...path, a];
        const after = replay(extended, safety, tiered);
        const v = after.violation();
        if (v !== null) {
          return {
            states,
            transitions,
            depth: depth + 1,
            elapsedMs: performance.now() - started,
            complete: false,
            counterexample: trace(extended, safety, tiered, v),
          };
        }
        const key = after.signature();
        if (seen.has(key)) continue;
        seen.add(key);
        states++;
        if (states >= maxStates)
          return {
            states,
            transitions,
            depth,
            elapsedMs: performance.now() - started,
            complete: false,
            counterexample: null,
          };
        next.push(extended);
      }
    }
    frontier = next;
    if (next.length > 0) depth++;
  }
  return {
    states,
    transitions,
    depth,
    elapsedMs: performance.now() - started,
    complete: true,
    counterexample: null,
  };
}

function replay(path: readonly Action[], safety: Safety, tiered: boolean): PrefixWorld {
  const world = new PrefixWorld(safety, tiered);
  for (const a of path) world.apply(a);
  return world;
}

function trace(
  path: readonly Action[],
  safety: Safety,
  tiered: boolean,
  v: { invariant: string; message: string },
): Counterexample {
  const world = new PrefixWorld(safety, tiered);
  const initialPools = `pool of ${world.poolPages} pages (page size ${PAGE_SIZE}): ${world.describe()}`;
  const steps = path.map((a) => {
    const event = world.apply(a);
    return { event, pools: world.describe() };
  });
  return { violation: v, initialPools, steps };
}
