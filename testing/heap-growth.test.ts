import assert from "node:assert/strict";
import { test } from "node:test";
import { allocationPerRound, leastAllocation } from "./heap-growth.js";

test("allocationPerRound counts an object a step, even when a GC collects it, and names the site", async () => {
  const kept: { i: number; x: number }[] = [];
  function allocatesOnePerStep(i: number): void {
    kept.push({ i, x: i * 0.5 });
    if (kept.length > 100) kept.length = 0;
  }
  const least = leastAllocation(
    await allocationPerRound(allocatesOnePerStep, { warmup: 500, steps: 20_000, rounds: 2 }),
  );
  // 20,000 objects of at least 16 bytes (a map word and two fields, compressed pointers).
  assert.ok(least.bytes > 20_000 * 12, `${least.bytes} bytes over 20,000 objects`);
  assert.match(least.sites, /allocatesOnePerStep/);
  // Going on for a quiet round (`below`) does not hide a loop that allocates on every step.
  const rounds = await allocationPerRound(allocatesOnePerStep, {
    warmup: 0,
    steps: 2000,
    rounds: 2,
    below: 1000,
    withinMs: 200,
  });
  assert.ok(rounds.length > 2, `${rounds.length} rounds in 200 ms`);
  assert.ok(
    leastAllocation(rounds).bytes > 2000 * 12,
    `${leastAllocation(rounds).bytes} bytes over 2,000 objects`,
  );
});

test("allocationPerRound finds ~0 in a loop that allocates nothing, its own messages not counted", async () => {
  const buf = new Float64Array(16);
  const least = leastAllocation(
    await allocationPerRound(
      (i) => {
        buf[i & 15] = (buf[(i + 1) & 15] ?? 0) + 1;
      },
      { warmup: 5000, steps: 2000, rounds: 3, below: 256 },
    ),
  );
  assert.ok(least.bytes < 256, `${least.bytes} bytes: ${least.sites}`);
});
