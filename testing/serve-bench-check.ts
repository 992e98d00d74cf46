/**
 * A hand computation of `kvfence bench serve`'s figures from the per-request arrays of a saved
 * result (`ttfts`, `itls`, `latencies`, `output_lens`, `input_lens`, `errors`, `duration`), written
 * independently of src/tools/bench/serve-report.ts (its own sort, percentile and deviation), so a
 * test can check that the reported aggregates are the ones the recorded run implies.
 */
import assert from "node:assert/strict";

interface SavedRun {
  readonly duration: number;
  readonly completed: number;
  readonly failed: number;
  readonly input_lens: readonly number[];
  readonly output_lens: readonly number[];
  readonly ttfts: readonly number[];
  readonly itls: ReadonlyArray<readonly number[]>;
  readonly latencies: readonly number[];
  readonly errors: readonly string[];
}

/** numpy.percentile's default ("linear"): rank p/100·(n−1) between the order statistics. */
function pct(values: readonly number[], p: number): number {
  if (values.length === 0) return 0;
  const s = values.slice().sort((a, b) => a - b);
  const rank = (p / 100) * (s.length - 1);
  const below = Math.floor(rank);
  const frac = rank - below;
  return below + 1 < s.length ? s[below]! * (1 - frac) + s[below + 1]! * frac : s[below]!;
}

function avg(values: readonly number[]): number {
  return values.length === 0 ? 0 : values.reduce((a, b) => a + b, 0) / values.length;
}

function popStd(values: readonly number[]): number {
  if (values.length === 0) return 0;
  const m = avg(values);
  return Math.sqrt(values.reduce((a, v) => a + (v - m) * (v - m), 0) / values.length);
}

/** The figures a run's arrays imply, under optional SLOs (ms). */
export function handComputed(
  run: SavedRun,
  slo?: { ttft?: number; tpot?: number; e2el?: number },
): Record<string, number | null> {
  const ok: number[] = [];
  run.errors.forEach((e, i) => {
    if (e === "") ok.push(i);
  });
  const ms = (s: number) => s * 1000;
  const series: Record<string, number[]> = {
    ttft: ok.map((i) => ms(run.ttfts[i]!)),
    tpot: ok
      .filter((i) => run.output_lens[i]! > 1)
      .map((i) => ms((run.latencies[i]! - run.ttfts[i]!) / (run.output_lens[i]! - 1))),
    itl: ok.flatMap((i) => run.itls[i]!.map(ms)),
    e2el: ok.map((i) => ms(run.latencies[i]!)),
  };
  const out: Record<string, number | null> = {};
  for (const [m, v] of Object.entries(series)) {
    out[`mean_${m}_ms`] = avg(v);
    out[`median_${m}_ms`] = pct(v, 50);
    out[`std_${m}_ms`] = popStd(v);
    out[`p50_${m}_ms`] = pct(v, 50);
    out[`p90_${m}_ms`] = pct(v, 90);
    out[`p99_${m}_ms`] = pct(v, 99);
  }
  const input = ok.reduce((a, i) => a + run.input_lens[i]!, 0);
  const output = ok.reduce((a, i) => a + run.output_lens[i]!, 0);
  out.completed = ok.length;
  out.failed = run.errors.length - ok.length;
  out.total_input_tokens = input;
  out.total_output_tokens = output;
  out.request_throughput = ok.length / run.duration;
  out.input_throughput = input / run.duration;
  out.output_throughput = output / run.duration;
  out.total_token_throughput = (input + output) / run.duration;
  if (slo === undefined) {
    out.request_goodput = null;
  } else {
    const good = ok.filter((i) => {
      const out1 = run.output_lens[i]!;
      const tpot = out1 > 1 ? ms((run.latencies[i]! - run.ttfts[i]!) / (out1 - 1)) : 0;
      return (
        (slo.ttft === undefined || ms(run.ttfts[i]!) <= slo.ttft) &&
        (slo.tpot === undefined || tpot <= slo.tpot) &&
        (slo.e2el === undefined || ms(run.latencies[i]!) <= slo.e2el)
      );
    }).length;
    out.request_goodput = good / run.duration;
  }
  return out;
}

/** Assert that every reported figure equals the hand computation (to 1e-9 relative). */
export function assertFiguresMatch(
  run: SavedRun,
  slo?: { ttft?: number; tpot?: number; e2el?: number },
): void {
  const expected = handComputed(run, slo);
  for (const [field, want] of Object.entries(expected)) {
    const got = (run as unknown as Record<string, unknown>)[field];
    if (want === null) {
      assert.equal(got, null, field);
      continue;
    }
    assert.equal(typeof got, "number", `${field} is reported`);
    assert.ok(
      Math.abs((got as number) - want) <= 1e-9 * Math.max(1, Math.abs(want)),
      `${field}: reported ${String(got)}, hand-computed ${want}`,
    );
  }
}
