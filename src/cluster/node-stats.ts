/**
 * The router's reading of its nodes' statistics: a stats poll of every node (null for a node that
 * does not answer within `STATS_TIMEOUT_MS`, is lost or is not answering its readiness pings),
 * the per-transfer GB/s and ABORT_ACK latencies the polls bring (drained by /metrics), the sum
 * over the nodes for `stats()` — its counters over every node that ever answered, so that they
 * never go down (`NodeTotals`) — and each node as the dashboard shows it.
 */

import type { NodeStats } from "../links/node-messages.js";
import type { EngineStats, EngineTierStats, NodeView } from "../protocol/engine-api.js";
import { NodeTotals } from "./node-totals.js";
import type { NodeSlot, RouterNode } from "./pair-pool.js";

const STATS_TIMEOUT_MS = 5000;

/** Adds one node's prefix-cache counters and pages to the sum of every node's. */
const NO_PREFIX_CACHE = {
  hits: 0,
  misses: 0,
  hitTokens: 0,
  evictions: 0,
  collisions: 0,
  sharedPages: 0,
  evictablePages: 0,
};

/** The node counters `stats()` sums over every node that ever answered (`NodeTotals`). */
const COUNTED = [
  "tagCheckFailures",
  "preemptions",
  "prefillTokens",
  "forkedSamples",
  "decodeSteps",
  "hits",
  "misses",
  "hitTokens",
  "evictions",
  "collisions",
] as const;

/** A node's KV-tier counters as `NodeTotals` keys. */
function tierCounts(t: EngineTierStats | undefined): Partial<Record<(typeof TIER_COUNTED)[number], number>> {
  if (t === undefined) return {};
  return {
    tierSpills: t.spills,
    tierLoadsRam: t.loads.ram,
    tierLoadsDisk: t.loads.disk,
    tierHitTokensRam: t.hitTokens.ram,
    tierHitTokensDisk: t.hitTokens.disk,
    tierRejectedFormat: t.rejected.format,
    tierRejectedMac: t.rejected.mac,
    tierRejectedOwner: t.rejected.owner,
    tierRejectedEpoch: t.rejected.epoch,
    tierDropped: t.dropped,
  };
}

const TIER_COUNTED = [
  "tierSpills",
  "tierLoadsRam",
  "tierLoadsDisk",
  "tierHitTokensRam",
  "tierHitTokensDisk",
  "tierRejectedFormat",
  "tierRejectedMac",
  "tierRejectedOwner",
  "tierRejectedEpoch",
  "tierDropped",
] as const;

/** `sum` (absent: none yet) plus one node's tier pages and bytes. */
function addTierGauges(sum: EngineTierStats | undefined, t: EngineTierStats): EngineTierStats {
  const out = sum ?? {
    pages: { ram: 0, disk: 0 },
    bytes: { ram: 0, disk: 0 },
    spills: 0,
    loads: { ram: 0, disk: 0 },
    hitTokens: { ram: 0, disk: 0 },
    rejected: { format: 0, mac: 0, owner: 0, epoch: 0 },
    dropped: 0,
  };
  for (const k of ["ram", "disk"] as const) {
    out.pages[k] += t.pages[k];
    out.bytes[k] += t.bytes[k];
  }
  return out;
}

/** The tier counters of every node that ever answered, from their `NodeTotals` keys. */
function tierTotals(
  t: Record<(typeof TIER_COUNTED)[number], number>,
): Omit<EngineTierStats, "pages" | "bytes"> {
  return {
    spills: t.tierSpills,
    loads: { ram: t.tierLoadsRam, disk: t.tierLoadsDisk },
    hitTokens: { ram: t.tierHitTokensRam, disk: t.tierHitTokensDisk },
    rejected: {
      format: t.tierRejectedFormat,
      mac: t.tierRejectedMac,
      owner: t.tierRejectedOwner,
      epoch: t.tierRejectedEpoch,
    },
    dropped: t.tierDropped,
  };
}

/** One node's answer to a poll (null: none). */
export interface NodeAnswer {
  readonly node: RouterNode;
  readonly stats: NodeStats | null;
}

export class NodeStatsPoller {
  readonly #waiters = new Map<number, { node: string; resolve: (s: NodeStats | null) => void }>();
  /** The nodes' counters for `stats()`, kept while a node misses a poll or restarts (never going down). */
  readonly #counted = new NodeTotals();
  /** Per-transfer GB/s and ABORT_ACK latencies drained from the nodes, until `takeObservations`. */
  #gbps: number[] = [];
  #ackSeconds: number[] = [];
  #nextId = 1;

  /** Every node's stats (null for a node that did not answer, is lost or is not answering pings). */
  async poll(slots: readonly NodeSlot[]): Promise<NodeAnswer[]> {
    const all = await Promise.all(
      slots.map(async (s) => ({
        node: s.node,
        // A node that does not answer its pings would hold the scrape for the whole timeout.
        stats: s.lost || !s.answering ? null : await this.#pollOne(s.node),
      })),
    );
    for (const { stats } of all) {
      if (stats === null) continue;
      // One observation per transfer: the writer's (prefill's) view.
      if (stats.role === "prefill") this.#gbps.push(...stats.transferGbps);
      this.#ackSeconds.push(...stats.abortAckSeconds);
    }
    return all;
  }

  /** A node answered poll `id`. */
  answer(id: number, stats: NodeStats): void {
    const waiter = this.#waiters.get(id);
    if (waiter === undefined) return;
    this.#waiters.delete(id);
    waiter.resolve(stats);
  }

  /** Node `id`'s link closed: its polls in flight read null. */
  nodeLost(id: string): void {
    for (const [pollId, waiter] of this.#waiters) {
      if (waiter.node === id) {
        this.#waiters.delete(pollId);
        waiter.resolve(null);
      }
    }
  }

