/**
 * The chaos campaign's faults, planned from the seed before the run and injected one at a time:
 * `kill` (kill -9 of a node process, restarted on its address after `holdMs`), `stop` (SIGSTOP,
 * SIGCONT after `holdMs`), `partition` (the node's host cut off from inside its namespace, healed
 * after `holdMs`) and `role` (`kvfence role`: the node drains, scrubs its pool and serves the other
 * role; switched back after `holdMs`, so that the shape is whole again for the next fault). The
 * kinds come round in a seeded order, so that every kind is injected once in every round; the target is any node, prefill or decode; a fault starts `gapMs` after
 * the previous one ended. The log says when each began and ended, relative to the workload's start.
 */
import { Rng } from "../probe/canary.js";
import type { ChaosCluster } from "./chaos-cluster.js";

export const FAULT_KINDS = ["kill", "stop", "partition", "role"] as const;
export type FaultKind = (typeof FAULT_KINDS)[number];

export interface PlannedFault {
  readonly kind: FaultKind;
  readonly target: string;
  readonly gapMs: number;
  readonly holdMs: number;
}

export interface InjectedFault extends PlannedFault {
  /** When it began and ended (healed, continued, restarted and listening), ms from the workload's start. */
  readonly atMs: number;
  readonly endMs: number;
  readonly error?: string;
}

/** How long each kind holds (ms, a range). */
const HOLD: Record<FaultKind, readonly [number, number]> = {
  kill: [500, 3000],
  stop: [1000, 4000],
  partition: [2000, 8000],
  role: [2000, 6000],
};

/** Faults for `durationMs` from `seed`: gaps of `gapMs` ± half, holds from HOLD. */
export function planFaults(input: {
  seed: number;
  durationMs: number;
  gapMs: number;
  targets: readonly string[];
  /** The kinds to inject (default all). */
  kinds?: readonly FaultKind[];
}): PlannedFault[] {
  const rng = new Rng(input.seed ^ 0xfa17);
  const plan: PlannedFault[] = [];
  let round: FaultKind[] = [];
  let t = 0;
  for (;;) {
    if (round.length === 0) {
      round = [...(input.kinds ?? FAULT_KINDS)];
      for (let i = round.length - 1; i > 0; i--) {
        const j = rng.int(i + 1);
        [round[i], round[j]] = [round[j]!, round[i]!];
      }
    }
    const kind = round.pop()!;
    const [lo, hi] = HOLD[kind];
    const fault = {
      kind,
      target: rng.pick(input.targets),
      gapMs: Math.round(input.gapMs * (0.5 + rng.next())),
      holdMs: Math.round(lo + (hi - lo) * rng.next()),
    };
    // A fault must end (and a killed node have time to come back) before the workload does.
    if (t + fault.gapMs + fault.holdMs + 5000 > input.durationMs) return plan;
    t += fault.gapMs + fault.holdMs;
    plan.push(fault);
  }
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Injects `plan` in order on `cluster`; `log` gets each fault as it ends. Stops early when `stopped()`. */
export async function inject(
  cluster: ChaosCluster,
  plan: readonly PlannedFault[],
  input: {
    readonly startMs: number;
    readonly stopped: () => boolean;
    readonly log: (f: InjectedFault) => void;
  },
): Promise<InjectedFault[]> {
  const done: InjectedFault[] = [];
  for (const fault of plan) {
    await sleep(fault.gapMs);
    if (input.stopped()) break;
    const atMs = Date.now() - input.startMs;
    let error: string | undefined;
    try {
      await apply(cluster, fault);
    } catch (err) {
      error = (err as Error).message.split("\n")[0];
    }
    const injected = { ...fault, atMs, endMs: Date.now() - input.startMs, ...(error ? { error } : {}) };
    done.push(injected);
    input.log(injected);
  }
  return done;
}

async function apply(cluster: ChaosCluster, { kind, target, holdMs }: PlannedFault): Promise<void> {
  switch (kind) {
    case "kill":
      await cluster.kill(target);
      await sleep(holdMs);
      await cluster.startNode(target);
      return;
    case "stop":
      cluster.signal(target, "SIGSTOP");
      await sleep(holdMs);
      cluster.signal(target, "SIGCONT");
      return;
    case "partition":
      cluster.partition(target);
      try {
        await sleep(holdMs);
      } finally {
        cluster.heal(target);
      }
      return;
    case "role": {
      const role = cluster.roleOf(target);
      await cluster.switchRole(target, role === "prefill" ? "decode" : "prefill");
      await sleep(holdMs);
      await cluster.switchRole(target, role);
      return;
    }
  }
}
