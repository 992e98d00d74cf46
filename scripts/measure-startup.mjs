// Spawn -> first token and peak RSS of `kvfence serve` (docs/topologies.md, "Kernels and threads"):
//   node scripts/measure-startup.mjs MODEL [serve options...]
// spawns the built server (dist/) on a free-ish port, streams one 4-token completion as soon as it
// answers, and prints the time from spawn to the first streamed chunk and the server's peak RSS
// (VmHWM from /proc/PID/status, Linux) as one JSON line. KVFENCE_MAIN=path/to/main.js measures
// another build (e.g. main's, for a before/after). Run it several times, interleaved: one run is noise.
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";

const [model, ...extra] = process.argv.slice(2);
if (model === undefined) {
  process.stderr.write("usage: node scripts/measure-startup.mjs MODEL [serve options...]\n");
  process.exit(2);
}
const main = process.env.KVFENCE_MAIN ?? fileURLToPath(new URL("../dist/src/cli/main.js", import.meta.url));
const port = 18000 + Math.floor(Math.random() * 1000);
const name = model.split("/").filter(Boolean).pop().replace(/\.gguf$/i, "");
const t0 = performance.now();
const child = spawn(
  process.execPath,
  [main, "serve", "--model", model, "--port", String(port), "--log-level", "warn", ...extra],
  { stdio: ["ignore", "ignore", "inherit"] },
);
const peakRss = () => {
  try {
    return Number(readFileSync(`/proc/${child.pid}/status`, "utf8").match(/VmHWM:\s+(\d+)/)?.[1]) * 1024;
  } catch {
    return Number.NaN;
  }
};
let firstTokenMs = Number.NaN;
while (child.exitCode === null && performance.now() - t0 < 300_000) {
  try {
    const r = await fetch(`http://127.0.0.1:${port}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: name, prompt: "hello", max_tokens: 4, temperature: 0, stream: true }),
    });
    const reader = r.body.getReader();
    await reader.read();
    firstTokenMs = performance.now() - t0;
    while (!(await reader.read()).done);
    if (r.status !== 200) process.stderr.write(`status ${r.status}\n`);
    break;
  } catch {
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}
const rss = peakRss();
console.log(JSON.stringify({ model, extra, spawnToFirstTokenMs: Math.round(firstTokenMs), peakRssMB: Math.round(rss / 1e6) }));
child.kill("SIGTERM");
await new Promise((resolve) => child.on("exit", resolve));
