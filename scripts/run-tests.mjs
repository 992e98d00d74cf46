// The test suite (npm test): every compiled test file under dist/, two files at a time, then the
// latency tests (`*.solo.test.js`) one at a time with nothing else running. A solo test measures
// one tenant's latency while another tenant floods the server, against a baseline taken in the
// same test: on a 2-core machine another test file's load would be what it measured.
//
// `--unit` runs the part of the suite a second Node version needs within CI's time (.ci/run runs
// the whole suite on Node 24 and this part on Node 20): every file but the end-to-end tests of
// processes and sockets (`*.e2e.test.js`), the long runs below and the solo latency tests. What it
// keeps is where Node versions differ: the kernels (relaxed SIMD with or without V8's flag), the
// model's parity, the allocation bounds, the engine, the protocol machines, the router over real
// HTTP with the openai client, the threaded topology.
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { join } from "node:path";

/** Files that run for most of a minute each (measured on 2 cores), left out of `--unit`. */
const LONG = new Set([
  "dist/src/tools/check/run-check.test.js", // the model checker over the real machines
  "dist/src/tools/incident/fault-matrix.test.js", // every fault against every guard, real servers
  "dist/src/tools/incident/fault-matrix-tiers.test.js", // the same for the KV tiers' faults
  "dist/src/tools/incident/incident.test.js", // the incident replayed on real servers
  "dist/src/model/recall.test.js", // the bundled model's recall of 200 held-out records
]);

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === "node_modules" ? [] : testFiles(path);
    return entry.name.endsWith(".test.js") ? [path] : [];
  });
}

const unit = process.argv.includes("--unit");
const files = testFiles("dist").sort();
const solo = unit ? [] : files.filter((f) => f.endsWith(".solo.test.js"));
const shared = files.filter(
  (f) => !f.endsWith(".solo.test.js") && !(unit && (f.endsWith(".e2e.test.js") || LONG.has(f))),
);
const run = (list, concurrency) =>
  spawnSync(
    process.execPath,
    ["--test", `--test-concurrency=${concurrency}`, "--test-timeout=300000", ...list],
    { stdio: "inherit" },
  ).status;

console.log(`Node ${process.version}: ${shared.length + solo.length} test files${unit ? " (--unit)" : ""}`);
let status = run(shared, 2);
if (solo.length > 0) status = run(solo, 1) || status;
process.exit(status ?? 1);
