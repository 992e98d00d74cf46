/**
 * Benchmark: the WebAssembly SIMD kernels (src/kernels/wasm-kernels.ts) against the TypeScript
 * reference, as kernels and on the real forward pass, next to the memory-bandwidth roofline
 * measured in the same run (issue #7 acceptance numbers).
 *
 * Parts:
 * - `micro`: matvec 576x1536 and 2048x2048, matmul 64x576x1536 (cache-warm, as MEASUREMENTS §2),
 *   GFLOP/s for ts, wasm on 1 thread and wasm on 2 threads.
 * - `roofline`: read bandwidth of 1 GiB of touched memory, native `memchr` (`Buffer.indexOf` of an
 *   absent byte) on 1 and on 2 threads; the roofline is bandwidth / bytes of weights one decode
 *   token reads (all linear weights and the LM head).
 * - `model`: ForwardPass on a model folder with `--kernels ts|wasm|both`: batch-1 decode at short
 *   context, aggregate batch-8 decode, batch-1 decode at 4096 tokens of context, and prefill of a
 *   512-token prompt (effective GFLOP/s per core: linear + causal attention FLOPs / time / threads).
 *
 * - `pass`: the bare wasm decode weight pass (every linear weight and the LM head once, matvecs only).
 * - `guards`: on the wasm kernels, batch-8 Engine decode with every guard on versus every guard off
 *   (`makeSafety({disabledGuards: GUARD_NAMES})`), two engines sharing one ForwardPass, each with its
 *   own PagePool inside the WebAssembly memory; interleaved pairs whose order flips every pair;
 *   throughput ratio on/off as a geometric mean with a 95% CI over the pairs.
 *
 * Every figure is the median over timed repetitions after warm-up (the spread is printed).
 * Decode at 4096 tokens reads KV the pool already holds (zeros): the cost of attention does not
 * depend on the values.
 *
 * Run: `node dist/bench/kernels.js [--model DIR] [--kernels ts|wasm|both] [--threads 1|2]
 * [--parts micro,roofline,pass,model,guards] [--prompt 512] [--pairs 20] [--json]`
 * (the model: `node dist/src/cli/main.js gen-model --like smollm2-135m --seed 1 /work/scratch/smol`).
 */
import { parseArgs } from "node:util";
import { Worker } from "node:worker_threads";
import { Engine } from "../src/engine/engine.js";
import type { GenerationEvents } from "../src/engine/engine-types.js";
import { type Kernels, referenceKernels } from "../src/kernels/kernels.js";
import { WasmKernels } from "../src/kernels/wasm-kernels.js";
import { type KvLayout, pageFloats } from "../src/kvcache/kv-layout.js";
import { PagePool } from "../src/kvcache/page-pool.js";
import { pairedRatio, type RatioInterval } from "../src/lib/stats.js";
import { loadModelConfig } from "../src/model/config-loader.js";
import { ForwardPass, type StepSequence } from "../src/model/forward.js";
import { loadWeights } from "../src/model/load-model.js";
import type { ModelConfig, ModelWeights } from "../src/model/model-config.js";
import { GUARD_NAMES, makeSafety } from "../src/protocol/safety.js";

interface Spread {
  median: number;
  min: number;
  max: number;
}

function spread(xs: number[]): Spread {
  const s = [...xs].sort((a, b) => a - b);
  return { median: s[Math.floor(s.length / 2)] as number, min: s[0] as number, max: s.at(-1) as number };
}

function nowMs(): number {
  return Number(process.hrtime.bigint()) / 1e6;
}

/** Times `fn` `reps` times after `warm` warm-up calls; milliseconds per call. */
function timeIt(fn: () => void, reps: number, warm: number): Spread {
  for (let i = 0; i < warm; i++) fn();
  const t: number[] = [];
  for (let i = 0; i < reps; i++) {
    const t0 = nowMs();
    fn();
    t.push(nowMs() - t0);
  }
  return spread(t);
}

