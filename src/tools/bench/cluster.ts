/**
 * `kvfence bench cluster`: what a cluster feature costs a whole cluster. Starts two local
 * multi-process clusters of the same shape (`--prefill N --decode M`, default 2+2, the bundled
 * model). The baseline has plaintext links and the router's static `--prefill/--decode` lists; the
 * variant (`--compare`) differs in one thing:
 *
 * - `tls`: mutual TLS on every link (docs/tls.md; the test certificates unless
 *   `--tls-cert/--tls-key/--tls-ca`). The goal: within 5% of plaintext.
 * - `registry`: membership in etcd (`--registry`, docs/topologies.md) on a throwaway etcd started
 *   for the run (Debian's etcd-server). The goal: within 2% of the static lists.
 *
 * Each round drives the same batch of chat requests (greedy, fixed prompts and `max_tokens`,
 * `--concurrency` in flight) through each cluster's router, the two arms in alternating order, and
 * measures output tokens per second of wall time. Reported: each arm's median [min–max], and the
 * variant/baseline throughput ratio as the geometric mean of the per-round paired ratios with a 95%
 * confidence interval (`pairedRatio`), beside the raw loopback socket's bandwidth measured in the
 * same rounds (the ceiling every TCP link shares). Both arms must give the same answers (greedy),
 * else the run reports a failure. Run it on a quiet machine; on a shared one the CI says how much
 * to trust the ratio.
 */
import net from "node:net";
import { Command, Option } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import { type LocalCluster, startLocalCluster } from "../../topology/local-cluster.js";
import { etcdAvailable, type LocalEtcd, startEtcd } from "../../topology/local-etcd.js";
import type { TlsFiles } from "../../transfer/tls-config.js";
import { type ArmLoadCliOptions, type ArmLoadOptions, armLoadOf, armLoadOptions } from "./arm-load.js";
import { positiveInt, runBenchCli } from "./bench-cli.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { cpuSeconds } from "./process-cpu.js";
import { defaultBenchTlsFiles } from "./transfer.js";

/** What the variant arm changes against the static plaintext baseline. */
export type ClusterComparison = "tls" | "registry";

/** Each comparison's variant label and goal (the CI's low end at least this ratio). */
const COMPARISONS: Record<ClusterComparison, { readonly variant: string; readonly goal: number }> = {
  tls: { variant: "TLS links", goal: 0.95 },
  registry: { variant: "etcd membership", goal: 0.98 },
};

/** A run: each round runs both arms once, in alternating order; each node's pool 256 pages by default. */
export interface ClusterBenchOptions extends ArmLoadOptions {
  /** The variant arm (default `tls`). */
  readonly compare?: ClusterComparison;
  readonly prefill?: number;
  readonly decode?: number;
  readonly tlsFiles?: TlsFiles;
}

export interface ArmResult {
  /** Output tokens per second of wall time, per round. */
  readonly tokensPerSecond: Summary;
  /** Output tokens per CPU second of the arm's processes, per round. */
  readonly tokensPerCpuSecond: Summary;
  /** Wall time of a round, ms. */
  readonly ms: Summary;
  readonly outputTokens: number;
}

export interface ClusterBenchResult {
  readonly compare: ClusterComparison;
  readonly shape: { readonly prefill: number; readonly decode: number };
  readonly rounds: number;
  readonly requests: number;
  readonly concurrency: number;
  readonly maxTokens: number;
  /** Plaintext links, static node lists. */
  readonly baseline: ArmResult;
  /** The baseline with `compare` changed. */
  readonly variant: ArmResult;
  /** Throughput of the variant over the baseline (paired by round). */
  readonly variantOverBaseline: RatioInterval;
  /**
   * CPU seconds per output token of the variant over the baseline (paired by round): every process
   * of the arm's cluster during its own round, and for etcd membership the etcd server's too.
   */
  readonly cpuPerTokenVariantOverBaseline: RatioInterval;
  /** The raw loopback socket, GB/s, one 64 MiB transfer per round. */
  readonly rawLoopbackGbps: Summary;
  readonly failures: readonly string[];
  readonly load: MachineLoad;
}

