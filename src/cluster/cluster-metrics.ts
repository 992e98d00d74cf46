/**
 * The disaggregated topology's metrics in the router's /metrics, aggregated from the nodes on each
 * scrape (`NodeStats`): bytes transferred and a GB/s histogram per transfer, checksum and coverage
 * failures, dropped stale and misaddressed writes, quarantined pages, ABORT_ACK latency, and pages
 * and queue gauges per node and role.
 */
import { exponentialBuckets, type MetricsRegistry } from "../lib/metrics.js";
import type { DisaggregatedEngine } from "./disaggregated-engine.js";
import type { NodeStats } from "./node-messages.js";

export function registerClusterMetrics(registry: MetricsRegistry, engine: DisaggregatedEngine): void {
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
    "Connections to a node's control or transfer port refused before admission, by reason (bad_hello, bad_proof: a replayed handshake, malformed, oversized, timeout, too_many_pending, peer_connected, layout_mismatch)",
    ["node", "port", "reason"],
  );

  // The last counts of each decode node, so a lost node's transfers stay in the totals.
  const lastTransfer = new Map<string, NodeStats["transfer"]>();

  registry.onCollect(async () => {
    const all = await engine.nodeStats();
    const queue: Record<string, Record<string, number>> = {
      prefill: { waiting: 0, running: 0 },
      decode: { waiting: 0, running: 0 },
    };
    for (const { node, stats } of all) {
      const role = node.hello.role;
      nodeUp.set(stats === null ? 0 : 1, { node: node.id, role });
      if (stats === null) continue;
      for (const state of ["free", "reserved", "ready", "quarantined"] as const) {
        nodePages.set(stats.pages[state], { node: node.id, role, state });
      }
      attempts.set(stats.attempts, { node: node.id, role });
      for (const [port, reasons] of Object.entries(stats.linkAuthFailures ?? {})) {
        for (const [reason, n] of Object.entries(reasons ?? {})) {
          linkAuth.setTotal(n, { node: node.id, port, reason });
        }
      }
      queue[role]!.waiting! += stats.queue.waiting;
      queue[role]!.running! += stats.queue.running;
      if (role === "decode") {
        lastTransfer.set(node.id, stats.transfer);
        quarantined.set(stats.pages.quarantined, { node: node.id });
      }
    }
    const observed = engine.takeObservations();
    for (const v of observed.gbps) gbps.observe(v);
    for (const v of observed.abortAckSeconds) ackLatency.observe(v);
    for (const role of ["prefill", "decode"]) {
      for (const state of ["waiting", "running"]) nodeQueue.set(queue[role]![state]!, { role, state });
    }
    const sum = (f: (t: NodeStats["transfer"]) => number): number => {
      let total = 0;
      for (const t of lastTransfer.values()) total += f(t);
      return total;
    };
    bytes.setTotal(sum((t) => t.bytes));
    pages.setTotal(sum((t) => t.pages));
    checksum.setTotal(sum((t) => t.checksumFailures));
    coverage.setTotal(sum((t) => t.coverageFailures));
    stale.setTotal(sum((t) => t.droppedStaleWrites));
    misaddressed.setTotal(sum((t) => t.droppedMisaddressedWrites));
  });
}
