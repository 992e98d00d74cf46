import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { assertMatrixCells } from "../../../testing/fault-matrix-cells.js";
import { linkTlsArgs, linkTlsInTests } from "../../../testing/tls-fixtures.js";
import { FAULT_NAMES, type FaultName, isFaultName } from "../../protocol/safety.js";
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

/** `KVFENCE_FAULT_MATRIX_FAULTS=corrupt-transfer,shared-prefix` runs only those rows. */
const ONLY: readonly FaultName[] | undefined = process.env.KVFENCE_FAULT_MATRIX_FAULTS?.split(",").map(
  (f) => {
    if (!isFaultName(f)) throw new Error(`KVFENCE_FAULT_MATRIX_FAULTS names an unknown fault: ${f}`);
    return f;
  },
);

test("runMatrix() shows each fault's bug with its guards off and each guard alone catching it", {
  timeout: 420_000,
}, async () => {
  // The TCP rows run over TLS links unless KVFENCE_TEST_LINK_TLS=off (the guards sit above the link).
  // The tier rows run in fault-matrix-tiers.test.ts (beside these), unless the whole document is written.
  const writeAll = process.env.KVFENCE_WRITE_FAULT_MATRIX === "1" && ONLY === undefined;
  const faults = ONLY ?? MATRIX_SCENARIOS.filter((s) => writeAll || s.victim !== "tier").map((s) => s.fault);
  const cells = await runMatrix({ linkTlsArgs: linkTlsArgs(linkTlsInTests(true)), faults });
  if (process.env.KVFENCE_WRITE_FAULT_MATRIX === "1") {
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
  assertMatrixCells(cells, faults);
  // The incident row: the over-pool prompt answered 200 with every guard off.
  if (ONLY === undefined) {
    const incident = cells.find((c) => c.fault === "placeholder-reject" && c.guardOn === null);
    assert.equal(incident?.status, 200);
  }
});
