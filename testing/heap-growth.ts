/**
 * Measures what a hot loop allocates: V8 heap growth across `steps` calls with no GC in between
 * (rounds during which a GC ran are discarded, since a GC hides allocation). Returns the growth of
 * every clean round in bytes; callers assert on the minimum. The noise floor is a few KB.
 */
import { PerformanceObserver, performance } from "node:perf_hooks";
import v8 from "node:v8";
import vm from "node:vm";

export async function heapGrowthPerRound(
  step: (i: number) => void,
  options: { warmup: number; steps: number; rounds: number },
): Promise<number[]> {
  v8.setFlagsFromString("--expose-gc");
  const gc = vm.runInNewContext("gc") as () => void;
  const run = (from: number, to: number): void => {
    for (let i = from; i < to; i++) step(i);
  };
  run(0, options.warmup);
  const gcTimes: number[] = [];
  const obs = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) gcTimes.push(e.startTime);
  });
  obs.observe({ entryTypes: ["gc"] });
  const rounds: Array<{ growth: number; start: number; end: number }> = [];
  for (let r = 0; r < options.rounds; r++) {
    gc();
    const start = performance.now();
    const before = process.memoryUsage().heapUsed;
    run(0, options.steps);
    const growth = process.memoryUsage().heapUsed - before;
    rounds.push({ growth, start, end: performance.now() });
  }
  await new Promise((resolve) => setTimeout(resolve, 50)); // gc entries arrive asynchronously
  obs.disconnect();
  return rounds.filter((r) => !gcTimes.some((t) => t >= r.start && t <= r.end)).map((r) => r.growth);
}
