/**
 * The router's KV index (issue #35 item 3, docs/topologies.md "Routing by where the KV lives"):
 * which node holds which cached page, per tenant namespace, fed by the nodes' cache events
 * (src/node/cache-events.ts) — every router keeps its own from the same events.
 *
 * A key is what the events carry: the first `CACHE_EVENT_KEY_CHARS` hex digits of a page's chain
 * key (`prefixBlockKey`, salted with its tenant's namespace), opaque. The index is one map per
 * tenant (key → node → tiers), so a prompt is only ever looked up among its own tenant's keys —
 * even where two tenants' keys coincide (a cache salted without the tenant, `shared-prefix`; keys
 * cut short, `prefix-collision`). That fence is the `route-namespace` guard: with it off (tests
 * only) every tenant shares one namespace, as in KV routers whose block hashes carry no tenant.
 *
 * Bounded: each node's newest `maxKeysPerNode` keys are kept (a stored key is the newest again),
 * the oldest forgotten first — a forgotten key only costs a routing hint. A node lost drops all
 * its keys; a `cache_snapshot` (a router's link to the node just opened) replaces them.
 *
 * `matches` walks a prompt's chain keys from the first and, per node, counts the pages it holds
 * consecutively from the first one (the prefix its cache can reuse), each page weighed by its best
 * tier (`TIER_WEIGHT`).
 */
import { CACHE_EVENT_KEY_CHARS, type CacheEventsMessage, type CacheTier } from "../links/node-messages.js";
import { guardOn, type Safety } from "../protocol/safety.js";

/** Keys kept per node by default (the oldest forgotten first): ~100 B each. */
export const KV_INDEX_KEYS_PER_NODE = 200_000;

/**
 * What a matched page is worth by the tier it is in: a page in the pool or host memory is reused
 * as is (host memory is copied back in microseconds); one on disk costs a read, which on a CPU
 * host is of the order of recomputing it, so it counts half.
 */
export const TIER_WEIGHT: Readonly<Record<CacheTier, number>> = { pool: 1, ram: 1, disk: 0.5 };

const TIER_BIT: Readonly<Record<CacheTier, number>> = { pool: 1, ram: 2, disk: 4 };

/** The weight of the best tier in `bits`. */
function weightOf(bits: number): number {
  return (bits & (TIER_BIT.pool | TIER_BIT.ram)) !== 0 ? TIER_WEIGHT.pool : TIER_WEIGHT.disk;
}

/** One key a node holds: its namespace, key and tiers (bits of `TIER_BIT`). */
interface NodeKey {
  readonly namespace: number;
  readonly key: string;
  bits: number;
}

/** The namespace every tenant shares with the `route-namespace` guard off. */
const SHARED_NAMESPACE = -1;

export class KvIndex {
  readonly #maxKeysPerNode: number;
  readonly #namespaced: boolean;
  /** Per node: its keys, oldest first, by `namespace|key`. */
  readonly #nodes = new Map<string, Map<string, NodeKey>>();
  /** Per namespace: key → node → tier bits. */
  readonly #namespaces = new Map<number, Map<string, Map<string, number>>>();
  /** Keys held over every node (a key two nodes hold counts twice). */
  #size = 0;

  constructor(options: { readonly safety: Safety; readonly maxKeysPerNode?: number }) {
    this.#maxKeysPerNode = options.maxKeysPerNode ?? KV_INDEX_KEYS_PER_NODE;
    this.#namespaced = guardOn(options.safety, "route-namespace");
  }

  /** Keys held over every node. */
  get size(): number {
    return this.#size;
  }

  /** Keys held for `node`. */
  sizeOf(node: string): number {
    return this.#nodes.get(node)?.size ?? 0;
  }

