/**
 * Measures what a hot loop allocates: growth of V8's young generation across `steps` calls with no
 * GC in between (rounds during which a GC ran are discarded, since a GC hides allocation). Returns
 * the growth of every clean round in bytes; callers assert on the minimum. The noise floor is a few
 * KB.
 *
 * Only the young generation counts, where every object a step creates starts. The whole heap also
 * grew when V8 happened to deoptimize and recompile a function mid-round (code and deoptimization
 * data go to the old and code spaces): a rarely taken branch, such as the main thread waiting long
 * for a descheduled kernel worker, made a test of the forward pass fail about one run in six.
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
    const before = youngBytes();
    run(0, options.steps);
    const growth = youngBytes() - before;
    rounds.push({ growth, start, end: performance.now() });
  }
  await new Promise((resolve) => setTimeout(resolve, 50)); // gc entries arrive asynchronously
  obs.disconnect();
  return rounds.filter((r) => !gcTimes.some((t) => t >= r.start && t <= r.end)).map((r) => r.growth);
}

/** Bytes in use in the young generation (new space and new large-object space). */
function youngBytes(): number {
  let used = 0;
  for (const s of v8.getHeapSpaceStatistics()) {
    if (s.space_name === "new_space" || s.space_name === "new_large_object_space") used += s.space_used_size;
  }
  return used;
}
