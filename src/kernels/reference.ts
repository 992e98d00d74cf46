/**
 * Reference numeric kernels in plain TypeScript over Float32Array.
 *
 * These are the ground truth that the fast WebAssembly kernels are tested against, and the kernels
 * the forward pass runs when nothing faster is available. Every kernel takes its destination first,
 * then its inputs, then its sizes; shapes are the caller's job (checked once at construction, never
 * per call), and no kernel allocates. Matrices are row-major; a weight is `[out][in]` as stored in
 * safetensors, so `matmul` computes `x · wᵀ`.
 *
 * Speed: plain JS peaks near 5–6 GFLOP/s per core (docs/benchmarks.md §3.2). The matrix kernels use a
 * 4x4 register tile for batches of rows and an 8-row, 8-accumulator matvec for the remainder;
 * sums accumulate in JS doubles, so they are more accurate than f32 accumulation.
 *
 * The KV pool is f32 or 2-byte half floats (src/kvcache/kv-layout.ts): `kvDtype` is 0 (f32, a
 * `Float32Array`), 1 (IEEE f16) or 2 (bf16), both a `Uint16Array` of raw bits. `roundKv` is the KV
 * write's rounding and `kvWidening` the read's exact widening, written here from the IEEE formats
 * so the WebAssembly kernels' bit tricks are checked against an independent implementation.
 *
 * Weights may be any format of weight-format.ts (the only module this one imports): a
 * matrix that is not a Float32Array is dequantised to f32, a block of rows at a time, and then
 * multiplied exactly as an f32 one — the independent reference every fast kernel is compared with.
 */
import { decodeMatrixRange, type Matrix } from "./weight-format.js";

/**
 * out[rows][outDim] = x[rows][inDim] · w[outDim][inDim]ᵀ.
 * `out` must not alias `x`.
 */
export function matmul(
  out: Float32Array,
  x: Float32Array,
  w: Matrix,
  rows: number,
  inDim: number,
  outDim: number,
): void {
  if (!(w instanceof Float32Array)) {
    matmulDecoded(out, x, w, rows, inDim, outDim);
    return;
  }
  let r = 0;
  for (; r + 4 <= rows; r += 4) matmulTile4(out, x, w, r, inDim, outDim);
  for (; r < rows; r++) matvecRow(out, x, w, r, inDim, outDim);
}

/**
 * `matmul` of the same x against each weight: outs[i] = x · ws[i]ᵀ, outs[i] `[rows][outDims[i]]`
 * (q/k/v and gate/up; a fast implementation runs them as one job).
 */
export function matmulEach(
  outs: readonly Float32Array[],
  x: Float32Array,
  ws: readonly Matrix[],
  rows: number,
  inDim: number,
  outDims: readonly number[],
): void {
  for (let i = 0; i < ws.length; i++) {
    matmul(outs[i] as Float32Array, x, ws[i] as Matrix, rows, inDim, outDims[i] as number);
  }
}

/** Weight rows dequantised per block of `matmulDecoded`, and its scratch (grown once, kept). */
const DECODED_ROWS = 64;
let decoded = new Float32Array(0);

/** `matmul` of a weight in another format: DECODED_ROWS weight rows at a time widened to f32. */
function matmulDecoded(
  out: Float32Array,
  x: Float32Array,
  w: Matrix,
  rows: number,
  inDim: number,
  outDim: number,
): void {
  if (decoded.length < DECODED_ROWS * inDim) decoded = new Float32Array(DECODED_ROWS * inDim);
  const wd = decoded;
  for (let j0 = 0; j0 < outDim; j0 += DECODED_ROWS) {
    const n = Math.min(DECODED_ROWS, outDim - j0);
    decodeMatrixRange(w, j0 * inDim, n * inDim, wd);
    for (let r = 0; r < rows; r++) {
      const xr = r * inDim;
      for (let j = 0; j < n; j++) {
        const wr = j * inDim;
        let s = 0;
        for (let k = 0; k < inDim; k++) s += (x[xr + k] as number) * (wd[wr + k] as number);
        out[r * outDim + j0 + j] = s;
      }
    }
  }
}

