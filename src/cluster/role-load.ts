/**
 * The load of each role (prefill, decode) as an autoscaler and the router's role policy
 * (src/cluster/role-policy.ts) read it, from one poll of the nodes' stats (docs/api.md, "Metrics
 * per role"): the nodes that answer, the requests waiting in their engines' queues (the queue
 * depth), the mean time a request waited in those queues since the previous read (the engines'
 * `queue_wait` phase: its sum and count over the role's nodes, as deltas per node incarnation so a
 * restart counts from zero), and the share of the role's KV pool in use (pages neither FREE nor
 * cached with no reference: the prefix cache gives those back on demand).
 */
import { NB, PHASE } from "../lib/phase-recorder.js";
import type { NodeAnswer } from "./node-stats.js";

export type Role = "prefill" | "decode";
export const ROLES: readonly Role[] = ["prefill", "decode"];

export interface RoleLoad {
  /** Nodes of the role that answered the poll. */
  readonly nodes: number;
  /** Requests waiting in the role's engine queues. */
  readonly waiting: number;
  /** Requests running in the role's engines. */
  readonly running: number;
  /** Mean engine queue wait of the requests that left a queue since the previous read, seconds (0: none did). */
  readonly waitSeconds: number;
  /** KV pool pages in use over the role's pool pages, 0..1. */
  readonly poolUsed: number;
}

export type RolesLoad = Readonly<Record<Role, RoleLoad>>;

/** Reads the roles' load from successive polls (keeps each node's queue-wait totals of the last one). */
export class RoleLoadMeter {
  /** Per node id: its incarnation and its queue-wait count and sum at the previous read. */
  readonly #last = new Map<string, { incarnation: number; count: number; sum: number }>();

  read(answers: readonly NodeAnswer[]): RolesLoad {
    const acc = {
      prefill: { nodes: 0, waiting: 0, running: 0, waits: 0, waitSum: 0, used: 0, total: 0 },
      decode: { nodes: 0, waiting: 0, running: 0, waits: 0, waitSum: 0, used: 0, total: 0 },
    };
    for (const { node, stats } of answers) {
      if (stats === null) continue;
      const a = acc[node.hello.role];
      a.nodes++;
      a.waiting += stats.queue.waiting;
      a.running += stats.queue.running;
      const idle = stats.prefixCache?.evictablePages ?? 0;
      a.used += stats.pages.total - stats.pages.free - idle;
      a.total += stats.pages.total;
      const phases = stats.phases;
      if (phases === undefined) continue;
      let count = 0;
      const row = PHASE.queue_wait * NB;
      for (let b = 0; b < NB; b++) count += phases.seconds[row + b] ?? 0;
      const sum = phases.secondsSum[PHASE.queue_wait] ?? 0;
      const was = this.#last.get(node.id);
      const same = was !== undefined && was.incarnation === node.hello.incarnation;
      a.waits += count - (same ? was.count : 0);
      a.waitSum += sum - (same ? was.sum : 0);
      this.#last.set(node.id, { incarnation: node.hello.incarnation, count, sum });
    }
    const load = (a: (typeof acc)[Role]): RoleLoad => ({
      nodes: a.nodes,
      waiting: a.waiting,
      running: a.running,
      waitSeconds: a.waits > 0 ? a.waitSum / a.waits : 0,
      poolUsed: a.total > 0 ? Math.max(0, a.used) / a.total : 0,
    });
    return { prefill: load(acc.prefill), decode: load(acc.decode) };
  }
}
