/**
 * The disaggregated topology's metrics in the router's /metrics (prom-client, in the router's
 * registry), aggregated from the nodes on each scrape (`NodeStats`, polled by a read added to the
 * router's `MetricsScrape` after the engine's): bytes transferred and a GB/s histogram per transfer,
 * checksum and coverage failures, dropped stale and misaddressed writes, quarantined pages,
 * ABORT_ACK latency, and pages and queue gauges per node and role; and the router's own refusals of
 * nodes it dialled; its KV index's size and routing decisions by reason; its migrations mid-stream. The GB/s and ABORT_ACK observations come with the polls (one per transfer or
 * abort, drained at the scrape), so they go to prom-client's `Histogram` as they are.
 */
import { exponentialBuckets, Histogram } from "prom-client";
import { type MetricsScrape, setCounter } from "../lib/metrics-scrape.js";
import type { PhaseMetrics, PhaseSource } from "../lib/phase-histograms.js";
import type { NodeStats } from "../links/node-messages.js";
import type { DisaggregatedEngine } from "./disaggregated-engine.js";
import { NodeTotals } from "./node-totals.js";
import type { RoutingReport } from "./pair-pool.js";
import { ROLES, RoleLoadMeter, type RolesLoad } from "./role-load.js";

/** Where the cluster's metrics join the router's (`RouterMetrics`): its scrape's reads and per-phase families. */
export interface ScrapeTarget {
  /** The reads of each scrape: the cluster's is added after the engine's. */
  readonly scrape: MetricsScrape;
  readonly phases: PhaseMetrics;
}

export function registerClusterMetrics(router: ScrapeTarget, engine: DisaggregatedEngine): void {
  const metrics = clusterMetrics(router.scrape);
  // Each decode node's transfer counts and each node's link refusals, kept while a node misses a
  // scrape, is lost or restarts, so no counter goes down.
  const transfers = new NodeTotals();
  const linkAuth = new NodeTotals();
  // Each role's load (role-load.ts), its queue wait since the previous scrape.
  const roles = new RoleLoadMeter();
  // The per-phase histograms of the router and of each node that answered this scrape.
  let phases: PhaseSource[] = [];
  router.phases.add(() => phases);
  router.scrape.add(async () => {
    phases = [{ node: "router", role: "router", snapshot: engine.phases.snapshot() }];
    const queue: Queues = { prefill: { waiting: 0, running: 0 }, decode: { waiting: 0, running: 0 } };
    const answers = await engine.nodeStats();
    collectRoles(metrics, roles.read(answers));
    for (const { node, stats } of answers) {
      const role = node.hello.role;
      metrics.nodeUp.set({ node: node.id, role }, stats === null ? 0 : 1);
      if (stats === null) continue;
      if (stats.phases !== undefined) phases.push({ node: node.id, role, snapshot: stats.phases });
      linkAuth.see(node.id, node.hello.incarnation, linkAuthCounts(stats));
      collectNode(metrics, { id: node.id, role }, stats, linkAuth.of(node.id));
      queue[role].waiting += stats.queue.waiting;
      queue[role].running += stats.queue.running;
      if (role === "decode") transfers.see(node.id, node.hello.incarnation, { ...stats.transfer });
    }
    const observed = engine.takeObservations();
    for (const v of observed.gbps) metrics.gbps.observe(v);
    for (const v of observed.abortAckSeconds) metrics.ackLatency.observe(v);
    for (const role of ["prefill", "decode"] as const) {
      for (const state of ["waiting", "running"] as const)
        metrics.nodeQueue.set({ role, state }, queue[role][state]);
    }
    metrics.transfers(transfers.total(TRANSFER_TOTALS));
    for (const [reason, n] of Object.entries(engine.dialRefusals))
      setCounter(metrics.dialRefusals, n, { reason });
    collectRouting(metrics, engine.routing());
    collectMigrations(metrics, engine);
  });
}