/** Four rows of x against all of w, four output columns at a time (16 accumulators). */
function matmulTile4(
  out: Float32Array,
  x: Float32Array,
  w: Float32Array,
  r: number,
  inDim: number,
  outDim: number,
): void {
  const x0 = r * inDim;
  const x1 = x0 + inDim;
  const x2 = x1 + inDim;
  const x3 = x2 + inDim;
  const o0 = r * outDim;
  const o1 = o0 + outDim;
  const o2 = o1 + outDim;
  const o3 = o2 + outDim;
  let j = 0;
  for (; j + 4 <= outDim; j += 4) {
    const w0 = j * inDim;
    const w1 = w0 + inDim;
    const w2 = w1 + inDim;
    const w3 = w2 + inDim;
    let a00 = 0,
      a01 = 0,
      a02 = 0,
      a03 = 0;
    let a10 = 0,
      a11 = 0,
      a12 = 0,
      a13 = 0;
    let a20 = 0,
      a21 = 0,
      a22 = 0,
      a23 = 0;
    let a30 = 0,
      a31 = 0,
      a32 = 0,
      a33 = 0;
    for (let k = 0; k < inDim; k++) {
      const b0 = w[w0 + k];
      const b1 = w[w1 + k];
      const b2 = w[w2 + k];
      const b3 = w[w3 + k];
      const v0 = x[x0 + k];
      const v1 = x[x1 + k];
      const v2 = x[x2 + k];
      const v3 = x[x3 + k];
      a00 += v0 * b0;
      a01 += v0 * b1;
      a02 += v0 * b2;
      a03 += v0 * b3;
      a10 += v1 * b0;
      a11 += v1 * b1;
      a12 += v1 * b2;
      a13 += v1 * b3;
      a20 += v2 * b0;
      a21 += v2 * b1;
      a22 += v2 * b2;
      a23 += v2 * b3;
      a30 += v3 * b0;
      a31 += v3 * b1;
      a32 += v3 * b2;
      a33 += v3 * b3;
    }
    out[o0 + j] = a00;
    out[o0 + j + 1] = a01;
    out[o0 + j + 2] = a02;
    out[o0 + j + 3] = a03;
    out[o1 + j] = a10;
    out[o1 + j + 1] = a11;
    out[o1 + j + 2] = a12;
    out[o1 + j + 3] = a13;
    out[o2 + j] = a20;
    out[o2 + j + 1] = a21;
    out[o2 + j + 2] = a22;
    out[o2 + j + 3] = a23;
    out[o3 + j] = a30;
    out[o3 + j + 1] = a31;
    out[o3 + j + 2] = a32;
    out[o3 + j + 3] = a33;
  }
  for (; j < outDim; j++) {
    const w0 = j * inDim;
    let a0 = 0,
      a1 = 0,
      a2 = 0,
      a3 = 0;
    for (let k = 0; k < inDim; k++) {
      const b = w[w0 + k];
      a0 += x[x0 + k] * b;
      a1 += x[x1 + k] * b;
      a2 += x[x2 + k] * b;
      a3 += x[x3 + k] * b;
    }
    out[o0 + j] = a0;
    out[o1 + j] = a1;
    out[o2 + j] = a2;
    out[o3 + j] = a3;
  }
}

/** One row of x against all of w, eight weight rows at a time (8 accumulators). */
function matvecRow(
  out: Float32Array,
  x: Float32Array,
  w: Float32Array,
  r: number,
  inDim: number,
  outDim: number,
): void {
  const xo = r * inDim;
  const oo = r * outDim;
  let j = 0;
  for (; j + 8 <= outDim; j += 8) {
    const w0 = j * inDim;
    const w1 = w0 + inDim;
    const w2 = w1 + inDim;
    const w3 = w2 + inDim;
    const w4 = w3 + inDim;
    const w5 = w4 + inDim;
    const w6 = w5 + inDim;
    const w7 = w6 + inDim;
    let a0 = 0,
      a1 = 0,
      a2 = 0,
      a3 = 0,
      a4 = 0,
      a5 = 0,
      a6 = 0,
      a7 = 0;
    for (let k = 0; k < inDim; k++) {
      const v = x[xo + k];
      a0 += v * w[w0 + k];
      a1 += v * w[w1 + k];
      a2 += v * w[w2 + k];
      a3 += v * w[w3 + k];
      a4 += v * w[w4 + k];
      a5 += v * w[w5 + k];
      a6 += v * w[w6 + k];
      a7 += v * w[w7 + k];
    }
    out[oo + j] = a0;
    out[oo + j + 1] = a1;
    out[oo + j + 2] = a2;
    out[oo + j + 3] = a3;
    out[oo + j + 4] = a4;
    out[oo + j + 5] = a5;
    out[oo + j + 6] = a6;
    out[oo + j + 7] = a7;
  }
  for (; j < outDim; j++) {
    const w0 = j * inDim;
    let a0 = 0,
      a1 = 0,
      a2 = 0,
      a3 = 0;
    let k = 0;
    for (; k + 4 <= inDim; k += 4) {
      a0 += x[xo + k] * w[w0 + k];
      a1 += x[xo + k + 1] * w[w0 + k + 1];
      a2 += x[xo + k + 2] * w[w0 + k + 2];
      a3 += x[xo + k + 3] * w[w0 + k + 3];
    }
    for (; k < inDim; k++) a0 += x[xo + k] * w[w0 + k];
    out[oo + j] = a0 + a1 + a2 + a3;
  }
}