function fill(a: Float32Array, seed: number): Float32Array {
  let s = seed >>> 0 || 1;
  for (let i = 0; i < a.length; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    a[i] = (s >>> 0) / 4294967296 - 0.5;
  }
  return a;
}

const fmt = (x: number, d = 1): string => x.toFixed(d);
const fmtS = (s: Spread, f: (x: number) => number, d = 1): string => {
  const a = f(s.min);
  const b = f(s.max);
  return `${fmt(f(s.median), d)} (${fmt(Math.min(a, b), d)}–${fmt(Math.max(a, b), d)})`;
};

// ---------------------------------------------------------------------------------------------

async function micro(log: (l: string) => void, results: Record<string, unknown>): Promise<void> {
  const shapes: [string, number, number, number, number][] = [
    ["matvec 576x1536", 1, 1536, 576, 200],
    ["matvec 2048x2048", 1, 2048, 2048, 50],
    ["matmul 64x576x1536", 64, 576, 1536, 3],
  ];
  const k1 = await WasmKernels.create({ threads: 1 });
  const k2 = await WasmKernels.create({ threads: 2 });
  await k2.ready();
  log("kernel                 | ts GFLOP/s      | wasm 1 thread    | wasm 2 threads");
  for (const [name, rows, inDim, outDim, inner] of shapes) {
    const flops = 2 * rows * inDim * outDim * inner;
    const row: string[] = [];
    const entry: Record<string, Spread> = {};
    for (const [label, kern] of [
      ["ts", referenceKernels],
      ["wasm1", k1],
      ["wasm2", k2],
    ] as const) {
      const x = fill(kern.allocF32(rows * inDim), 1);
      const w = fill(kern.allocF32(inDim * outDim), 2);
      const out = kern.allocF32(rows * outDim);
      const reps = label === "ts" ? 3 : 7;
      const t = timeIt(
        () => {
          for (let i = 0; i < inner; i++) kern.matmul(out, x, w, rows, inDim, outDim);
        },
        reps,
        1,
      );
      entry[label] = t;
      row.push(fmtS(t, (ms) => flops / ms / 1e6));
    }
    results[name] = entry;
    log(`${name.padEnd(22)} | ${row.join(" | ")}`);
  }
  await k1.close();
  await k2.close();
}

// ---------------------------------------------------------------------------------------------

const MEMCHR_WORKER = `
const { workerData } = require("node:worker_threads");
const ctl = new Int32Array(workerData.ctl);
const buf = Buffer.from(workerData.sab, workerData.offset, workerData.length);
let seen = 0;
for (;;) {
  Atomics.wait(ctl, 0, seen);
  seen = Atomics.load(ctl, 0);
  if (seen < 0) break;
  ctl[2] = buf.indexOf(1);
  Atomics.store(ctl, 1, seen);
  Atomics.notify(ctl, 1);
}
`;

/** Read bandwidth (GB/s) of `bytes` of touched memory with native memchr on 1 and 2 threads. */
async function roofline(log: (l: string) => void): Promise<{ one: Spread; two: Spread }> {
  const bytes = 1 << 30;
  const sab = new SharedArrayBuffer(bytes);
  const all = Buffer.from(sab);
  all.fill(0); // touch every page
  const half = bytes / 2;
  const ctlSab = new SharedArrayBuffer(16);
  const ctl = new Int32Array(ctlSab);
  const worker = new Worker(MEMCHR_WORKER, {
    eval: true,
    workerData: { sab, ctl: ctlSab, offset: half, length: half },
  });
  await new Promise((r) => setTimeout(r, 200));
  const mine = Buffer.from(sab, 0, half);
  const one = timeIt(() => all.indexOf(1), 7, 1);
  let seq = 0;
  const two = timeIt(
    () => {
      seq++;
      Atomics.store(ctl, 0, seq);
      Atomics.notify(ctl, 0);
      mine.indexOf(1);
      while (Atomics.load(ctl, 1) !== seq) Atomics.wait(ctl, 1, Atomics.load(ctl, 1), 1);
    },
    7,
    1,
  );
  Atomics.store(ctl, 0, -1);
  Atomics.notify(ctl, 0);
  await worker.terminate();
  const gbs = (ms: number) => bytes / ms / 1e6;
  log(
    `read bandwidth, native memchr over 1 GiB: 1 thread ${fmtS(one, gbs)} GB/s, 2 threads ${fmtS(two, gbs)} GB/s`,
  );
  return { one: mapSpread(one, gbs), two: mapSpread(two, gbs) };
}

