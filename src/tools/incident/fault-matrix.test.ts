import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { linkTlsArgs, linkTlsInTests } from "../../../testing/tls-fixtures.js";
import { FAULT_NAMES } from "../../protocol/safety.js";
import { MATRIX_SCENARIOS, NOT_IN_MATRIX, renderMatrix, runMatrix } from "./fault-matrix.js";

const DOC = fileURLToPath(
  new URL(
    import.meta.url.includes("/dist/") ? "../../../../docs/fault-matrix.md" : "../../../docs/fault-matrix.md",
    import.meta.url,
  ),
);

test("MATRIX_SCENARIOS and NOT_IN_MATRIX together name every fault of docs/design.md §5", () => {
  const named = new Set([...MATRIX_SCENARIOS.map((s) => s.fault), ...Object.keys(NOT_IN_MATRIX)]);
  assert.deepEqual([...named].sort(), [...FAULT_NAMES].sort());
});

test("runMatrix() shows each fault's bug with its guards off and each guard alone catching it", {
  timeout: 360_000,
}, async () => {
  // The TCP rows run over TLS links unless KVFENCE_TEST_LINK_TLS=off (the guards sit above the link).
  const cells = await runMatrix({ linkTlsArgs: linkTlsArgs(linkTlsInTests(true)) });
  if (process.env.KVFENCE_WRITE_FAULT_MATRIX === "1") {
    writeFileSync(
      DOC,
      renderMatrix(
        cells,
        "KVFENCE_WRITE_FAULT_MATRIX=1 node --test dist/src/tools/incident/fault-matrix.test.js",
        new Date().toISOString().slice(0, 10),
      ),
    );
  }
  const expectedCells = MATRIX_SCENARIOS.reduce((n, s) => n + 1 + s.guards.length, 0);
  assert.equal(cells.length, expectedCells);
  for (const cell of cells) {
    const label = `${cell.faults.join("+")} with ${cell.guardOn ?? "no guard"} on: ${cell.symptom}`;
    assert.ok(cell.ok, label);
    if (cell.expect === "caught" && cell.caughtAsMiss) {
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
  // The incident row: the over-pool prompt answered 200 with every guard off.
  const incident = cells.find((c) => c.fault === "placeholder-reject" && c.guardOn === null);
  assert.equal(incident?.status, 200);
});