const now = (): bigint => process.hrtime.bigint();

/** Prompt `i`: the bundled model's record-lookup shape, `chars` long, distinct per request. */
export function prompt(i: number, chars: number): string {
  const records: string[] = [];
  let text = "";
  for (let k = 0; text.length < chars - 60; k++) {
    const account = 1000 + ((i * 37 + k * 11) % 9000);
    records.push(
      `the access code of account ${account} is ${String.fromCharCode(65 + ((i + k) % 26))}${k % 10}X-${(account * 7) % 1000}.`,
    );
    text = records.join(" ");
  }
  return `${text} what is the access code of account ${1000 + ((i * 37) % 9000)}?`;
}

/** Where a round's chats go: a cluster's URL, its model, every request's max_tokens, an API key if any. */
export interface Target {
  readonly url: string;
  readonly model: string;
  readonly maxTokens: number;
  readonly apiKey?: string;
}

/** One greedy chat completion (with the target's API key if any): its text and output tokens. */
async function chat(target: Target, content: string): Promise<{ text: string; tokens: number }> {
  const res = await fetch(`${target.url}/v1/chat/completions`, {
    method: "POST",
    headers: {
      "content-type": "application/json",
      ...(target.apiKey === undefined ? {} : { authorization: `Bearer ${target.apiKey}` }),
    },
    body: JSON.stringify({
      model: target.model,
      messages: [{ role: "user", content }],
      max_tokens: target.maxTokens,
      temperature: 0,
    }),
  });
  const body = (await res.json()) as {
    choices?: { message?: { content?: string } }[];
    usage?: { completion_tokens?: number };
    error?: { message?: string };
  };
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${body.error?.message ?? "no error body"}`);
  return { text: body.choices?.[0]?.message?.content ?? "", tokens: body.usage?.completion_tokens ?? 0 };
}

/** Runs `prompts` through `target` with `concurrency` in flight; wall time and answers in order. */
export async function round(
  target: Target,
  prompts: readonly string[],
  concurrency: number,
): Promise<{ ns: number; tokens: number; texts: string[] }> {
  const texts = new Array<string>(prompts.length);
  let tokens = 0;
  let next = 0;
  const t0 = now();
  await Promise.all(
    Array.from({ length: Math.min(concurrency, prompts.length) }, async () => {
      while (next < prompts.length) {
        const i = next++;
        const r = await chat(target, prompts[i]!);
        texts[i] = r.text;
        tokens += r.tokens;
      }
    }),
  );
  return { ns: Number(now() - t0), tokens, texts };
}

/** Bandwidth of a plain socket pair over 127.0.0.1: `bytes` in 1 MiB writes, counted on read. */
export async function rawLoopbackGbps(bytes = 64 << 20): Promise<number> {
  const chunk = Buffer.alloc(1 << 20, 7);
  let received = 0;
  let done: (t: bigint) => void = () => {};
  const finished = new Promise<bigint>((resolve) => {
    done = resolve;
  });
  const server = net.createServer({ noDelay: true }, (socket) => {
    socket.on("data", (d: Buffer) => {
      received += d.length;
      if (received >= bytes) done(now());
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const client = net.connect({
    host: "127.0.0.1",
    port: (server.address() as net.AddressInfo).port,
    noDelay: true,
  });
  await new Promise((resolve) => client.once("connect", resolve));
  const t0 = now();
  for (let sent = 0; sent < bytes; sent += chunk.length) {
    if (!client.write(chunk)) await new Promise((resolve) => client.once("drain", resolve));
  }
  const t1 = await finished;
  client.destroy();
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return bytes / Number(t1 - t0);
}

export async function runClusterBench(options: ClusterBenchOptions = {}): Promise<ClusterBenchResult> {
  const compare = options.compare ?? "tls";
  const prefill = options.prefill ?? 2;
  const decode = options.decode ?? 2;
  const rounds = options.rounds ?? 10;
  const warmup = options.warmup ?? 1;
  const requests = options.requests ?? 16;
  const concurrency = options.concurrency ?? 8;
  const maxTokens = options.maxTokens ?? 64;
  const log = options.log ?? (() => {});
  const tlsFiles = options.tlsFiles ?? defaultBenchTlsFiles();
  const loadStart = loadAverage();
  const nodeArgs = ["--kv-pages", String(options.kvPages ?? 256)];
  const base = { prefill, decode, model: options.model ?? bundledModelDir(), nodeArgs };
  const tlsArgs = ["--tls-cert", tlsFiles.cert, "--tls-key", tlsFiles.key, "--tls-ca", tlsFiles.ca];
  const prompts = Array.from({ length: requests }, (_, i) => prompt(i, options.promptChars ?? 400));

  const clusters: { baseline?: LocalCluster; variant?: LocalCluster } = {};
  let etcd: LocalEtcd | undefined;
  let measured: Measured;
  try {
    log(`starting two ${prefill}+${decode} clusters (static plaintext, and ${COMPARISONS[compare].variant})`);
    clusters.baseline = await startLocalCluster(base);
    if (compare === "tls") {
      clusters.variant = await startLocalCluster({ ...base, nodeArgs: [...nodeArgs, ...tlsArgs] });
    } else {
      if (!etcdAvailable()) throw new Error("etcd is not installed: apt-get install -y etcd-server");
      etcd = await startEtcd();
      clusters.variant = await startLocalCluster({ ...base, registry: etcd.url });
      await untilAllReady(clusters.variant.url, prefill, decode);
    }
    const models = (await (await fetch(`${clusters.baseline.url}/v1/models`)).json()) as {
      data: { id: string }[];
    };
    const pidsOf = (c: LocalCluster): number[] =>
      [c.router, ...c.prefill.map((p) => p.process), ...c.decode.map((d) => d.process)].flatMap((p) =>
        p.pid === undefined ? [] : [p.pid],
      );
    const { baseline, variant } = clusters;
    const arms: Record<ArmName, Arm> = {
      baseline: { url: baseline.url, pids: () => pidsOf(baseline) },
      variant: {
        url: variant.url,
        pids: () => {
          const e = etcd?.pid();
          return e === undefined ? pidsOf(variant) : [...pidsOf(variant), e];
        },
      },
    };
    const run = { model: models.data[0]!.id, prompts, concurrency, maxTokens, rounds, warmup, log };
    measured = await measureArms(arms, run);
  } finally {
    await Promise.all([clusters.baseline?.close(), clusters.variant?.close()]);
    await etcd?.stop();
  }
  const { ns, tps, perCpu, outputTokens, raw, failures } = measured;
  const arm = (name: ArmName): ArmResult => ({
    tokensPerSecond: summarize(tps[name]),
    tokensPerCpuSecond: summarize(perCpu[name]),
    ms: summarize(ns[name].map((t) => t / 1e6)),
    outputTokens: outputTokens[name],
  });
  return {
    compare,
    shape: { prefill, decode },
    rounds,
    requests,
    concurrency,
    maxTokens,
    baseline: arm("baseline"),
    variant: arm("variant"),
    // Throughput ratio = time ratio baseline / variant (the same tokens in both arms).
    variantOverBaseline: pairedRatio(ns.baseline, ns.variant),
    cpuPerTokenVariantOverBaseline: pairedRatio(perCpu.baseline, perCpu.variant),
    rawLoopbackGbps: summarize(raw),
    failures,
    load: machineLoad(loadStart),
  };
}

type ArmName = "baseline" | "variant";

/** An arm: its router's URL and the processes whose CPU it uses. */
interface Arm {
  readonly url: string;
  readonly pids: () => readonly number[];
}

/** Waits until the router of a registry cluster has paired every node (its /ready counts them). */
async function untilAllReady(url: string, prefill: number, decode: number): Promise<void> {
  const deadline = Date.now() + 30_000;
  for (;;) {
    const body = (await fetch(`${url}/ready`).then(
      (r) => r.json(),
      () => null,
    )) as { prefill?: { ready: number }; decode?: { ready: number } } | null;
    if (body?.prefill?.ready === prefill && body.decode?.ready === decode) return;
    if (Date.now() > deadline)
      throw new Error(`the registry cluster's router did not pair ${prefill}+${decode} nodes in 30 s`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Per arm, per measured round: wall time, output tokens per wall and per CPU second; the raw loopback per round; failures. */
interface Measured {
  readonly ns: Record<ArmName, number[]>;
  readonly tps: Record<ArmName, number[]>;
  /** Output tokens per CPU second of the arm's processes. */
  readonly perCpu: Record<ArmName, number[]>;
  readonly outputTokens: Record<ArmName, number>;
  readonly raw: number[];
  readonly failures: string[];
}

/**
 * The rounds, warm-up first: both arms in an order that flips every round, the same greedy batch
 * through each (every answer must equal the first round's), then the raw loopback socket.
 */
async function measureArms(
  arms: Record<ArmName, Arm>,
  run: {
    readonly model: string;
    readonly prompts: readonly string[];
    readonly concurrency: number;
    readonly maxTokens: number;
    readonly rounds: number;
    readonly warmup: number;
    readonly log: (line: string) => void;
  },
): Promise<Measured> {
  const m: Measured = {
    ns: { baseline: [], variant: [] },
    tps: { baseline: [], variant: [] },
    perCpu: { baseline: [], variant: [] },
    outputTokens: { baseline: 0, variant: 0 },
    raw: [],
    failures: [],
  };
  let reference: string[] | null = null;
  for (let r = -run.warmup; r < run.rounds; r++) {
    const order: readonly ArmName[] =
      ((r % 2) + 2) % 2 === 0 ? ["baseline", "variant"] : ["variant", "baseline"];
    for (const arm of order) {
      const target = { url: arms[arm].url, model: run.model, maxTokens: run.maxTokens };
      const cpu0 = cpuSeconds(arms[arm].pids());
      const result = await round(target, run.prompts, run.concurrency);
      const cpu = cpuSeconds(arms[arm].pids()) - cpu0;
      if (reference === null) reference = result.texts;
      else if (result.texts.some((t, i) => t !== reference![i]) && m.failures.length < 5) {
        m.failures.push(`${arm} round ${r + 1}: answers differ from the first round's (greedy decoding)`);
      }
      if (r >= 0) {
        m.ns[arm].push(result.ns);
        m.perCpu[arm].push(result.tokens / cpu);
        m.tps[arm].push(result.tokens / (result.ns / 1e9));
        m.outputTokens[arm] += result.tokens;
      }
    }
    if (r >= 0) {
      m.raw.push(await rawLoopbackGbps());
      run.log(
        `round ${r + 1}/${run.rounds}: baseline ${m.tps.baseline.at(-1)!.toFixed(0)} tok/s, variant ${m.tps.variant.at(-1)!.toFixed(0)} tok/s, raw loopback ${m.raw.at(-1)!.toFixed(2)} GB/s`,
      );
    }
  }
  return m;
}

/** The human-readable report of a run. */
export function formatClusterReport(r: ClusterBenchResult): string {
  const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;
  const arm = (name: string, a: ArmResult): string =>
    `${name.padEnd(10)} ${a.tokensPerSecond.median.toFixed(0).padStart(6)} tok/s [${a.tokensPerSecond.min.toFixed(0)}–${a.tokensPerSecond.max.toFixed(0)}]   round ${a.ms.median.toFixed(0)} ms median   ${a.outputTokens} output tokens`;
  const t = r.variantOverBaseline;
  const c = r.cpuPerTokenVariantOverBaseline;
  const { variant, goal } = COMPARISONS[r.compare];
  const within = `within ${((1 - goal) * 100).toFixed(0)}%`;
  const verdict = Number.isNaN(t.low)
    ? "too few rounds for a CI"
    : t.low >= goal
      ? `${within} (CI low end ≥ ${pct(goal)})`
      : t.high < goal
        ? `NOT ${within} (CI high end < ${pct(goal)})`
        : `undecided: the CI straddles ${pct(goal)} (more rounds, a quieter machine)`;
  return [
    `kvfence cluster ${r.shape.prefill}+${r.shape.decode}, static plaintext vs ${variant}: ${r.rounds} interleaved rounds of ${r.requests} chat requests (${r.concurrency} in flight, max_tokens ${r.maxTokens}, greedy)`,
    describeLoad(r.load),
    arm("static", r.baseline),
    arm(r.compare === "tls" ? "TLS" : "etcd", r.variant),
    `${variant} throughput / static plaintext: ${pct(t.ratio)} [95% CI ${pct(t.low)}–${pct(t.high)}]: ${verdict}`,
    `${variant} CPU per token / static plaintext: ${pct(c.ratio)} [95% CI ${pct(c.low)}–${pct(c.high)}] (every process of the arm during its rounds${r.compare === "registry" ? ", etcd's included" : ""})`,
    `raw loopback socket: ${r.rawLoopbackGbps.median.toFixed(2)} GB/s [${r.rawLoopbackGbps.min.toFixed(2)}–${r.rawLoopbackGbps.max.toFixed(2)}]`,
    ...(r.failures.length > 0 ? [`FAILURES: ${r.failures.join("; ")}`] : []),
  ].join("\n");
}

interface ClusterCliOptions extends ArmLoadCliOptions {
  compare: ClusterComparison;
  prefill: number;
  decode: number;
  tlsCert?: string;
  tlsKey?: string;
  tlsCa?: string;
  json?: boolean;
}

/** `kvfence bench cluster`. */
export function clusterCommand(): Command {
  const cmd = new Command("cluster")
    .description(
      "Chat throughput of a local multi-process cluster with TLS links (or etcd membership) vs plaintext links and static node lists (interleaved rounds, 95% CI of the ratio), beside the raw loopback socket",
    )
    .addOption(
      new Option("--compare <what>", "the variant arm: TLS on every link, or membership in etcd")
        .choices(["tls", "registry"])
        .default("tls"),
    )
    .option("--prefill <n>", "prefill node processes per cluster", positiveInt("--prefill"), 2)
    .option("--decode <n>", "decode node processes per cluster", positiveInt("--decode"), 2)
    .option(
      "--tls-cert <file>",
      "TLS arm: every process's certificate (default testing/fixtures/tls/node.crt)",
    )
    .option("--tls-key <file>", "TLS arm: its private key (default testing/fixtures/tls/node.key)")
    .option("--tls-ca <file>", "TLS arm: the CA (default testing/fixtures/tls/ca.crt)");
  const defaults = { kvPages: 256, rounds: 10, warmup: 1, requests: 16, concurrency: 8, promptChars: 400 };
  return armLoadOptions(cmd, defaults).action((o: ClusterCliOptions) => {
    const d = defaultBenchTlsFiles();
    return runBenchCli(
      "cluster",
      o.json,
      (log) =>
        runClusterBench({
          compare: o.compare,
          prefill: o.prefill,
          decode: o.decode,
          ...armLoadOf(o),
          tlsFiles: { cert: o.tlsCert ?? d.cert, key: o.tlsKey ?? d.key, ca: o.tlsCa ?? d.ca },
          log,
        }),
      formatClusterReport,
    );
  });
}
