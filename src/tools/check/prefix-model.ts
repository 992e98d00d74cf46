/**
 * The prefix cache's tenant fence, checked by a small explicit-state model of its own (the transfer
 * protocol model has no prefix cache): two tenants send prompts that share their first block, in
 * every order, each with or without a client-supplied cache salt (tenant 1 forging tenant 0's salt
 * too). A lookup hits only blocks whose key the same salt produced; the invariant is that **a hit
 * never serves a block cached for another tenant** (docs/design.md §3, docs/prior-art.md H9).
 */

import { prefixBlockKey, prefixCacheSalt } from "../../protocol/prefix-key.js";
import { makeSafety, type Safety } from "../../protocol/safety.js";
import type { Counterexample, ExploreResult } from "./explore.js";

interface PrefixRequest {
  readonly tenant: number;
  readonly clientSalt: string | null;
  readonly tokens: readonly number[];
}

const PREFIX_REQUESTS: readonly PrefixRequest[] = [
  { tenant: 0, clientSalt: null, tokens: [11, 12] },
  { tenant: 1, clientSalt: null, tokens: [11, 12] },
  { tenant: 1, clientSalt: "tenant:0", tokens: [11, 12] },
];

/** Explores every order of the requests; stops at the first cross-tenant hit. */
export function explorePrefixCache(keepGuards: boolean): ExploreResult {
  const started = performance.now();
  const safety: Safety = keepGuards
    ? makeSafety({ faults: ["shared-prefix"] })
    : makeSafety({ faults: ["shared-prefix"], disabledGuards: ["tenant-salt"] });
  // State: the order of requests served so far (the cache is a function of it).
  let frontier: number[][] = [[]];
  let states = 1;
  let transitions = 0;
  let depth = 0;
  while (frontier.length > 0) {
    const next: number[][] = [];
    for (const order of frontier) {
      for (let i = 0; i < PREFIX_REQUESTS.length; i++) {
        if (order.includes(i)) continue;
        transitions++;
        const path = [...order, i];
        const cex = serve(path, safety);
        if (cex !== null) {
          return {
            states,
            transitions,
            depth: depth + 1,
            elapsedMs: performance.now() - started,
            complete: false,
            counterexample: cex,
          };
        }
        next.push(path);
        states++;
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

function serve(order: readonly number[], safety: Safety): Counterexample | null {
  const cache = new Map<string, number>();
  const steps: { event: string; pools: string }[] = [];
  for (const i of order) {
    const r = PREFIX_REQUESTS[i]!;
    const salt = prefixCacheSalt(safety, r.tenant, r.clientSalt);
    const key = prefixBlockKey(salt, r.tokens);
    const owner = cache.get(key);
    const label = `tenant ${r.tenant} sends prompt [${r.tokens.join(",")}]${r.clientSalt === null ? "" : ` with cache_salt "${r.clientSalt}"`}: block key ${key}`;
    if (owner !== undefined && owner !== r.tenant) {
      steps.push({ event: `${label} HITS the block cached for tenant ${owner}`, pools: describe(cache) });
      return {
        violation: {
          invariant: "1",
          message: `Tenant ${r.tenant}'s prompt hit a prefix-cache block of tenant ${owner}: another tenant's KV (and the timing of a hit) serves it`,
        },
        initialPools: "prefix cache: empty",
        steps,
      };
    }
    if (owner === undefined) cache.set(key, r.tenant);
    steps.push({
      event: `${label} ${owner === undefined ? "misses, caches it" : "hits its own tenant's block"}`,
      pools: describe(cache),
    });
  }
  return null;
}

function describe(cache: Map<string, number>): string {
  return `prefix cache: ${[...cache].map(([k, t]) => `${k}→tenant ${t}`).join(", ")}`;
}