/** out[r][j] += bias[j] for every row r < rows (in place on out). */
export function addBias(out: Float32Array, bias: Float32Array, rows: number, n: number): void {
  for (let r = 0; r < rows; r++) {
    const o = r * n;
    for (let j = 0; j < n; j++) out[o + j] += bias[j];
  }
}

/** out[i] = a[i] + b[i] for i < n (out may alias a or b). */
export function add(out: Float32Array, a: Float32Array, b: Float32Array, n: number): void {
  for (let i = 0; i < n; i++) out[i] = a[i] + b[i];
}

/**
 * RMSNorm of each of `rows` rows of n floats: out = x / sqrt(mean(x²) + eps) * weight.
 * `out` may alias `x`.
 */
export function rmsnorm(
  out: Float32Array,
  x: Float32Array,
  weight: Float32Array,
  n: number,
  eps: number,
  rows = 1,
): void {
  for (let r = 0; r < rows; r++) {
    const o = r * n;
    let s0 = 0,
      s1 = 0,
      s2 = 0,
      s3 = 0;
    let i = 0;
    for (; i + 4 <= n; i += 4) {
      const v0 = x[o + i];
      const v1 = x[o + i + 1];
      const v2 = x[o + i + 2];
      const v3 = x[o + i + 3];
      s0 += v0 * v0;
      s1 += v1 * v1;
      s2 += v2 * v2;
      s3 += v3 * v3;
    }
    for (; i < n; i++) s0 += x[o + i] * x[o + i];
    // HF casts to f32 and multiplies by the f32 rsqrt; we keep the scale in double.
    const scale = 1 / Math.sqrt((s0 + s1 + s2 + s3) / n + eps);
    for (let j = 0; j < n; j++) out[o + j] = x[o + j] * scale * weight[j];
  }
}

/**
 * Builds RoPE tables for positions [fromPosition, maxPositions): cos[p][i] and sin[p][i] for
 * i < headDim/2, with inv_freq[i] = theta^(-2i/headDim) (Hugging Face Llama convention). Each
 * position's entries depend on it alone, so a table may be filled in steps.
 */
export function ropeTables(
  cos: Float64Array,
  sin: Float64Array,
  maxPositions: number,
  headDim: number,
  theta: number,
  fromPosition = 0,
): void {
  const half = headDim >> 1;
  for (let i = 0; i < half; i++) {
    const invFreq = theta ** (-(2 * i) / headDim);
    for (let p = fromPosition; p < maxPositions; p++) {
      const angle = p * invFreq;
      cos[p * half + i] = Math.cos(angle);
      sin[p * half + i] = Math.sin(angle);
    }
  }
}

/**
 * Rotary embedding in place on x[rows][numHeads][headDim], row r at position positions[r], using
 * rotate_half over [first half | second half] of each head:
 * x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin.
 */
export function rope(
  x: Float32Array,
  positions: Int32Array,
  cos: Float64Array,
  sin: Float64Array,
  rows: number,
  numHeads: number,
  headDim: number,
): void {
  const half = headDim >> 1;
  for (let r = 0; r < rows; r++) {
    const t = positions[r] * half;
    for (let h = 0; h < numHeads; h++) {
      const base = (r * numHeads + h) * headDim;
      for (let i = 0; i < half; i++) {
        const c = cos[t + i];
        const s = sin[t + i];
        const a = x[base + i];
        const b = x[base + half + i];
        x[base + i] = a * c - b * s;
        x[base + half + i] = b * c + a * s;
      }
    }
  }
}

