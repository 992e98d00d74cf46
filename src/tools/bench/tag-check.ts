/**
 * Benchmark: what the per-step page tag check (docs/design.md §3) costs in decode throughput.
 *
 * Two engines share one forward pass and one set of weights, each with its own KV pool: one with
 * the check on (the default), one with it off. Both prefill the same batch of prompts once; then
 * the benchmark alternates between them, `steps` timed pure-decode steps at a time, in pairs whose
 * order flips every pair (on→off, off→on, …) so drift in the shared machine hits both arms alike.
 * Each pair gives a throughput ratio on/off; the report is the mean ratio with a 95% confidence
 * interval over the pairs (target: cost ≤ 1%, i.e. ratio ≥ 0.99).
 *
 * Because the end-to-end ratio is noisy on a shared machine, the benchmark also times the check
 * alone — `PagePool.checkStep` over the very block tables of the batch — and reports it as a
 * fraction of the mean step time, which resolves costs far below the end-to-end noise. That is the
 * one rule set of every page-tag check (`OwnershipTable.checkStep`): a decode node runs the same
 * function once per token, from its decode state machine instead of the engine.
 *
 * The forward pass runs on the server's kernels (`--kernels auto`, the default: native where the
 * addon runs, else wasm; `--threads` 1 or 2; or `--kernels native|wasm|ts`), built as the server
 * builds it (`createForward`): on wasm both pools live in the one WebAssembly memory beside the
 * weights.
 *
 * With `--arms prefix-cache` the two engines both check tags and differ in the prefix cache (on vs
 * off) instead: the batch's prompts are all different, so nothing hits, but with the cache on
 * their full prompt pages are cached after the prefill (SHARED, referenced by their requests) and
 * every decode step checks them as shared pages — the cache's no-hit cost on decode throughput
 * (issue #16: ≤ 1%).
 *
 * With `--arms grammar` the two engines differ in structured output (issue #34): the same batch
 * decodes at temperature 1 under a JSON schema (an object of one free string, so no request ends
 * within the run) versus unconstrained — the grammar's cost per decode step (target ≤ 10%); with
 * `--arms grammar-idle` both run unconstrained, one with a grammar engine wired and one without
 * (target 0%). Page tags are on in both.
 *
 * Run: `node dist/src/tools/bench/tag-check.js [--model DIR | --like smollm2-135m|tiny] [--kernels wasm|ts]
 * [--threads 2] [--pairs 10] [--batch 8] [--prompt 16] [--steps 1] [--json]`, or
 * `kvfence bench tag-check` with the same options. Without `--model`, a random model with the
 * shapes of `--like` is generated once (as `kvfence gen-model` does) under the OS temp folder.
 */
import { existsSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Command, InvalidArgumentError } from "commander";
import { Engine } from "../../engine/engine.js";
import { createForward, type KernelsName } from "../../engine/forward-setup.js";
import { GrammarThreads } from "../../grammar/grammar-thread.js";
import { chooseKernels, type KernelsRequest } from "../../kernels/choose-kernels.js";
import { DEFAULT_KV_CACHE_DTYPE, isKvDtype, type KvDtype, type KvLayout } from "../../kvcache/kv-layout.js";
import type { PagePool } from "../../kvcache/page-pool.js";
import { pairedRatio, quantile, type RatioInterval } from "../../lib/stats.js";
import { loadModelConfig } from "../../model/config-loader.js";
import { genModel } from "../../model/gen-model.js";
import { loadWeights } from "../../model/load-model.js";
import type { GenerationEvents } from "../../protocol/engine-api.js";
import type { OutputConstraint } from "../../protocol/output-constraint.js";
import { makeSafety } from "../../protocol/safety.js";
import { GREEDY_SAMPLING, type SamplingParams } from "../../protocol/sampling-params.js";
import { positiveInteger } from "./bench-cli.js";

