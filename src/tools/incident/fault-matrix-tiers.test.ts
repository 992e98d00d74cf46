/**
 * The KV tiers' rows of the fault × guard matrix (src/tools/incident/tier-cells.ts), beside the
 * other rows (fault-matrix.test.ts) so the two halves run in parallel: each tier fault's bug with
 * its guard off (a page served from a corrupt, planted, stale or racing record), and its guard
 * alone catching it. `KVFENCE_WRITE_FAULT_MATRIX=1` rewrites the tier section of
 * docs/fault-matrix.md from this run.
 */
import assert from "node:assert/strict";
import { readFileSync, writeFileSync } from "node:fs";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { assertMatrixCells } from "../../../testing/fault-matrix-cells.js";
import { MATRIX_SCENARIOS, renderTierSection, runMatrix, TIER_SECTION_HEADING } from "./fault-matrix.js";

const DOC = fileURLToPath(
  new URL(
    import.meta.url.includes("/dist/") ? "../../../../docs/fault-matrix.md" : "../../../docs/fault-matrix.md",
    import.meta.url,
  ),
);

test("runMatrix() shows each KV-tier fault's bug with its guard off and the guard alone catching it", {
  timeout: 300_000,
}, async () => {
  const faults = MATRIX_SCENARIOS.filter((s) => s.victim === "tier").map((s) => s.fault);
  assert.ok(faults.length >= 4, "the tier rows: corrupt, planted, stale epoch, spill race");
  const cells = await runMatrix({ faults });
  if (process.env.KVFENCE_WRITE_FAULT_MATRIX === "1") {
    const doc = readFileSync(DOC, "utf8");
    const at = doc.indexOf(TIER_SECTION_HEADING);
    assert.ok(at >= 0, `${DOC} has no tier section`);
    writeFileSync(DOC, `${doc.slice(0, at)}${renderTierSection(cells).join("\n")}\n`);
  }
  assertMatrixCells(cells, faults);
});
