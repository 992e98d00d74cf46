/**
 * `kvfence bench model`: forward-pass throughput of a model folder on the TypeScript reference
 * kernels, the WebAssembly SIMD kernels or both side by side, against the machine's memory roofline
 * measured in the same run.
 *
 * Each kernel set gets its forward pass and KV pool from `createForward` (the server's own setup:
 * for wasm, weights, activations and pool in one shared WebAssembly memory, on `threads` threads;
 * the reference always runs on one). Its arms:
 * - Prefill: one sequence, a seeded random prompt of `promptTokens` in one chunk; tokens/s and
 *   effective GFLOP/s per core (linear and causal-attention FLOPs / time / threads).
 * - Decode at each batch size: `batch` sequences that already hold a `contextTokens` context each
 *   decode `decodeSteps` steps together; tokens/s = batch · steps / time. Every repeat rewrites the
 *   same KV slots, so repeats are identical work.
 * - Long-context decode (when `longContextTokens` > 0 fits the model's window): batch 1 at that
 *   context, over resident random KV (attention costs the same for any values).
 *
 * Each kernel set runs once per KV cache dtype of `kvCacheDtypes` (`--kv-cache-dtype f32,f16,bf16`
 * compares them in one interleaved run): the pool's element type, which the attention reads.
 *
 * Roofline: decode must read every distinct weight once per step, so at batch B the ceiling is
 * B · read bandwidth / weight bytes, with the bandwidth of as many threads as the kernels use
 * (src/tools/bench/roofline.ts: native memchr over `bandwidthBytes` of touched memory).
 *
 * Every arm of every kernel set runs once per repeat, interleaved with the bandwidth probe, and the
 * report gives the median, the range and a bootstrap 95% CI of the median.
 *
 * Weight formats (`dtypes`, `--dtype f32,bf16,q8_0,q4_0`): the folder's weights are converted in
 * memory to each format (src/kernels/weight-format.ts: halves rounded to nearest even, blocks as
 * llama-quantize makes them) and every kernel set runs on each, all in the same interleaved rounds;
 * each format's roofline counts its own weight bytes.
 */
