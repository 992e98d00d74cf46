/**
 * `kvfence bench startup`: spawn-to-first-token and peak RSS of `kvfence serve MODEL` (issue #33's
 * start-up line: at most 1.5× llama.cpp's spawn-to-first-token on the same file, and a peak RSS of
 * at most the weights + the KV pools + 150 MB). Each run spawns a server on a free port, reads its
 * address from its first line, sends one completion of `max_tokens` 1 and times spawn → answer;
 * the peak RSS is the server's VmHWM (/proc) read before it is stopped. With `--baseline DIR` (a
 * built checkout) the two builds' runs are interleaved, so a loaded machine weighs on both alike.
 * The weights are the model's files; the pools are read from the server's "engine ready" log line
 * (one pool an engine: two in the default topology).
 */
import { type ChildProcess, spawn } from "node:child_process";
import { once } from "node:events";
import { readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { Command } from "commander";
import { packageRoot } from "../../lib/package-root.js";
import { median } from "../../lib/stats.js";
import { openModelMeta, weightFilesOf } from "../../model/load-model.js";
import { positiveInteger, runBenchCli } from "./bench-cli.js";

/** What the budget allows beyond the weights and the pools (issue #33). */
export const RSS_ALLOWANCE_BYTES = 150e6;

/** One server start. */
export interface StartupRun {
  readonly build: string;
  readonly seconds: number;
  readonly peakRssBytes: number;
  /** Bytes of every engine's KV pool, from the "engine ready" line. */
  readonly poolBytes: number;
}

export interface StartupReport {
  readonly model: string;
  readonly weightBytes: number;
  readonly runs: readonly StartupRun[];
  /** Per build: median seconds and peak RSS, and the RSS budget (weights + pools + 150 MB). */
  readonly builds: readonly {
    readonly build: string;
    readonly medianSeconds: number;
    readonly secondsRange: readonly [number, number];
    readonly medianPeakRssBytes: number;
    readonly poolBytes: number;
    readonly rssBudgetBytes: number;
  }[];
  readonly failures: readonly string[];
}

/** The per-build medians of `runs` and the RSS verdict (a build over its budget is a failure). */
export function summarizeStartup(weightBytes: number, runs: readonly StartupRun[]): StartupReport["builds"] {
  const names = [...new Set(runs.map((r) => r.build))];
  return names.map((build) => {
    const mine = runs.filter((r) => r.build === build);
    const seconds = mine.map((r) => r.seconds);
    const poolBytes = median(mine.map((r) => r.poolBytes));
    return {
      build,
      medianSeconds: median(seconds),
      secondsRange: [Math.min(...seconds), Math.max(...seconds)] as const,
      medianPeakRssBytes: median(mine.map((r) => r.peakRssBytes)),
      poolBytes,
      rssBudgetBytes: weightBytes + poolBytes + RSS_ALLOWANCE_BYTES,
    };
  });
}

/** Spawns `kvfence serve` of `root` (a built checkout), times its first token, reads its peak RSS. */
async function startOnce(
  root: string,
  model: string,
  args: readonly string[],
): Promise<Omit<StartupRun, "build">> {
  const started = performance.now();
  const child = spawn(
    process.execPath,
    [join(root, "dist/src/cli/main.js"), "serve", model, "--host", "127.0.0.1", "--port", "0", ...args],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  try {
    let out = "";
    let log = ""; // pino's lines, the "engine ready" one among them
    child.stdout.setEncoding("utf8");
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (d: string) => {
      log += d;
    });
    const url = await new Promise<string>((resolve, reject) => {
      child.stdout.on("data", (d: string) => {
        out += d;
        const m = /serving \S+ at (http:\/\/\S+) /.exec(out);
        if (m !== null) resolve(m[1]!);
      });
      child.once("exit", (code) => reject(new Error(`the server exited with code ${code} before serving`)));
    });
    const name = model.split(/[\\/]/).filter(Boolean).at(-1);
    const res = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: name, prompt: "Hello", max_tokens: 1 }),
    });
    const body = (await res.json()) as { choices?: unknown };
    if (!res.ok || body.choices === undefined) throw new Error(`the first completion failed: ${res.status}`);
    const seconds = (performance.now() - started) / 1000;
    const hwm = /VmHWM:\s+(\d+) kB/.exec(readFileSync(`/proc/${child.pid}/status`, "utf8"));
    const ready = `${out}\n${log}`
      .split("\n")
      .filter((l) => l.includes('"engine ready"'))
      .map((l) => JSON.parse(l) as { poolBytes: number; topology: string })[0];
    const engines = ready?.topology === "threads" ? 2 : 1;
    return {
      seconds,
      peakRssBytes: hwm === null ? Number.NaN : Number(hwm[1]) * 1024,
      poolBytes: ready === undefined ? Number.NaN : engines * ready.poolBytes,
    };
  } finally {
    await stop(child);
  }
}

