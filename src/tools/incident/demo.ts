/**
 * `npm run demo:incident`: the incident of docs/design.md §1, reproduced on a real kvfence server and
 * then stopped by each guard, with a narrated output for people. It starts a threaded server whose
 * prefill pool (256 tokens) is smaller than the context window (1,024 tokens), switches on the
 * `undersized-pool` and `placeholder-reject` faults, switches every guard off, and runs the canary
 * leak probe against it; then it repeats the run with each guard alone, and with every guard on.
 */
import { exitCodeOf } from "../probe/probe-report.js";
import { MATRIX_SCENARIOS, runCell } from "./fault-matrix.js";
import {
  INCIDENT_FAULTS,
  INCIDENT_GUARDS,
  INCIDENT_SHAPE,
  type IncidentRun,
  runIncident,
} from "./incident.js";

const out = (line = ""): void => void process.stdout.write(`${line}\n`);

function describe(run: IncidentRun): string {
  const kinds = Object.entries(run.findingKinds)
    .map(([k, n]) => `${n} ${k}`)
    .join(", ");
  return `${run.report.outcome}${kinds === "" ? "" : ` (${kinds})`} in ${(run.report.durationMs / 1000).toFixed(1)} s`;
}

function counters(run: IncidentRun): string {
  return Object.entries(run.guardCounters)
    .filter(([, v]) => v > 0)
    .map(([k, v]) => `${k.replace(/^kvfence_/, "")}=${v}`)
    .join(", ");
}

async function main(): Promise<void> {
  out("kvfence incident demo");
  out("=====================");
  out();
  out("The incident: a model served with a context window larger than the prefill node's KV pool.");
  out("A prompt too long for that pool was swapped for a one-token placeholder; prefill reported");
  out("the transfer complete; decode generated from pages it had reserved but never received, which");
  out("still held earlier customers' KV (pages are not zeroed); the client got HTTP 200, not 400.");
  out();
  out(
    `This server: window ${INCIDENT_SHAPE.maxModelLen} tokens, prefill pool ${INCIDENT_SHAPE.prefillKvPages * INCIDENT_SHAPE.pageSize} tokens, ` +
      `decode pool ${INCIDENT_SHAPE.decodeKvPages * INCIDENT_SHAPE.pageSize} tokens (threads, shared memory).`,
  );
  out(`Faults on: ${INCIDENT_FAULTS.join(", ")}. The detector is \`kvfence probe\` (runProbe):`);
  out("tenant A plants access codes, tenant B sends prompts at and around every limit.");
  out();
  out(`1. Every guard off (${INCIDENT_GUARDS.join(", ")}):`);
  const bad = await runIncident({ faults: INCIDENT_FAULTS, disabledGuards: [...INCIDENT_GUARDS] });
  out(`   probe: ${describe(bad)}`);
  const leaks = bad.report.findings.filter((f) => f.kind === "leak");
  for (const f of [...leaks, ...bad.report.findings.filter((f) => f.kind !== "leak")].slice(0, 4)) {
    out(`   - [${f.kind}] ${f.case}: ${f.message}`);
    if (f.excerpt !== undefined) out(`       answer: ${JSON.stringify(f.excerpt.slice(0, 100))}`);
  }
  if (leaks.length > 0) out(`   => tenant A's code found in ${leaks.length} of tenant B's HTTP-200 answers.`);
  else out("   => over-limit prompts answered HTTP 200 from pages that never received their KV.");
  out();
  out("   By hand: tenant A sends three prompts that nearly fill the prefill pool (codes such as");
  out("   QX7-PL2), then tenant B sends a prompt just over it, asking for A's account 4821:");
  const cell = await runCell(MATRIX_SCENARIOS[0]!, null);
  out(
    `   B got HTTP ${cell.status}; answer ${JSON.stringify(cell.answer)}${cell.leakedCode ? " — tenant A's code, in tenant B's answer" : ""}`,
  );
  out();
  out("2. Each guard alone (the other three still off):");
  for (const guard of INCIDENT_GUARDS) {
    const run = await runIncident({
      faults: INCIDENT_FAULTS,
      disabledGuards: INCIDENT_GUARDS.filter((g) => g !== guard),
    });
    const wrong200 = (run.findingKinds["over-limit-accepted"] ?? 0) + (run.findingKinds.leak ?? 0);
    out(
      `   ${guard.padEnd(16)} ${wrong200 === 0 ? "blocks it" : "DOES NOT block it"}: ${describe(run)}; caught: ${counters(run)}`,
    );
  }
  out("   (a 5xx from a guard is still a probe finding, `not-4xx`: only the admission doors give the 400)");
  out();
  out("3. Every guard on (the faults still on):");
  const good = await runIncident({ faults: INCIDENT_FAULTS, disabledGuards: [] });
  out(`   probe: ${describe(good)}; caught: ${counters(good)}`);
  out();
  const reproduced = exitCodeOf(bad.report) === 1 && (bad.findingKinds["over-limit-accepted"] ?? 0) > 0;
  const stopped = good.report.outcome === "clean";
  out(reproduced && stopped ? "Incident reproduced, and stopped by every guard." : "UNEXPECTED: see above.");
  process.exitCode = reproduced && stopped ? 0 : 1;
}

await main();