import { existsSync, readFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { createForward, type ForwardSetup, type KernelsName } from "../../engine/forward-setup.js";
import { chooseKernels } from "../../kernels/choose-kernels.js";
import { KernelProfile } from "../../kernels/kernel-profile.js";
import { roundKv } from "../../kernels/reference.js";
import { WasmKernels } from "../../kernels/wasm-kernels.js";
import { type Matrix, matrixBytes, type WeightDType } from "../../kernels/weight-format.js";
import {
  DEFAULT_KV_CACHE_DTYPE,
  type KvDtype,
  type KvLayout,
  kvDtypeCode,
  kvDtypeOf,
  pageFloats,
} from "../../kvcache/kv-layout.js";
import { Prng } from "../../lib/prng.js";
import {
  bootstrapInterval,
  type Interval,
  pairedRatio,
  type RatioInterval,
  type Summary,
  summarize,
} from "../../lib/stats.js";
import { convertWeights } from "../../model/convert-model.js";
import type { StepSequence } from "../../model/forward.js";
import { openModel } from "../../model/load-model.js";
import type { ModelConfig, ModelWeights } from "../../model/model-config.js";
import { formatProfile, type PhaseProfile, profilePhases } from "./model-profile.js";
import { BandwidthProbe } from "./roofline.js";

/** The largest CPU cache of cpu0 in bytes (Linux sysfs), or null where it cannot be read. */
function lastLevelCacheBytes(): number | null {
  let best: number | null = null;
  for (let i = 0; i < 8; i++) {
    try {
      const text = readFileSync(`/sys/devices/system/cpu/cpu0/cache/index${i}/size`, "utf8").trim();
      const match = /^(\d+)([KMG]?)$/.exec(text);
      if (match === null) continue;
      const bytes = Number(match[1]) * ({ "": 1, K: 1024, M: 1024 ** 2, G: 1024 ** 3 }[match[2]!] ?? 1);
      if (best === null || bytes > best) best = bytes;
    } catch {
      break;
    }
  }
  return best;
}

/**
 * A kernel set to run: the TypeScript reference, the WebAssembly kernels as the server runs them
 * (the fused multiply-add build where the engine has it), or the WebAssembly build without relaxed
 * SIMD (a multiply, then an add), for an A/B of the two in one process.
 */
export type BenchKernels = KernelsName | "auto" | "wasm-mul-add" | "wasm-i16";

export interface ModelBenchOptions {
  readonly modelDir: string;
  /** Weight formats to run each kernel set on (default: the folder's own). */
  readonly dtypes?: readonly WeightDType[];
  /** Kernel sets to run, side by side. */
  readonly kernels: readonly BenchKernels[];
  /** Threads of the WebAssembly kernels (the reference runs on 1). */
  readonly threads: 1 | 2;
  readonly promptTokens: number;
  readonly contextTokens: number;
  /** Context of the batch-1 long-context decode arm; 0 skips it (so does a context beyond the window). */
  readonly longContextTokens: number;
  readonly decodeSteps: number;
  /** Tokens per KV page (kvfence serve's `--page-size`, default 16). */
  readonly pageSize: number;
  /** KV cache element types to run each kernel set on, side by side (default f16). */
  readonly kvCacheDtypes?: readonly KvDtype[];
  readonly batchSizes: readonly number[];
  readonly repeats: number;
  readonly bandwidthBytes: number;
  readonly seed: number;
  /**
   * A kvfence checkout (built) whose forward pass runs beside this build's: every arm gets a twin
   * on that build's `createForward`, in the same repeats (the order of the arms reversed every
   * other repeat), and the report gives this build / baseline as paired ratios with 95% CIs.
   */
  readonly baseline?: string;
  /** After the timed repeats, run each phase once more with every kernel call timed (`--profile`). */
  readonly profile?: boolean;
  readonly log?: (line: string) => void;
}

export const MODEL_BENCH_DEFAULTS = {
  kernels: ["ts", "wasm"],
  threads: 2,
  promptTokens: 128,
  contextTokens: 32,
  longContextTokens: 0,
  decodeSteps: 16,
  pageSize: 16,
  batchSizes: [1, 8],
  repeats: 5,
  bandwidthBytes: 2 ** 30,
  seed: 1,
} as const;

export interface Measured {
  readonly summary: Summary;
  readonly ci95: Interval;
}

export interface DecodeResult {
  readonly batch: number;
  readonly contextTokens: number;
  readonly tokensPerSecond: Measured;
  /** B · median read bandwidth on the run's threads / weight bytes. */
  readonly rooflineTokensPerSecond: number;
  /** This batch's tok/s over batch 1's in the same repeat (null for batch 1, or without batch 1). */
  readonly vsBatch1: Measured | null;
}

export interface KernelsRun {
  readonly kernels: BenchKernels;
  /** "baseline" for an arm on the `--baseline` build's forward pass. */
  readonly build: ArmBuild;
  readonly kvCacheDtype: KvDtype;
  /** The weight format of this run ("as stored" when the folder's formats were kept). */
  readonly dtype: WeightDType | "stored";
  /** Bytes of distinct weights one decode step reads in this format (its roofline's). */
  readonly weightBytes: number;
  /** For WebAssembly runs: whether the kernels used fused multiply-add (relaxed SIMD). */
  readonly fma: boolean | null;
  /** For WebAssembly runs: whether batches on Q8_0/Q4_0 ran the int8 dot with accumulate (`WasmKernels.dotAdd`). */
  readonly dotAdd: boolean | null;
  readonly threads: 1 | 2;
  readonly prefillTokensPerSecond: Measured;
  readonly prefillGflopsPerCore: Measured;
  readonly decode: readonly DecodeResult[];
  /** The long-context arm, or null when skipped. */
  readonly longContext: DecodeResult | null;
  /** With `profile`: where each phase's step time goes, kernel by kernel (null without). */
  readonly profile: readonly PhaseProfile[] | null;
}

/** This build / the baseline's twin of one arm, each figure a paired ratio by repeat. */
export interface BaselineRatio {
  readonly kernels: BenchKernels;
  readonly kvCacheDtype: KvDtype;
  readonly dtype: WeightDType | "stored";
  readonly prefill: RatioInterval;
  readonly decode: readonly { readonly batch: number; readonly ratio: RatioInterval }[];
  readonly longContext: RatioInterval | null;
}

export interface ModelBenchResult {
  readonly model: string;
  readonly config: ModelConfig;
  readonly weightBytes: number;
  readonly loadSeconds: number;
  readonly options: Omit<ModelBenchOptions, "log">;
  /** Read bandwidth in GB/s on 1 and (when a run uses 2) on 2 threads. */
  readonly readGbps: { readonly 1: Measured; readonly 2: Measured | null };
  readonly runs: readonly KernelsRun[];
  /** With `baseline`: one entry per arm of this build. */
  readonly vsBaseline: readonly BaselineRatio[];
  readonly node: string;
}

/** Bytes of distinct weights one decode step reads (a tied LM head counts once). */
export function weightBytes(weights: ModelWeights): number {
  const seen = new Set<Matrix>();
  const add = (a: Matrix | null): void => {
    if (a !== null) seen.add(a);
  };
  add(weights.embed);
  add(weights.lmHead);
  add(weights.finalNorm);
  for (const l of weights.layers) {
    for (const a of [
      l.inputNorm,
      l.q,
      l.k,
      l.v,
      l.qBias,
      l.kBias,
      l.vBias,
      l.o,
      l.postNorm,
      l.gate,
      l.up,
      l.down,
    ])
      add(a);
  }
  let bytes = 0;
  for (const a of seen) bytes += matrixBytes(a).byteLength;
  // The embedding table is not streamed by decode (one row per token), unless it is the LM head.
  if (weights.embed !== weights.lmHead) bytes -= matrixBytes(weights.embed).byteLength;
  return bytes;
}

/** FLOPs of a prefill of `n` tokens in one chunk with one logits row: linear layers and causal attention. */
export function prefillFlops(c: ModelConfig, n: number): number {
  const q = c.numHeads * c.headDim;
  const kv = c.numKvHeads * c.headDim;
  const perLayer = c.hiddenSize * (2 * q + 2 * kv) + 3 * c.hiddenSize * c.intermediateSize;
  const linear = 2 * n * c.numLayers * perLayer + 2 * c.vocabSize * c.hiddenSize;
  const attention = c.numLayers * c.numHeads * 4 * c.headDim * ((n * (n + 1)) / 2);
  return linear + attention;
}

function measured(values: number[], seed: number): Measured {
  return { summary: summarize(values), ci95: bootstrapInterval(values, { seed }) };
}

type ArmBuild = "this" | "baseline";

/** One kernel set's forward pass, its sequences and its timed arms. */
interface Arms {
  readonly name: BenchKernels;
  readonly build: ArmBuild;
  readonly kvDtype: KvDtype;
  readonly dtype: WeightDType | "stored";
  readonly weightBytes: number;
  readonly threads: 1 | 2;
  readonly setup: ForwardSetup;
  /** With `--profile` (this build's arms only): the profile its kernels are timed into. */
  readonly profile: KernelProfile | null;
  prefill(): number;
  decode(batchIndex: number): number;
  /** null when the arm is skipped. */
  readonly long: (() => number) | null;
}

/** The model an arm runs and the long-context arm's length (0: skipped). */
interface ArmModel {
  readonly config: ModelConfig;
  readonly weights: ModelWeights;
  readonly longContext: number;
}

/** The `createForward` of this build or of the checkout at `baseline`. */
async function forwardOf(baseline: string | undefined): Promise<typeof createForward> {
  if (baseline === undefined) return createForward;
  const file = join(resolve(baseline), "dist", "src", "engine", "forward-setup.js");
  if (!existsSync(file))
    throw new Error(`--baseline ${baseline}: no ${file}; give a kvfence checkout built with npm ci`);
  const mod = (await import(pathToFileURL(file).href)) as { createForward?: typeof createForward };
  if (typeof mod.createForward !== "function")
    throw new Error(`--baseline ${baseline}: ${file} has no createForward`);
  return mod.createForward;
}

async function prepareArms(
  name: BenchKernels,
  kvDtype: KvDtype,
  options: ModelBenchOptions,
  model: ArmModel,
  dtype: WeightDType | "stored",
  build: ArmBuild,
): Promise<Arms> {
  const { config, longContext } = model;
  const weights = dtype === "stored" ? model.weights : convertWeights(model.weights, config, dtype);
  const threads: 1 | 2 = name === "ts" ? 1 : options.threads;
  const rng = new Prng(options.seed);
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: options.pageSize,
    dtype: kvDtype,
  };
  const n = armPages(options, longContext);
  const forward = await forwardOf(build === "baseline" ? options.baseline : undefined);
  const profile = options.profile === true && build === "this" ? new KernelProfile() : null;
  const setup = await forward(config, weights, layout, {
    ...(profile === null ? {} : { profile }),
    kernels: name === "ts" || name === "native" ? name : "wasm",
    wasmFma: name !== "wasm-mul-add",
    wasmDotAdd: name !== "wasm-i16",
    kernelThreads: threads,
    maxBatchTokens: Math.max(options.promptTokens, n.maxBatch * options.contextTokens),
    maxSequences: n.maxBatch,
    poolPages: [n.decode + n.prefill + n.long],
  });
  const { forward: fp } = setup;
  const pool = (setup.pools[0] as (typeof setup.pools)[number]).data;
  const vocab = config.vocabSize;
  const randomTokens = (count: number): Int32Array =>
    Int32Array.from({ length: count }, () => rng.nextInt(vocab));

  // Decode: maxBatch sequences whose contexts are prefilled once; every run restarts at
  // position contextTokens and rewrites the same slots.
  const decodeSeqs: StepSequence[] = [];
  for (let s = 0; s < n.maxBatch; s++) {
    decodeSeqs.push(
      benchSequence(randomTokens(options.contextTokens), 0, s * n.perDecodeSeq, n.perDecodeSeq, vocab),
    );
  }
  fp.step(pool, decodeSeqs);
  decodeSeqs.forEach((s, i) => {
    s.tokens = Int32Array.of(i % vocab);
  });
  const prefillBatch = [benchSequence(randomTokens(options.promptTokens), 0, n.decode, n.prefill, vocab)];
  const decodeBatches = options.batchSizes.map((b) => decodeSeqs.slice(0, b));
  if (n.long > 0) fillResidentKv(pool, layout, n.decode + n.prefill, n.long, rng);
  const longBatch = [
    benchSequence(Int32Array.of(1 % vocab), longContext, n.decode + n.prefill, n.long, vocab),
  ];
  const run = (batch: StepSequence[], start: number): number =>
    decodeTokensPerSecond(fp, pool, batch, start, options.decodeSteps);
  return {
    name,
    build,
    kvDtype,
    dtype,
    weightBytes: weightBytes(weights),
    threads,
    setup,
    profile,
    prefill() {
      const t0 = process.hrtime.bigint();
      fp.step(pool, prefillBatch);
      return options.promptTokens / (Number(process.hrtime.bigint() - t0) / 1e9);
    },
    decode: (i) => run(decodeBatches[i] as StepSequence[], options.contextTokens),
    long: longContext > 0 ? () => run(longBatch, longContext) : null,
  };
}

