/**
 * Token sampling from logits: greedy, temperature, min-p, top-k and top-p (nucleus), in that order
 * (as vLLM applies them), reproducible from a seeded `Prng` per request. Before the draw,
 * `Sampler.process` applies a request's logit controls (`LogitControls`) in vLLM's order: logit
 * bias, the stop tokens held back until `minTokens`, then the repetition, frequency and presence
 * penalties. Every control only changes logits, so a non-greedy draw takes exactly one number from
 * the generator whatever the controls: a seeded request samples the same tokens in every topology.
 *
 * Allocation-free per token: the index and probability scratch (vocab-sized) is allocated once per
 * `Sampler`. Top-k keeps a min-heap of the k best logits; top-p without top-k avoids sorting the
 * whole vocabulary by first gathering only tokens above a probability threshold (lowered tenfold
 * until the gathered mass reaches p: the nucleus is then provably inside the gathered set, since it
 * is a prefix of the descending order), then heap-sorts those.
 */

import { KvfenceError } from "../lib/errors.js";
import type { LogitControls } from "../lib/logit-controls.js";
import type { Prng } from "../lib/prng.js";

export type { LogitControls } from "../lib/logit-controls.js";

/**
 * What the sampler reads of a request's `SamplingParams` (src/protocol/sampling-params.ts, which
 * the model layer does not import): a `SamplingParams` is one.
 */
export interface SamplerSettings {
  /** Below `MIN_TEMPERATURE` (0 included) means greedy. */
  readonly temperature: number;
  /** Keep only the k most likely tokens; 0 disables. */
  readonly topK: number;
  /** Keep the smallest set of most likely tokens whose mass reaches p; 1 disables. */
  readonly topP: number;
  /** The request's logit controls, if any (`Sampler.process` applies them; min-p is the draw's). */
  readonly controls?: LogitControls | undefined;
}

/** A request's tokens as `Sampler.process` reads them: prompt then output, `length` valid. */
export interface TokenHistory {
  readonly tokens: Int32Array;
  readonly promptLength: number;
  readonly length: number;
  /** Tokens generated so far (a decode node's first one, sampled by prefill, counts). */
  readonly generated: number;
}

/**
 * Temperatures below this are greedy, as in vLLM: dividing logits by a temperature near 0 overflows
 * (1 / 5e-324 is Infinity, and 0 × Infinity is NaN), and a NaN probability mass would make the
 * nucleus search below loop forever, freezing the engine for every request.
 */
export const MIN_TEMPERATURE = 1e-5;

export const GREEDY: SamplerSettings = Object.freeze({ temperature: 0, topK: 0, topP: 1 });

/** Index of the largest logit (the lowest index among ties). */
export function argmax(logits: Float32Array): number {
  let best = 0;
  let bestValue = logits[0] as number;
  for (let i = 1; i < logits.length; i++) {
    const v = logits[i] as number;
    if (v > bestValue) {
      bestValue = v;
      best = i;
    }
  }
  return best;
}

export class Sampler {
  readonly vocabSize: number;
  readonly #scratch: Scratch;
  /** Per-token counts of the output (frequency and presence penalties), zeroed after each use. */
  readonly #counts: Int32Array;
  /** Tokens seen in prompt or output (repetition penalty), cleared after each use. */
  readonly #seen: Uint8Array;