function mapSpread(s: Spread, f: (x: number) => number): Spread {
  const a = f(s.min);
  const b = f(s.max);
  return { median: f(s.median), min: Math.min(a, b), max: Math.max(a, b) };
}

// ---------------------------------------------------------------------------------------------

/** Bytes of weights one decode token reads: every linear weight plus the LM head. */
function decodeWeightBytes(c: ModelConfig): number {
  const q = c.numHeads * c.headDim;
  const kv = c.numKvHeads * c.headDim;
  const perLayer = c.hiddenSize * (2 * q + 2 * kv) + 3 * c.hiddenSize * c.intermediateSize;
  return 4 * (c.numLayers * perLayer + c.vocabSize * c.hiddenSize);
}

/** FLOPs of a prefill of n tokens (one logits row). */
function prefillFlops(c: ModelConfig, n: number): number {
  const q = c.numHeads * c.headDim;
  const kv = c.numKvHeads * c.headDim;
  const perLayer = c.hiddenSize * (2 * q + 2 * kv) + 3 * c.hiddenSize * c.intermediateSize;
  const linear = 2 * n * c.numLayers * perLayer + 2 * c.vocabSize * c.hiddenSize;
  const attention = c.numLayers * c.numHeads * 4 * c.headDim * ((n * (n + 1)) / 2);
  return linear + attention;
}

interface ModelResult {
  kernels: string;
  threads: number;
  decode1: Spread; // tok/s
  decode8: Spread; // aggregate tok/s
  decode4k: Spread; // tok/s
  prefill: Spread; // GFLOP/s per core
  prefillMs: Spread;
}