/** The pages of an arm's pool: every decode sequence's, then the prefill prompt's, then the long arm's. */
function armPages(options: ModelBenchOptions, longContext: number) {
  const maxBatch = Math.max(...options.batchSizes);
  const perDecodeSeq = Math.ceil((options.contextTokens + options.decodeSteps) / options.pageSize);
  return {
    maxBatch,
    perDecodeSeq,
    decode: maxBatch * perDecodeSeq,
    prefill: Math.ceil(options.promptTokens / options.pageSize),
    long: longContext > 0 ? Math.ceil((longContext + options.decodeSteps) / options.pageSize) : 0,
  };
}

/** A sequence of `tokens` at `startPos` over the `count` pages from `firstPage` on, with a logits row. */
function benchSequence(
  tokens: Int32Array,
  startPos: number,
  firstPage: number,
  count: number,
  vocabSize: number,
): StepSequence {
  return {
    tokens,
    startPos,
    blockTable: Int32Array.from({ length: count }, (_, i) => firstPage + i),
    logits: new Float32Array(vocabSize),
  };
}

type BenchPool = ForwardSetup["pools"][number]["data"];

/** Decode tokens/s of `batch` stepping `steps` times together from position `start`. */
function decodeTokensPerSecond(
  fp: ForwardSetup["forward"],
  pool: BenchPool,
  batch: StepSequence[],
  start: number,
  steps: number,
): number {
  for (const s of batch) s.startPos = start;
  const t0 = process.hrtime.bigint();
  for (let step = 0; step < steps; step++) {
    fp.step(pool, batch);
    for (let i = 0; i < batch.length; i++) (batch[i] as StepSequence).startPos++;
  }
  return (batch.length * steps) / (Number(process.hrtime.bigint() - t0) / 1e9);
}

