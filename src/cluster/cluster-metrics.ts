/**
 * The disaggregated topology's metrics in the router's /metrics, aggregated from the nodes on each
 * scrape (`NodeStats`): bytes transferred and a GB/s histogram per transfer, checksum and coverage
 * failures, dropped stale and misaddressed writes, quarantined pages, ABORT_ACK latency, and pages
 * and queue gauges per node and role; and the router's own refusals of nodes it dialled.
 */
import { exponentialBuckets, type MetricsRegistry } from "../lib/metrics.js";
import { type PhaseSource, renderPhaseMetrics } from "../lib/phase-histograms.js";
import type { NodeStats } from "../links/node-messages.js";
import type { DisaggregatedEngine } from "./disaggregated-engine.js";
import { NodeTotals } from "./node-totals.js";

export function registerClusterMetrics(registry: MetricsRegistry, engine: DisaggregatedEngine): void {
  const metrics = clusterMetrics(registry);
  // Each decode node's transfer counts and each node's link refusals, kept while a node misses a
  // scrape, is lost or restarts, so no counter goes down.
  const transfers = new NodeTotals();
  const linkAuth = new NodeTotals();
  // The per-phase histograms of the router and of each node that answered this scrape.
  let phases: PhaseSource[] = [];
  registry.onExpose(() => renderPhaseMetrics(phases));
  registry.onCollect(async () => {
    phases = [{ node: "router", role: "router", snapshot: engine.phases.snapshot() }];
    const queue: Queues = { prefill: { waiting: 0, running: 0 }, decode: { waiting: 0, running: 0 } };
    for (const { node, stats } of await engine.nodeStats()) {
      const role = node.hello.role;
      metrics.nodeUp.set(stats === null ? 0 : 1, { node: node.id, role });
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
        metrics.nodeQueue.set(queue[role][state], { role, state });
    }
    collectTransfers(metrics, transfers);
    for (const [reason, n] of Object.entries(engine.dialRefusals))
      metrics.dialRefusals.setTotal(n, { reason });
  });
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
    metrics.linkAuth.setTotal(n, { node: id, port, reason });
  }
  for (const state of ["free", "reserved", "ready", "quarantined"] as const) {
    metrics.nodePages.set(stats.pages[state], { node: id, role, state });
  }
  metrics.attempts.set(stats.attempts, { node: id, role });
  if (role === "decode") metrics.quarantined.set(stats.pages.quarantined, { node: id });
}

/** A node's link refusals as `port/reason` counts. */
function linkAuthCounts(stats: NodeStats): Record<string, number> {
  const counts: Record<string, number> = {};
  for (const [port, reasons] of Object.entries(stats.linkAuthFailures ?? {}))
    for (const [reason, n] of Object.entries(reasons ?? {})) counts[`${port}/${reason}`] = n;
  return counts;
}

/** The transfer totals over every decode node's counts (`NodeTotals`: lost and restarted ones too). */
function collectTransfers(metrics: ClusterMetrics, transfers: NodeTotals): void {
  const total = transfers.total([
    "bytes",
    "pages",
    "checksumFailures",
    "coverageFailures",
    "droppedStaleWrites",
    "droppedMisaddressedWrites",
  ]);
  metrics.bytes.setTotal(total.bytes);
  metrics.pages.setTotal(total.pages);
  metrics.checksum.setTotal(total.checksumFailures);
  metrics.coverage.setTotal(total.coverageFailures);
  metrics.stale.setTotal(total.droppedStaleWrites);
  metrics.misaddressed.setTotal(total.droppedMisaddressedWrites);
}

function clusterMetrics(registry: MetricsRegistry) {
  const bytes = registry.counter(
    "kvfence_transfer_bytes_total",
    "KV bytes transferred from prefill to decode, as decode applied them",
  );
  const pages = registry.counter(
    "kvfence_transfer_pages_total",
    "KV pages transferred, as decode applied them",
  );
  const gbps = registry.histogram(
    "kvfence_transfer_gbps",
    "Throughput of each KV transfer (GB/s, 10^9 B/s), as prefill wrote it",
    {
      buckets: exponentialBuckets(0.01, 2, 14),
    },
  );
  const checksum = registry.counter(
    "kvfence_transfer_checksum_failures_total",
    "Transfers refused at commit: a page checksum differed",
  );
  const coverage = registry.counter(
    "kvfence_transfer_coverage_failures_total",
    "Transfers refused at commit: coverage differed from the reservation",
  );
  const stale = registry.counter(
    "kvfence_transfer_dropped_stale_writes_total",
    "Page writes dropped by decode: the page was no longer leased to that (rid, epoch)",
  );
  const misaddressed = registry.counter(
    "kvfence_transfer_dropped_misaddressed_writes_total",
    "Page writes dropped by decode: out of bounds or the wrong size",
  );
  const quarantined = registry.gauge(
    "kvfence_quarantined_pages",
    "Decode pages quarantined until their writer acknowledges the abort or is fenced",
    ["node"],
  );
  const ackLatency = registry.histogram(
    "kvfence_abort_ack_latency_seconds",
    "Time from decode relaying an abort to prefill's ABORT_ACK",
    {
      buckets: exponentialBuckets(0.0001, 2, 16),
    },
  );
  const nodePages = registry.gauge("kvfence_node_kv_pages", "KV pool pages by node and state", [
    "node",
    "role",
    "state",
  ]);
  const nodeQueue = registry.gauge("kvfence_node_requests", "Engine requests by role and queue state", [
    "role",
    "state",
  ]);
  const nodeUp = registry.gauge("kvfence_node_up", "1 while the node answers, 0 once it is lost", [
    "node",
    "role",
  ]);
  const attempts = registry.gauge(
    "kvfence_node_protocol_attempts",
    "Transfer-protocol attempts a node holds now",
    ["node", "role"],
  );

  const linkAuth = registry.counter(
    "kvfence_link_auth_failures_total",
    "Connections to a node's control or transfer port refused before admission, by reason (bad_hello, bad_proof: a replayed handshake, malformed, oversized, timeout, too_many_pending, peer_connected, layout_mismatch, address_mismatch: dialled through a relay)",
    ["node", "port", "reason"],
  );
  const dialRefusals = registry.counter(
    "kvfence_router_link_refusals_total",
    "Nodes the router dialled and refused in the handshake, by reason (address_mismatch: the node answers to another address than the one dialled, i.e. a relay, e.g. at a registry entry copied to its address)",
    ["reason"],
  );

  return {
    bytes,
    pages,
    gbps,
    checksum,
    coverage,
    stale,
    misaddressed,
    quarantined,
    ackLatency,
    nodePages,
    nodeQueue,
    nodeUp,
    attempts,
    linkAuth,
    dialRefusals,
  };
}