function modelRun(
  name: string,
  kern: Kernels,
  threads: number,
  config: ModelConfig,
  weights: ModelWeights,
  promptLen: number,
  log: (l: string) => void,
): ModelResult {
  const slow = name === "ts";
  const pageSize = 16;
  const layout: KvLayout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize,
  };
  const longCtx = 4096;
  const shortPages = Math.ceil(64 / pageSize);
  const longPages = Math.ceil((longCtx + 32) / pageSize);
  const prefillPages = Math.ceil(promptLen / pageSize);
  const numPages = 8 * shortPages + longPages + prefillPages;
  const pool = kern.allocF32(numPages * pageFloats(layout));
  const fp = new ForwardPass(config, weights, layout, {
    maxBatchTokens: Math.max(promptLen, 8 * 16),
    maxSequences: 8,
    kernels: kern,
  });
  const vocab = config.vocabSize;
  let nextPage = 0;
  const pages = (n: number): Int32Array => Int32Array.from({ length: n }, () => nextPage++);
  const seqs: StepSequence[] = [];
  for (let i = 0; i < 8; i++) {
    seqs.push({
      tokens: Int32Array.from({ length: 16 }, (_, j) => (i * 97 + j * 13 + 5) % vocab),
      startPos: 0,
      blockTable: pages(shortPages),
      logits: new Float32Array(vocab),
    });
  }
  // Prefill the 8 short prompts as one batched step.
  fp.step(pool, seqs);
  for (const s of seqs) {
    s.startPos = 16;
    s.tokens = Int32Array.of(7);
  }
  const decodeSteps = slow ? 6 : 24;
  const one = [seqs[0] as StepSequence];
  // Decode steps reuse positions 16..47 so the context stays short.
  let p1 = 0;
  const d1 = timeIt(
    () => {
      (seqs[0] as StepSequence).startPos = 16 + (p1++ % 32);
      fp.step(pool, one);
    },
    decodeSteps,
    3,
  );
  const tok = (ms: number) => 1000 / ms;
  log(`  [${name}] decode batch 1, ctx ≈ 16–48: ${fmtS(d1, tok)} tok/s (${fmtS(d1, (x) => x, 2)} ms/step)`);
  let p8 = 0;
  const d8 = timeIt(
    () => {
      const pos = 16 + (p8++ % 32);
      for (const s of seqs) s.startPos = pos;
      fp.step(pool, seqs);
    },
    slow ? 4 : 16,
    2,
  );
  const tok8 = (ms: number) => 8000 / ms;
  log(`  [${name}] decode batch 8 aggregate: ${fmtS(d8, tok8)} tok/s (${fmtS(d8, (x) => x, 2)} ms/step)`);
  const long: StepSequence = {
    tokens: Int32Array.of(9),
    startPos: longCtx,
    blockTable: pages(longPages),
    logits: new Float32Array(vocab),
  };
  const longs = [long];
  let p4 = 0;
  const d4 = timeIt(
    () => {
      long.startPos = longCtx + (p4++ % 16);
      fp.step(pool, longs);
    },
    slow ? 4 : 16,
    2,
  );
  log(
    `  [${name}] decode batch 1 at ctx ${longCtx}: ${fmtS(d4, tok)} tok/s (${fmtS(d4, (x) => x, 2)} ms/step)`,
  );
  const pre: StepSequence = {
    tokens: Int32Array.from({ length: promptLen }, (_, j) => (j * 31 + 1) % vocab),
    startPos: 0,
    blockTable: pages(prefillPages),
    logits: new Float32Array(vocab),
  };
  const pres = [pre];
  const pm = timeIt(() => fp.step(pool, pres), slow ? 1 : 3, slow ? 0 : 1);
  const flops = prefillFlops(config, promptLen);
  const perCore = (ms: number) => flops / ms / 1e6 / threads;
  log(
    `  [${name}] prefill ${promptLen} tokens: ${fmtS(pm, (x) => x, 0)} ms, ${fmtS(pm, perCore)} GFLOP/s per core (${threads} thread${threads > 1 ? "s" : ""}, ${fmt(flops / 1e9, 1)} GFLOP)`,
  );
  return {
    kernels: name,
    threads,
    decode1: mapSpread(d1, tok),
    decode8: mapSpread(d8, tok8),
    decode4k: mapSpread(d4, tok),
    prefill: mapSpread(pm, perCore),
    prefillMs: pm,
  };
}

/** The bare decode weight pass: one matvec over every linear weight and the LM head; ms per pass. */
function weightPass(k: WasmKernels, config: ModelConfig, w: ModelWeights, reps: number): Spread {
  const h = config.hiddenSize;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  const inter = config.intermediateSize;
  const x = fill(k.allocF32(Math.max(h, q, inter)), 3);
  const y = k.allocF32(Math.max(config.vocabSize, inter));
  return timeIt(
    () => {
      for (const l of w.layers) {
        k.matmul(y, x, l.q, 1, h, q);
        k.matmul(y, x, l.k, 1, h, kv);
        k.matmul(y, x, l.v, 1, h, kv);
        k.matmul(y, x, l.o, 1, q, h);
        k.matmul(y, x, l.gate, 1, h, inter);
        k.matmul(y, x, l.up, 1, h, inter);
        k.matmul(y, x, l.down, 1, inter, h);
      }
      k.matmul(y, x, w.lmHead, 1, h, config.vocabSize);
    },
    reps,
    2,
  );
}

const IGNORE: GenerationEvents = { onTokens() {}, onFinish() {}, onError() {} };