  constructor(vocabSize: number) {
    if (!Number.isInteger(vocabSize) || vocabSize < 1) {
      throw new KvfenceError("config_invalid", `Sampler vocabSize must be a positive integer: ${vocabSize}`);
    }
    this.vocabSize = vocabSize;
    this.#scratch = {
      idx: new Int32Array(vocabSize),
      probs: new Float64Array(vocabSize),
      mass: new Float64Array(1),
    };
    this.#counts = new Int32Array(vocabSize);
    this.#seen = new Uint8Array(vocabSize);
  }

  /** True when a draw with `params` takes a number from the generator (it is not greedy). */
  static draws(params: SamplerSettings): boolean {
    return params.temperature >= MIN_TEMPERATURE && params.topK !== 1;
  }

  /**
   * Applies `controls` to `logits` in place, in vLLM's order: logit bias; while fewer than
   * `minTokens` are generated, `stopTokenIds` (the request's, EOS) and the client's stop ids at −∞;
   * repetition penalty over prompt and output; frequency and presence penalties over the output.
   */
  process(
    logits: Float32Array,
    controls: LogitControls,
    history: TokenHistory,
    stopTokenIds: readonly number[],
  ): void {
    const bias = controls.logitBias;
    if (bias !== undefined) for (const [id, b] of bias) logits[id] = (logits[id] as number) + b;
    if (history.generated < (controls.minTokens ?? 0)) {
      for (const id of stopTokenIds) logits[id] = Number.NEGATIVE_INFINITY;
      for (const id of controls.stopTokenIds ?? []) logits[id] = Number.NEGATIVE_INFINITY;
    }
    const rep = controls.repetitionPenalty ?? 1;
    if (rep !== 1) repetitionPenalty(logits, history, rep, this.#seen);
    const freq = controls.frequencyPenalty ?? 0;
    const pres = controls.presencePenalty ?? 0;
    if (freq !== 0 || pres !== 0) outputPenalties(logits, history, freq, pres, this.#counts);
  }

  /** Checks sampling parameters once per request (not per token). */
  static validate(params: SamplerSettings, vocabSize?: number): void {
    const { temperature, topK, topP } = params;
    if (!Number.isFinite(temperature) || temperature < 0) {
      throw new KvfenceError("invalid_request", `Temperature must be a finite number ≥ 0: ${temperature}`, {
        param: "temperature",
      });
    }
    if (!Number.isInteger(topK) || topK < 0) {
      throw new KvfenceError("invalid_request", `Top-k must be an integer ≥ 0 (0 disables): ${topK}`, {
        param: "top_k",
      });
    }
    if (!(topP > 0 && topP <= 1)) {
      throw new KvfenceError("invalid_request", `Top-p must be in (0, 1]: ${topP}`, { param: "top_p" });
    }
    if (params.controls !== undefined) Sampler.#validateControls(params.controls, vocabSize);
  }

  static #validateControls(c: LogitControls, vocabSize: number | undefined): void {
    const bad = (param: string, message: string): never => {
      throw new KvfenceError("invalid_request", message, { param });
    };
    checkTokenIds(
      (c.logitBias ?? []).map(([id]) => id),
      "logit_bias",
      vocabSize,
    );
    checkTokenIds(c.stopTokenIds ?? [], "stop_token_ids", vocabSize);
    for (const [, b] of c.logitBias ?? []) {
      if (!(b >= -100 && b <= 100)) bad("logit_bias", `A logit_bias value must be from -100 to 100: ${b}`);
    }
    const minTokens = c.minTokens ?? 0;
    if (!Number.isInteger(minTokens) || minTokens < 0)
      bad("min_tokens", `min_tokens must be an integer ≥ 0: ${minTokens}`);
    const rep = c.repetitionPenalty ?? 1;
    if (!(Number.isFinite(rep) && rep > 0))
      bad("repetition_penalty", `repetition_penalty must be a finite number > 0 (1 disables): ${rep}`);
    for (const [param, v] of [
      ["frequency_penalty", c.frequencyPenalty ?? 0],
      ["presence_penalty", c.presencePenalty ?? 0],
    ] as const) {
      if (!(v >= -2 && v <= 2)) bad(param, `${param} must be from -2 to 2: ${v}`);
    }
    const minP = c.minP ?? 0;
    if (!(minP >= 0 && minP <= 1)) bad("min_p", `min_p must be from 0 to 1: ${minP}`);
  }

  /** Draws one token id from `logits` (length vocabSize). Uses `rng` only when not greedy. */
  sample(logits: Float32Array, params: SamplerSettings, rng: Prng): number {
    const vocab = this.vocabSize;
    let topK = params.topK;
    if (params.temperature < MIN_TEMPERATURE || topK === 1) return argmax(logits);
    if (topK <= 0 || topK > vocab) topK = vocab;
    if (params.controls !== undefined) applyMinP(logits, params);
    const s = this.#scratch;
    let n = weigh(s, logits, topK, params);
    const sorted = params.topP < 1;
    if (sorted) {
      if (n === vocab) n = gather(s, params);
      sortDescending(s.idx, n, s.probs);
      // The nucleus: the shortest prefix of the sorted candidates reaching top_p of the mass. (In
      // a function of its own, this loop made a draw allocate a heap number now and then.)
      const target = params.topP * (s.mass[0] as number);
      let cum = 0;
      let keep = n;
      for (let i = 0; i < n; i++) {
        cum += s.probs[s.idx[i] as number] as number;
        if (cum >= target) {
          keep = i + 1;
          break;
        }
      }
      s.mass[0] = cum;
      n = keep;
    }
    const { idx, probs } = s;
    let u = rng.next() * (s.mass[0] as number);
    for (let i = 0; i < n; i++) {
      const t = idx[i] as number;
      u -= probs[t] as number;
      if (u < 0) return t;
    }
    // Rounding left u ≥ 0 after the last candidate: return the least likely kept token.
    return sorted ? (idx[n - 1] as number) : (idx[lastPositive(idx, n, probs)] as number);
  }
}

