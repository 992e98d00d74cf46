/**
 * A node changes role at run time (`kvfence role NODE prefill|decode`, docs/topologies.md, "Roles
 * that follow the load"): between the old role's node object and the new one's, over the same
 * engine and pool, the pool is scrubbed — the prefix cache emptied (every cached page evicted),
 * then every page checked FREE and every byte of KV data zeroed — so no page of the old role's KV
 * is there for the new role to read, whatever its page tags say. The node server
 * (src/node/node-server.ts) does the rest: it stops taking work, fences its routers and transfer
 * peers, and builds the new role's node object (src/node/node-host.ts, `roleNode`).
 */
import type { Engine } from "../engine/engine.js";
import { KvfenceError } from "../lib/errors.js";

/** What a scrub did, for the node's log. */
export interface ScrubReport {
  /** Pages the prefix cache held and evicted. */
  readonly cachedPages: number;
  /** Pages of the pool zeroed (all of them). */
  readonly pages: number;
}

/**
 * Empties `engine`'s prefix cache and zeroes its whole KV pool. Throws (touching no data) when a
 * page is not FREE once the cache is empty: something still holds it, and its KV is not this
 * call's to wipe.
 */
export function scrubPool(engine: Engine): ScrubReport {
  const cache = engine.prefixCache;
  const cachedPages = cache === null ? 0 : cache.evict(cache.size);
  const pool = engine.pool;
  const counts = pool.table.counts();
  if (counts.free !== counts.total)
    throw new KvfenceError(
      "internal",
      `Cannot scrub the KV pool for a role switch while pages are in use (reserved ${counts.reserved}, ready ${counts.ready}, quarantined ${counts.quarantined}): ${counts.total - counts.free} pages`,
    );
  pool.data.fill(0);
  return { cachedPages, pages: pool.numPages };
}

/** Resolves once `done()` holds, polling every `everyMs`; false when `timeoutMs` passed first. */
export async function waitUntil(done: () => boolean, timeoutMs: number, everyMs = 50): Promise<boolean> {
  const until = Date.now() + timeoutMs;
  while (!done()) {
    if (Date.now() >= until) return false;
    await new Promise((r) => setTimeout(r, everyMs));
  }
  return true;
}