export interface TagCheckBenchOptions {
  /** A model folder; when absent, a random model shaped like `like` is generated (once) in a temp folder. */
  readonly model?: string;
  readonly like?: string;
  /** The forward pass's kernels. Default "wasm". */
  readonly kernels?: KernelsName;
  /** Threads of the wasm kernels. Default 2. */
  readonly threads?: 1 | 2;
  /** Interleaved on/off pairs. Default 10. */
  readonly pairs?: number;
  /** Concurrent decoding requests. Default 8. */
  readonly batch?: number;
  /** Prompt tokens per request. Default 16. */
  readonly promptTokens?: number;
  /** Timed decode steps per arm of a pair. Default 1. */
  readonly steps?: number;
  readonly pageSize?: number;
  /** The KV cache element type (`--kv-cache-dtype`, default f16). */
  readonly kvCacheDtype?: KvDtype;
  /** What the arms differ in: the page-tag check (default), the prefix cache or structured output (tags on). */
  readonly arms?: ArmsKind;
  /** Progress lines go here. */
  readonly log?: (line: string) => void;
}

export type ArmsKind = "tags" | "prefix-cache" | "grammar" | "grammar-idle";
const ARMS_KINDS: readonly string[] = ["tags", "prefix-cache", "grammar", "grammar-idle"];

/** The "on" arm's constraint of `--arms grammar`: a JSON object of one free string. */
const BENCH_SCHEMA: OutputConstraint = {
  kind: "json_schema",
  schema: '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}',
  strict: true,
};

export interface TagCheckBenchReport {
  readonly arms: ArmsKind;
  readonly model: string;
  readonly kernels: KernelsName;
  readonly threads: 1 | 2;
  readonly batch: number;
  readonly promptTokens: number;
  readonly stepsPerArm: number;
  readonly pairs: readonly { on: Arm; off: Arm }[];
  /** Decode tokens per wall-clock second, median over arms. */
  readonly tokensPerSecondOn: number;
  readonly tokensPerSecondOff: number;
  /** Throughput ratio on/off per CPU second of the stepping thread: geometric mean and 95% CI over pairs. */
  readonly cpuRatio: RatioInterval;
  /** The same per wall-clock second (noisier on a shared machine). */
  readonly wallRatio: RatioInterval;
  /** The check alone, per step of the whole batch, in CPU microseconds; and as a fraction of a decode step's CPU time. */
  readonly checkMicrosPerStep: number;
  readonly checkFractionOfStep: number;
  readonly pagesCheckedPerStep: number;
}

/** Decode tokens per second in one arm: per wall-clock second and per CPU second of this thread. */
export interface Arm {
  readonly wall: number;
  readonly cpu: number;
}

const IGNORE: GenerationEvents = { onTokens() {}, onFinish() {}, onError() {} };

function modelDir(options: TagCheckBenchOptions, log: (line: string) => void): string {
  if (options.model !== undefined) return options.model;
  const like = options.like ?? "smollm2-135m";
  const dir = join(tmpdir(), "kvfence-bench-models", `${like}-seed1`);
  if (!existsSync(join(dir, "model.safetensors"))) {
    log(`generating a random ${like}-shaped model in ${dir}`);
    genModel(dir, { like, seed: 1 });
  }
  return dir;
}

export async function runTagCheckBench(options: TagCheckBenchOptions = {}): Promise<TagCheckBenchReport> {
  const log = options.log ?? (() => {});
  const pairs = options.pairs ?? 10;
  const batch = options.batch ?? 8;
  const promptTokens = options.promptTokens ?? 16;
  const steps = options.steps ?? 1;
  const dir = modelDir(options, log);
  const kernels = options.kernels ?? "wasm";
  const threads = kernels === "ts" ? 1 : (options.threads ?? 2);
  const shape = {
    batch,
    promptTokens,
    decodeTokens: 2 * pairs * steps + 3,
    pageSize: options.pageSize ?? 16,
    kvCacheDtype: options.kvCacheDtype ?? DEFAULT_KV_CACHE_DTYPE,
  };
  const arms = options.arms ?? "tags";
  const { setup, engines } = await prefilledEngines({ dir, kernels, threads, log, arms }, shape);
  const results = timePairs(engines, { pairs, steps, log });
  const check = timeCheckAlone(engines[0]);
  for (const engine of engines) for (const t of engine.liveBlockTables()) engine.abort(t.rid);
  // Stops the grammar threads (--arms grammar): running workers keep the process alive.
  for (const engine of engines) engine.close();
  await setup.close();

  const cpuRatio = pairedRatio(
    results.map((r) => r.on.cpu),
    results.map((r) => r.off.cpu),
  );
  const wallRatio = pairedRatio(
    results.map((r) => r.on.wall),
    results.map((r) => r.off.wall),
  );
  const median = (xs: number[]) => quantile(xs, 0.5);
  const tokensPerSecondOn = median(results.map((r) => r.on.wall));
  const cpuStepSeconds = batch / median(results.map((r) => r.on.cpu));
  return {
    arms,
    model: dir,
    kernels,
    threads,
    batch,
    promptTokens,
    stepsPerArm: steps,
    pairs: results,
    tokensPerSecondOn,
    tokensPerSecondOff: median(results.map((r) => r.off.wall)),
    cpuRatio,
    wallRatio,
    checkMicrosPerStep: check.micros,
    checkFractionOfStep: check.micros / 1e6 / cpuStepSeconds,
    pagesCheckedPerStep: check.pages,
  };
}