  /** Whether any node holds a key of `tenant`'s namespace (else a prompt's keys need not be computed). */
  knows(tenant: number): boolean {
    return (this.#namespaces.get(this.#namespaceOf(tenant))?.size ?? 0) > 0;
  }

  /** `node`'s cache events: a snapshot replaces what was known of it. */
  apply(node: string, message: CacheEventsMessage): void {
    if (message.kind === "cache_snapshot") this.dropNode(node);
    for (const batch of message.batches) {
      const namespace = this.#namespaceOf(batch.tenant);
      const bit = TIER_BIT[batch.tier];
      if (bit === undefined) continue; // a tier of a newer node: not routed by
      for (const key of batch.removed) this.#remove(node, namespace, key, bit);
      for (const key of batch.stored) this.#add(node, namespace, key, bit);
    }
  }

  /** `node` is lost: nothing of it is known any more. */
  dropNode(node: string): void {
    const keys = this.#nodes.get(node);
    if (keys === undefined) return;
    for (const k of keys.values()) this.#unlink(node, k);
    this.#size -= keys.size;
    this.#nodes.delete(node);
  }

  /**
   * Per node holding at least the first of `keys` (a prompt's chain keys, whole or short, in
   * order) in `tenant`'s namespace: the pages it holds consecutively from the first, weighed by
   * tier (`TIER_WEIGHT`). Nodes holding none are absent.
   */
  matches(tenant: number, keys: readonly string[]): Map<string, number> {
    const out = new Map<string, number>();
    const namespace = this.#namespaces.get(this.#namespaceOf(tenant));
    if (namespace === undefined) return out;
    /** The nodes holding every key so far (null: before the first). */
    let alive: Set<string> | null = null;
    for (const key of keys) {
      const holders = namespace.get(key.slice(0, CACHE_EVENT_KEY_CHARS));
      if (holders === undefined) break;
      const next = new Set<string>();
      for (const node of alive ?? holders.keys()) {
        const bits = holders.get(node);
        if (bits === undefined) continue;
        out.set(node, (out.get(node) ?? 0) + weightOf(bits));
        next.add(node);
      }
      if (next.size === 0) break;
      alive = next;
    }
    return out;
  }

  #namespaceOf(tenant: number): number {
    return this.#namespaced ? tenant : SHARED_NAMESPACE;
  }

  #add(node: string, namespace: number, key: string, bit: number): void {
    let keys = this.#nodes.get(node);
    if (keys === undefined) {
      keys = new Map();
      this.#nodes.set(node, keys);
    }
    const id = `${namespace}|${key}`;
    let k = keys.get(id);
    if (k === undefined) {
      k = { namespace, key, bits: 0 };
      this.#size++;
    } else keys.delete(id); // the newest again
    k.bits |= bit;
    keys.set(id, k);
    let holders = this.#namespaces.get(namespace);
    if (holders === undefined) {
      holders = new Map();
      this.#namespaces.set(namespace, holders);
    }
    let nodes = holders.get(key);
    if (nodes === undefined) {
      nodes = new Map();
      holders.set(key, nodes);
    }
    nodes.set(node, k.bits);
    if (keys.size > this.#maxKeysPerNode) {
      const [oldestId, oldest] = keys.entries().next().value!;
      keys.delete(oldestId);
      this.#size--;
      this.#unlink(node, oldest);
    }
  }

  #remove(node: string, namespace: number, key: string, bit: number): void {
    const keys = this.#nodes.get(node);
    const id = `${namespace}|${key}`;
    const k = keys?.get(id);
    if (keys === undefined || k === undefined) return;
    k.bits &= ~bit;
    if (k.bits !== 0) {
      this.#namespaces.get(namespace)?.get(key)?.set(node, k.bits);
      return;
    }
    keys.delete(id);
    this.#size--;
    this.#unlink(node, k);
  }

  /** `k` of `node` leaves its namespace's map. */
  #unlink(node: string, k: NodeKey): void {
    const holders = this.#namespaces.get(k.namespace);
    const nodes = holders?.get(k.key);
    if (holders === undefined || nodes === undefined) return;
    nodes.delete(node);
    if (nodes.size === 0) holders.delete(k.key);
    if (holders.size === 0) this.#namespaces.delete(k.namespace);
  }
}