/** out[i] = silu(gate[i]) · up[i] for i < n, silu(g) = g / (1 + e^(−g)). `out` may alias either input. */
export function swiglu(out: Float32Array, gate: Float32Array, up: Float32Array, n: number): void {
  for (let i = 0; i < n; i++) {
    const g = gate[i];
    out[i] = (g / (1 + Math.exp(-g))) * up[i];
  }
}

/** In-place softmax over x[offset .. offset+n). */
export function softmax(x: Float32Array | Float64Array, offset: number, n: number): void {
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < n; i++) if (x[offset + i] > max) max = x[offset + i];
  let sum = 0;
  for (let i = 0; i < n; i++) {
    const e = Math.exp(x[offset + i] - max);
    x[offset + i] = e;
    sum += e;
  }
  const inv = 1 / sum;
  for (let i = 0; i < n; i++) x[offset + i] *= inv;
}

/**
 * Causal attention for `rows` consecutive query rows of one sequence through its block table.
 *
 * Query row i (activation row rowStart+i) sits at absolute position startPos+i and attends to
 * positions [0, startPos+i], whose K/V are read from the paged pool (layout page → layer → K|V →
 * token-in-page → kv-head → dim; see src/kvcache/kv-layout.ts). q and out are
 * `[*][numHeads*headDim]`; query head h reads KV head floor(h / (numHeads/numKvHeads)).
 * `scratch` holds at least headDim + startPos + rows doubles (the scores live from offset
 * headDim; the first headDim slots are reserved). The result is softmax(q·Kᵀ/√d)·V.
 */
export function pagedAttention(
  out: Float32Array,
  q: Float32Array,
  pool: Float32Array | Uint16Array,
  blockTable: Int32Array,
  scratch: Float64Array,
  rowStart: number,
  rows: number,
  startPos: number,
  layer: number,
  numLayers: number,
  numHeads: number,
  numKvHeads: number,
  headDim: number,
  pageSize: number,
  kvDtype = 0,
): void {
  // Half-float elements are widened through a table of all 65,536 values (exact); f32 read as is.
  const wide = kvDtype === 0 ? null : kvWidening(kvDtype);
  const group = numHeads / numKvHeads;
  const rowFloats = numKvHeads * headDim;
  const pageFloats = numLayers * 2 * pageSize * rowFloats;
  const kBase = layer * 2 * pageSize * rowFloats; // within a page
  const vBase = kBase + pageSize * rowFloats;
  const scale = 1 / Math.sqrt(headDim);
  const qStride = numHeads * headDim;
  for (let i = 0; i < rows; i++) {
    const ctx = startPos + i + 1;
    const qRow = (rowStart + i) * qStride;
    for (let h = 0; h < numHeads; h++) {
      const kvh = Math.floor(h / group);
      const qo = qRow + h * headDim;
      const headOff = kvh * headDim;
      // Scores q·k/√d, page by page (no division per token).
      let max = Number.NEGATIVE_INFINITY;
      for (let t = 0, p = 0; t < ctx; p++) {
        let ko = blockTable[p] * pageFloats + kBase + headOff;
        const tEnd = Math.min(ctx, t + pageSize);
        for (; t < tEnd; t++, ko += rowFloats) {
          let a0 = 0;
          let a1 = 0;
          let a2 = 0;
          let a3 = 0;
          let d = 0;
          for (; d + 4 <= headDim; d += 4) {
            if (wide === null) {
              a0 += q[qo + d] * pool[ko + d];
              a1 += q[qo + d + 1] * pool[ko + d + 1];
              a2 += q[qo + d + 2] * pool[ko + d + 2];
              a3 += q[qo + d + 3] * pool[ko + d + 3];
            } else {
              a0 += q[qo + d] * wide[pool[ko + d]];
              a1 += q[qo + d + 1] * wide[pool[ko + d + 1]];
              a2 += q[qo + d + 2] * wide[pool[ko + d + 2]];
              a3 += q[qo + d + 3] * wide[pool[ko + d + 3]];
            }
          }
          for (; d < headDim; d++) a0 += q[qo + d] * (wide === null ? pool[ko + d] : wide[pool[ko + d]]);
          const sc = (a0 + a1 + a2 + a3) * scale;
          scratch[headDim + t] = sc;
          if (sc > max) max = sc;
        }
      }
      let sum = 0;
      for (let t = 0; t < ctx; t++) {
        const e = Math.exp(scratch[headDim + t] - max);
        scratch[headDim + t] = e;
        sum += e;
      }
      // Σ p·v, eight output dims at a time in local accumulators (one pass over the context per
      // eight dims beats read-modify-writing a 64-slot accumulator per token), page by page.
      const inv = 1 / sum;
      let d0 = 0;
      for (; d0 + 8 <= headDim; d0 += 8) {
        let o0 = 0;
        let o1 = 0;
        let o2 = 0;
        let o3 = 0;
        let o4 = 0;
        let o5 = 0;
        let o6 = 0;
        let o7 = 0;
        for (let t = 0, p = 0; t < ctx; p++) {
          let vo = blockTable[p] * pageFloats + vBase + headOff + d0;
          const tEnd = Math.min(ctx, t + pageSize);
          for (; t < tEnd; t++, vo += rowFloats) {
            const w = scratch[headDim + t];
            if (wide === null) {
              o0 += w * pool[vo];
              o1 += w * pool[vo + 1];
              o2 += w * pool[vo + 2];
              o3 += w * pool[vo + 3];
              o4 += w * pool[vo + 4];
              o5 += w * pool[vo + 5];
              o6 += w * pool[vo + 6];
              o7 += w * pool[vo + 7];
            } else {
              o0 += w * wide[pool[vo]];
              o1 += w * wide[pool[vo + 1]];
              o2 += w * wide[pool[vo + 2]];
              o3 += w * wide[pool[vo + 3]];
              o4 += w * wide[pool[vo + 4]];
              o5 += w * wide[pool[vo + 5]];
              o6 += w * wide[pool[vo + 6]];
              o7 += w * wide[pool[vo + 7]];
            }
          }
        }
        const oo = qo + d0;
        out[oo] = o0 * inv;
        out[oo + 1] = o1 * inv;
        out[oo + 2] = o2 * inv;
        out[oo + 3] = o3 * inv;
        out[oo + 4] = o4 * inv;
        out[oo + 5] = o5 * inv;
        out[oo + 6] = o6 * inv;
        out[oo + 7] = o7 * inv;
      }
      for (; d0 < headDim; d0++) {
        let o0 = 0;
        for (let t = 0, p = 0; t < ctx; p++) {
          let vo = blockTable[p] * pageFloats + vBase + headOff + d0;
          const tEnd = Math.min(ctx, t + pageSize);
          for (; t < tEnd; t++, vo += rowFloats)
            o0 += scratch[headDim + t] * (wide === null ? pool[vo] : wide[pool[vo]]);
        }
        out[qo + d0] = o0 * inv;
      }
    }
  }
}