/** The batch of each engine: how many requests, their prompt and decode tokens, the page size. */
interface BatchShape {
  readonly batch: number;
  readonly promptTokens: number;
  readonly decodeTokens: number;
  readonly pageSize: number;
  readonly kvCacheDtype: KvDtype;
}

/**
 * Two engines over one forward pass (check on, check off), each with its own pool, both with the
 * same batch prefilled in one step and one untimed decode step (to warm the JIT).
 */
async function prefilledEngines(
  run: {
    readonly dir: string;
    readonly kernels: KernelsName;
    readonly threads: 1 | 2;
    readonly log: (line: string) => void;
    readonly arms: ArmsKind;
  },
  shape: BatchShape,
): Promise<{ setup: Awaited<ReturnType<typeof createForward>>; engines: [Engine, Engine] }> {
  const { dir, log } = run;
  const config = loadModelConfig(dir);
  const weights = loadWeights(dir, config);
  log(`model ${dir}: ${config.numLayers} layers, hidden ${config.hiddenSize}, vocab ${config.vocabSize}`);
  const { batch, promptTokens, pageSize } = shape;
  const perRequest = promptTokens + shape.decodeTokens;
  const layout: KvLayout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize,
    dtype: shape.kvCacheDtype,
  };
  const numPages = batch * Math.ceil(perRequest / pageSize) + 1;
  const setup = await createForward(config, weights, layout, {
    kernels: run.kernels,
    kernelThreads: run.threads,
    maxBatchTokens: Math.max(batch * promptTokens, batch),
    maxSequences: batch,
    poolPages: [numPages, numPages],
  });
  log(`kernels ${run.kernels}, ${run.threads} thread${run.threads > 1 ? "s" : ""}`);
  const cacheArms = run.arms === "prefix-cache";
  const grammarArms = run.arms === "grammar" || run.arms === "grammar-idle";
  const grammar = grammarArms
    ? new GrammarThreads({ tokenizerPath: dir, vocabSize: config.vocabSize })
    : null;
  const engineOf = (on: boolean, pool: PagePool): Engine =>
    new Engine(setup.forward, pool, {
      safety: makeSafety({ disabledGuards: on || cacheArms || grammarArms ? [] : ["page-tags"] }),
      prefixCache: cacheArms && on,
      seed: 1,
      maxModelLen: Math.min(config.maxPositionEmbeddings, perRequest + 1),
      ...(grammar !== null && (on || run.arms === "grammar") ? { grammar: async () => grammar } : {}),
    });
  const engines: [Engine, Engine] = [
    engineOf(true, setup.pools[0] as PagePool),
    engineOf(false, setup.pools[1] as PagePool),
  ];
  const sampling: SamplingParams = grammarArms
    ? { ...GREEDY_SAMPLING, temperature: 1, seed: 1 }
    : GREEDY_SAMPLING;
  const constrained = run.arms === "grammar" ? { ...sampling, constraint: BENCH_SCHEMA } : sampling;
  await prefill(engines[0], shape, config.vocabSize, constrained);
  await prefill(engines[1], shape, config.vocabSize, sampling);
  log(`prefilled ${batch} × ${promptTokens} tokens in both engines`);
  for (const engine of engines) engine.step(); // one untimed decode step each: warm the JIT
  return { setup, engines };
}

