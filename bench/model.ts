/**
 * `kvfence bench model`: forward-pass throughput of a model folder against the machine's memory
 * roofline, measured in the same run.
 *
 * - Prefill: one sequence, a seeded random prompt of `promptTokens` in one chunk; tokens/s.
 * - Decode at each batch size: `batch` sequences that already hold a `contextTokens` context each
 *   decode `decodeSteps` steps together; tokens/s = batch · steps / time. Every repeat rewrites
 *   the same KV slots, so repeats are identical work.
 * - Roofline: decode must read every distinct weight once per step, so at batch B the ceiling is
 *   B · readBandwidth / weightBytes tokens/s. Read bandwidth is a 4-accumulator Float64Array sum
 *   over a buffer far larger than L3 (1 GiB by default), touched before timing.
 *
 * Arms are interleaved within each repeat (bandwidth, prefill, decode per batch), and the report
 * gives the median, the range and a bootstrap 95% CI of the median.
 */
import { pageFloats } from "../src/kvcache/kv-layout.js";
import { Prng } from "../src/lib/prng.js";
import { bootstrapInterval, type Interval, type Summary, summarize } from "../src/lib/stats.js";
import { ForwardPass, type StepSequence } from "../src/model/forward.js";
import { loadModel } from "../src/model/load-model.js";
import type { ModelConfig, ModelWeights } from "../src/model/model-config.js";

export interface ModelBenchOptions {
  readonly modelDir: string;
  readonly promptTokens: number;
  readonly contextTokens: number;
  readonly decodeSteps: number;
  readonly batchSizes: readonly number[];
  readonly repeats: number;
  readonly bandwidthBytes: number;
  readonly seed: number;
  readonly log?: (line: string) => void;
}

export const MODEL_BENCH_DEFAULTS = {
  promptTokens: 128,
  contextTokens: 32,
  decodeSteps: 16,
  batchSizes: [1, 8],
  repeats: 5,
  bandwidthBytes: 2 ** 30,
  seed: 1,
} as const;

export interface Measured {
  readonly summary: Summary;
  readonly ci95: Interval;
}

export interface ModelBenchResult {
  readonly model: string;
  readonly config: ModelConfig;
  readonly weightBytes: number;
  readonly loadSeconds: number;
  readonly options: Omit<ModelBenchOptions, "log">;
  readonly readGbps: Measured;
  readonly prefillTokensPerSecond: Measured;
  readonly decode: ReadonlyArray<{
    readonly batch: number;
    readonly tokensPerSecond: Measured;
    /** B · median read bandwidth / weight bytes. */
    readonly rooflineTokensPerSecond: number;
  }>;
  readonly node: string;
}