/**
 * Fills `count` pages of `pool` from `firstPage` on with random KV (rounded to the pool's dtype).
 * The long arm's KV must be resident, as a served sequence's is: pages never written would be read
 * from the kernel's shared zero page, all of it cache-hot (which once measured 27-28 tok/s at 4,096
 * tokens where resident KV gives ~20).
 */
function fillResidentKv(
  pool: BenchPool,
  layout: KvLayout,
  firstPage: number,
  count: number,
  rng: Prng,
): void {
  const floats = pageFloats(layout);
  const kv = pool.subarray(firstPage * floats, (firstPage + count) * floats);
  if (kv instanceof Float32Array) rng.fillGaussian(kv, 0.5);
  else {
    const values = new Float32Array(kv.length);
    rng.fillGaussian(values, 0.5);
    const code = kvDtypeCode(kvDtypeOf(layout));
    for (let i = 0; i < values.length; i++) kv[i] = roundKv(values[i] as number, code);
  }
}

export async function runModelBench(options: ModelBenchOptions): Promise<ModelBenchResult> {
  const log = options.log ?? (() => {});
  const tLoad = performance.now();
  const model = await openModel(options.modelDir);
  const loadSeconds = (performance.now() - tLoad) / 1000;
  const { config, weights } = model;
  const bytes = weightBytes(weights);
  log(
    `loaded ${model.name} in ${loadSeconds.toFixed(1)} s: ${(bytes / 1e6).toFixed(1)} MB of weights read per decode step`,
  );
  let longContext = options.longContextTokens;
  if (longContext > 0 && longContext + options.decodeSteps > config.maxPositionEmbeddings) {
    log(
      `skipping the long-context arm: ${longContext} + ${options.decodeSteps} steps exceed the model's window of ${config.maxPositionEmbeddings}`,
    );
    longContext = 0;
  }

  // auto: what the server would run here (native where the addon passes its self-test, else wasm).
  const auto = options.kernels.includes("auto") ? (await chooseKernels("auto")).kernels : "wasm";
  const kernelSets = [...new Set(options.kernels.map((k) => (k === "auto" ? auto : k)))];
  const kvDtypes = [...new Set(options.kvCacheDtypes ?? [DEFAULT_KV_CACHE_DTYPE])];
  const dtypes: (WeightDType | "stored")[] =
    options.dtypes === undefined ? ["stored"] : [...new Set(options.dtypes)];
  const arms: Arms[] = [];
  const builds: ArmBuild[] = options.baseline === undefined ? ["this"] : ["this", "baseline"];
  for (const dtype of dtypes) {
    for (const name of kernelSets)
      for (const kvDtype of kvDtypes)
        for (const build of builds)
          arms.push(
            await prepareArms(name, kvDtype, options, { config, weights, longContext }, dtype, build),
          );
  }
  const twoThreads = arms.some((a) => a.threads === 2);
  log(
    `allocating and touching a ${(options.bandwidthBytes / 2 ** 30).toFixed(2)} GiB buffer for the bandwidth probe`,
  );
  const probe = await BandwidthProbe.start(options.bandwidthBytes);
  try {
    const { gbps1, gbps2, samples } = sampleArms(arms, probe, { options, twoThreads, longContext });
    const readGbps = {
      1: measured(gbps1, options.seed),
      2: twoThreads ? measured(gbps2, options.seed) : null,
    };
    const roofline =
      (a: Arms) =>
      (threads: 1 | 2, batch: number): number =>
        (batch * ((threads === 2 ? readGbps[2] : readGbps[1]) ?? readGbps[1]).summary.median * 1e9) /
        a.weightBytes;
    const flops = prefillFlops(config, options.promptTokens);
    const runs = arms.map((a, k) => ({
      ...kernelsRun(a, samples[k]!, { options, k, flops, longContext, roofline: roofline(a) }),
      profile:
        a.profile === null ? null : profilePhases({ ...a, profile: a.profile }, { ...options, longContext }),
    }));
    const vsBaseline = arms.flatMap((a, k): BaselineRatio[] => {
      if (a.build !== "this" || options.baseline === undefined) return [];
      // The twin comes right after its arm (see `builds` above).
      const mine = samples[k] as ArmSamples;
      const twin = samples[k + 1] as ArmSamples;
      return [
        {
          kernels: a.name,
          kvCacheDtype: a.kvDtype,
          dtype: a.dtype,
          prefill: pairedRatio(mine.prefill, twin.prefill),
          decode: options.batchSizes.map((batch, i) => ({
            batch,
            ratio: pairedRatio(mine.decode[i] as number[], twin.decode[i] as number[]),
          })),
          longContext: a.long === null ? null : pairedRatio(mine.long, twin.long),
        },
      ];
    });
    const { log: _log, ...rest } = options;
    return {
      model: model.name,
      config,
      weightBytes: bytes,
      loadSeconds,
      options: rest,
      readGbps,
      runs,
      vsBaseline,
      node: process.version,
    };
  } finally {
    await probe.close();
    for (const a of arms) await a.setup.close();
  }
}