  /** The per-transfer GB/s and ABORT_ACK latencies (seconds) observed since the last call. */
  takeObservations(): { gbps: number[]; abortAckSeconds: number[] } {
    const taken = { gbps: this.#gbps, abortAckSeconds: this.#ackSeconds };
    this.#gbps = [];
    this.#ackSeconds = [];
    return taken;
  }

  /**
   * The sum of a poll's answers for `stats()`: the pages, queues and prefix-cache pages of the
   * nodes that answered, the counters of every node that ever did; `waiting` and `aborts` are the
   * router's. Throws when no node answered.
   */
  sum(
    all: readonly NodeAnswer[],
    router: { readonly waiting: number; readonly aborts: number },
  ): EngineStats {
    const sum: EngineStats = {
      pages: { free: 0, reserved: 0, ready: 0, quarantined: 0, total: 0 },
      queue: { waiting: router.waiting, running: 0, preempted: 0 },
      counters: { tagCheckFailures: 0, preemptions: 0, aborts: 0, promptTokens: 0, completionTokens: 0 },
    };
    let answered = 0;
    let prefixCache = false;
    for (const { node, stats } of all) {
      if (stats === null) continue;
      answered++;
      for (const k of ["free", "reserved", "ready", "quarantined", "total"] as const)
        sum.pages[k] += stats.pages[k];
      for (const k of ["waiting", "running", "preempted"] as const) sum.queue[k] += stats.queue[k];
      const c = stats.prefixCache;
      this.#counted.see(node.id, node.hello.incarnation, {
        tagCheckFailures: stats.counters.tagCheckFailures,
        preemptions: stats.counters.preemptions,
        // Prompt tokens computed (the prefill nodes'), samples forked from one transfer (the decode nodes').
        prefillTokens: stats.counters.prefillTokens ?? 0,
        forkedSamples: stats.counters.forkedSamples ?? 0,
        decodeSteps: stats.role === "decode" ? (stats.counters.decodeSteps ?? 0) : 0,
        ...(c === undefined ? {} : { hits: c.hits, misses: c.misses, hitTokens: c.hitTokens }),
        ...(c === undefined ? {} : { evictions: c.evictions, collisions: c.collisions }),
        ...tierCounts(stats.tiers),
      });
      if (c === undefined) continue;
      prefixCache = true;
      sum.prefixCache ??= { ...NO_PREFIX_CACHE };
      sum.prefixCache.sharedPages += c.sharedPages;
      sum.prefixCache.evictablePages += c.evictablePages;
    }
    if (answered === 0) throw new Error("No node answers");
    // Counters over every node that ever answered: one that misses this poll keeps its last counts.
    const counted = this.#counted.total(COUNTED);
    sum.counters.tagCheckFailures = counted.tagCheckFailures;
    sum.counters.preemptions = counted.preemptions;
    if (prefixCache && sum.prefixCache !== undefined) {
      for (const k of ["hits", "misses", "hitTokens", "evictions", "collisions"] as const)
        sum.prefixCache[k] = counted[k];
    }
    const tiers = this.#sumTiers(all);
    if (tiers !== undefined) sum.tiers = tiers;
    // Aborts are the router's (a client gone, a stop string matched), as on one engine; the nodes'
    // own counts would miss a request aborted before decode ran it and count some twice.
    sum.counters.aborts = router.aborts;
    sum.counters.prefillTokens = counted.prefillTokens;
    sum.counters.forkedSamples = counted.forkedSamples;
    sum.counters.decodeSteps = counted.decodeSteps;
    return sum;
  }

  /** The tiers' pages and bytes of the nodes that answered, their counters of every node that ever did. */
  #sumTiers(all: readonly NodeAnswer[]): EngineTierStats | undefined {
    let sum: EngineTierStats | undefined;
    for (const { stats } of all) if (stats?.tiers !== undefined) sum = addTierGauges(sum, stats.tiers);
    return sum === undefined ? undefined : Object.assign(sum, tierTotals(this.#counted.total(TIER_COUNTED)));
  }

  #pollOne(node: RouterNode): Promise<NodeStats | null> {
    const id = this.#nextId++;
    return new Promise((resolve) => {
      // A node that does not answer a stats poll in time shows as unknown (it is not fenced for it).
      const timer = setTimeout(() => {
        if (this.#waiters.delete(id)) resolve(null);
      }, STATS_TIMEOUT_MS);
      timer.unref();
      this.#waiters.set(id, {
        node: node.id,
        resolve: (s) => {
          clearTimeout(timer);
          resolve(s);
        },
      });
      try {
        node.link.send({ kind: "stats", id });
      } catch {
        this.#waiters.delete(id);
        resolve(null);
      }
    });
  }
}

/** One node's answer as the dashboard shows it: its stats and its guard counters. */
export function nodeView({ node, stats }: NodeAnswer): NodeView {
  const t = stats?.transfer;
  let linkAuth = 0;
  for (const reasons of Object.values(stats?.linkAuthFailures ?? {}))
    for (const n of Object.values(reasons ?? {})) linkAuth += n;
  return {
    id: node.id,
    role: node.hello.role,
    up: stats !== null,
    stats,
    transferBytes: t?.bytes ?? 0,
    guards: {
      tag_check_failures: stats?.counters.tagCheckFailures ?? 0,
      checksum_failures: t?.checksumFailures ?? 0,
      coverage_failures: t?.coverageFailures ?? 0,
      dropped_stale_writes: t?.droppedStaleWrites ?? 0,
      dropped_misaddressed_writes: t?.droppedMisaddressedWrites ?? 0,
      link_auth_failures: linkAuth,
    },
  };
}