/** One sequence's query rows for `pagedAttentionBatch`: the arguments of `pagedAttention` that differ. */
export interface AttentionSequence {
  readonly blockTable: Int32Array;
  readonly rowStart: number;
  readonly rows: number;
  readonly startPos: number;
}

/**
 * `pagedAttention` for each of the first `count` sequences of a batch (a fast implementation may
 * spread them over threads; the count lets a caller reuse one array of records across steps).
 */
export function pagedAttentionBatch(
  out: Float32Array,
  q: Float32Array,
  pool: Float32Array | Uint16Array,
  sequences: readonly AttentionSequence[],
  count: number,
  scratch: Float64Array,
  layer: number,
  numLayers: number,
  numHeads: number,
  numKvHeads: number,
  headDim: number,
  pageSize: number,
  kvDtype = 0,
): void {
  for (let i = 0; i < count; i++) {
    const s = sequences[i] as AttentionSequence;
    pagedAttention(
      out,
      q,
      pool,
      s.blockTable,
      scratch,
      s.rowStart,
      s.rows,
      s.startPos,
      layer,
      numLayers,
      numHeads,
      numKvHeads,
      headDim,
      pageSize,
      kvDtype,
    );
  }
}

/**
 * The KV write of one layer for the first `count` sequences: the K and V rows of each sequence's
 * tokens (activation rows rowStart.., at positions startPos..) into their slots of the pool through
 * the block table, rounded to `kvDtype` (`roundKv`). k and v are `[*][numKvHeads*headDim]`.
 */