/** Bytes of distinct weights one decode step reads (a tied LM head counts once). */
export function weightBytes(weights: ModelWeights): number {
  const seen = new Set<Float32Array>();
  const add = (a: Float32Array | null): void => {
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
  for (const a of seen) bytes += a.byteLength;
  // The embedding table is not streamed by decode (one row per token), unless it is the LM head.
  if (weights.embed !== weights.lmHead) bytes -= weights.embed.byteLength;
  return bytes;
}

/** One read-only pass over `buf` with 4 accumulators; returns GB/s (and the sum, to keep it live). */
export function readBandwidth(buf: Float64Array): { gbps: number; sum: number } {
  const t0 = process.hrtime.bigint();
  let a0 = 0;
  let a1 = 0;
  let a2 = 0;
  let a3 = 0;
  const n = buf.length - (buf.length % 4);
  for (let i = 0; i < n; i += 4) {
    a0 += buf[i] as number;
    a1 += buf[i + 1] as number;
    a2 += buf[i + 2] as number;
    a3 += buf[i + 3] as number;
  }
  for (let i = n; i < buf.length; i++) a0 += buf[i] as number;
  const ns = Number(process.hrtime.bigint() - t0);
  return { gbps: buf.byteLength / ns, sum: a0 + a1 + a2 + a3 };
}

function measured(values: number[], seed: number): Measured {
  return { summary: summarize(values), ci95: bootstrapInterval(values, { seed }) };
}

export function runModelBench(options: ModelBenchOptions): ModelBenchResult {
  const log = options.log ?? (() => {});
  const tLoad = performance.now();
  const model = loadModel(options.modelDir);
  const loadSeconds = (performance.now() - tLoad) / 1000;
  const { config, weights } = model;
  const bytes = weightBytes(weights);
  log(
    `loaded ${model.name} in ${loadSeconds.toFixed(1)} s: ${(bytes / 1e6).toFixed(1)} MB of weights read per decode step`,
  );

  const rng = new Prng(options.seed);
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: 16,
  };
  const maxBatch = Math.max(...options.batchSizes);
  const ctxLen = options.contextTokens + options.decodeSteps;
  const pagesPerDecodeSeq = Math.ceil(ctxLen / layout.pageSize);
  const pagesForPrefill = Math.ceil(options.promptTokens / layout.pageSize);
  const decodePages = maxBatch * pagesPerDecodeSeq;
  const pool = new Float32Array((decodePages + pagesForPrefill) * pageFloats(layout));
  pool.fill(0); // touch every page before timing
  const fp = new ForwardPass(config, weights, layout, {
    maxBatchTokens: Math.max(options.promptTokens, maxBatch * options.contextTokens),
    maxSequences: maxBatch,
  });
  const randomTokens = (n: number): Int32Array =>
    Int32Array.from({ length: n }, () => rng.nextInt(config.vocabSize));

  // Decode arms: maxBatch sequences whose contexts are prefilled once; every decode run restarts
  // at position contextTokens and rewrites the same slots.
  const decodeSeqs: StepSequence[] = [];
  for (let s = 0; s < maxBatch; s++) {
    decodeSeqs.push({
      tokens: randomTokens(options.contextTokens),
      startPos: 0,
      blockTable: Int32Array.from({ length: pagesPerDecodeSeq }, (_, i) => s * pagesPerDecodeSeq + i),
      logits: new Float32Array(config.vocabSize),
    });
  }
  fp.step(pool, decodeSeqs);
  decodeSeqs.forEach((s, i) => {
    s.tokens = Int32Array.of(i % config.vocabSize);
  });
  // Prefill arm: its own pages after the decode ones.
  const prefillSeq: StepSequence = {
    tokens: randomTokens(options.promptTokens),
    startPos: 0,
    blockTable: Int32Array.from({ length: pagesForPrefill }, (_, i) => decodePages + i),
    logits: new Float32Array(config.vocabSize),
  };
  const decodeBatches = options.batchSizes.map((b) => decodeSeqs.slice(0, b));
  const runDecode = (batch: StepSequence[]): number => {
    for (const s of batch) s.startPos = options.contextTokens;
    const t0 = process.hrtime.bigint();
    for (let step = 0; step < options.decodeSteps; step++) {
      fp.step(pool, batch);
      for (let i = 0; i < batch.length; i++) (batch[i] as StepSequence).startPos++;
    }
    const ns = Number(process.hrtime.bigint() - t0);
    return (batch.length * options.decodeSteps) / (ns / 1e9);
  };

  log(
    `allocating and touching a ${(options.bandwidthBytes / 2 ** 30).toFixed(2)} GiB buffer for the read-bandwidth probe`,
  );
  const probe = new Float64Array(Math.floor(options.bandwidthBytes / 8));
  for (let i = 0; i < probe.length; i++) probe[i] = i & 1023;

  // Warm-up (JIT) with one small round of each arm.
  readBandwidth(probe.subarray(0, 1 << 20));
  fp.step(pool, [prefillSeq]);
  for (const b of decodeBatches) runDecode(b);

  const gbps: number[] = [];
  const prefill: number[] = [];
  const decode: number[][] = options.batchSizes.map(() => []);
  let keep = 0;
  for (let r = 0; r < options.repeats; r++) {
    const bw = readBandwidth(probe);
    keep += bw.sum;
    gbps.push(bw.gbps);
    const t0 = process.hrtime.bigint();
    fp.step(pool, [prefillSeq]);
    prefill.push(options.promptTokens / (Number(process.hrtime.bigint() - t0) / 1e9));
    decodeBatches.forEach((b, i) => {
      (decode[i] as number[]).push(runDecode(b));
    });
    log(
      `repeat ${r + 1}/${options.repeats}: read ${bw.gbps.toFixed(1)} GB/s, prefill ${(prefill.at(-1) as number).toFixed(1)} tok/s, ` +
        options.batchSizes
          .map((b, i) => `decode@${b} ${((decode[i] as number[]).at(-1) as number).toFixed(1)} tok/s`)
          .join(", "),
    );
  }
  if (keep === -1) log("");
  const readGbps = measured(gbps, options.seed);
  const { log: _log, ...rest } = options;
  return {
    model: model.name,
    config,
    weightBytes: bytes,
    loadSeconds,
    options: rest,
    readGbps,
    prefillTokensPerSecond: measured(prefill, options.seed + 1),
    decode: options.batchSizes.map((batch, i) => ({
      batch,
      tokensPerSecond: measured(decode[i] as number[], options.seed + 2 + i),
      rooflineTokensPerSecond: (batch * readGbps.summary.median * 1e9) / bytes,
    })),
    node: process.version,
  };
}

export function formatModelBench(r: ModelBenchResult): string {
  const c = r.config;
  const m = (x: Measured, digits = 1): string =>
    `${x.summary.median.toFixed(digits)} [range ${x.summary.min.toFixed(digits)}–${x.summary.max.toFixed(digits)}; 95% CI of median ${x.ci95.low.toFixed(digits)}–${x.ci95.high.toFixed(digits)}]`;
  const lines = [
    `model bench: ${r.model} (${c.architecture}, ${c.numLayers} layers, hidden ${c.hiddenSize}, heads ${c.numHeads}/${c.numKvHeads}, vocab ${c.vocabSize}); Node ${r.node}, plain-TS reference kernels, 1 thread`,
    `  weights read per decode step: ${(r.weightBytes / 1e6).toFixed(1)} MB (f32); ${r.options.repeats} interleaved repeats, medians`,
    `  read bandwidth (Float64Array sum over ${(r.options.bandwidthBytes / 2 ** 30).toFixed(2)} GiB): ${m(r.readGbps, 2)} GB/s`,
    `  prefill (${r.options.promptTokens}-token prompt, one chunk): ${m(r.prefillTokensPerSecond)} tok/s`,
  ];
  for (const d of r.decode) {
    const pct = (d.tokensPerSecond.summary.median / d.rooflineTokensPerSecond) * 100;
    lines.push(
      `  decode batch ${d.batch} (context ${r.options.contextTokens}, ${r.options.decodeSteps} steps): ${m(d.tokensPerSecond)} tok/s; roofline ${d.rooflineTokensPerSecond.toFixed(1)} tok/s (${pct.toFixed(0)}% of it)`,
    );
  }
  return lines.join("\n");
}
