// The test suite (npm test): every compiled test file under dist/, two files at a time, then the
// latency tests (`*.solo.test.js`) one at a time with nothing else running. A solo test measures
// one tenant's latency while another tenant floods the server, against a baseline taken in the
// same test: on a 2-core machine another test file's load would be what it measured.
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { join } from "node:path";

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return entry.name === "node_modules" ? [] : testFiles(path);
    return entry.name.endsWith(".test.js") ? [path] : [];
  });
}

const files = testFiles("dist").sort();
const solo = files.filter((f) => f.endsWith(".solo.test.js"));
const shared = files.filter((f) => !f.endsWith(".solo.test.js"));
const run = (list, concurrency) =>
  spawnSync(
    process.execPath,
    ["--test", `--test-concurrency=${concurrency}`, "--test-timeout=300000", ...list],
    { stdio: "inherit" },
  ).status;

let status = run(shared, 2);
if (solo.length > 0) status = run(solo, 1) || status;
process.exit(status ?? 1);