/** Submits the batch and prefills all of it in one step (after a constrained batch's grammars are bound). */
async function prefill(
  engine: Engine,
  shape: BatchShape,
  vocabSize: number,
  sampling: SamplingParams,
): Promise<void> {
  const { batch, promptTokens } = shape;
  for (let r = 0; r < batch; r++) {
    const prompt = Int32Array.from({ length: promptTokens }, (_, i) => (r * 131 + i * 17 + 3) % vocabSize);
    engine.submit(
      {
        rid: r + 1,
        tenant: 0,
        promptTokens: prompt,
        maxTokens: shape.decodeTokens,
        sampling,
      },
      IGNORE,
    );
  }
  // A constrained request waits for its grammar thread's matcher before it is queued.
  for (let turns = 0; engine.stats().queue.waiting < batch; turns++) {
    if (turns > 60_000) throw new Error("The grammar thread made no matchers within a minute");
    await new Promise((resolve) => setTimeout(resolve, 1));
  }
  engine.step(); // the whole batch's prefill in one step
  const s = engine.stats();
  if (s.queue.running !== batch || s.counters.completionTokens !== batch) {
    throw new Error(`Prefill did not complete in one step: ${JSON.stringify(s.queue)}`);
  }
}

/**
 * The interleaved pairs, the order flipping every pair. Each arm: decode tokens per second of wall
 * time and of this thread's CPU time. CPU time does not count time the OS gave other processes (the
 * machine is shared), so its ratio is the sharper one; the wall-time ratio is reported beside it.
 */
function timePairs(
  [checkOn, checkOff]: readonly [Engine, Engine],
  run: { readonly pairs: number; readonly steps: number; readonly log: (line: string) => void },
): { on: Arm; off: Arm }[] {
  const timeArm = (engine: Engine): Arm => {
    const before = engine.stats().counters.completionTokens;
    const c0 = process.cpuUsage();
    const t0 = performance.now();
    for (let i = 0; i < run.steps; i++) engine.step();
    const wallSeconds = (performance.now() - t0) / 1000;
    const cpu = process.cpuUsage(c0);
    const tokens = engine.stats().counters.completionTokens - before;
    return { wall: tokens / wallSeconds, cpu: tokens / ((cpu.user + cpu.system) / 1e6) };
  };
  const results: { on: Arm; off: Arm }[] = [];
  for (let p = 0; p < run.pairs; p++) {
    let on: Arm;
    let off: Arm;
    if (p % 2 === 0) {
      on = timeArm(checkOn);
      off = timeArm(checkOff);
    } else {
      off = timeArm(checkOff);
      on = timeArm(checkOn);
    }
    results.push({ on, off });
    run.log(
      `pair ${p + 1}/${run.pairs}: on ${on.wall.toFixed(2)} tok/s (cpu ${on.cpu.toFixed(2)}), off ${off.wall.toFixed(2)} tok/s (cpu ${off.cpu.toFixed(2)})`,
    );
  }
  return results;
}

/** The check alone, over the checked engine's live block tables, as a step would run it. */
function timeCheckAlone(checked: Engine): { micros: number; pages: number } {
  const pool = checked.pool;
  const tables = checked.liveBlockTables();
  let pages = 0;
  for (const t of tables) pages += t.blockTable.length;
  const reps = 20_000;
  let failures = 0;
  const c0 = process.cpuUsage();
  for (let i = 0; i < reps; i++) {
    for (const t of tables) {
      const end = Math.min(t.computed + 1, t.blockTable.length * pool.pageSize);
      if (pool.checkStep(t.blockTable, t.rid, t.epoch, t.computed, end) >= 0) failures++;
    }
  }
  const cpu = process.cpuUsage(c0);
  if (failures > 0) throw new Error(`Tag check failed on a healthy batch: ${failures} times`);
  return { micros: (cpu.user + cpu.system) / reps, pages };
}

const ARMS_LINE: Readonly<Record<Exclude<ArmsKind, "tags">, string>> = {
  "prefix-cache":
    "arms: prefix cache on vs off (page tags on in both; nothing hits, the prompt pages are cached)",
  grammar: "arms: a JSON schema on vs unconstrained (temperature 1; page tags on in both)",
  "grammar-idle": "arms: a grammar engine wired vs none, every request unconstrained (page tags on in both)",
};

