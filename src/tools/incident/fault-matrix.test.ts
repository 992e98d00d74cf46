import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { linkTlsArgs, linkTlsInTests } from "../../../testing/tls-fixtures.js";
import { FAULT_NAMES, type FaultName, isFaultName } from "../../protocol/safety.js";
import {
  MATRIX_SCENARIOS,
  NOT_IN_MATRIX,
  renderMatrix,
  renderTierSection,
  runMatrix,
  TIER_SECTION_HEADING,
} from "./fault-matrix.js";

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

/**
 * `KVFENCE_FAULT_MATRIX_FAULTS=tier-corrupt,spill-race` runs only those rows (with
 * KVFENCE_WRITE_FAULT_MATRIX=1 and only tier rows, their section of the document is rewritten).
 */
const ONLY: readonly FaultName[] | undefined = process.env.KVFENCE_FAULT_MATRIX_FAULTS?.split(",").map(
  (f) => {
    if (!isFaultName(f)) throw new Error(`KVFENCE_FAULT_MATRIX_FAULTS names an unknown fault: ${f}`);
    return f;
  },
);

test("runMatrix() shows each fault's bug with its guards off and each guard alone catching it", {
  // The tier rows add 8 cells of two short server runs each (about 30 s).
  timeout: 420_000,
}, async () => {
  // The TCP rows run over TLS links unless KVFENCE_TEST_LINK_TLS=off (the guards sit above the link).
  const cells = await runMatrix({
    linkTlsArgs: linkTlsArgs(linkTlsInTests(true)),
    ...(ONLY === undefined ? {} : { faults: ONLY }),
  });
  const tierOnly =
    ONLY !== undefined && MATRIX_SCENARIOS.every((s) => !ONLY.includes(s.fault) || s.victim === "tier");
  if (process.env.KVFENCE_WRITE_FAULT_MATRIX === "1" && tierOnly) {
    const doc = readFileSync(DOC, "utf8");
    const at = doc.indexOf(TIER_SECTION_HEADING);
    assert.ok(at >= 0, `${DOC} has no tier section`);
    writeFileSync(DOC, `${doc.slice(0, at)}${renderTierSection(cells).join("\n")}\n`);
  } else if (process.env.KVFENCE_WRITE_FAULT_MATRIX === "1") {
    assert.equal(ONLY, undefined, "the whole document is written from the whole matrix");
    writeFileSync(
      DOC,
      renderMatrix(
        cells,
        "KVFENCE_WRITE_FAULT_MATRIX=1 node --test dist/src/tools/incident/fault-matrix.test.js",
        new Date().toISOString().slice(0, 10),
      ),
    );
  }
  const expectedCells = MATRIX_SCENARIOS.filter((s) => ONLY === undefined || ONLY.includes(s.fault)).reduce(
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
  // The incident row: the over-pool prompt answered 200 with every guard off.
  if (ONLY === undefined) {
    const incident = cells.find((c) => c.fault === "placeholder-reject" && c.guardOn === null);
    assert.equal(incident?.status, 200);
  }
});
