import assert from "node:assert/strict";
import { test } from "node:test";
import { hrTimeOf } from "./tracing.js";

test("hrTimeOf: epoch milliseconds as [seconds, nanoseconds], carrying a rounded-up second", () => {
  assert.deepEqual(hrTimeOf(1_700_000_000_123.5), [1_700_000_000, 123_500_000]);
  // An epoch in milliseconds as a double resolves ~0.2 µs: the nanoseconds are that close.
  const [s, ns] = hrTimeOf(1_700_000_000_123.456);
  assert.ok(s === 1_700_000_000 && Math.abs(ns - 123_456_000) < 300, String(ns));
  assert.deepEqual(hrTimeOf(0), [0, 0]);
  assert.deepEqual(hrTimeOf(1999.9999999), [2, 0]);
  assert.deepEqual(hrTimeOf(2.5), [0, 2_500_000]);
});