/**
 * A sampler's scratch, allocated once: candidate ids, their unnormalised probabilities (by token
 * id), and their probability mass. The steps of a draw pass no double to each other (a double
 * argument of a call that is not inlined is boxed: a heap number per token); the mass goes through
 * `mass[0]`.
 */
interface Scratch {
  readonly idx: Int32Array;
  readonly probs: Float64Array;
  readonly mass: Float64Array;
}

/**
 * The candidates (the top `topK` ids, or every id) into `s.idx[0..n)`, their unnormalised
 * probabilities at the request's temperature into `s.probs` and their sum into `s.mass`; returns n.
 */
function weigh(s: Scratch, logits: Float32Array, topK: number, params: SamplerSettings): number {
  const { idx, probs } = s;
  const vocab = probs.length;
  const invT = 1 / params.temperature;
  const max = logits[argmax(logits)] as number;
  let n: number;
  if (topK < vocab) {
    n = topKHeap(idx, logits, topK);
    for (let i = 0; i < n; i++) {
      const t = idx[i] as number;
      probs[t] = Math.exp(((logits[t] as number) - max) * invT);
    }
  } else {
    n = vocab;
    for (let t = 0; t < n; t++) {
      idx[t] = t;
      probs[t] = Math.exp(((logits[t] as number) - max) * invT);
    }
  }
  let mass = 0;
  for (let i = 0; i < n; i++) mass += probs[idx[i] as number] as number;
  s.mass[0] = mass;
  return n;
}

/**
 * Top-p over the whole vocabulary without sorting it: gathers into `s.idx` the tokens above a
 * threshold, lowered tenfold until their mass reaches top_p of `s.mass`; returns how many.
 */
function gather(s: Scratch, params: SamplerSettings): number {
  const { idx, probs } = s;
  const vocab = probs.length;
  const mass = s.mass[0] as number;
  const target = params.topP * mass;
  let threshold = 1e-3 * mass;
  for (;;) {
    let m = 0;
    let c = 0;
    for (let t = 0; t < vocab; t++) {
      const p = probs[t] as number;
      if (p >= threshold) {
        idx[c++] = t;
        m += p;
      }
    }
    if (m >= target || threshold < 1e-300) return c;
    threshold *= 0.1;
    if (threshold < 1e-12 * mass) threshold = 0;
  }
}

/** Refuses ids that are not token ids of a vocabulary of `vocabSize` (when known). */
function checkTokenIds(ids: readonly number[], param: string, vocabSize: number | undefined): void {
  for (const id of ids) {
    if (!Number.isInteger(id) || id < 0 || (vocabSize !== undefined && id >= vocabSize)) {
      throw new KvfenceError(
        "invalid_request",
        `${param} names a token id outside the vocabulary of ${vocabSize}: ${id}`,
        { param },
      );
    }
  }
}

