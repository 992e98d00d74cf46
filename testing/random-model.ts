/**
 * Seeded random Llama/Qwen2 models for tests (no files): a small `ModelConfig` and matching f32
 * `ModelWeights`, plus a naive dense float64 forward pass to compare the paged one against.
 */

import { decodeMatrix, type Matrix } from "../src/kernels/weight-format.js";
import { Prng } from "../src/lib/prng.js";
import type { LayerWeights, ModelConfig, ModelWeights } from "../src/model/model-config.js";

export interface RandomModelOptions {
  architecture?: "llama" | "qwen2";
  hiddenSize?: number;
  numHeads?: number;
  numKvHeads?: number;
  headDim?: number;
  intermediateSize?: number;
  numLayers?: number;
  vocabSize?: number;
  maxPositionEmbeddings?: number;
  ropeTheta?: number;
  tieWordEmbeddings?: boolean;
  seed?: number;
  /** Standard deviation of the random weights. */
  std?: number;
  /** The config's EOS ids (none by default). */
  eosTokenIds?: readonly number[];
}

export function randomModel(options: RandomModelOptions = {}): {
  config: ModelConfig;
  weights: ModelWeights;
} {
  const arch = options.architecture ?? "llama";
  const qwen = arch === "qwen2";
  const config: ModelConfig = Object.freeze({
    architecture: arch,
    hiddenSize: options.hiddenSize ?? 48,
    numHeads: options.numHeads ?? 6,
    numKvHeads: options.numKvHeads ?? 2,
    headDim: options.headDim ?? 8,
    intermediateSize: options.intermediateSize ?? 96,
    numLayers: options.numLayers ?? 2,
    rmsNormEps: 1e-5,
    ropeTheta: options.ropeTheta ?? 10000,
    tieWordEmbeddings: options.tieWordEmbeddings ?? !qwen,
    attentionBias: qwen,
    maxPositionEmbeddings: options.maxPositionEmbeddings ?? 256,
    vocabSize: options.vocabSize ?? 64,
    bosTokenId: null,
    eosTokenIds: options.eosTokenIds ?? [],
  });
  const rng = new Prng(options.seed ?? 1);
  const std = options.std ?? 0.2;
  const h = config.hiddenSize;
  const qd = config.numHeads * config.headDim;
  const kvd = config.numKvHeads * config.headDim;
  const inter = config.intermediateSize;
  const rand = (n: number, s = std): Float32Array => {
    const a = new Float32Array(n);
    rng.fillGaussian(a, s);
    return a;
  };
  const norm = (n: number): Float32Array => {
    const a = new Float32Array(n);
    for (let i = 0; i < n; i++) a[i] = 1 + (rng.next() - 0.5) * 0.4;
    return a;
  };
  const layers: LayerWeights[] = [];
  for (let l = 0; l < config.numLayers; l++) {
    layers.push({
      inputNorm: norm(h),
      q: rand(qd * h),
      k: rand(kvd * h),
      v: rand(kvd * h),
      qBias: qwen ? rand(qd) : null,
      kBias: qwen ? rand(kvd) : null,
      vBias: qwen ? rand(kvd) : null,
      o: rand(h * qd),
      postNorm: norm(h),
      gate: rand(inter * h),
      up: rand(inter * h),
      down: rand(h * inter),
    });
  }
  const embed = rand(config.vocabSize * h, 1);
  const weights: ModelWeights = {
    embed,
    layers,
    finalNorm: norm(h),
    lmHead: config.tieWordEmbeddings ? embed : rand(config.vocabSize * h),
  };
  return { config, weights };
}

/**
 * Naive dense forward in float64 over a whole token sequence (no cache, no paging): returns the
 * logits of every position, [tokens.length][vocab]. Written independently of the kernels.
 */