/** One arm's measurements, one entry per repeat: prefill tok/s, decode tok/s per batch size, long context. */
interface ArmSamples {
  readonly prefill: number[];
  readonly decode: number[][];
  readonly long: number[];
}

/**
 * One warm-up round of each arm (JIT, first touch of activations), then `repeats` rounds: the
 * read bandwidth (1 and, when an arm runs 2 threads, 2 threads), then every arm in turn.
 */
function sampleArms(
  arms: readonly Arms[],
  probe: BandwidthProbe,
  run: { readonly options: ModelBenchOptions; readonly twoThreads: boolean; readonly longContext: number },
): { gbps1: number[]; gbps2: number[]; samples: ArmSamples[] } {
  const { options, twoThreads, longContext } = run;
  const log = options.log ?? (() => {});
  probe.measure(1);
  if (twoThreads) probe.measure(2);
  for (const a of arms) {
    a.prefill();
    for (let i = 0; i < options.batchSizes.length; i++) a.decode(i);
    a.long?.();
  }
  const gbps1: number[] = [];
  const gbps2: number[] = [];
  const samples: ArmSamples[] = arms.map(() => ({
    prefill: [],
    decode: options.batchSizes.map(() => []),
    long: [],
  }));
  for (let r = 0; r < options.repeats; r++) {
    gbps1.push(probe.measure(1));
    if (twoThreads) gbps2.push(probe.measure(2));
    const parts = [
      `read ${(gbps1.at(-1) as number).toFixed(1)}${twoThreads ? `/${(gbps2.at(-1) as number).toFixed(1)}` : ""} GB/s`,
    ];
    // Every other repeat runs the arms in reverse, so no arm always follows the bandwidth probe.
    const order = arms.map((_, k) => (r % 2 === 0 ? k : arms.length - 1 - k));
    const parts0 = parts.length;
    for (const k of order) {
      const a = arms[k] as Arms;
      const s = samples[k]!;
      s.prefill.push(a.prefill());
      options.batchSizes.forEach((_, i) => {
        (s.decode[i] as number[]).push(a.decode(i));
      });
      if (a.long !== null) s.long.push(a.long());
      parts[parts0 + k] =
        `${armLabel(a.name, a.dtype, a.build)} kv ${a.kvDtype}: prefill ${(s.prefill.at(-1) as number).toFixed(1)} tok/s, ` +
        options.batchSizes
          .map((b, i) => `decode@${b} ${((s.decode[i] as number[]).at(-1) as number).toFixed(1)}`)
          .join(", ") +
        (a.long === null ? "" : `, decode@ctx${longContext} ${(s.long.at(-1) as number).toFixed(1)}`);
    }
    log(`repeat ${r + 1}/${options.repeats}: ${parts.join("; ")}`);
  }
  return { gbps1, gbps2, samples };
}

