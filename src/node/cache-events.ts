/**
 * A node's cache events (issue #35 item 3, docs/topologies.md "Routing by where the KV lives"): the
 * publisher that tells every router which chain keys the node's caches hold, so a router can send
 * a prompt to the node that holds its longest prefix (src/cluster/kv-index.ts keeps them).
 *
 * It is the prefix cache's observer (`PrefixCache.observe`): a page stored in the pool is a key
 * stored in tier `pool`, a page about to be evicted a key removed from it. The KV tiers report
 * their own pages (spilled to host memory or disk, loaded back, dropped) through `record`, with
 * their tier. What it sends is opaque: per tenant and tier, the first `CACHE_EVENT_KEY_CHARS` hex
 * digits of each chain key — never a token id; the keys are salted with the tenant's namespace, so
 * a router learns nothing of a prompt it cannot compute itself.
 *
 * Changes are coalesced: the first change after a message starts a `CACHE_EVENT_INTERVAL_MS`
 * timer, and everything changed until it fires goes in one `cache_events` message (the newest
 * state of each key wins), so a node sends at most one per interval whatever its load. It goes to
 * every router (the node's `toRouter` with no rid: all of them). A router whose link opens gets
 * `snapshot()` first, everything held now, which replaces what it knew of the node; changes still
 * pending then reach it again in the next message (stored and removed are idempotent).
 */
import {
  CACHE_EVENT_KEY_CHARS,
  type CacheEventBatch,
  type CacheEventsMessage,
  type CacheTier,
  type FromNode,
} from "../links/node-messages.js";
import type { CachedPage, PrefixCacheObserver } from "../protocol/prefix-cache.js";

/** At most one `cache_events` message per this many ms per node. */
export const CACHE_EVENT_INTERVAL_MS = 50;
/** Keys per message of a snapshot: a larger set continues in `cache_events` messages. */
const SNAPSHOT_CHUNK_KEYS = 50_000;

/** Batches being built, by `tier|tenant`. */
type Batches = Map<string, CacheEventBatch & { stored: string[]; removed: string[] }>;

/** A key's place: its tenant, tier and (short) key. */
interface Held {
  readonly tenant: number;
  readonly tier: CacheTier;
  readonly key: string;
}

export class CacheEventPublisher implements PrefixCacheObserver {
  readonly #send: (message: FromNode) => void;
  readonly #intervalMs: number;
  /** Everything held now, by `tier|tenant|key`. */
  readonly #held = new Map<string, Held>();
  /** Changes not sent yet, by `tier|tenant|key`: its newest state (true: held). */
  readonly #pending = new Map<string, Held & { present: boolean }>();
  #timer: NodeJS.Timeout | null = null;
  #closed = false;
  /** `cache_events` messages sent (tests, and the coalescing's proof). */
  messages = 0;

  constructor(send: (message: FromNode) => void, intervalMs = CACHE_EVENT_INTERVAL_MS) {
    this.#send = send;
    this.#intervalMs = intervalMs;
  }

  stored(page: CachedPage): void {
    this.record(page.tenant, page.key, "pool", true);
  }

  evicting(page: CachedPage): void {
    this.record(page.tenant, page.key, "pool", false);
  }

  /**
   * `tier` gained (`present`) or lost a page of `tenant` whose chain key is `key` (`prefixBlockKey`,
   * whole or short). The KV tiers call this for what they spill, load and drop.
   */
  record(tenant: number, key: string, tier: CacheTier, present: boolean): void {
    if (this.#closed) return;
    const short = key.slice(0, CACHE_EVENT_KEY_CHARS);
    const id = `${tier}|${tenant}|${short}`;
    const held = { tenant, tier, key: short };
    if (present) this.#held.set(id, held);
    else this.#held.delete(id);
    this.#pending.set(id, { ...held, present });
    if (this.#timer === null) {
      this.#timer = setTimeout(() => this.flush(), this.#intervalMs);
      this.#timer.unref();
    }
  }

  /** Keys held now, over every tier. */
  get size(): number {
    return this.#held.size;
  }

  /** The messages that give a router whose link just opened everything held now (at least one). */
  snapshot(): CacheEventsMessage[] {
    const out: CacheEventsMessage[] = [];
    let chunk: Batches = new Map();
    let keys = 0;
    const push = (): void => {
      out.push({ kind: out.length === 0 ? "cache_snapshot" : "cache_events", batches: [...chunk.values()] });
      chunk = new Map();
      keys = 0;
    };
    for (const h of this.#held.values()) {
      if (keys === SNAPSHOT_CHUNK_KEYS) push();
      batchOf(chunk, h).stored.push(h.key);
      keys++;
    }
    push();
    return out;
  }

  /** Sends the pending changes now (the timer's job; tests call it to skip the wait). */
  flush(): void {
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
    if (this.#pending.size === 0 || this.#closed) return;
    const batches: Batches = new Map();
    for (const p of this.#pending.values()) {
      const batch = batchOf(batches, p);
      (p.present ? batch.stored : batch.removed).push(p.key);
    }
    this.#pending.clear();
    this.messages++;
    this.#send({ kind: "cache_events", batches: [...batches.values()] });
  }

  close(): void {
    this.#closed = true;
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
  }
}

/** The batch of `h`'s tenant and tier in `batches`, created empty. */
function batchOf(batches: Batches, h: Held): CacheEventBatch & { stored: string[]; removed: string[] } {
  const id = `${h.tier}|${h.tenant}`;
  let batch = batches.get(id);
  if (batch === undefined) {
    batch = { tenant: h.tenant, tier: h.tier, stored: [], removed: [] };
    batches.set(id, batch);
  }
  return batch;
}
