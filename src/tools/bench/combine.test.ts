import assert from "node:assert/strict";
import test from "node:test";
import { pairedRatio } from "../../lib/stats.js";
import { formatPooled, poolRatios } from "./combine.js";

test("pooling two chunks' pairs gives the interval of one run over all the pairs", () => {
  const a = [100, 103, 98, 101, 99, 102, 97, 104];
  const b = [101, 102, 99, 103, 100, 101, 99, 103];
  const whole = pairedRatio(a, b);
  const chunk = (lo: number, hi: number) => ({
    other: { ratio: 5 },
    arms: [{ name: "x", ratio: pairedRatio(a.slice(lo, hi), b.slice(lo, hi)) }],
  });
  const [pooled] = poolRatios([
    JSON.parse(JSON.stringify(chunk(0, 3))),
    JSON.parse(JSON.stringify(chunk(3, 8))),
  ]);
  assert.equal(pooled!.path, "arms.0.ratio");
  assert.equal(pooled!.pooled.n, 8);
  assert.ok(Math.abs(pooled!.pooled.ratio - whole.ratio) < 1e-12);
  assert.ok(Math.abs(pooled!.pooled.low - whole.low) < 1e-12);
  assert.ok(Math.abs(pooled!.pooled.high - whole.high) < 1e-12);
  assert.match(
    formatPooled([pooled!], { atLeast: 0.9 }),
    /arms\.0\.ratio: .* over 8 pairs.*\n {2}≥ 90\.0%: holds$/,
  );
  assert.match(formatPooled([pooled!], { atMost: 0.9 }), /\n {2}≤ 90\.0%: FAILS$/);
});

test("with three or more files, each file is also one unit: the interval of the files' mean logs", () => {
  // Three chunks whose pairs agree within each chunk and differ between chunks (a draw per chunk):
  // the pooled interval is narrow, the files' interval is not.
  const chunk = (shift: number) => ({
    r: pairedRatio(
      [100, 100.2, 99.8, 100.1, 99.9].map((x) => x * shift),
      [100, 100, 100, 100, 100],
    ),
  });
  const shifts = [0.99, 1.0, 1.02];
  const [pooled] = poolRatios(shifts.map(chunk));
  const byFile = pooled!.byFile!;
  assert.equal(byFile.n, 3);
  const means = shifts.map((s) => Math.log(chunk(s).r.ratio));
  assert.ok(Math.abs(Math.log(byFile.ratio) - means.reduce((a, b) => a + b) / 3) < 1e-12);
  assert.ok(byFile.high - byFile.low > 3 * (pooled!.pooled.high - pooled!.pooled.low));
  assert.ok(byFile.low < 0.99 && pooled!.pooled.low > 0.99);
  assert.match(
    formatPooled([pooled!], { atLeast: 0.99 }),
    /over 15 pairs.*\n {2}≥ 99\.0%: holds\n {2}each file one unit: .* over 3 files\n {4}≥ 99\.0%: undecided$/,
  );
  assert.equal(poolRatios([chunk(1), chunk(1)])[0]!.byFile, null);
});

test("results of different benchmarks, or without logs, are refused", () => {
  const r = { variantOverBaseline: pairedRatio([1, 2], [2, 1]) };
  assert.throws(() => poolRatios([r, { other: pairedRatio([1, 2], [2, 1]) }]), /has no paired ratio at "/);
  assert.throws(() => poolRatios([{ ratio: 1, low: 0, high: 2, n: 3 }]), /no paired ratios with their logs/);
  // With a path, results of different arm sets pool on the ratio they share.
  const other = { variantOverBaseline: pairedRatio([1, 2], [2, 1]), control: pairedRatio([1, 1], [1, 1]) };
  assert.equal(poolRatios([r, other], "variantOverBaseline")[0]!.pooled.n, 4);
  assert.throws(() => poolRatios([r, other], "control"), /has no paired ratio at "control"/);
  assert.throws(
    () => poolRatios([r], "nothing"),
    /no ratio at "nothing"; the results have variantOverBaseline/,
  );
});
