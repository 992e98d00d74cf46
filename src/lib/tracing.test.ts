/**
 * src/lib/tracing.ts's conversion of a phase's epoch milliseconds to the HrTime the OTLP exporter
 * encodes (the spans themselves, end to end: src/topology/tracing.e2e.test.ts).
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { hrTimeOf } from "./tracing.js";

test("epoch milliseconds to [seconds, nanoseconds], to the nanosecond, carrying a rounded-up second", () => {
  assert.deepEqual(hrTimeOf(1_796_182_840_870.25), [1_796_182_840, 870_250_000]);
  assert.deepEqual(hrTimeOf(1_796_182_840_000), [1_796_182_840, 0]);
  assert.deepEqual(hrTimeOf(12.000_001), [0, 12_000_001]);
  assert.deepEqual(hrTimeOf(1999.999_999_9), [2, 0], "rounds to the next second, not to 1e9 ns");
  assert.deepEqual(hrTimeOf(0), [0, 0]);
});
