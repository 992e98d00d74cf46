/**
 * The batched, paged forward pass of a Llama-family decoder (Llama, Mistral, Qwen2).
 *
 * One `step()` carries any mix of sequences: prefill chunks and single decode tokens of different
 * lengths. All their tokens are concatenated into one `[totalTokens][hidden]` activation matrix so
 * every linear layer runs as one matmul over the batch (q/k/v and gate/up as one call each);
 * attention, one kernel call for the batch, runs per sequence, causal within its chunk, over
 * positions [0, startPos+i] read through the sequence's block table from the paged KV pool
 * (src/kvcache/kv-layout.ts). Each layer first writes the step's new K/V into the pool, then
 * attends, so a chunk sees its own tokens exactly as later steps will.
 *
 * Allocation: every activation buffer is allocated at construction for `maxBatchTokens` rows (and
 * `maxSequences` logit rows), RoPE cos/sin tables are precomputed up to `maxPositionEmbeddings`, and
 * `step()` uses indexed loops only — no arrays, closures, iterators or subarrays are created per
 * step (forward.test.ts checks heap growth over many decode steps). Checks on the step's input are
 * integer compares that throw `KvfenceError` only on caller bugs.
 *
 * Logits are computed only for sequences that ask for them (non-null `logits`), from their last
 * token: those rows are gathered, normed and multiplied by the LM head as one small matmul. A
 * sequence that also asks for the logits of every token of its step (`rowLogits`, for prompt
 * log-probabilities) has its rows put through the same buffers, `maxSequences` rows at a time.
 */
import { type Kernels, referenceKernels } from "../kernels/kernels.js";
import { type AttentionSequence, ropeTables } from "../kernels/reference.js";
import { decodeMatrixRange, type Matrix, matrixElements } from "../kernels/weight-format.js";
import { type KvLayout, kvDtypeCode, kvDtypeOf, pageFloats } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import type { ModelConfig, ModelWeights } from "./model-config.js";

/** A step's attention record of one sequence, rewritten in place every step (no allocation). */
type MutableAttentionSequence = { -readonly [K in keyof AttentionSequence]: AttentionSequence[K] };

export interface StepSequence {
  /** This sequence's new tokens in this step: a prefill chunk or one decode token. */
  tokens: Int32Array;
  /** Absolute position of tokens[0]; KV for [0, startPos) is already in the pool. */
  startPos: number;
  /** Physical page for each logical page; covers [0, startPos + tokens.length). */
  blockTable: Int32Array;
  /** When non-null (length vocabSize), receives the logits of the LAST token. */
  logits: Float32Array | null;
  /**
   * When set, called with the logits of every token of the step, in order: token `index` of the
   * step's tokens, its row at `offset` of `logits` (the pass's own buffer: read it during the call).
   */
  rowLogits?: ((index: number, logits: Float32Array, offset: number) => void) | null;
}

export interface ForwardPassOptions {
  /** Most tokens (summed over sequences) one step may carry. */
  maxBatchTokens: number;
  /** Most sequences one step may carry. */
  maxSequences: number;
  /** The kernels (and the allocator of the activation buffers); default the TypeScript reference. */
  kernels?: Kernels;
}

/** RoPE positions filled when a forward pass is made (more as its steps reach further). */
const ROPE_FIRST_POSITIONS = 1024;