/** Arm `k`'s figures, each with its bootstrap CI (seeded per arm and figure). */
function kernelsRun(
  a: Arms,
  s: ArmSamples,
  run: {
    readonly options: ModelBenchOptions;
    readonly k: number;
    readonly flops: number;
    readonly longContext: number;
    readonly roofline: (threads: 1 | 2, batch: number) => number;
  },
): Omit<KernelsRun, "profile"> {
  const { options, roofline } = run;
  const seed = options.seed + 10 * (run.k + 1);
  const b1 = options.batchSizes.indexOf(1);
  const kernels = a.setup.kernels;
  return {
    kernels: a.name,
    build: a.build,
    kvCacheDtype: a.kvDtype,
    dtype: a.dtype,
    weightBytes: a.weightBytes,
    fma: kernels instanceof WasmKernels ? kernels.fma : null,
    dotAdd: kernels instanceof WasmKernels ? kernels.dotAdd : null,
    threads: a.threads,
    prefillTokensPerSecond: measured(s.prefill, seed),
    prefillGflopsPerCore: measured(
      s.prefill.map((tps) => (run.flops * tps) / options.promptTokens / 1e9 / a.threads),
      seed,
    ),
    decode: options.batchSizes.map((batch, i) => ({
      batch,
      contextTokens: options.contextTokens,
      tokensPerSecond: measured(s.decode[i] as number[], seed + 1 + i),
      rooflineTokensPerSecond: roofline(a.threads, batch),
      vsBatch1:
        batch === 1 || b1 < 0
          ? null
          : measured(
              (s.decode[i] as number[]).map((tps, r) => tps / ((s.decode[b1] as number[])[r] as number)),
              seed + 20 + i,
            ),
    })),
    longContext:
      a.long === null
        ? null
        : {
            batch: 1,
            contextTokens: run.longContext,
            tokensPerSecond: measured(s.long, seed + 9),
            rooflineTokensPerSecond: roofline(a.threads, 1),
            vsBatch1: null,
          },
  };
}

