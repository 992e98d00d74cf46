/**
 * Measures what a hot loop allocates: the bytes allocated during `steps` calls, counted by V8's
 * sampling heap profiler (over the inspector, with the objects later collected included), once per
 * round. Returns each round's bytes and its largest allocation sites; callers assert on the round
 * that allocated least, so a round in which V8 happened to deoptimize and recompile a function
 * (code and deoptimization data are allocated too) does not fail a test.
 *
 * With `below`, rounds go on (a pause between them) until one allocates less than `below` or
 * `withinMs` has passed: on a loaded machine V8's optimizing compiler runs on a starved background
 * thread, and until it is done the loop runs in a tier that boxes numbers (CI once saw all five
 * rounds of the router's histogram test, 123 ms in all, at 16 KB, where a quiet run shows ~0). Code
 * that allocates on every step still fails, once the time is up.
 *
 * The sampler's estimate is unbiased (each sample is weighted by the chance of sampling an object of
 * its size; with a mean interval of 32 bytes, a few KB are ~100 samples, ±10%). It replaced a
 * measure of the young generation's growth between two calls of `gc()`, which on Node 22 and 24
 * moves by whole allocation buffers: 3–280 KB over 2,000 steps of a loop that the sampler shows
 * allocating under 1 KB (found on the decode node's test).
 */
import { Session } from "node:inspector/promises";

export interface RoundAllocation {
  /** Bytes allocated during the round (estimated by sampling). */
  readonly bytes: number;
  /** The round's largest allocation sites, "bytes function url:line", for a failure message. */
  readonly sites: string;
}

interface ProfileNode {
  readonly callFrame: { readonly functionName: string; readonly url: string; readonly lineNumber: number };
  readonly selfSize: number;
  readonly children: readonly ProfileNode[];
}

export async function allocationPerRound(
  step: (i: number) => void,
  options: {
    warmup: number;
    steps: number;
    rounds: number;
    /**
     * Frames whose script URL matches are not counted (what they call still is): code whose
     * allocation another test measures in a loop of its own. A function V8 inlined counts as the
     * frame it was inlined into.
     */
    notIn?: RegExp;
    /** Go on past `rounds` until a round allocates less than this, or `withinMs` (5,000) has passed. */
    below?: number;
    withinMs?: number;
  },
): Promise<RoundAllocation[]> {
  const deadline = performance.now() + (options.withinMs ?? 5000);
  const { below } = options;
  const done = (rounds: readonly RoundAllocation[]): boolean => {
    if (below !== undefined && rounds.some((r) => r.bytes < below)) return true;
    if (rounds.length < options.rounds) return false;
    return below === undefined || performance.now() >= deadline;
  };
  // Only what is allocated below this frame counts (not the inspector's own messages).
  const measuredLoop = (from: number, to: number): void => {
    for (let i = from; i < to; i++) step(i);
  };
  measuredLoop(0, options.warmup);
  const session = new Session();
  session.connect();
  try {
    await session.post("HeapProfiler.enable");
    const rounds: RoundAllocation[] = [];
    while (!done(rounds)) {
      if (rounds.length >= options.rounds) await new Promise((resolve) => setTimeout(resolve, 25));
      await session.post("HeapProfiler.startSampling", {
        samplingInterval: 32,
        includeObjectsCollectedByMajorGC: true,
        includeObjectsCollectedByMinorGC: true,
      });
      measuredLoop(0, options.steps);
      const { profile } = await session.post("HeapProfiler.stopSampling");
      rounds.push(summarize(profile.head as ProfileNode, options.notIn));
    }
    return rounds;
  } finally {
    session.disconnect();
  }
}

/** The round that allocated least. */
export function leastAllocation(rounds: readonly RoundAllocation[]): RoundAllocation {
  return rounds.reduce((a, b) => (b.bytes < a.bytes ? b : a));
}

function summarize(head: ProfileNode, notIn: RegExp | undefined): RoundAllocation {
  const bySite = new Map<string, number>();
  let bytes = 0;
  // The loop's own frame counts too: the step is often inlined into it, and the sampler names only
  // the outermost function of an optimized frame.
  const visit = (n: ProfileNode, above: boolean): void => {
    const f = n.callFrame;
    const measured = above || (f.functionName === "measuredLoop" && f.url.includes("heap-growth"));
    if (measured && n.selfSize > 0 && !notIn?.test(f.url)) {
      bytes += n.selfSize;
      const site = `${f.functionName || "(anonymous)"} ${f.url.split("/").slice(-2).join("/")}:${f.lineNumber + 1}`;
      bySite.set(site, (bySite.get(site) ?? 0) + n.selfSize);
    }
    for (const c of n.children) visit(c, measured);
  };
  visit(head, false);
  const sites = [...bySite]
    .sort((a, b) => b[1] - a[1])
    .slice(0, 4)
    .map(([site, b]) => `${b} ${site}`)
    .join("; ");
  return { bytes, sites };
}
