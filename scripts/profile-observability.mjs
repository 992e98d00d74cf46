// Where the observability's CPU goes (docs/benchmarks.md §8, "Where the cost is: profiles"):
//   node scripts/profile-observability.mjs MODE [requests=160] [concurrency=16] [maxTokens=64] [pollMs=1000]
// MODE: off | hist | traces | dash | all. Starts the built threaded server (dist/) under
// `node --cpu-prof` (one profile per thread: the router, its tokenizer threads, the prefill and
// decode workers) with the mode's features (hist: the default; off, traces and dash add
// --no-phase-metrics; traces and all export spans to a receiver in this script; dash and all poll
// /kvfence/state every pollMs), scrapes /metrics every second in every mode, sends a warm-up batch
// (64 chats, or `requests` if fewer) and waits 7 s (the first span export and its module loading fall before the window), then sends
// `requests` greedy chats and counts, in that window only, each thread's samples that are not idle
// and those whose stack holds observability code (the outermost such frame decides): traces (the
// OpenTelemetry packages, src/lib/tracing.ts), histograms (src/lib/phase-histograms.ts,
// prom-client), node stats and the dashboard (the stats a scrape or poll asks of each node,
// src/router/dashboard.ts). Samples, not time: a thread descheduled on a loaded machine shows as one
// long sample. KVFENCE_MAIN=path/to/main.js profiles another build (a before/after). Prints one JSON
// line per thread and a total; the profiles stay in $TMPDIR/kvfence-profile-MODE/.
//
// KVFENCE_PROFILER=callgrind counts instructions instead, which do not depend on the machine's
// load or speed: the server runs under `valgrind --tool=callgrind` with instrumentation off until
// the window opens (`callgrind_control -i on`); the window is the batch and then 7 s more, so the
// spans the batch made are built and exported inside it (the warm-up's were before), and it
// closes with a dump (`callgrind_control -d`); /metrics is scraped (and /kvfence/state polled, in
// dash and all) once every KVFENCE_CALLGRIND_PER_SCRAPE (30) chats, about a second of load, not
// every second of the slowed wall time; the chats are streamed. Prints the window's instructions (every thread, user
// space only: not the kernel's share of the HTTP posts), in total and per output token.
import { spawn } from "node:child_process";
import { mkdirSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const MODES = ["off", "hist", "traces", "dash", "all"];
const [mode, requests = "160", concurrency = "16", maxTokens = "64", pollMs = "1000"] = process.argv.slice(2);
if (!MODES.includes(mode)) {
  process.stderr.write(
    `usage: node scripts/profile-observability.mjs ${MODES.join("|")} [requests] [concurrency] [maxTokens] [pollMs]\n`,
  );
  process.exit(2);
}
const main = process.env.KVFENCE_MAIN ?? fileURLToPath(new URL("../dist/src/cli/main.js", import.meta.url));
const callgrind = process.env.KVFENCE_PROFILER === "callgrind";
const dir = join(tmpdir(), `kvfence-${callgrind ? "callgrind" : "profile"}-${mode}`);
rmSync(dir, { recursive: true, force: true });
mkdirSync(dir, { recursive: true });

let spans = 0;
const sink = createServer((req, res) => {
  let body = "";
  req.setEncoding("utf8");
  req.on("data", (c) => {
    body += c;
  });
  req.on("end", () => {
    spans += body.split('"spanId"').length - 1;
    res.end("{}");
  });
});
await new Promise((resolve) => sink.listen(0, "127.0.0.1", resolve));

const key = "kvfence-profile-operator-key-0001";
const args = [main, "serve", "--host", "127.0.0.1", "--port", "0"];
args.push("--log-level", "warn", "--kv-pages", "600", "--operator-key", key);
if (mode === "off" || mode === "traces" || mode === "dash") args.push("--no-phase-metrics");
if (mode === "traces" || mode === "all")
  args.push("--otlp-endpoint", `http://127.0.0.1:${sink.address().port}`);
const child = callgrind
  ? spawn(
      "valgrind",
      [
        "--tool=callgrind",
        "--instr-atstart=no",
        `--callgrind-out-file=${join(dir, "callgrind.out")}`,
        process.execPath,
        ...args,
      ],
      { stdio: ["ignore", "pipe", "ignore"] },
    )
  : spawn(process.execPath, ["--cpu-prof", `--cpu-prof-dir=${dir}`, ...args], {
      stdio: ["ignore", "pipe", "inherit"],
    });
const url = await new Promise((resolve, reject) => {
  let out = "";
  child.on("exit", (code) => reject(new Error(`the server exited (${code})`)));
  child.stdout.on("data", (d) => {
    out += d;
    const m = /(?:listening at| at) (https?:\/\/\S+)/.exec(out);
    if (m !== null) resolve(m[1]);
  });
});
const model = (await (await fetch(`${url}/v1/models`)).json()).data[0].id;
const headers = { authorization: `Bearer ${key}` };
const counts = { polls: 0, scrapes: 0 };
const get = async (path, field) => {
  try {
    await (await fetch(`${url}${path}`, { headers })).arrayBuffer();
    counts[field]++;
  } catch {
    // stopping
  }
};
const dashboard = mode === "dash" || mode === "all";
// Under valgrind a second of wall time is a fraction of a second of load: scrape (and poll) after
// every KVFENCE_CALLGRIND_PER_SCRAPE chats instead (30: about a second of this server's load).
const perScrape = Number(process.env.KVFENCE_CALLGRIND_PER_SCRAPE ?? 30);
const timers = callgrind ? [] : [setInterval(() => void get("/metrics", "scrapes"), 1000)];
if (dashboard && !callgrind)
  timers.push(setInterval(() => void get("/kvfence/state", "polls"), Number(pollMs)));

async function batch(n) {
  let next = 0;
  let tokens = 0;
  let done = 0;
  const one = async () => {
    while (next < n) {
      const i = next++;
      const record = `the access code of account ${1000 + i} is X${i % 10}. `;
      const content = `${record.repeat(4)}what is the access code of account ${1000 + i}?`;
      const res = await fetch(`${url}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({
          model,
          messages: [{ role: "user", content }],
          max_tokens: Number(maxTokens),
          temperature: 0,
          // Streamed under valgrind, where a whole answer takes longer than fetch waits for headers (300 s).
          ...(callgrind ? { stream: true, stream_options: { include_usage: true } } : {}),
        }),
      });
      if (callgrind) {
        const events = await res.text();
        tokens += Number(/"completion_tokens":(\d+)/.exec(events.slice(events.lastIndexOf('"usage"')))?.[1] ?? 0);
      } else tokens += (await res.json()).usage?.completion_tokens ?? 0;
      if (callgrind && ++done % perScrape === 0)
        await Promise.all([get("/metrics", "scrapes"), dashboard ? get("/kvfence/state", "polls") : null]);
    }
  };
  await Promise.all(Array.from({ length: Number(concurrency) }, one));
  return tokens;
}
await batch(Math.min(64, Number(requests)));
await new Promise((resolve) => setTimeout(resolve, 7000));
const control = (...a) =>
  new Promise((resolve, reject) =>
    spawn("callgrind_control", [...a, String(child.pid)], { stdio: "ignore" }).on("exit", (code) =>
      code === 0 ? resolve() : reject(new Error(`callgrind_control ${a.join(" ")}: exit ${code}`)),
    ),
  );
if (callgrind) await control("-i", "on");
// V8's profile times and process.hrtime are the same monotonic clock, in µs here.
const start = Number(process.hrtime.bigint() / 1000n);
const tokens = await batch(Number(requests));
const end = Number(process.hrtime.bigint() / 1000n);
if (callgrind) {
  await new Promise((resolve) => setTimeout(resolve, 7000));
  await control("-d");
}
for (const t of timers) clearInterval(t);
child.removeAllListeners("exit");
child.kill("SIGTERM");
await new Promise((resolve) => child.on("exit", resolve));
sink.close();

if (callgrind) {
  // The dump of the window (callgrind.out.1; the one at exit, of nothing since, is callgrind.out).
  const dump = readFileSync(join(dir, "callgrind.out.1"), "utf8");
  const ir = Number(/^(?:summary|totals): (\d+)/m.exec(dump)[1]);
  console.log(JSON.stringify({ mode, tokens, spans, ...counts, instructions: ir, perToken: Math.round(ir / tokens) }));
  process.exit(0);
}

const CATEGORIES = [
  ["traces", (f, u) => u.includes("@opentelemetry") || u.includes("lib/tracing")],
  [
    "histograms",
    (f, u) => u.includes("phase-histograms") || u.includes("histogram-recorder") || u.includes("prom-client"),
  ],
  [
    "stats",
    (f, u) =>
      (u.includes("router/dashboard") && f === "dashboardState") ||
      f === "nodeViews" ||
      f === "pageMapOf" ||
      (u.includes("/engine/engine") && f === "stats") ||
      (u.includes("node-core") && f === "stats"),
  ],
];
const total = { busy: 0, traces: 0, histograms: 0, stats: 0 };
for (const file of readdirSync(dir).filter((f) => f.endsWith(".cpuprofile")).sort()) {
  const p = JSON.parse(readFileSync(join(dir, file), "utf8"));
  const byId = new Map(p.nodes.map((n) => [n.id, n]));
  const parent = new Map();
  for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
  const thread = { busy: 0, traces: 0, histograms: 0, stats: 0 };
  let t = p.startTime;
  for (let i = 0; i < p.samples.length; i++) {
    t += p.timeDeltas[i];
    if (t < start || t > end) continue;
    let id = p.samples[i];
    if (byId.get(id).callFrame.functionName === "(idle)") continue;
    thread.busy++;
    let outer = null;
    for (; id !== undefined; id = parent.get(id)) {
      const { functionName, url: u } = byId.get(id).callFrame;
      for (const [name, match] of CATEGORIES) if (match(functionName, u)) outer = name;
    }
    if (outer !== null) thread[outer]++;
  }
  for (const k of Object.keys(total)) total[k] += thread[k];
  console.log(JSON.stringify({ thread: file.split(".")[3], ...thread }));
}
const share = (k) => `${((100 * total[k]) / total.busy).toFixed(2)}%`;
console.log(
  JSON.stringify({
    mode,
    tokens,
    windowMs: Math.round((end - start) / 1000),
    spans,
    ...counts,
    busySamples: total.busy,
    traces: share("traces"),
    histograms: share("histograms"),
    stats: share("stats"),
  }),
);