/** "wasm", or "wasm q8_0" when formats are compared; "… (baseline)" for the baseline's twin. */
function armLabel(kernels: BenchKernels, dtype: WeightDType | "stored", build: ArmBuild = "this"): string {
  const label = dtype === "stored" ? kernels : `${kernels} ${dtype}`;
  return build === "baseline" ? `${label} (baseline)` : label;
}

/** The WebAssembly build a run used, for its report line ("" for the TypeScript and native kernels). */
function buildLabel(run: KernelsRun): string {
  if (run.fma === null || run.kernels === "native") return "";
  if (!run.fma) return " (multiply, then add)";
  const int8 = run.dtype === "q8_0" || run.dtype === "q4_0";
  return run.dotAdd === true && int8
    ? " (fused multiply-add, int8 dot with accumulate)"
    : " (fused multiply-add)";
}

export function formatModelBench(r: ModelBenchResult): string {
  const c = r.config;
  const m = (x: Measured, digits = 1): string =>
    `${x.summary.median.toFixed(digits)} [range ${x.summary.min.toFixed(digits)}–${x.summary.max.toFixed(digits)}; 95% CI of median ${x.ci95.low.toFixed(digits)}–${x.ci95.high.toFixed(digits)}]`;
  const bandwidth = `1 thread ${m(r.readGbps[1], 2)}${r.readGbps[2] === null ? "" : `, 2 threads ${m(r.readGbps[2], 2)}`}`;
  const lines = [
    `model bench: ${r.model} (${c.architecture}, ${c.numLayers} layers, hidden ${c.hiddenSize}, heads ${c.numHeads}/${c.numKvHeads}, vocab ${c.vocabSize}); Node ${r.node}`,
    `  weights read per decode step: ${(r.weightBytes / 1e6).toFixed(1)} MB as stored${formatBytesByDtype(r)}; KV pages of ${r.options.pageSize} tokens; ${r.options.repeats} interleaved repeats, medians`,
    `  read bandwidth (native memchr over ${(r.options.bandwidthBytes / 2 ** 30).toFixed(2)} GiB): ${bandwidth} GB/s`,
  ];
  const l3 = lastLevelCacheBytes();
  const decodeLine = (d: DecodeResult & { weightBytes?: number }): string => {
    const pct = (d.tokensPerSecond.summary.median / d.rooflineTokensPerSecond) * 100;
    const weightBytesOfRun = d.weightBytes ?? r.weightBytes;
    const speedup = d.vsBatch1 === null ? "" : `; ×${m(d.vsBatch1, 2)} of batch 1 (paired by repeat)`;
    const cached =
      pct > 100 && l3 !== null && weightBytesOfRun <= l3
        ? `; the weights fit in the ${(l3 / 2 ** 20).toFixed(0)} MiB last-level cache, so they need not come from DRAM`
        : "";
    return `    decode batch ${d.batch} (context ${d.contextTokens}, ${r.options.decodeSteps} steps): ${m(d.tokensPerSecond)} tok/s; roofline ${d.rooflineTokensPerSecond.toFixed(1)} tok/s (${pct.toFixed(1)}% of it${cached})${speedup}`;
  };
  for (const run of r.runs) {
    const build = buildLabel(run);
    const format =
      run.dtype === "stored"
        ? ""
        : ` on ${run.dtype} weights (${(run.weightBytes / 1e6).toFixed(1)} MB per step)`;
    const of = run.build === "baseline" ? ` of the baseline (${r.options.baseline})` : "";
    lines.push(
      `  ${run.kernels} kernels${of}${build}${format}, ${run.threads} thread${run.threads > 1 ? "s" : ""}, KV cache ${run.kvCacheDtype}:`,
    );
    lines.push(
      `    prefill (${r.options.promptTokens}-token prompt, one chunk): ${m(run.prefillTokensPerSecond)} tok/s = ${m(run.prefillGflopsPerCore)} GFLOP/s per core`,
    );
    for (const d of run.decode) lines.push(decodeLine({ ...d, weightBytes: run.weightBytes }));
    if (run.longContext !== null)
      lines.push(decodeLine({ ...run.longContext, weightBytes: run.weightBytes }));
    if (run.profile !== null) lines.push(...formatProfile(run.profile));
  }
  if (r.runs.length > 1) {
    lines.push("  side by side (medians):");
    const batches = r.runs[0]?.decode.map((d) => d.batch) ?? [];
    lines.push(
      `    kernels, KV      | prefill tok/s | ${batches.map((b) => `decode b${b} tok/s`).join(" | ")}${r.runs[0]?.longContext ? ` | decode @${r.runs[0].longContext.contextTokens} tok/s` : ""}`,
    );
    for (const run of r.runs) {
      const cells = [
        run.prefillTokensPerSecond.summary.median.toFixed(1),
        ...run.decode.map((d) => d.tokensPerSecond.summary.median.toFixed(1)),
        ...(run.longContext === null ? [] : [run.longContext.tokensPerSecond.summary.median.toFixed(1)]),
      ];
      lines.push(
        `    ${`${armLabel(run.kernels, run.dtype, run.build)} ${run.threads}t ${run.kvCacheDtype}`.padEnd(16)} | ${cells.join(" | ")}`,
      );
    }
  }
  lines.push(...formatVsBaseline(r));
  return lines.join("\n");
}