/** What an autoscaler reads per role (docs/api.md, "Metrics per role"). */
function collectRoles(metrics: ClusterMetrics, load: RolesLoad): void {
  for (const role of ROLES) {
    const l = load[role];
    metrics.roleNodes.set({ role }, l.nodes);
    metrics.roleQueueDepth.set({ role }, l.waiting);
    metrics.roleQueueWait.set({ role }, l.waitSeconds);
    metrics.rolePoolUsed.set({ role }, l.poolUsed);
  }
}

/** The router's moves and migrations by reason and result (migration.ts). */
function collectMigrations(metrics: ClusterMetrics, engine: DisaggregatedEngine): void {
  for (const { reason, result, count } of engine.migrations.counts())
    setCounter(metrics.migrations, count, { reason, result });
}

/** The router's KV index size and its routing decisions by reason (kv-routing-policy.ts). */
function collectRouting(metrics: ClusterMetrics, routing: RoutingReport | null): void {
  if (routing === null) return;
  metrics.indexKeys.set(routing.indexKeys);
  for (const [reason, n] of Object.entries(routing.decisions))
    setCounter(metrics.routingDecisions, n, { reason });
}

type Queues = Record<"prefill" | "decode", { waiting: number; running: number }>;
type ClusterMetrics = ReturnType<typeof clusterMetrics>;

/** One live node's gauges (pages by state, protocol attempts, quarantine) and its link refusals. */
function collectNode(
  metrics: ClusterMetrics,
  node: { readonly id: string; readonly role: "prefill" | "decode" },
  stats: NodeStats,
  linkAuth: Readonly<Record<string, number>>,
): void {
  const { id, role } = node;
  for (const [key, n] of Object.entries(linkAuth)) {
    const [port, reason] = key.split("/") as [string, string];
    setCounter(metrics.linkAuth, n, { node: id, port, reason });
  }
  for (const state of ["free", "reserved", "ready", "quarantined"] as const) {
    metrics.nodePages.set({ node: id, role, state }, stats.pages[state]);
  }
  metrics.attempts.set({ node: id, role }, stats.attempts);
  if (role === "decode") metrics.quarantined.set({ node: id }, stats.pages.quarantined);
}

/** A node's link refusals as `port/reason` counts. */
function linkAuthCounts(stats: NodeStats): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const [port, reasons] of Object.entries(stats.linkAuthFailures ?? {}))
    for (const [reason, n] of Object.entries(reasons ?? {})) counts[`${port}/${reason}`] = n;
  return counts;
}

/** The transfer counters, each the sum of a count over every decode node (`NodeTotals`: lost and restarted ones too). */
const TRANSFER_COUNTERS = [
  {
    name: "kvfence_transfer_bytes_total",
    help: "KV bytes transferred from prefill to decode, as decode applied them",
    total: "bytes",
  },
  {
    name: "kvfence_transfer_pages_total",
    help: "KV pages transferred, as decode applied them",
    total: "pages",
  },
  {
    name: "kvfence_transfer_pages_reused_total",
    help: "Prompt pages decode held in its own prefix cache instead of receiving them (decode-side reuse)",
    total: "pagesReused",
  },
  {
    name: "kvfence_transfer_checksum_failures_total",
    help: "Transfers refused at commit: a page checksum differed",
    total: "checksumFailures",
  },
  {
    name: "kvfence_transfer_coverage_failures_total",
    help: "Transfers refused at commit: coverage differed from the reservation",
    total: "coverageFailures",
  },
  {
    name: "kvfence_transfer_dropped_stale_writes_total",
    help: "Page writes dropped by decode: the page was no longer leased to that (rid, epoch)",
    total: "droppedStaleWrites",
  },
  {
    name: "kvfence_transfer_dropped_misaddressed_writes_total",
    help: "Page writes dropped by decode: out of bounds or the wrong size",
    total: "droppedMisaddressedWrites",
  },
] as const;
const TRANSFER_TOTALS = TRANSFER_COUNTERS.map((c) => c.total);

function clusterMetrics(scrape: MetricsScrape) {
  return { ...transferMetrics(scrape), ...nodeMetrics(scrape) };
}

