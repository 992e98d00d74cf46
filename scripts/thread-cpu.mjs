// Where two builds' CPU goes, thread by thread (docs/benchmarks.md §2, the fair-share run):
//   node scripts/thread-cpu.mjs A_DIR B_DIR [rounds=6] [requests=64] [-- serve flags of A]
// Starts `kvfence serve` (the default threaded topology, the bundled model, 600 pages, one tenant's
// keys file) of each built checkout (A_DIR, B_DIR: folders holding dist/src/cli/main.js), sends
// each the same greedy chats of `kvfence bench fair-share` (the bench's prompts, 16 in flight,
// max_tokens 64) in interleaved rounds (ABBA), and sums each thread's CPU ticks (user + system,
// /proc/PID/task/TID/stat) over the measured rounds only. Threads are named by their place in the
// process: `main` (the router's event loop), then every other thread in the order it was started
// (V8's platform threads first; a kvfence serve starts its request-preparation workers before
// the prefill and then the decode worker). Prints one JSON line per build: tokens, ticks per
// thread, and output tokens per CPU second.
import { spawn } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const argv = process.argv.slice(2);
const dash = argv.indexOf("--");
const [aDir, bDir, rounds = "6", requests = "64"] = dash < 0 ? argv : argv.slice(0, dash);
const aArgs = dash < 0 ? [] : argv.slice(dash + 1);
if (aDir === undefined || bDir === undefined) {
  process.stderr.write("usage: node scripts/thread-cpu.mjs A_DIR B_DIR [rounds] [requests] [-- serve flags of A]\n");
  process.exit(2);
}
const here = fileURLToPath(new URL("..", import.meta.url));
const { prompt, round } = await import(join(here, "dist/src/tools/bench/cluster.js"));
const model = join(here, "models/kvfence-tiny");
const dir = mkdtempSync(join(tmpdir(), "kvfence-thread-cpu-"));
const KEY = "sk-bench-tenant-alone-1";
writeFileSync(join(dir, "keys.json"), JSON.stringify({ [KEY]: "alone" }));

async function start(root, extra) {
  const main = join(resolve(root), "dist/src/cli/main.js");
  const args = [main, "serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warn", "--model", model];
  args.push("--kv-pages", "600", "--api-keys", join(dir, "keys.json"), ...extra);
  const child = spawn(process.execPath, args, { stdio: ["ignore", "pipe", "inherit"] });
  const url = await new Promise((ok, fail) => {
    let out = "";
    child.on("exit", (code) => fail(new Error(`${main} serve exited (${code})`)));
    child.stdout.on("data", (d) => {
      out += d;
      const m = /(?:listening at| at) (https?:\/\/\S+)/.exec(out);
      if (m !== null) ok(m[1]);
    });
  });
  child.removeAllListeners("exit");
  return { root, child, url, ticks: new Map(), tokens: 0 };
}

/** Each thread's ticks so far, by tid. */
function ticksOf(pid) {
  const out = new Map();
  for (const tid of readdirSync(`/proc/${pid}/task`)) {
    try {
      const stat = readFileSync(`/proc/${pid}/task/${tid}/stat`, "utf8");
      const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      out.set(Number(tid), Number(f[11]) + Number(f[12]));
    } catch {
      // the thread ended
    }
  }
  return out;
}

const servers = [await start(aDir, aArgs), await start(bDir, [])];
const headers = { authorization: `Bearer ${KEY}` };
const modelId = (await (await fetch(`${servers[0].url}/v1/models`, { headers })).json()).data[0].id;
const prompts = Array.from({ length: Number(requests) }, (_, i) => prompt(i, 400));
for (let r = -1; r < Number(rounds); r++) {
  for (const s of r % 2 === 0 ? servers : [...servers].reverse()) {
    const before = ticksOf(s.child.pid);
    const result = await round({ url: s.url, model: modelId, maxTokens: 64, apiKey: KEY }, prompts, 16);
    if (r < 0) continue; // warm-up
    s.tokens += result.tokens;
    for (const [tid, t] of ticksOf(s.child.pid)) s.ticks.set(tid, (s.ticks.get(tid) ?? 0) + t - (before.get(tid) ?? 0));
  }
}
for (const s of servers) {
  s.child.kill("SIGTERM");
  const tids = [...s.ticks.keys()].sort((x, y) => x - y);
  const threads = Object.fromEntries(
    tids
      .map((tid, i) => [tid === s.child.pid ? "main" : `thread${i}`, s.ticks.get(tid)])
      .filter(([, t]) => t > 0),
  );
  const total = [...s.ticks.values()].reduce((x, y) => x + y, 0);
  console.log(JSON.stringify({ build: s.root, tokens: s.tokens, ticks: total, tokensPerCpuSecond: Math.round(s.tokens / (total / 100)), threads }));
}
rmSync(dir, { recursive: true, force: true });