/** vLLM's repetition penalty over prompt and output, each distinct token once (`seen` is left clear). */
function repetitionPenalty(logits: Float32Array, history: TokenHistory, rep: number, seen: Uint8Array): void {
  const { tokens, length } = history;
  for (let i = 0; i < length; i++) {
    const t = tokens[i] as number;
    if (seen[t] === 1) continue;
    seen[t] = 1;
    const l = logits[t] as number;
    logits[t] = l > 0 ? l / rep : l * rep;
  }
  for (let i = 0; i < length; i++) seen[tokens[i] as number] = 0;
}

/** OpenAI's frequency and presence penalties over the output (`counts` is left zeroed). */
function outputPenalties(
  logits: Float32Array,
  history: TokenHistory,
  freq: number,
  pres: number,
  counts: Int32Array,
): void {
  const { tokens, promptLength, length } = history;
  for (let i = promptLength; i < length; i++) counts[tokens[i] as number]! += 1;
  for (let i = promptLength; i < length; i++) {
    const t = tokens[i] as number;
    const c = counts[t] as number;
    if (c === 0) continue;
    logits[t] = (logits[t] as number) - freq * c - pres;
    counts[t] = 0;
  }
}

/**
 * Min-p on the logits: a token's probability at temperature T over the top token's is
 * exp((l − max) / T), so those under `minP` are the logits below max + T·ln(minP); they go to −∞.
 */
function applyMinP(logits: Float32Array, params: SamplerSettings): void {
  const minP = params.controls?.minP ?? 0;
  if (minP <= 0) return;
  const floor = (logits[argmax(logits)] as number) + params.temperature * Math.log(minP);
  for (let t = 0; t < logits.length; t++)
    if ((logits[t] as number) < floor) logits[t] = Number.NEGATIVE_INFINITY;
}

function lastPositive(idx: Int32Array, n: number, probs: Float64Array): number {
  for (let i = n - 1; i > 0; i--) if ((probs[idx[i] as number] as number) > 0) return i;
  return 0;
}

/** Fills idx[0..k) with the ids of the k largest logits (a min-heap on logit); returns k. */
function topKHeap(idx: Int32Array, logits: Float32Array, k: number): number {
  let size = 0;
  for (let t = 0; t < logits.length; t++) {
    const v = logits[t] as number;
    if (size < k) {
      // Sift up.
      let i = size++;
      while (i > 0) {
        const parent = (i - 1) >> 1;
        const pt = idx[parent] as number;
        if ((logits[pt] as number) <= v) break;
        idx[i] = pt;
        i = parent;
      }
      idx[i] = t;
    } else if (v > (logits[idx[0] as number] as number)) {
      siftDownMin(idx, 0, size, t, logits);
    }
  }
  return size;
}

/** Places `item` at heap position i and sifts it down a min-heap of `size` keyed by key[id]. */
function siftDownMin(
  idx: Int32Array,
  i: number,
  size: number,
  item: number,
  key: Float32Array | Float64Array,
): void {
  const v = key[item] as number;
  for (;;) {
    let child = 2 * i + 1;
    if (child >= size) break;
    const right = child + 1;
    if (right < size && (key[idx[right] as number] as number) < (key[idx[child] as number] as number))
      child = right;
    const ct = idx[child] as number;
    if ((key[ct] as number) >= v) break;
    idx[i] = ct;
    i = child;
  }
  idx[i] = item;
}

/** In-place heapsort of idx[0..n) by key[id], descending (a min-heap drained to the back). */
function sortDescending(idx: Int32Array, n: number, key: Float64Array): void {
  for (let i = (n >> 1) - 1; i >= 0; i--) siftDownMin(idx, i, n, idx[i] as number, key);
  for (let end = n - 1; end > 0; end--) {
    const root = idx[0] as number;
    siftDownMin(idx, 0, end, idx[end] as number, key);
    idx[end] = root;
  }
}
