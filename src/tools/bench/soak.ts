/**
 * `kvfence bench soak`: does a node's protocol memory stay bounded by the work in flight
 * (docs/protocol.md §3, the watermark)? Starts real prefill and decode node processes (the bundled
 * model by default), drives `--requests` short requests (a few prompt tokens, `--max-tokens` 1 by
 * default, `--concurrency` in flight, every `--abort-every`th aborted by its client) through a
 * router in this process (`connectCluster`, the same `DisaggregatedEngine` as `kvfence serve
 * --role router`, without the HTTP layer so the run is about the nodes), and at every
 * `--checkpoint` requests, once the cluster is idle, reads each node's attempts, tombstones and V8
 * heap (the least of a few samples, to stay clear of garbage not yet collected). Reported: the
 * heap at each checkpoint, its growth from the first checkpoint to the last, and the tombstones
 * left when idle (0 when the watermarks reach the nodes). Without the watermark each request
 * leaves one tombstone per node, about 165 bytes: 100,000 requests grow each node by some 16 MB.
 */
import { Command } from "commander";
import { connectCluster } from "../../cluster/cluster-router.js";
import type { DisaggregatedEngine } from "../../cluster/disaggregated-engine.js";
import { bundledModelDir } from "../../lib/package-root.js";
import type { GenerationRequest } from "../../protocol/engine-api.js";
import { GREEDY_SAMPLING } from "../../protocol/sampling-params.js";
import { startNodeProcesses } from "../../topology/local-cluster.js";
import { positiveInt } from "./bench-cli.js";

export interface SoakOptions {
  readonly requests?: number;
  readonly checkpoint?: number;
  readonly concurrency?: number;
  readonly maxTokens?: number;
  readonly promptTokens?: number;
  /** Every n-th request is aborted by its client right after it was submitted (0: none). */
  readonly abortEvery?: number;
  readonly prefill?: number;
  readonly decode?: number;
  readonly model?: string;
  readonly log?: (line: string) => void;
}

export interface SoakCheckpoint {
  readonly requests: number;
  readonly seconds: number;
  readonly nodes: readonly {
    readonly id: string;
    readonly heapBytes: number;
    readonly attempts: number;
    readonly tombstones: number;
  }[];
}