/** Guards on versus off, batch-8 decode through the Engine on the wasm kernels. */
function guardsAB(
  k: WasmKernels,
  config: ModelConfig,
  weights: ModelWeights,
  pairs: number,
  log: (l: string) => void,
): { ratio: RatioInterval; onTokS: number; offTokS: number } {
  const batch = 8;
  const prompt = 16;
  const steps = 4;
  const pageSize = 16;
  const decodeTokens = 2 * pairs * steps + 8;
  const perRequest = prompt + decodeTokens;
  const layout: KvLayout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize,
  };
  const numPages = batch * Math.ceil(perRequest / pageSize) + 1;
  const forward = new ForwardPass(config, weights, layout, {
    maxBatchTokens: batch * prompt,
    maxSequences: batch,
    kernels: k,
  });
  const engines = [true, false].map((on) => {
    const at = k.allocBytes(PagePool.dataBytesFor(layout, numPages));
    const pool = new PagePool(layout, numPages, {
      dataBuffer: k.memory.buffer as SharedArrayBuffer,
      dataByteOffset: at,
    });
    return new Engine(forward, pool, {
      safety: makeSafety({ disabledGuards: on ? [] : GUARD_NAMES }),
      seed: 1,
      maxModelLen: Math.min(config.maxPositionEmbeddings, perRequest + 1),
    });
  });
  for (const engine of engines) {
    for (let r = 0; r < batch; r++) {
      const promptTokens = Int32Array.from(
        { length: prompt },
        (_, i) => (r * 131 + i * 17 + 3) % config.vocabSize,
      );
      engine.submit(
        {
          rid: r + 1,
          tenant: 0,
          promptTokens,
          maxTokens: decodeTokens,
          temperature: 0,
          topP: 1,
          topK: 0,
          seed: null,
          stopTokenIds: [],
        },
        IGNORE,
      );
    }
    engine.step();
    engine.step();
  }
  const arm = (engine: Engine): number => {
    const before = engine.stats().counters.completionTokens;
    const t0 = nowMs();
    for (let i = 0; i < steps; i++) engine.step();
    return ((engine.stats().counters.completionTokens - before) * 1000) / (nowMs() - t0);
  };
  const on: number[] = [];
  const off: number[] = [];
  for (let p = 0; p < pairs; p++) {
    if (p % 2 === 0) {
      on.push(arm(engines[0] as Engine));
      off.push(arm(engines[1] as Engine));
    } else {
      off.push(arm(engines[1] as Engine));
      on.push(arm(engines[0] as Engine));
    }
  }
  for (const engine of engines) for (const t of engine.liveBlockTables()) engine.abort(t.rid);
  const ratio = pairedRatio(on, off);
  const med = (xs: number[]) => spread(xs).median;
  const pct = (x: number) => `${((1 - x) * 100).toFixed(2)}%`;
  log(
    `guards on/off (wasm, batch ${batch}, ${pairs} interleaved pairs of ${steps} steps): on ${fmt(med(on))} tok/s, off ${fmt(med(off))} tok/s; ratio ${ratio.ratio.toFixed(4)} (95% CI ${ratio.low.toFixed(4)}–${ratio.high.toFixed(4)}); cost ${pct(ratio.ratio)} (CI ${pct(ratio.high)} – ${pct(ratio.low)})`,
  );
  return { ratio, onTokS: med(on), offTokS: med(off) };
}

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      model: { type: "string", default: "/work/scratch/smol" },
      kernels: { type: "string", default: "both" },
      threads: { type: "string", default: "2" },
      parts: { type: "string", default: "micro,roofline,model" },
      prompt: { type: "string", default: "512" },
      pairs: { type: "string", default: "20" },
      "matvec-chunk": { type: "string", default: "0" },
      json: { type: "boolean", default: false },
    },
  });
  const parts = new Set((values.parts ?? "").split(","));
  const which = values.kernels ?? "both";
  if (!["ts", "wasm", "both"].includes(which))
    throw new Error(`--kernels must be ts, wasm or both: ${which}`);
  const threads = values.threads === "1" ? 1 : 2;
  const promptLen = Number(values.prompt);
  const log = (l: string) => {
    if (!values.json) console.log(l);
  };
  const results: Record<string, unknown> = { node: process.version };
  if (parts.has("micro")) {
    const m: Record<string, unknown> = {};
    results.micro = m;
    await micro(log, m);
  }
  let bw: { one: Spread; two: Spread } | null = null;
  if (parts.has("roofline")) bw = await roofline(log);
  if (parts.has("model") || parts.has("guards") || parts.has("pass")) {
    const dir = values.model as string;
    const config = loadModelConfig(dir);
    const weights = loadWeights(dir, config);
    const wBytes = decodeWeightBytes(config);
    log(`model ${dir}: ${fmt(wBytes / 1e6, 0)} MB of weights per decode token`);
    if (bw !== null) {
      const r1 = mapSpread(bw.one, (g) => (g * 1e9) / wBytes);
      const r2 = mapSpread(bw.two, (g) => (g * 1e9) / wBytes);
      log(
        `roofline (weights / measured bandwidth): 1 thread ${fmtS(r1, (x) => x)} tok/s, 2 threads ${fmtS(r2, (x) => x)} tok/s`,
      );
      results.roofline = {
        bandwidthGBs: bw,
        tokensPerSecond1: r1,
        tokensPerSecond2: r2,
        weightBytes: wBytes,
      };
    }
    const runs: ModelResult[] = [];
    if (which === "wasm" || which === "both" || parts.has("guards") || parts.has("pass")) {
      const k = await WasmKernels.create({
        threads,
        initialBytes: wBytes + (1 << 28),
        matvecChunk: Number(values["matvec-chunk"]),
      });
      await k.ready();
      const placed = k.placeWeights(weights);
      if (parts.has("pass")) {
        const t = weightPass(k, config, placed, 15);
        log(
          `bare wasm weight pass (${threads} thread${threads > 1 ? "s" : ""}): ${fmtS(t, (ms) => 1000 / ms)} passes/s (${fmtS(t, (x) => x, 2)} ms)`,
        );
        results.weightPass = mapSpread(t, (ms) => 1000 / ms);
      }
      if (parts.has("model") && which !== "ts")
        runs.push(modelRun("wasm", k, threads, config, placed, promptLen, log));
      if (parts.has("guards")) results.guards = guardsAB(k, config, placed, Number(values.pairs), log);
      if (k.fallbackCalls !== 0) log(`  WARNING: ${k.fallbackCalls} kernel calls fell back to TypeScript`);
      await k.close();
    }
    if (parts.has("model") && (which === "ts" || which === "both")) {
      runs.push(modelRun("ts", referenceKernels, 1, config, weights, promptLen, log));
    }
    results.model = runs;
    if (runs.length > 0) log("");
    if (runs.length > 0)
      log(
        "kernels | decode b1 tok/s | decode b8 agg tok/s (x b1) | decode @4096 tok/s | prefill GFLOP/s/core",
      );
    for (const r of runs) {
      log(
        `${`${r.kernels} ${r.threads}t`.padEnd(7)} | ${fmt(r.decode1.median)} | ${fmt(r.decode8.median)} (x${fmt(r.decode8.median / r.decode1.median, 2)}) | ${fmt(r.decode4k.median)} | ${fmt(r.prefill.median)}`,
      );
    }
    const roof = results.roofline as { tokensPerSecond2: Spread } | undefined;
    const w = runs.find((r) => r.kernels === "wasm");
    if (roof !== undefined && w !== undefined) {
      log(
        `wasm decode b1 = ${fmt((100 * w.decode1.median) / roof.tokensPerSecond2.median)}% of the 2-thread roofline`,
      );
    }
  }
  if (values.json) console.log(JSON.stringify(results, null, 2));
}

await main();