export function naiveForward(
  config: ModelConfig,
  weights: ModelWeights,
  tokens: ArrayLike<number>,
): Float64Array[] {
  const { hiddenSize: h, numHeads, numKvHeads, headDim: hd, intermediateSize: inter, vocabSize } = config;
  const n = tokens.length;
  const lin = (x: Float64Array, m: Matrix, outDim: number, bias: Float32Array | null): Float64Array => {
    const w = decodeMatrix(m);
    const inDim = x.length;
    const y = new Float64Array(outDim);
    for (let j = 0; j < outDim; j++) {
      let s = bias === null ? 0 : (bias[j] as number);
      for (let k = 0; k < inDim; k++) s += (x[k] as number) * (w[j * inDim + k] as number);
      y[j] = s;
    }
    return y;
  };
  const norm = (x: Float64Array, w: Float32Array): Float64Array => {
    let ss = 0;
    for (const v of x) ss += v * v;
    const r = 1 / Math.sqrt(ss / x.length + config.rmsNormEps);
    return x.map((v, i) => v * r * (w[i] as number));
  };
  const rot = (x: Float64Array, heads: number, pos: number): void => {
    const half = hd / 2;
    for (let hh = 0; hh < heads; hh++) {
      for (let i = 0; i < half; i++) {
        const ang = pos / config.ropeTheta ** ((2 * i) / hd);
        const a = x[hh * hd + i] as number;
        const b = x[hh * hd + half + i] as number;
        x[hh * hd + i] = a * Math.cos(ang) - b * Math.sin(ang);
        x[hh * hd + half + i] = b * Math.cos(ang) + a * Math.sin(ang);
      }
    }
  };
  let xs: Float64Array[] = [];
  for (let t = 0; t < n; t++)
    xs.push(
      Float64Array.from(
        decodeMatrix(weights.embed).subarray((tokens[t] as number) * h, ((tokens[t] as number) + 1) * h),
      ),
    );
  for (const w of weights.layers) {
    const qs: Float64Array[] = [];
    const ks: Float64Array[] = [];
    const vs: Float64Array[] = [];
    for (let t = 0; t < n; t++) {
      const xn = norm(xs[t] as Float64Array, w.inputNorm);
      const q = lin(xn, w.q, numHeads * hd, w.qBias);
      const k = lin(xn, w.k, numKvHeads * hd, w.kBias);
      rot(q, numHeads, t);
      rot(k, numKvHeads, t);
      qs.push(q);
      ks.push(k);
      vs.push(lin(xn, w.v, numKvHeads * hd, w.vBias));
    }
    const next: Float64Array[] = [];
    for (let t = 0; t < n; t++) {
      const att = naiveAttention(config, { qs, ks, vs }, t);
      const o = lin(att, w.o, h, null);
      const x1 = (xs[t] as Float64Array).map((v, i) => v + (o[i] as number));
      const xn = norm(x1, w.postNorm);
      const g = lin(xn, w.gate, inter, null);
      const u = lin(xn, w.up, inter, null);
      const act = g.map((gv, i) => (gv / (1 + Math.exp(-gv))) * (u[i] as number));
      const d = lin(act, w.down, h, null);
      next.push(x1.map((v, i) => v + (d[i] as number)));
    }
    xs = next;
  }
  return xs.map((x) => lin(norm(x, weights.finalNorm), weights.lmHead, vocabSize, null));
}

/** Causal GQA attention of position `t` over positions 0..t, every head, in float64. */
function naiveAttention(
  config: ModelConfig,
  qkv: {
    readonly qs: readonly Float64Array[];
    readonly ks: readonly Float64Array[];
    readonly vs: readonly Float64Array[];
  },
  t: number,
): Float64Array {
  const { numHeads, numKvHeads, headDim: hd } = config;
  const { qs, ks, vs } = qkv;
  const att = new Float64Array(numHeads * hd);
  for (let hh = 0; hh < numHeads; hh++) {
    const kvh = Math.floor(hh / (numHeads / numKvHeads));
    const sc: number[] = [];
    for (let u = 0; u <= t; u++) {
      let s = 0;
      for (let d = 0; d < hd; d++)
        s += (qs[t] as Float64Array)[hh * hd + d]! * (ks[u] as Float64Array)[kvh * hd + d]!;
      sc.push(s / Math.sqrt(hd));
    }
    const m = Math.max(...sc);
    const e = sc.map((s) => Math.exp(s - m));
    const z = e.reduce((a, b) => a + b, 0);
    for (let u = 0; u <= t; u++) {
      for (let d = 0; d < hd; d++)
        att[hh * hd + d]! += ((e[u] as number) / z) * (vs[u] as Float64Array)[kvh * hd + d]!;
    }
  }
  return att;
}