/** The lines of this build / baseline (none without a baseline). */
function formatVsBaseline(r: ModelBenchResult): string[] {
  if (r.vsBaseline.length === 0) return [];
  const pct = (x: RatioInterval): string =>
    `${(100 * x.ratio).toFixed(1)}% [${(100 * x.low).toFixed(1)}–${(100 * x.high).toFixed(1)}]`;
  const lines = [
    `  this build / baseline (tok/s, geometric mean of the ${r.options.repeats} paired repeats, 95% CI):`,
  ];
  for (const v of r.vsBaseline) {
    const cells = [
      `prefill ${pct(v.prefill)}`,
      ...v.decode.map((d) => `b${d.batch} ${pct(d.ratio)}`),
      ...(v.longContext === null ? [] : [`@${r.options.longContextTokens} ${pct(v.longContext)}`]),
    ];
    lines.push(
      `    ${`${armLabel(v.kernels, v.dtype)} ${v.kvCacheDtype}`.padEnd(16)} | ${cells.join(" | ")}`,
    );
  }
  return lines;
}

/** ", bf16 270.0 MB, q8_0 143.4 MB" for the formats compared (empty without --dtype). */
function formatBytesByDtype(r: ModelBenchResult): string {
  const seen = new Map<string, number>();
  for (const run of r.runs) if (run.dtype !== "stored") seen.set(run.dtype, run.weightBytes);
  return [...seen].map(([d, b]) => `, ${d} ${(b / 1e6).toFixed(1)} MB`).join("");
}