export function formatTagCheckReport(r: TagCheckBenchReport): string {
  const pct = (x: number) => `${(x * 100).toFixed(2)}%`;
  const line = (name: string, q: RatioInterval) =>
    `  ratio on/off (${name}): ${q.ratio.toFixed(4)} (95% CI ${q.low.toFixed(4)} – ${q.high.toFixed(4)}); cost ${pct(1 - q.ratio)} (CI ${pct(1 - q.high)} – ${pct(1 - q.low)})`;
  return [
    ...(r.arms === "tags" ? [] : [ARMS_LINE[r.arms]]),
    `tag-check bench: ${r.model} on the ${r.kernels} kernels, ${r.threads} thread${r.threads > 1 ? "s" : ""}`,
    `  batch ${r.batch}, prompt ${r.promptTokens} tokens, ${r.stepsPerArm} decode step(s) per arm, ${r.pairs.length} interleaved pairs`,
    `  decode throughput (median, wall): check on ${r.tokensPerSecondOn.toFixed(2)} tok/s, off ${r.tokensPerSecondOff.toFixed(2)} tok/s`,
    line("per CPU second", r.cpuRatio),
    line("per wall second", r.wallRatio),
    `  the check alone: ${r.checkMicrosPerStep.toFixed(2)} µs per step over ${r.pagesCheckedPerStep} pages = ${(r.checkFractionOfStep * 100).toPrecision(2)}% of a decode step's CPU time`,
  ].join("\n");
}

/** `kvfence bench tag-check`: the same benchmark as a subcommand of the `bench` group. */
export function tagCheckCommand(): Command {
  return new Command("tag-check")
    .description(
      "Decode throughput with the per-step KV page tag check on versus off (interleaved pairs, 95% CI)",
    )
    .option("--model <dir>", "model folder (default: a random model shaped like --like, generated once)")
    .option("--like <model>", "shape of the generated model: smollm2-135m or tiny", "smollm2-135m")
    .option(
      "--kernels <kind>",
      "forward-pass kernels: auto (the server's default: native where it runs, else wasm), native, wasm or ts",
      "auto",
    )
    .option("--threads <n>", "threads of the native or wasm kernels: 1 or 2", "2")
    .option("--pairs <n>", "interleaved on/off pairs", positiveInteger, 10)
    .option("--batch <n>", "concurrent decoding requests", positiveInteger, 8)
    .option("--prompt <n>", "prompt tokens per request", positiveInteger, 16)
    .option("--steps <n>", "timed decode steps per arm", positiveInteger, 1)
    .option("--kv-cache-dtype <dtype>", "KV cache element type: f32, f16 or bf16", DEFAULT_KV_CACHE_DTYPE)
    .option(
      "--arms <kind>",
      "tags (the check on vs off), prefix-cache (the cache on vs off, no hit), grammar (a JSON schema vs none) or grammar-idle (a grammar engine wired vs none)",
      "tags",
    )
    .option("--json", "print the report as JSON", false)
    .action(
      async (opts: {
        model?: string;
        like: string;
        kernels: string;
        threads: string;
        pairs: number;
        batch: number;
        prompt: number;
        steps: number;
        kvCacheDtype: string;
        arms: string;
        json: boolean;
      }) => {
        if (!isKvDtype(opts.kvCacheDtype))
          throw new InvalidArgumentError(`--kv-cache-dtype must be f32, f16 or bf16: ${opts.kvCacheDtype}`);
        if (
          !["auto", "native", "wasm", "ts"].includes(opts.kernels) ||
          (opts.threads !== "1" && opts.threads !== "2") ||
          !ARMS_KINDS.includes(opts.arms)
        ) {
          throw new InvalidArgumentError(
            `--kernels must be auto, native, wasm or ts, --threads 1 or 2, --arms tags, prefix-cache, grammar or grammar-idle: ${opts.kernels}, ${opts.threads}, ${opts.arms}`,
          );
        }
        const report = await runTagCheckBench({
          ...(opts.model === undefined ? {} : { model: opts.model }),
          kernels: (await chooseKernels(opts.kernels as KernelsRequest)).kernels,
          threads: opts.threads === "1" ? 1 : 2,
          like: opts.like,
          pairs: opts.pairs,
          batch: opts.batch,
          promptTokens: opts.prompt,
          steps: opts.steps,
          kvCacheDtype: opts.kvCacheDtype,
          arms: opts.arms as ArmsKind,
          log: (line) => process.stderr.write(`${line}\n`),
        });
        process.stdout.write(
          opts.json ? `${JSON.stringify(report, null, 2)}\n` : `${formatTagCheckReport(report)}\n`,
        );
      },
    );
}

if (import.meta.url === `file://${process.argv[1]}`) await tagCheckCommand().parseAsync(process.argv);
