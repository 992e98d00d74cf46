import assert from "node:assert/strict";
import { test } from "node:test";
import { linkTlsArgs, linkTlsInTests } from "../../../testing/tls-fixtures.js";
import { INCIDENT_FAULTS, INCIDENT_GUARDS, runIncident } from "./incident.js";

/** The probe's findings that mean a wrong 200 or a leak (a 5xx from a guard is `not-4xx`). */
const CATCHING_KINDS = ["leak", "over-limit-accepted", "wrong-answer", "usage-mismatch"];

test("runIncident() lets the probe catch the incident with every guard off", {
  timeout: 120_000,
}, async () => {
  const run = await runIncident({ faults: INCIDENT_FAULTS, disabledGuards: [...INCIDENT_GUARDS] });
  assert.equal(run.report.outcome, "findings");
  // Over-limit prompts were answered 200 (the wrong 200 of the incident).
  assert.ok((run.findingKinds["over-limit-accepted"] ?? 0) > 0, JSON.stringify(run.findingKinds));
  // And the leak as text: one of tenant A's planted codes in tenant B's HTTP-200 answer.
  assert.ok((run.findingKinds.leak ?? 0) > 0, JSON.stringify(run.findingKinds));
  // The probe finds it within 60 seconds on this machine.
  assert.ok(run.report.durationMs < 60_000, `probe took ${run.report.durationMs} ms`);
  // No guard counted anything: every guard was off.
  assert.equal(run.guardCounters.kvfence_transfer_coverage_failures_total, 0);
  assert.equal(run.guardCounters.kvfence_transfer_checksum_failures_total, 0);
  assert.equal(run.guardCounters.kvfence_tag_check_failures_total, 0);
});

for (const guard of INCIDENT_GUARDS) {
  test(`runIncident() with only the ${guard} guard on answers no over-limit prompt with 200`, {
    timeout: 120_000,
  }, async () => {
    const run = await runIncident({
      faults: INCIDENT_FAULTS,
      disabledGuards: INCIDENT_GUARDS.filter((g) => g !== guard),
    });
    for (const kind of CATCHING_KINDS)
      assert.equal(run.findingKinds[kind] ?? 0, 0, `${kind}: ${JSON.stringify(run.findingKinds)}`);
    const counter = {
      "admission-doors": "kvfence_admission_rejections_total",
      coverage: "kvfence_transfer_coverage_failures_total",
      checksum: "kvfence_transfer_checksum_failures_total",
      "page-tags": "kvfence_tag_check_failures_total",
    }[guard];
    assert.ok((run.guardCounters[counter] ?? 0) > 0, `${counter} stayed 0`);
  });
}

test("runIncident() with every guard on reports clean: over-limit prompts get 400", {
  timeout: 120_000,
}, async () => {
  const run = await runIncident({ faults: INCIDENT_FAULTS, disabledGuards: [] });
  assert.equal(run.report.outcome, "clean", JSON.stringify(run.report.findings.slice(0, 3)));
  assert.ok((run.guardCounters.kvfence_admission_rejections_total ?? 0) > 0);
});

test("runProbe() reports clean against a default kvfence server", { timeout: 120_000 }, async () => {
  const run = await runIncident({ faults: [], disabledGuards: [], defaults: true });
  assert.equal(run.report.outcome, "clean", JSON.stringify(run.report.findings.slice(0, 3)));
  assert.equal(run.report.findings.length, 0);
});

test("runProbe() reports clean against a default kvfence cluster (processes, TCP links over TLS)", {
  timeout: 120_000,
}, async () => {
  const run = await runIncident({
    faults: [],
    disabledGuards: [],
    defaults: true,
    topology: "tcp",
    linkTlsArgs: linkTlsArgs(linkTlsInTests(true)),
  });
  assert.equal(run.report.outcome, "clean", JSON.stringify(run.report.findings.slice(0, 3)));
  assert.equal(run.report.findings.length, 0);
});
