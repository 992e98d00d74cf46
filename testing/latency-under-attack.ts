/**
 * The measurement of the solo latency tests (`*.solo.test.ts`): one tenant ("victor") sends small
 * requests on a fixed schedule while another ("mallory") attacks, and victor's p99 latency under
 * attack is compared with its own p99 measured alone, in turns with the attack (alone, attacked,
 * alone, …) so that a change in the machine's load hits both alike.
 *
 * Victor's load is open-loop: one request every `intervalMs` whether or not the earlier ones were
 * answered, each latency counted from its scheduled time, so that a stall counts against every
 * request it delays, not just one. Mallory's client runs in a thread of its own at the lowest
 * priority (testing/flood-worker.ts), standing in for another machine.
 */
import { Worker } from "node:worker_threads";
import type { FloodAnswer, FloodOptions, FloodRequest } from "./flood-worker.js";

export function p99(samples: readonly number[]): number {
  const sorted = [...samples].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil(0.99 * sorted.length) - 1)]!;
}

export interface Flood {
  /** Sends every request at once; resolves with every answer. */
  round(): Promise<FloodAnswer[]>;
  close(): Promise<number>;
}

/** Mallory's client in a thread of its own (the bodies are moved to it, not copied). */
export async function startFlood(
  url: string,
  apiKey: string,
  requests: readonly FloodRequest[],
): Promise<Flood> {
  // Each body in an ArrayBuffer of its own: a small Buffer lies in Node's shared pool, which Node
  // 22 and later refuse to transfer (DataCloneError).
  const own = requests.map((r) => ({ ...r, body: new Uint8Array(r.body) }));
  const options: FloodOptions = { url, apiKey, requests: own };
  const worker = new Worker(new URL("./flood-worker.js", import.meta.url), {
    workerData: options,
    transferList: own.map((r) => r.body.buffer),
  });
  await new Promise((resolve) => worker.once("online", resolve));
  return {
    round: () =>
      new Promise<FloodAnswer[]>((resolve, reject) => {
        worker.once("error", reject);
        worker.once("message", (answers: FloodAnswer[]) => {
          worker.off("error", reject);
          resolve(answers);
        });
        worker.postMessage("go");
      }),
    close: () => worker.terminate(),
  };
}

export interface LatencyComparison {
  /** One of victor's requests; it throws on a failure (counted as infinitely slow, and named). */
  readonly ask: () => Promise<void>;
  /** One round of the attack: resolves once the attacker's answers are in. */
  readonly attack: () => Promise<void>;
  /** Alone/attacked turns per attempt. */
  readonly rounds: number;
  /** Attempts, one of which must pass: a machine shared with other work can stall this process for its own reasons. */
  readonly attempts: number;
  /** Milliseconds victor's p99 under attack may exceed its p99 alone. */
  readonly boundMs: number;
  readonly intervalMs?: number;
  /** Victor's requests in flight past which a scheduled one is counted as waiting, not sent. */
  readonly maxInFlight?: number;
  /** Victor's requests per turn at least (alone, and under an attack shorter than that). */
  readonly minPerTurn?: number;
  /** Where each attempt's report goes (the test's diagnostic). */
  readonly report: (line: string) => void;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Victor's p99 under attack against alone, attempt by attempt until one is within `boundMs`. */
export async function compareLatency(
  options: LatencyComparison,
): Promise<{ passed: boolean; reports: string[] }> {
  const intervalMs = options.intervalMs ?? 40;
  const maxInFlight = options.maxInFlight ?? 100;
  const minPerTurn = options.minPerTurn ?? 20;
  const failures: string[] = [];
  /** Victor's load until `more()` is false and at least `min` were sent; the latencies. */
  const measure = async (more: () => boolean, min: number): Promise<number[]> => {
    const latencies: number[] = [];
    const pending: Promise<void>[] = [];
    let inFlight = 0;
    const start = performance.now();
    for (let i = 0; more() || i < min; i++) {
      const due = start + i * intervalMs;
      const wait = due - performance.now();
      if (wait > 0) await sleep(wait);
      if (inFlight >= maxInFlight) {
        // Too far behind to send: the slot counts with the time it has waited already.
        latencies.push(performance.now() - due);
        continue;
      }
      inFlight++;
      pending.push(
        options.ask().then(
          () => {
            inFlight--;
            latencies.push(performance.now() - due);
          },
          (err: Error) => {
            inFlight--;
            failures.push(err.message);
            latencies.push(Number.POSITIVE_INFINITY);
          },
        ),
      );
    }
    await Promise.all(pending);
    return latencies;
  };
  await measure(() => false, 10); // warm-up

  const slowest = (xs: number[]) =>
    [...xs]
      .sort((a, b) => b - a)
      .slice(0, 5)
      .map((x) => x.toFixed(0))
      .join(", ");
  const reports: string[] = [];
  for (let attempt = 0; attempt < options.attempts; attempt++) {
    const alone: number[] = [];
    const underAttack: number[] = [];
    for (let round = 0; round < options.rounds; round++) {
      alone.push(...(await measure(() => false, minPerTurn)));
      let attacking = true;
      const attacked = options.attack().finally(() => {
        attacking = false;
      });
      underAttack.push(...(await measure(() => attacking, minPerTurn)));
      await attacked;
    }
    const report =
      `victor's p99 ${p99(underAttack).toFixed(1)} ms under attack (${underAttack.length} requests; slowest ${slowest(underAttack)}), ` +
      `${p99(alone).toFixed(1)} ms alone (${alone.length}; slowest ${slowest(alone)})` +
      (failures.length === 0 ? "" : `; ${failures.length} failed: ${[...new Set(failures)].join("; ")}`);
    options.report(report);
    reports.push(report);
    if (p99(underAttack) <= p99(alone) + options.boundMs) return { passed: true, reports };
  }
  return { passed: false, reports };
}