export class ForwardPass {
  readonly config: ModelConfig;
  readonly layout: KvLayout;
  readonly maxBatchTokens: number;
  readonly maxSequences: number;
  #weights: ModelWeights;
  #kernels: Kernels;
  #pageFloats: number;
  /** The pool's element type as the kernels' code (kv-layout.ts `kvDtypeCode`). */
  #kvDtype: number;
  #cos: Float64Array;
  #sin: Float64Array;
  /**
   * Positions [0, ropePositions) of the RoPE tables are filled: they grow with the positions steps
   * reach (`#coverRope`), not all `maxPositionEmbeddings` at start-up (two engines × 0.5 M cos/sin
   * for an 8k window, 16× that for a 128k one, on each engine thread's start).
   */
  #ropePositions = 0;
  // Activations, [maxBatchTokens][...].
  #x: Float32Array; // residual stream [T][hidden]
  #xn: Float32Array; // normed [T][hidden]
  #q: Float32Array; // [T][heads*headDim]
  #k: Float32Array; // [T][kvHeads*headDim]
  #v: Float32Array; // [T][kvHeads*headDim]
  #attn: Float32Array; // [T][heads*headDim]
  #proj: Float32Array; // [T][hidden]
  #gate: Float32Array; // [T][intermediate]
  #up: Float32Array; // [T][intermediate]
  #positions: Int32Array; // [T]
  #scratch: Float64Array; // attention: headDim + maxPositions
  /**
   * rmsNormEps kept boxed: V8 stores a double object field unboxed and must allocate a fresh
   * HeapNumber each time it passes it to a call; an array that also holds null keeps its elements
   * tagged, so reading [0] yields the existing box (forward.test.ts catches a regression).
   */
  #epsBox: [number, null];
  // Logit rows, [maxSequences][...].
  #lastRows: Float32Array; // [S][hidden]
  #logitRows: Float32Array; // [S][vocab]
  #logitViews: Float32Array[]; // row i of #logitRows, made once (a subarray per step would allocate)
  #attention: MutableAttentionSequence[]; // [S], for pagedAttentionBatch
  #qkv: Float32Array[];
  #qkvDims: number[];
  #qkvWeights: Matrix[][]; // [layer]: q, k, v
  #gateUp: Float32Array[];
  #gateUpDims: number[];
  #gateUpWeights: Matrix[][]; // [layer]: gate, up

  /**
   * Bytes of the buffers the constructor takes from `kernels.alloc*` for `config` and `options`
   * (each rounded up to 64 bytes, as the WebAssembly arena aligns them), so a caller can size a
   * `WasmKernels` memory once instead of growing it.
   */
  static bufferBytes(
    config: ModelConfig,
    options: Pick<ForwardPassOptions, "maxBatchTokens" | "maxSequences">,
  ): number {
    const { hiddenSize: hidden, numHeads, numKvHeads, headDim, intermediateSize, vocabSize } = config;
    const maxPos = config.maxPositionEmbeddings;
    const t = options.maxBatchTokens;
    const s = options.maxSequences;
    const aligned = (bytes: number): number => Math.ceil(bytes / 64) * 64;
    // The constructor's allocations, in order.
    const rows = [hidden, hidden, numHeads * headDim, numKvHeads * headDim, numKvHeads * headDim];
    return [
      8 * maxPos * (headDim >> 1),
      8 * maxPos * (headDim >> 1),
      ...rows.map((n) => 4 * t * n),
      4 * t * numHeads * headDim,
      4 * t * hidden,
      4 * t * intermediateSize,
      4 * t * intermediateSize,
      4 * t,
      8 * (headDim + maxPos),
      4 * s * hidden,
      4 * s * vocabSize,
    ].reduce((sum, bytes) => sum + aligned(bytes), 0);
  }

