import assert from "node:assert/strict";
import { test } from "node:test";
import { TransferClock, TransferMetrics } from "./transfer-metrics.js";

test("TransferMetrics.recordVerdict() counts checksum and coverage failures, not successes", () => {
  const m = new TransferMetrics();
  for (const code of ["ok", "checksum_mismatch", "coverage_mismatch", "stale_manifest", "ok"])
    m.recordVerdict(code);
  assert.equal(m.checksumFailures, 1);
  assert.equal(m.coverageFailures, 2);
});

test("TransferClock.end() records one transfer with its bytes and a positive rate", () => {
  const m = new TransferMetrics();
  const clock = new TransferClock();
  clock.add(1, 1, 1000);
  clock.add(1, 1, 500);
  clock.end(1, 2, m); // another epoch: nothing to end
  assert.equal(m.transfers, 0);
  clock.end(1, 1, m);
  assert.equal(m.transfers, 1);
  assert.ok(m.lastTransferGbps > 0);
  clock.end(1, 1, m);
  assert.equal(m.transfers, 1);
  assert.equal(m.snapshot().transfers, 1);
});
