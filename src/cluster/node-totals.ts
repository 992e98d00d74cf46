/**
 * Counters summed over a cluster's nodes, for /metrics, that never go down. A node's counts reach
 * the router only when it answers a poll, and start from zero when it restarts. Summing the
 * answers of one poll would make a counter drop whenever a node misses that poll (busy computing a
 * long prefill, frozen, lost) or comes back as a new incarnation. Prometheus would read the drop as
 * a counter reset.
 *
 * So this keeps, per node id, its last answered counts and what its earlier incarnations counted:
 * a node that misses a poll keeps its last counts in the totals, and a restarted node's counts
 * add to its old incarnation's.
 */

type Counts = Record<string, number>;

export class NodeTotals {
  readonly #nodes = new Map<string, { incarnation: number; now: Counts; before: Counts }>();

  /** Node `id`, incarnation `incarnation`, answered with `counts` (its own totals since it started). */
  see(id: string, incarnation: number, counts: Readonly<Counts>): void {
    const node = this.#nodes.get(id);
    if (node === undefined) {
      this.#nodes.set(id, { incarnation, now: { ...counts }, before: {} });
      return;
    }
    if (node.incarnation !== incarnation) {
      add(node.before, node.now);
      node.incarnation = incarnation;
    }
    node.now = { ...counts };
  }

  /** Node `id`'s totals over all its incarnations (empty if it never answered). */
  of(id: string): Counts {
    const node = this.#nodes.get(id);
    const sum: Counts = {};
    if (node !== undefined) {
      add(sum, node.before);
      add(sum, node.now);
    }
    return sum;
  }

  /** The totals over every node that ever answered, `keys` reading 0 when none counted them. */
  total<K extends string>(keys: readonly K[]): Record<K, number> {
    const sum = {} as Record<K, number>;
    for (const k of keys) sum[k] = 0;
    for (const id of this.#nodes.keys()) {
      const counts = this.of(id);
      for (const k of keys) sum[k] += counts[k] ?? 0;
    }
    return sum;
  }
}

function add(to: Counts, from: Readonly<Counts>): void {
  for (const [k, v] of Object.entries(from)) to[k] = (to[k] ?? 0) + v;
}
