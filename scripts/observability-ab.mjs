// Observability's cost by build and by thread (docs/benchmarks.md §8, "One exporter a process"):
//   node scripts/observability-ab.mjs ROUNDS NAME=MAIN_JS[:FEATURES] NAME=MAIN_JS[:FEATURES] ...
// FEATURES: a comma-separated list of nohist (--no-phase-metrics), traces (--otlp-endpoint to a
// span sink in this script that counts the spans and drops them), dash (/kvfence/state polled
// every second). Each arm is a threaded `kvfence serve` of the build whose dist/src/cli/main.js is
// MAIN_JS (so two builds compare, e.g. this tree's dist and an older one's), with the bundled model
// and 600 pages. As `kvfence bench observability`: every arm's /metrics scraped every second of
// its own loaded time (polls likewise), bursts of 32 greedy chats (16 in flight, max_tokens 64), a
// round every arm's burst in a rotated order and then reversed, 2 warm-up rounds, CPU (user +
// system, /proc) read at the rounds' edges. Prints each pair's paired ratio of CPU per output
// token and of throughput (95% CI), and each arm's CPU ms per token thread by thread
// (/proc/PID/task/TID/stat over the measured rounds; in a threaded server the threads, by start
// order, are the main thread, V8's four platform threads, the two request-preparation workers,
// then the prefill and the decode worker). OUT=file.json keeps every round.
import { randomBytes } from "node:crypto";
import { writeFileSync } from "node:fs";

const D = new URL("../dist/src/", import.meta.url).pathname;
const { startArm } = await import(`${D}tools/bench/fair-share.js`);
const { round, prompt } = await import(`${D}tools/bench/cluster.js`);
const { cpuSeconds, threadCpuSeconds } = await import(`${D}tools/bench/process-cpu.js`);
const { activeTimer, spanSink } = await import(`${D}tools/bench/observability.js`);
const { pairedRatio } = await import(`${D}lib/stats.js`);
const { bundledModelDir } = await import(`${D}lib/package-root.js`);

const [roundsArg, ...specs] = process.argv.slice(2);
const rounds = Number(roundsArg);
if (!(rounds > 0) || specs.length < 2) {
  process.stderr.write("usage: node scripts/observability-ab.mjs ROUNDS NAME=MAIN_JS[:FEATURES] ...\n");
  process.exit(2);
}
const key = randomBytes(24).toString("hex");

const arms = [];
for (const spec of specs) {
  const [name, rest] = spec.split("=");
  const [main, features = ""] = rest.split(":");
  const on = new Set(features.split(",").filter(Boolean));
  const args = ["--model", bundledModelDir(), "--kv-pages", "600", "--log-level", "warn"];
  if (on.has("nohist")) args.push("--no-phase-metrics");
  const spans = on.has("traces") ? await spanSink() : null;
  if (spans !== null) args.push("--otlp-endpoint", spans.url);
  arms.push({ name, main, args, spans, dash: on.has("dash"), samples: [] });
}
const started = await Promise.all(arms.map((a) => startArm(a.main, "threads", a.args, ["--operator-key", key])));
const headers = { authorization: `Bearer ${key}` };
arms.forEach((a, i) => {
  a.server = started[i];
  const get = (path) =>
    fetch(`${a.server.url}${path}`, { headers })
      .then((r) => r.arrayBuffer())
      .catch(() => {});
  a.timers = [activeTimer(1000, () => void get("/metrics"))];
  if (a.dash) a.timers.push(activeTimer(1000, () => void get("/kvfence/state")));
});
const model = (await (await fetch(`${arms[0].server.url}/v1/models`)).json()).data[0].id;
const prompts = Array.from({ length: 32 }, (_, i) => prompt(i, 200));
let cpu0 = arms.map((a) => cpuSeconds(a.server.pids));
for (let r = -2; r < rounds; r++) {
  const k = ((r % arms.length) + arms.length) % arms.length;
  const once = [...arms.slice(k), ...arms.slice(0, k)];
  const burst = new Map(arms.map((a) => [a, { ns: 0, tokens: 0 }]));
  for (const a of [...once, ...[...once].reverse()]) {
    for (const t of a.timers) t.resume();
    const res = await round({ url: a.server.url, model, maxTokens: 64 }, prompts, 16);
    for (const t of a.timers) t.pause();
    burst.get(a).ns += res.ns;
    burst.get(a).tokens += res.tokens;
  }
  const cpu1 = arms.map((a) => cpuSeconds(a.server.pids));
  if (r === -1) for (const a of arms) a.threads0 = threadCpuSeconds(a.server.pids);
  if (r >= 0) arms.forEach((a, i) => a.samples.push({ ...burst.get(a), cpuSeconds: cpu1[i] - cpu0[i] }));
  cpu0 = cpu1;
}
const pct = (x) => `${(x.ratio * 100).toFixed(2)}% [${(x.low * 100).toFixed(2)}–${(x.high * 100).toFixed(2)}%]`;
const out = { rounds, arms: {}, ratios: {} };
for (const a of arms) {
  const tokens = a.samples.reduce((s, x) => s + x.tokens, 0);
  const perThread = [];
  for (const [id, t] of threadCpuSeconds(a.server.pids)) {
    const d = t - (a.threads0.get(id) ?? 0);
    if (d > 0) perThread.push(+((1000 * d) / tokens).toFixed(4));
  }
  out.arms[a.name] = {
    cpuMsPerToken: (1000 * a.samples.reduce((s, x) => s + x.cpuSeconds, 0)) / tokens,
    spans: a.spans?.spans() ?? 0,
    threadsMsPerToken: perThread,
    rounds: a.samples,
  };
  console.log(JSON.stringify({ arm: a.name, ...out.arms[a.name], rounds: undefined }));
}
for (let i = 1; i < arms.length; i++)
  for (let j = 0; j < i; j++) {
    const [A, B] = [arms[i].samples, arms[j].samples];
    const cpu = pairedRatio(
      A.map((x) => x.cpuSeconds / x.tokens),
      B.map((x) => x.cpuSeconds / x.tokens),
    );
    const tput = pairedRatio(
      A.map((x) => x.tokens / x.ns),
      B.map((x) => x.tokens / x.ns),
    );
    out.ratios[`${arms[i].name}/${arms[j].name}`] = { cpuPerToken: cpu, throughput: tput };
    console.log(`${arms[i].name} / ${arms[j].name}: CPU per token ${pct(cpu)}, throughput ${pct(tput)}`);
  }
if (process.env.OUT) writeFileSync(process.env.OUT, JSON.stringify(out));
await Promise.all(arms.map((a) => a.server.close()));
for (const a of arms) await a.spans?.close();
