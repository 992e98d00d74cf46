/**
 * Test drivers for the forward pass: page pools with in-order or shuffled block tables, and a run
 * of one prompt through `ForwardPass.step()` in chunks that collects the logits of every position.
 */
import { roundKv } from "../src/kernels/reference.js";
import { type KvDtype, type KvLayout, kvDtypeCode, kvDtypeOf, pageFloats } from "../src/kvcache/kv-layout.js";
import { Prng } from "../src/lib/prng.js";
import type { ForwardPass, StepSequence } from "../src/model/forward.js";
import type { ModelConfig } from "../src/model/model-config.js";

export function layoutFor(config: ModelConfig, pageSize = 16, dtype: KvDtype = "f32"): KvLayout {
  return {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize,
    dtype,
  };
}

/** A pool's data: f32, or the bits of f16/bf16 elements (the layout's dtype). */
export type PoolData = Float32Array | Uint16Array;

/** A pool of `numPages` pages filled with garbage (NaN-free large values), so unwritten reads show. */
export function makePool(layout: KvLayout, numPages: number, seed = 7): Float32Array {
  const pool = new Float32Array(numPages * pageFloats(layout));
  const rng = new Prng(seed);
  for (let i = 0; i < pool.length; i++) pool[i] = (rng.next() - 0.5) * 100;
  return pool;
}

/** `makePool` at the layout's dtype: f32 as there, f16/bf16 the same garbage rounded (a Uint16Array). */
export function makeKvPool(layout: KvLayout, numPages: number, seed = 7): PoolData {
  const dtype = kvDtypeOf(layout);
  if (dtype === "f32") return makePool(layout, numPages, seed);
  const n = numPages * pageFloats(layout);
  const rng = new Prng(seed);
  const pool = new Uint16Array(n);
  const code = kvDtypeCode(dtype);
  for (let i = 0; i < pool.length; i++) pool[i] = roundKv((rng.next() - 0.5) * 100, code);
  return pool;
}

/** `count` distinct physical pages out of `numPages`: 0..count-1 in order, or a random permutation. */
export function blockTable(count: number, numPages: number, shuffled: boolean, seed = 3): Int32Array {
  const pages = Int32Array.from({ length: numPages }, (_, i) => i);
  if (shuffled) {
    const rng = new Prng(seed);
    for (let i = numPages - 1; i > 0; i--) {
      const j = rng.nextInt(i + 1);
      const t = pages[i] as number;
      pages[i] = pages[j] as number;
      pages[j] = t;
    }
  }
  return pages.slice(0, count);
}

/**
 * Feeds `tokens` through the forward pass in chunks of the given sizes (the last size repeats;
 * size 1 everywhere is token-by-token decode) and returns the logits of every position,
 * [n][vocab]. A chunk step yields the logits of its last position; the chunk's earlier positions
 * are then read back by one-token steps at those positions in DESCENDING order, so each of those
 * steps attends over K/V that the chunk itself wrote (it rewrites only its own position).
 */
export function logitsAtEveryPosition(
  fp: ForwardPass,
  pool: PoolData,
  table: Int32Array,
  tokens: Int32Array,
  chunkSizes: readonly number[],
): Float32Array[] {
  const vocab = fp.config.vocabSize;
  const result: Float32Array[] = [];
  let pos = 0;
  let c = 0;
  while (pos < tokens.length) {
    const size = Math.min(chunkSizes[Math.min(c, chunkSizes.length - 1)] as number, tokens.length - pos);
    const chunk: Float32Array[] = new Array(size);
    const last = new Float32Array(vocab);
    fp.step(pool, [
      { tokens: tokens.slice(pos, pos + size), startPos: pos, blockTable: table, logits: last },
    ]);
    chunk[size - 1] = last;
    for (let i = size - 2; i >= 0; i--) {
      const logits = new Float32Array(vocab);
      const seq: StepSequence = {
        tokens: tokens.slice(pos + i, pos + i + 1),
        startPos: pos + i,
        blockTable: table,
        logits,
      };
      fp.step(pool, [seq]);
      chunk[i] = logits;
    }
    result.push(...chunk);
    pos += size;
    c++;
  }
  return result;
}

/**
 * Greedy continuation of `prompt` by `count` tokens (prompt prefilled in one chunk). `margins`, when
 * given, receives each step's top-1 minus top-2 logit.
 */
export function greedyContinuation(
  fp: ForwardPass,
  pool: PoolData,
  table: Int32Array,
  prompt: Int32Array,
  count: number,
  margins?: number[],
): number[] {
  const logits = new Float32Array(fp.config.vocabSize);
  const out: number[] = [];
  fp.step(pool, [{ tokens: prompt, startPos: 0, blockTable: table, logits }]);
  const one = new Int32Array(1);
  for (let i = 0; i < count; i++) {
    let best = 0;
    let second = -Infinity;
    for (let j = 1; j < logits.length; j++) {
      const v = logits[j] as number;
      if (v > (logits[best] as number)) {
        second = logits[best] as number;
        best = j;
      } else if (v > second) second = v;
    }
    out.push(best);
    margins?.push((logits[best] as number) - second);
    if (i === count - 1) break;
    one[0] = best;
    fp.step(pool, [{ tokens: one, startPos: prompt.length + i, blockTable: table, logits }]);
  }
  return out;
}