/** The transfer counters, and the GB/s of each transfer and the latency of each ABORT_ACK. */
function transferMetrics(scrape: MetricsScrape) {
  const transfers = scrape.totalCounters(TRANSFER_COUNTERS);
  const gbps = new Histogram({
    name: "kvfence_transfer_gbps",
    help: "Throughput of each KV transfer (GB/s, 10^9 B/s), as prefill wrote it",
    buckets: exponentialBuckets(0.01, 2, 14),
    ...scrape.options,
  });
  const ackLatency = new Histogram({
    name: "kvfence_abort_ack_latency_seconds",
    help: "Time from decode relaying an abort to prefill's ABORT_ACK",
    buckets: exponentialBuckets(0.0001, 2, 16),
    ...scrape.options,
  });
  // No series before the first observation (prom-client starts a histogram without labels at 0).
  gbps.reset();
  ackLatency.reset();
  return { transfers, gbps, ackLatency };
}

/** Each node's gauges and link refusals, and the router's refusals of nodes it dialled. */
function nodeMetrics(scrape: MetricsScrape) {
  return {
    quarantined: scrape.gauge(
      "kvfence_quarantined_pages",
      "Decode pages quarantined until their writer acknowledges the abort or is fenced",
      ["node"],
    ),
    nodePages: scrape.gauge("kvfence_node_kv_pages", "KV pool pages by node and state", [
      "node",
      "role",
      "state",
    ]),
    nodeQueue: scrape.gauge("kvfence_node_requests", "Engine requests by role and queue state", [
      "role",
      "state",
    ]),
    roleNodes: scrape.gauge("kvfence_role_nodes", "Nodes of each role that answered this scrape", ["role"]),
    roleQueueDepth: scrape.gauge(
      "kvfence_role_queue_depth",
      "Requests waiting in the engine queues of each role's nodes",
      ["role"],
    ),
    roleQueueWait: scrape.gauge(
      "kvfence_role_queue_wait_seconds",
      "Mean engine queue wait of the requests that left a queue of the role since the previous scrape (0: none did)",
      ["role"],
    ),
    rolePoolUsed: scrape.gauge(
      "kvfence_role_kv_pool_used_ratio",
      "KV pool pages in use (neither free nor cached with no reference) over the role's pool pages",
      ["role"],
    ),
    nodeUp: scrape.gauge("kvfence_node_up", "1 while the node answers, 0 once it is lost", ["node", "role"]),
    attempts: scrape.gauge("kvfence_node_protocol_attempts", "Transfer-protocol attempts a node holds now", [
      "node",
      "role",
    ]),
    linkAuth: scrape.counter(
      "kvfence_link_auth_failures_total",
      "Connections to a node's control or transfer port refused before admission, by reason (bad_hello, bad_proof: a replayed handshake, malformed, oversized, timeout, too_many_pending, peer_connected, layout_mismatch, address_mismatch: dialled through a relay)",
      ["node", "port", "reason"],
    ),
    indexKeys: scrape.gauge(
      "kvfence_kv_index_keys",
      "Chain keys of the nodes' caches this router's KV index holds, over every node (src/cluster/kv-index.ts)",
    ),
    routingDecisions: scrape.counter(
      "kvfence_routing_decisions_total",
      "Pairs picked by where the KV lives, by reason (cache_hit: the prefill node holding the longest prefix; load: another, its load weighed more; fallback: no candidate holds a page of it, prefix affinity picked)",
      ["reason"],
    ),
    dialRefusals: scrape.counter(
      "kvfence_router_link_refusals_total",
      "Nodes the router dialled and refused in the handshake, by reason (address_mismatch: the node answers to another address than the one dialled, i.e. a relay, e.g. at a registry entry copied to its address)",
      ["reason"],
    ),
    migrations: scrape.counter(
      "kvfence_migrations_total",
      "Requests whose attempt a node's loss or failure ended after tokens were sent, by reason (the error code: node_unavailable, transfer_failed, page_tag_mismatch, ...) and result (migrated: it went on on another pair; moved: the same before its first token; budget_spent: --max-migrations reached; no_pair: no other pair up; group: a sample of n > 1)",
      ["reason", "result"],
    ),
  };
}