  constructor(config: ModelConfig, weights: ModelWeights, layout: KvLayout, options: ForwardPassOptions) {
    const { maxBatchTokens, maxSequences } = options;
    if (!Number.isInteger(maxBatchTokens) || maxBatchTokens < 1) {
      throw new KvfenceError(
        "config_invalid",
        `maxBatchTokens must be a positive integer: ${maxBatchTokens}`,
      );
    }
    if (!Number.isInteger(maxSequences) || maxSequences < 1) {
      throw new KvfenceError("config_invalid", `maxSequences must be a positive integer: ${maxSequences}`);
    }
    if (
      layout.numLayers !== config.numLayers ||
      layout.numKvHeads !== config.numKvHeads ||
      layout.headDim !== config.headDim
    ) {
      throw new KvfenceError(
        "layout_mismatch",
        `KV layout does not match the model: layout layers=${layout.numLayers} kvHeads=${layout.numKvHeads} headDim=${layout.headDim}, model ${config.numLayers}/${config.numKvHeads}/${config.headDim}; build the layout from the model config`,
      );
    }
    if (config.numHeads % config.numKvHeads !== 0 || config.headDim % 2 !== 0) {
      throw new KvfenceError(
        "unsupported_model",
        `Heads must be a multiple of KV heads and headDim even: ${config.numHeads}/${config.numKvHeads}, headDim ${config.headDim}`,
      );
    }
    checkWeights(config, weights);
    this.config = config;
    this.layout = layout;
    this.maxBatchTokens = maxBatchTokens;
    this.maxSequences = maxSequences;
    this.#weights = weights;
    const kernels = options.kernels ?? referenceKernels;
    this.#kernels = kernels;
    this.#pageFloats = pageFloats(layout);
    this.#kvDtype = kvDtypeCode(kvDtypeOf(layout));
    const { hiddenSize: hidden, numHeads, numKvHeads, headDim, intermediateSize, vocabSize } = config;
    const maxPos = config.maxPositionEmbeddings;
    this.#cos = kernels.allocF64(maxPos * (headDim >> 1));
    this.#sin = kernels.allocF64(maxPos * (headDim >> 1));
    this.#coverRope(ROPE_FIRST_POSITIONS);
    const t = maxBatchTokens;
    this.#x = kernels.allocF32(t * hidden);
    this.#xn = kernels.allocF32(t * hidden);
    this.#q = kernels.allocF32(t * numHeads * headDim);
    this.#k = kernels.allocF32(t * numKvHeads * headDim);
    this.#v = kernels.allocF32(t * numKvHeads * headDim);
    this.#attn = kernels.allocF32(t * numHeads * headDim);
    this.#proj = kernels.allocF32(t * hidden);
    this.#gate = kernels.allocF32(t * intermediateSize);
    this.#up = kernels.allocF32(t * intermediateSize);
    this.#positions = kernels.allocI32(t);
    this.#scratch = kernels.allocF64(headDim + maxPos);
    this.#epsBox = [config.rmsNormEps, null];
    this.#lastRows = kernels.allocF32(maxSequences * hidden);
    this.#logitRows = kernels.allocF32(maxSequences * vocabSize);
    this.#logitViews = Array.from({ length: maxSequences }, (_, i) =>
      this.#logitRows.subarray(i * vocabSize, (i + 1) * vocabSize),
    );
    // q/k/v and gate/up: each one matmulEach over the same normed rows.
    this.#qkv = [this.#q, this.#k, this.#v];
    this.#qkvDims = [numHeads * headDim, numKvHeads * headDim, numKvHeads * headDim];
    this.#qkvWeights = weights.layers.map((w) => [w.q, w.k, w.v]);
    this.#gateUp = [this.#gate, this.#up];
    this.#gateUpDims = [intermediateSize, intermediateSize];
    this.#gateUpWeights = weights.layers.map((w) => [w.gate, w.up]);
    this.#attention = Array.from({ length: maxSequences }, () => ({
      blockTable: new Int32Array(0),
      rowStart: 0,
      rows: 0,
      startPos: 0,
    }));
  }

  /** Positions whose RoPE tables are filled (they grow as steps reach further; see `#coverRope`). */
  get ropePositions(): number {
    return this.#ropePositions;
  }

  /** Fills the RoPE tables up to `endPos` at least, doubling (at most the model's window). */
  #coverRope(endPos: number): void {
    const { maxPositionEmbeddings, headDim, ropeTheta } = this.config;
    const to = Math.min(maxPositionEmbeddings, Math.max(endPos, 2 * this.#ropePositions));
    ropeTables(this.#cos, this.#sin, to, headDim, ropeTheta, this.#ropePositions);
    this.#ropePositions = to;
  }

  /**
   * Runs one batched step. Writes the new tokens' K/V into `pool` (the whole KV pool, page-major as
   * in src/kvcache/kv-layout.ts: a Float32Array, or a Uint16Array of f16/bf16 bits as the layout's
   * dtype says), rounded to its dtype, and attends through each block table.
   */
  step(pool: Float32Array | Uint16Array, sequences: readonly StepSequence[]): void {
    const cfg = this.config;
    const hidden = cfg.hiddenSize;
    const numSeqs = sequences.length;
    const total = this.#checkStep(pool, sequences);
    if (total === 0) return;
    // Before this step writes K and V into the pool: is it this engine's (a shared memory's fence)?
    this.#kernels.checkPool?.(pool);
    const { add, addBias, matmul, matmulEach, rmsnorm, rope, swiglu } = this.#kernels;

    // Embeddings and positions.
    const embed = this.#weights.embed;
    const x = this.#x;
    const positions = this.#positions;
    let row = 0;
    let endPos = 0;
    const attention = this.#attention;
    for (let s = 0; s < numSeqs; s++) {
      const seq = sequences[s] as StepSequence;
      const tokens = seq.tokens;
      const a = attention[s] as MutableAttentionSequence;
      a.blockTable = seq.blockTable;
      a.rowStart = row;
      a.rows = tokens.length;
      a.startPos = seq.startPos;
      endPos = Math.max(endPos, seq.startPos + tokens.length);
      for (let i = 0; i < tokens.length; i++) {
        // One row of the table, widened or dequantised if it is stored so (as llama.cpp's get_rows).
        decodeMatrixRange(embed, (tokens[i] as number) * hidden, hidden, x, row * hidden);
        positions[row] = seq.startPos + i;
        row++;
      }
    }
    if (endPos > this.#ropePositions) this.#coverRope(endPos);

    const { numHeads, numKvHeads, headDim, intermediateSize: inter } = cfg;
    const eps = this.#epsBox[0];
    const qDim = numHeads * headDim;
    const kvDim = numKvHeads * headDim;
    const xn = this.#xn;
    const q = this.#q;
    const k = this.#k;
    const v = this.#v;
    const proj = this.#proj;
    const gate = this.#gate;
    const up = this.#up;
    const layers = this.#weights.layers;
    for (let l = 0; l < cfg.numLayers; l++) {
      const w = layers[l] as (typeof layers)[number];
      rmsnorm(xn, x, w.inputNorm, hidden, eps, total);
      matmulEach(this.#qkv, xn, this.#qkvWeights[l] as Matrix[], total, hidden, this.#qkvDims);
      if (w.qBias !== null) addBias(q, w.qBias, total, qDim);
      if (w.kBias !== null) addBias(k, w.kBias, total, kvDim);
      if (w.vBias !== null) addBias(v, w.vBias, total, kvDim);
      rope(q, positions, this.#cos, this.#sin, total, numHeads, headDim);
      rope(k, positions, this.#cos, this.#sin, total, numKvHeads, headDim);
      this.#attend(pool, numSeqs, l);
      matmul(proj, this.#attn, w.o, total, qDim, hidden);
      add(x, x, proj, total * hidden);
      rmsnorm(xn, x, w.postNorm, hidden, eps, total);
      matmulEach(this.#gateUp, xn, this.#gateUpWeights[l] as Matrix[], total, hidden, this.#gateUpDims);
      swiglu(gate, gate, up, total * inter);
      matmul(proj, gate, w.down, total, inter, hidden);
      add(x, x, proj, total * hidden);
    }

    // Gather the last row of every sequence that wants logits; norm; LM head.
    const last = this.#lastRows;
    let numOut = 0;
    row = 0;
    for (let s = 0; s < numSeqs; s++) {
      const seq = sequences[s] as StepSequence;
      row += seq.tokens.length;
      if (seq.logits === null) continue;
      const src = (row - 1) * hidden;
      const dst = numOut * hidden;
      for (let j = 0; j < hidden; j++) last[dst + j] = x[src + j] as number;
      numOut++;
    }
    if (numOut > 0) this.#lastLogits(sequences, numOut);
    row = 0;
    for (let s = 0; s < numSeqs; s++) {
      const seq = sequences[s] as StepSequence;
      if (seq.rowLogits != null) this.#allLogits(x, row, seq.tokens.length, seq.rowLogits);
      row += seq.tokens.length;
    }
  }

  /** Norm and LM head over the `numOut` gathered last rows, into each asking sequence's `logits`. */
  #lastLogits(sequences: readonly StepSequence[], numOut: number): void {
    const cfg = this.config;
    const hidden = cfg.hiddenSize;
    const eps = this.#epsBox[0];
    const { rmsnorm, matmul } = this.#kernels;
    const last = this.#lastRows;
    const numSeqs = sequences.length;
    rmsnorm(last, last, this.#weights.finalNorm, hidden, eps, numOut);
    const vocab = cfg.vocabSize;
    const logitRows = this.#logitRows;
    matmul(logitRows, last, this.#weights.lmHead, numOut, hidden, vocab);
    let o = 0;
    for (let s = 0; s < numSeqs; s++) {
      const out = (sequences[s] as StepSequence).logits;
      if (out === null) continue;
      out.set(this.#logitViews[o] as Float32Array);
      o++;
    }
  }

  /** Layer `layer`'s KV write (rounded to the pool's dtype) and attention for the step's sequences. */
  #attend(pool: Float32Array | Uint16Array, numSeqs: number, layer: number): void {
    const { numLayers, numHeads, numKvHeads, headDim } = this.config;
    const pageSize = this.layout.pageSize;
    const kvDtype = this.#kvDtype;
    const attention = this.#attention;
    const kernels = this.#kernels;
    kernels.storeKv(
      pool,
      this.#k,
      this.#v,
      attention,
      numSeqs,
      layer,
      numLayers,
      numKvHeads,
      headDim,
      pageSize,
      kvDtype,
    );
    kernels.pagedAttentionBatch(
      this.#attn,
      this.#q,
      pool,
      attention,
      numSeqs,
      this.#scratch,
      layer,
      numLayers,
      numHeads,
      numKvHeads,
      headDim,
      pageSize,
      kvDtype,
    );
  }

  /** The logits of rows [first, first + n) of `x`, one by one to `each`, through the LM-head buffers. */
  #allLogits(
    x: Float32Array,
    first: number,
    n: number,
    each: (index: number, logits: Float32Array, offset: number) => void,
  ): void {
    const { hiddenSize: hidden, vocabSize: vocab, rmsNormEps: eps } = this.config;
    const { rmsnorm, matmul } = this.#kernels;
    const last = this.#lastRows;
    const chunk = this.maxSequences;
    for (let done = 0; done < n; done += chunk) {
      const rows = Math.min(chunk, n - done);
      last.set(x.subarray((first + done) * hidden, (first + done + rows) * hidden));
      rmsnorm(last, last, this.#weights.finalNorm, hidden, eps, rows);
      matmul(this.#logitRows, last, this.#weights.lmHead, rows, hidden, vocab);
      for (let r = 0; r < rows; r++) each(done + r, this.#logitRows, r * vocab);
    }
  }

  /** Validates a step's shape (integer compares only); returns its total token count. */
  #checkStep(pool: Float32Array | Uint16Array, sequences: readonly StepSequence[]): number {
    const cfg = this.config;
    if (sequences.length > this.maxSequences) {
      throw new KvfenceError(
        "internal",
        `Step carries more sequences than maxSequences: ${sequences.length} > ${this.maxSequences}; split the batch`,
      );
    }
    if (pool.length % this.#pageFloats !== 0) {
      throw new KvfenceError(
        "layout_mismatch",
        `KV pool length is not a whole number of pages: ${pool.length} elements, page ${this.#pageFloats}; size it with pageFloats(layout)`,
      );
    }
    const numPages = (pool.length / this.#pageFloats) | 0; // whole (checked above), so an int32
    const pageSize = this.layout.pageSize;
    let total = 0;
    for (let s = 0; s < sequences.length; s++) {
      const seq = sequences[s] as StepSequence;
      const n = seq.tokens.length;
      const end = seq.startPos + n;
      if (!Number.isInteger(seq.startPos) || seq.startPos < 0 || end > cfg.maxPositionEmbeddings) {
        throw new KvfenceError(
          "context_length_exceeded",
          `Sequence ${s} spans positions beyond the model window: [${seq.startPos}, ${end}) with maxPositionEmbeddings ${cfg.maxPositionEmbeddings}`,
        );
      }
      const pagesNeeded = ((end + pageSize - 1) / pageSize) | 0;
      if (seq.blockTable.length < pagesNeeded) {
        throw new KvfenceError(
          "internal",
          `Block table of sequence ${s} is too short: ${seq.blockTable.length} pages for ${end} tokens; allocate ${pagesNeeded} pages`,
        );
      }
      for (let p = 0; p < pagesNeeded; p++) {
        const page = seq.blockTable[p] as number;
        if (page < 0 || page >= numPages) {
          throw new KvfenceError(
            "internal",
            `Block table of sequence ${s} names a page outside the pool: ${page} (pool has ${numPages})`,
          );
        }
      }
      for (let i = 0; i < n; i++) {
        const t = seq.tokens[i] as number;
        if (t < 0 || t >= cfg.vocabSize) {
          throw new KvfenceError(
            "invalid_request",
            `Token id out of vocabulary range: ${t} (vocab ${cfg.vocabSize})`,
          );
        }
      }
      if (seq.logits !== null && (n === 0 || seq.logits.length !== cfg.vocabSize)) {
        throw new KvfenceError(
          "internal",
          `Logits buffer of sequence ${s} must have length vocabSize and the sequence at least one token: length ${seq.logits.length}, ${n} tokens`,
        );
      }
      total += n;
    }
    if (total > this.maxBatchTokens) {
      throw new KvfenceError(
        "internal",
        `Step carries more tokens than maxBatchTokens: ${total} > ${this.maxBatchTokens}; split the batch`,
      );
    }
    return total;
  }
}

function checkWeights(config: ModelConfig, w: ModelWeights): void {
  const { hiddenSize: h, numHeads, numKvHeads, headDim, intermediateSize: inter, vocabSize } = config;
  const expect = (name: string, arr: Matrix | null, n: number): void => {
    if (arr === null || matrixElements(arr) !== n) {
      throw new KvfenceError(
        "bad_model_folder",
        `Weight ${name} has the wrong size: ${arr === null ? "missing" : matrixElements(arr)}, expected ${n}`,
      );
    }
  };
  expect("embed", w.embed, vocabSize * h);
  expect("lmHead", w.lmHead, vocabSize * h);
  expect("finalNorm", w.finalNorm, h);
  if (w.layers.length !== config.numLayers) {
    throw new KvfenceError(
      "bad_model_folder",
      `Wrong number of layers: ${w.layers.length}, expected ${config.numLayers}`,
    );
  }
  w.layers.forEach((l, i) => {
    expect(`layers.${i}.inputNorm`, l.inputNorm, h);
    expect(`layers.${i}.q`, l.q, numHeads * headDim * h);
    expect(`layers.${i}.k`, l.k, numKvHeads * headDim * h);
    expect(`layers.${i}.v`, l.v, numKvHeads * headDim * h);
    if (l.qBias !== null) expect(`layers.${i}.qBias`, l.qBias, numHeads * headDim);
    if (l.kBias !== null) expect(`layers.${i}.kBias`, l.kBias, numKvHeads * headDim);
    if (l.vBias !== null) expect(`layers.${i}.vBias`, l.vBias, numKvHeads * headDim);
    expect(`layers.${i}.o`, l.o, h * numHeads * headDim);
    expect(`layers.${i}.postNorm`, l.postNorm, h);
    expect(`layers.${i}.gate`, l.gate, inter * h);
    expect(`layers.${i}.up`, l.up, inter * h);
    expect(`layers.${i}.down`, l.down, h * inter);
  });
}