export interface SoakResult {
  readonly requests: number;
  readonly failed: number;
  readonly checkpoints: readonly SoakCheckpoint[];
  /** Per node: heap at the last checkpoint minus at the first, bytes. */
  readonly heapGrowth: Readonly<Record<string, number>>;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export async function runSoak(options: SoakOptions = {}): Promise<SoakResult> {
  const total = options.requests ?? 100_000;
  const every = options.checkpoint ?? 10_000;
  const concurrency = options.concurrency ?? 16;
  const log = options.log ?? (() => {});
  const nodes = await startNodeProcesses({
    prefill: options.prefill ?? 1,
    decode: options.decode ?? 1,
    model: options.model ?? bundledModelDir(),
    nodeArgs: ["--kv-pages", "256"],
  });
  let engine: DisaggregatedEngine | null = null;
  try {
    engine = await connectCluster({
      prefill: nodes.prefill.map((p) => p.url),
      decode: nodes.decode.map((d) => d.url),
      secret: nodes.secret,
      maxModelLen: 1024,
      fairShare: { tenants: 1, maxQueue: concurrency * 4 },
    });
    const checkpoints: SoakCheckpoint[] = [];
    const t0 = performance.now();
    let failed = 0;
    let done = 0;
    let next = 0;
    const one = (rid: number) =>
      new Promise<void>((resolve) => {
        const request = soakRequest(rid, options.promptTokens ?? 8, options.maxTokens ?? 1);
        engine!.submit(request, {
          onTokens: () => {},
          onFinish: () => resolve(),
          onError: () => {
            failed++;
            resolve();
          },
        });
        const abortEvery = options.abortEvery ?? 10;
        if (abortEvery > 0 && rid % abortEvery === 0) {
          // Silenced: an aborted request gets no event; it is done once the router forgot it.
          engine!.abort(rid);
          resolve();
        }
      });
    while (done < total) {
      const upTo = Math.min(total, done + every);
      await Promise.all(
        Array.from({ length: concurrency }, async () => {
          while (next < upTo) {
            const rid = ++next;
            await one(rid);
          }
        }),
      );
      done = upTo;
      checkpoints.push(await checkpoint(engine, done, (performance.now() - t0) / 1000));
      const c = checkpoints.at(-1)!;
      log(
        `${done} requests, ${c.seconds.toFixed(0)} s: ${c.nodes.map((n) => `${n.id} heap ${(n.heapBytes / 1e6).toFixed(2)} MB, ${n.tombstones} tombstones, ${n.attempts} attempts`).join("; ")}`,
      );
    }
    const first = checkpoints[0]!;
    const last = checkpoints.at(-1)!;
    const heapGrowth: Record<string, number> = {};
    for (const n of last.nodes)
      heapGrowth[n.id] = n.heapBytes - (first.nodes.find((m) => m.id === n.id)?.heapBytes ?? 0);
    return { requests: total, failed, checkpoints, heapGrowth };
  } finally {
    await engine?.close();
    await nodes.close();
  }
}

function soakRequest(rid: number, promptTokens: number, maxTokens: number): GenerationRequest {
  return {
    rid,
    tenant: 0,
    promptTokens: Int32Array.from({ length: promptTokens }, (_, i) => 3 + ((rid * 7 + i * 13) % 200)),
    maxTokens,
    sampling: GREEDY_SAMPLING,
  };
}

/** Once idle: each node's attempts and tombstones, and the least heap of five samples 100 ms apart. */
async function checkpoint(
  engine: DisaggregatedEngine,
  requests: number,
  seconds: number,
): Promise<SoakCheckpoint> {
  const deadline = Date.now() + 10_000;
  while (engine.inFlight > 0 && Date.now() < deadline) await sleep(10);
  const samples: { id: string; heapBytes: number; attempts: number; tombstones: number }[][] = [];
  for (let i = 0; i < 5; i++) {
    await sleep(100);
    const all = await engine.nodeStats();
    samples.push(
      all.map(({ node, stats }) => ({
        id: node.id,
        heapBytes: stats?.heapUsedBytes ?? 0,
        attempts: stats?.attempts ?? -1,
        tombstones: stats?.tombstones ?? -1,
      })),
    );
  }
  const nodes = samples[0]!.map((n, j) => ({
    ...samples.at(-1)![j]!,
    heapBytes: Math.min(...samples.map((s) => s[j]!.heapBytes)),
    id: n.id,
  }));
  return { requests, seconds, nodes };
}

export function formatSoak(r: SoakResult): string {
  const lines = [`kvfence bench soak: ${r.requests} requests, ${r.failed} failed`];
  for (const c of r.checkpoints) {
    lines.push(
      `  ${String(c.requests).padStart(7)} requests ${c.seconds.toFixed(0).padStart(5)} s  ${c.nodes.map((n) => `${n.id}: heap ${(n.heapBytes / 1e6).toFixed(2)} MB, tombstones ${n.tombstones}, attempts ${n.attempts}`).join("  ")}`,
    );
  }
  lines.push(
    `heap growth from the first checkpoint to the last: ${Object.entries(r.heapGrowth)
      .map(([id, b]) => `${id} ${(b / 1e6).toFixed(2)} MB`)
      .join(", ")}`,
  );
  return lines.join("\n");
}

interface SoakCliOptions {
  requests: number;
  checkpoint: number;
  concurrency: number;
  maxTokens: number;
  abortEvery: number;
  prefill: number;
  decode: number;
  model?: string;
  json?: boolean;
}

/** `kvfence bench soak`. */
export function soakCommand(): Command {
  return new Command("soak")
    .description(
      "Many short requests through real node processes: each node's heap, attempts and protocol tombstones at every checkpoint (bounded protocol state)",
    )
    .option("--requests <n>", "requests in all", positiveInt("--requests"), 100_000)
    .option(
      "--checkpoint <n>",
      "read the nodes every this many requests",
      positiveInt("--checkpoint"),
      10_000,
    )
    .option("--concurrency <n>", "requests in flight", positiveInt("--concurrency"), 16)
    .option("--max-tokens <n>", "max_tokens of each request", positiveInt("--max-tokens"), 1)
    .option(
      "--abort-every <n>",
      "abort every n-th request (0: none)",
      (v) => (v === "0" ? 0 : positiveInt("--abort-every")(v)),
      10,
    )
    .option("--prefill <n>", "prefill node processes", positiveInt("--prefill"), 1)
    .option("--decode <n>", "decode node processes", positiveInt("--decode"), 1)
    .option("--model <dir>", "Hugging Face model folder (default: bundled kvfence-tiny)")
    .option("--json", "print the result as JSON")
    .action(async (o: SoakCliOptions) => {
      try {
        const result = await runSoak({
          ...o,
          log: o.json === true ? () => {} : (line) => process.stderr.write(`${line}\n`),
        });
        process.stdout.write(`${o.json === true ? JSON.stringify(result, null, 2) : formatSoak(result)}\n`);
      } catch (err) {
        process.stderr.write(`kvfence bench soak: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 1;
      }
    });
}