export function storeKv(
  pool: Float32Array | Uint16Array,
  k: Float32Array,
  v: Float32Array,
  sequences: readonly AttentionSequence[],
  count: number,
  layer: number,
  numLayers: number,
  numKvHeads: number,
  headDim: number,
  pageSize: number,
  kvDtype = 0,
): void {
  const kvDim = numKvHeads * headDim;
  const pageFloats = numLayers * 2 * pageSize * kvDim;
  const kBase = layer * 2 * pageSize * kvDim;
  const vBase = kBase + pageSize * kvDim;
  for (let s = 0; s < count; s++) {
    const seq = sequences[s] as AttentionSequence;
    for (let i = 0; i < seq.rows; i++) {
      const pos = seq.startPos + i;
      const page = seq.blockTable[(pos / pageSize) | 0] as number;
      const off = page * pageFloats + (pos % pageSize) * kvDim;
      const src = (seq.rowStart + i) * kvDim;
      if (kvDtype === 0) {
        for (let j = 0; j < kvDim; j++) {
          pool[off + kBase + j] = k[src + j] as number;
          pool[off + vBase + j] = v[src + j] as number;
        }
      } else {
        for (let j = 0; j < kvDim; j++) {
          pool[off + kBase + j] = roundKv(k[src + j] as number, kvDtype);
          pool[off + vBase + j] = roundKv(v[src + j] as number, kvDtype);
        }
      }
    }
  }
}

const f32Box = new Float32Array(1);
const u32Box = new Uint32Array(f32Box.buffer);

/**
 * The bits of the `kvDtype` (1 f16, 2 bf16) value nearest to the f32 `x`, ties to even. A NaN
 * stays a quiet NaN. An f16 beyond ±65504 (the largest finite half) saturates to ±65504 instead of
 * becoming an infinity, which would turn every attention score of its head into NaN; bf16 has
 * f32's range.
 */
export function roundKv(x: number, kvDtype: number): number {
  f32Box[0] = x;
  const b = u32Box[0] as number;
  const sign = (b >>> 16) & 0x8000;
  const a = b & 0x7fffffff;
  if (a > 0x7f800000) return kvDtype === 2 ? (b >>> 16) | 0x40 : sign | 0x7e00;
  if (kvDtype === 2) {
    // Keep the top 16 bits, rounding on the 16 dropped: up past half, or at half when odd.
    const kept = b >>> 16;
    const rest = b & 0xffff;
    return (rest > 0x8000 || (rest === 0x8000 && (kept & 1) === 1) ? kept + 1 : kept) & 0xffff;
  }
  // f16: exponent bias 15 against f32's 127, 10 mantissa bits against 23.
  const exp = (a >>> 23) - 112;
  const mant = a & 0x7fffff;
  if (exp >= 31) return sign | 0x7bff;
  let h: number;
  let rest: number;
  let halfway: number;
  if (exp <= 0) {
    // A subnormal half: the implicit bit joins the mantissa, shifted 14 − exp places.
    const shift = 14 - exp;
    if (shift > 24) return sign;
    const full = mant | 0x800000;
    h = full >>> shift;
    rest = full - h * 2 ** shift;
    halfway = 2 ** (shift - 1);
  } else {
    h = (exp << 10) | (mant >>> 13);
    rest = mant & 0x1fff;
    halfway = 0x1000;
  }
  if (rest > halfway || (rest === halfway && (h & 1) === 1)) h++;
  return sign | Math.min(h, 0x7bff);
}

const widening: (Float32Array | null)[] = [null, null, null];

/**
 * The f32 value of every 16-bit pattern of `kvDtype` (1 f16, 2 bf16), indexed by the bits: the
 * exact IEEE widening (f16: ±2^(e−15)·(1 + m/1024), subnormals ±2^−14·m/1024, e = 31 an infinity or
 * NaN; bf16: the bits are an f32's top half). Built once on first use (256 KiB).
 */
export function kvWidening(kvDtype: number): Float32Array {
  let table = widening[kvDtype] ?? null;
  if (table !== null) return table;
  table = new Float32Array(65536);
  for (let bits = 0; bits < 65536; bits++) {
    if (kvDtype === 2) {
      u32Box[0] = bits * 65536;
      table[bits] = f32Box[0] as number;
      continue;
    }
    const sign = bits & 0x8000 ? -1 : 1;
    const e = (bits >>> 10) & 0x1f;
    const m = bits & 0x3ff;
    if (e === 31) table[bits] = m === 0 ? sign * Number.POSITIVE_INFINITY : Number.NaN;
    else if (e === 0) table[bits] = sign * 2 ** -14 * (m / 1024);
    else table[bits] = sign * 2 ** (e - 15) * (1 + m / 1024);
  }
  widening[kvDtype] = table;
  return table;
}