async function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = once(child, "exit");
  child.kill("SIGINT");
  const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
  await exited;
  clearTimeout(timer);
}

export async function runStartupBench(options: {
  readonly model: string;
  readonly runs: number;
  /** A built checkout to interleave with this one. */
  readonly baseline?: string;
  readonly serveArgs?: readonly string[];
  readonly log?: (line: string) => void;
}): Promise<StartupReport> {
  const meta = await openModelMeta(options.model);
  const weightBytes = weightFilesOf(meta).reduce((sum, f) => sum + statSync(f).size, 0);
  const builds = [{ build: "this", root: packageRoot() }];
  if (options.baseline !== undefined) builds.push({ build: "baseline", root: options.baseline });
  const runs: StartupRun[] = [];
  for (let i = 0; i < options.runs; i++) {
    for (const b of builds) {
      const run = { build: b.build, ...(await startOnce(b.root, options.model, options.serveArgs ?? [])) };
      options.log?.(
        `run ${i + 1}/${options.runs} ${b.build}: ${run.seconds.toFixed(2)} s, peak RSS ${(run.peakRssBytes / 1e6).toFixed(0)} MB`,
      );
      runs.push(run);
    }
  }
  const summary = summarizeStartup(weightBytes, runs);
  const failures = summary
    .filter((s) => s.medianPeakRssBytes > s.rssBudgetBytes)
    .map(
      (s) =>
        `${s.build}: peak RSS ${(s.medianPeakRssBytes / 1e6).toFixed(0)} MB is over weights + KV pools + 150 MB: ${(s.rssBudgetBytes / 1e6).toFixed(0)} MB`,
    );
  return { model: options.model, weightBytes, runs, builds: summary, failures };
}

export function formatStartupReport(r: StartupReport): string {
  const mb = (b: number): string => `${(b / 1e6).toFixed(0)} MB`;
  return [
    `startup bench: kvfence serve ${r.model}, ${r.runs.length} runs; weights ${mb(r.weightBytes)}`,
    ...r.builds.map(
      (b) =>
        `  ${b.build}: spawn to first token median ${b.medianSeconds.toFixed(2)} s (${b.secondsRange[0].toFixed(2)}–${b.secondsRange[1].toFixed(2)}), peak RSS median ${mb(b.medianPeakRssBytes)}; weights + KV pools (${mb(b.poolBytes)}) + 150 MB = ${mb(b.rssBudgetBytes)}`,
    ),
    ...r.failures.map((f) => `  FAIL ${f}`),
  ].join("\n");
}

/** `kvfence bench startup`. */
export function startupCommand(): Command {
  return new Command("startup")
    .description("Spawn-to-first-token and peak RSS of `kvfence serve MODEL` over interleaved runs (Linux)")
    .requiredOption("--model <dir|file.gguf>", "model folder or GGUF file to serve")
    .option("--runs <n>", "server starts per build", positiveInteger, 5)
    .option("--baseline <dir>", "a built checkout whose `serve` runs interleaved with this one's")
    .option("--serve-args <args>", 'more `serve` flags, space-separated (e.g. "--kernels wasm")', "")
    .option("--json", "print the report as JSON", false)
    .action(
      async (opts: { model: string; runs: number; baseline?: string; serveArgs: string; json: boolean }) =>
        runBenchCli(
          "startup",
          opts.json,
          (log) =>
            runStartupBench({
              model: opts.model,
              runs: opts.runs,
              ...(opts.baseline === undefined ? {} : { baseline: opts.baseline }),
              serveArgs: opts.serveArgs.split(" ").filter((a) => a !== ""),
              log,
            }),
          formatStartupReport,
        ),
    );
}
