/**
 * What every cell of the fault × guard matrix (src/tools/incident/fault-matrix.ts) must show: with
 * its guards off the bug, with a guard alone on the catch — a refusal counted by the guard, a
 * correct miss, or (the spill copy) a correct hit. Shared by the matrix's two test files.
 */
import assert from "node:assert/strict";
import type { FaultName } from "../src/protocol/safety.js";
import type { CellOutcome } from "../src/tools/incident/fault-matrix.js";
import { MATRIX_SCENARIOS } from "../src/tools/incident/fault-matrix.js";

export function assertMatrixCells(cells: readonly CellOutcome[], faults: readonly FaultName[]): void {
  const expectedCells = MATRIX_SCENARIOS.filter((s) => faults.includes(s.fault)).reduce(
    (n, s) => n + 1 + s.guards.length,
    0,
  );
  assert.equal(cells.length, expectedCells);
  for (const cell of cells) {
    const label = `${cell.faults.join("+")} with ${cell.guardOn ?? "no guard"} on: ${cell.symptom}`;
    assert.ok(cell.ok, label);
    if (cell.expect === "caught" && cell.caughtAsCorrectHit === true) {
      // tier-spill-copy: the spill copied the page, so the tier's hit serves B's own KV.
      assert.equal(cell.status, 200, label);
      assert.equal(cell.differsFromBaseline, false, label);
      assert.equal(cell.leakedCode, false, label);
    } else if (cell.expect === "caught" && cell.caughtAsMiss) {
      // A prefix-cache key guard: a correct miss, nothing of the other prompt reused.
      assert.equal(cell.status, 200, label);
      assert.equal(cell.leakedCode, false, label);
    } else if (cell.expect === "caught") {
      assert.ok(cell.status >= 400 || cell.errorCode === "client aborted", label);
      assert.ok(cell.guardCounterDelta > 0, label);
      assert.equal(cell.leakedCode, false, label);
    } else {
      assert.equal(cell.guardCounterDelta, 0, label);
    }
  }
}
