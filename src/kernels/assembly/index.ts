/**
 * WebAssembly SIMD128 kernels (AssemblyScript), compiled by scripts/build-wasm.mjs into
 * dist/src/kernels/kernels.wasm and driven by src/kernels/wasm-kernels.ts.
 *
 * Every argument is a byte address in the imported shared memory (or a size). The module owns no
 * memory of its own: no static data, no allocator, no globals that matter, so the main thread and
 * the worker can each instantiate it over the same `WebAssembly.Memory` without interfering.
 *
 * Parallel kernels (`matmulPar`, `attentionPar`) cut their work into chunks and claim them with an
 * atomic counter at `counter`, so both threads call the same function on the same arguments and the
 * faster one simply takes more chunks (docs/benchmarks.md §3.2: 2 threads reach x1.9–2.0 only when neither
 * waits on the other).
 *
 * Shapes follow src/kernels/reference.ts: a weight is `[out][in]`, matmul computes x · wᵀ.
 * Matmul: four or more x-rows are packed in groups of 8 so one pointer reaches all 8, each chunk of
 * weight rows is read once to bring it into L2, and a tile computes on it two weight rows at a time;
 * 1–3 rows stream the weights, one or two rows per pass over a chunk. Sums accumulate
 * in f32 lanes (the reference uses doubles).
 */

// ---------------------------------------------------------------------------------------------
// helpers

@inline
function hsum(v: v128): f32 {
  return f32x4.extract_lane(v, 0) + f32x4.extract_lane(v, 1) + (f32x4.extract_lane(v, 2) + f32x4.extract_lane(v, 3));
}

/**
 * acc + a·b on four lanes: one fused multiply-add in the relaxed-SIMD build (kernels-fma.wasm; a
 * multiply and an add where the CPU has no FMA), a multiply and an add in the plain build. The 8-row
 * matmul tile issues two vector multiply-adds per cycle either way, but as separate instructions
 * it runs out of dispatch slots first: from L2 on one core, 53 against 44 GFLOP/s.
 */
@inline
function fma(acc: v128, a: v128, b: v128): v128 {
  if (ASC_FEATURE_RELAXED_SIMD) return f32x4.relaxed_madd(a, b, acc);
  return f32x4.add(acc, f32x4.mul(a, b));
}

/** exp on four lanes (Cephes expf: range reduction to [-ln2/2, ln2/2], degree-6 polynomial). */
@inline
function expv(x: v128): v128 {
  // pmin/pmax are one instruction each on x86; min/max, which must order NaNs and signed zeros,
  // are several (a NaN still comes out a NaN).
  x = f32x4.pmin(f32x4.pmax(x, f32x4.splat(-87.3)), f32x4.splat(88.7));
  const fx = f32x4.nearest(f32x4.mul(x, f32x4.splat(1.44269504088896341)));
  let r = f32x4.sub(x, f32x4.mul(fx, f32x4.splat(0.693359375)));
  r = f32x4.sub(r, f32x4.mul(fx, f32x4.splat(-2.12194440e-4)));
  let p = f32x4.splat(1.9875691500e-4);
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(1.3981999507e-3));
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(8.3334519073e-3));
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(4.1665795894e-2));
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(1.6666665459e-1));
  p = f32x4.add(f32x4.mul(p, r), f32x4.splat(5.0000001201e-1));
  const y = f32x4.add(f32x4.add(f32x4.mul(f32x4.mul(p, r), r), r), f32x4.splat(1.0));
  // 2^fx: fx is a whole number in [-126, 128], so fx + 2^23 + 127 is a float whose low mantissa
  // bits are fx + 127; shifting them into the exponent field drops the rest (cheaper than
  // i32x4.trunc_sat_f32x4_s, a sequence of several instructions on x86).
  const pow2n = i32x4.shl(f32x4.add(fx, f32x4.splat(8388735.0)), 23);
  return f32x4.mul(y, pow2n);
}

/** Scalar exp with the same polynomial, for tails. */
@inline
function exps(x: f32): f32 {
  return f32x4.extract_lane(expv(f32x4.splat(x)), 0);
}

// ---------------------------------------------------------------------------------------------
// matmul

// Weight formats (src/kernels/weight-format.ts). The f32 and half kernels are one generic source
// over W: f32 (4-byte floats), u16 (bf16) or i16 (f16, a marker type: the bits are IEEE halves);
// sizeof<W>() and isSigned<W>() are compile-time constants, so each instance is its own loop.
export const DT_F32: i32 = 0;
export const DT_F16: i32 = 1;
export const DT_BF16: i32 = 2;
export const DT_Q8_0: i32 = 3;
export const DT_Q4_0: i32 = 4;
/** llama.cpp's k-quants (`matmulColsK`). */
export const DT_Q4_K: i32 = 5;
export const DT_Q5_K: i32 = 6;
export const DT_Q6_K: i32 = 7;
/** Flag on DT_Q8_0/DT_Q4_0 (ignored on the k-quants): batches run `qTileDot16` (the loader sets it where `dotAddExact`). */
export const DT_DOT_ADD: i32 = 8;

/** 2^112: an f16's exponent and mantissa shifted into an f32's, times this, is its value (subnormals too). */
const F16_SCALE: f32 = 5.192296858534828e33;

/** Four weights at p widened to f32 lanes (halves: one zero-extending load, then shifts). */
@inline
function wload4<W>(p: usize): v128 {
  if (sizeof<W>() == 4) return v128.load(p);
  const h = v128.load16x4_u(p);
  if (!isSigned<W>()) return i32x4.shl(h, 16);
  const mag = f32x4.mul(i32x4.shl(v128.and(h, i32x4.splat(0x7fff)), 13), f32x4.splat(F16_SCALE));
  return v128.or(mag, i32x4.shl(v128.and(h, i32x4.splat(0x8000)), 16));
}

/** One weight at p as f32 (for tails). Infinities and NaNs of f16 weights are not kept (no model has them). */
@inline
function wload1<W>(p: usize): f32 {
  if (sizeof<W>() == 4) return load<f32>(p);
  const h = <u32>load<u16>(p);
  if (!isSigned<W>()) return reinterpret<f32>(h << 16);
  return f16ToF32(h);
}

@inline
function f16ToF32(h: u32): f32 {
  const mag = reinterpret<f32>((h & 0x7fff) << 13) * F16_SCALE;
  return reinterpret<f32>(reinterpret<u32>(mag) | ((h & 0x8000) << 16));
}

/** Byte offset into a W weight row of the x byte offset k (4 bytes a value). */
@inline
function wk<W>(k: usize): usize {
  return sizeof<W>() == 4 ? k : k >> 1;
}

/**
 * out[r][j] for one row r, columns j in [c0, c1): one weight row at a time with 4 accumulators, so a
 * chunk of columns is one sequential read stream (x stays in L1). Reading 4 or 8 weight rows at once
 * (as many streams) was slower: the bare decode weight pass on the 135M shape went from 36 to 55
 * passes/s on 2 threads and from 24 to 43 on 1 (src/tools/bench/kernels.ts --parts pass, interleaved).
 */
function matvecRow<W>(out: usize, x: usize, w: usize, r: i32, inDim: i32, outDim: i32, c0: i32, c1: i32): void {
  const xs = (<usize>inDim) << 2;
  const ws = <usize>inDim * sizeof<W>();
  const xr = x + <usize>r * xs;
  const orow = out + ((<usize>r * <usize>outDim) << 2);
  const k16 = (<usize>(inDim & ~15)) << 2;
  const k4 = (<usize>(inDim & ~3)) << 2;
  const h = sizeof<W>() << 2; // bytes of four weights
  for (let j = c0; j < c1; j++) {
    const w0 = w + <usize>j * ws;
    let a0 = f32x4.splat(0), a1 = f32x4.splat(0), a2 = f32x4.splat(0), a3 = f32x4.splat(0);
    let k: usize = 0;
    for (; k < k16; k += 64) {
      const p = w0 + wk<W>(k);
      a0 = fma(a0, v128.load(xr + k), wload4<W>(p));
      a1 = fma(a1, v128.load(xr + k, 16), wload4<W>(p + h));
      a2 = fma(a2, v128.load(xr + k, 32), wload4<W>(p + 2 * h));
      a3 = fma(a3, v128.load(xr + k, 48), wload4<W>(p + 3 * h));
    }
    for (; k < k4; k += 16) a0 = fma(a0, v128.load(xr + k), wload4<W>(w0 + wk<W>(k)));
    let s0 = hsum(f32x4.add(f32x4.add(a0, a1), f32x4.add(a2, a3)));
    for (; k < xs; k += 4) s0 += load<f32>(xr + k) * wload1<W>(w0 + wk<W>(k));
    store<f32>(orow + ((<usize>j) << 2), s0);
  }
}

/**
 * `matvecRow` for rows 0 and 1 in one pass: each weight vector is loaded once for both rows (8
 * accumulators), so two decode rows read the weights once from DRAM, as one does.
 */
function matvecRows2<W>(out: usize, x: usize, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32): void {
  const xs = (<usize>inDim) << 2;
  const ws = <usize>inDim * sizeof<W>();
  const h = sizeof<W>() << 2;
  const x1 = x + xs;
  const o1 = out + ((<usize>outDim) << 2);
  const k8 = (<usize>(inDim & ~7)) << 2;
  const k4 = (<usize>(inDim & ~3)) << 2;
  for (let j = c0; j < c1; j++) {
    const w0 = w + <usize>j * ws;
    let a0 = f32x4.splat(0), a1 = f32x4.splat(0), b0 = f32x4.splat(0), b1 = f32x4.splat(0);
    let k: usize = 0;
    for (; k < k8; k += 32) {
      const u = wload4<W>(w0 + wk<W>(k));
      const v = wload4<W>(w0 + wk<W>(k) + h);
      a0 = fma(a0, v128.load(x + k), u);
      a1 = fma(a1, v128.load(x + k, 16), v);
      b0 = fma(b0, v128.load(x1 + k), u);
      b1 = fma(b1, v128.load(x1 + k, 16), v);
    }
    for (; k < k4; k += 16) {
      const u = wload4<W>(w0 + wk<W>(k));
      a0 = fma(a0, v128.load(x + k), u);
      b0 = fma(b0, v128.load(x1 + k), u);
    }
    let s0 = hsum(f32x4.add(a0, a1));
    let s1 = hsum(f32x4.add(b0, b1));
    for (; k < xs; k += 4) {
      const u = wload1<W>(w0 + wk<W>(k));
      s0 += load<f32>(x + k) * u;
      s1 += load<f32>(x1 + k) * u;
    }
    const jo = (<usize>j) << 2;
    store<f32>(out + jo, s0);
    store<f32>(o1 + jo, s1);
  }
}

/** Bytes of one packed group of 8 x-rows (see `pack8`): ⌈inDim/4⌉ quads × 8 rows × 16 bytes. */
@inline
function packedGroupBytes(inDim: i32): usize {
  return (<usize>((inDim + 3) >> 2)) << 7;
}

/**
 * Packs the rows of x[rows][inDim] in groups of 8 for `tile8`: group g at xp + g·packedGroupBytes
 * holds, for each quad of k, the 8 rows' four values one after another ([k/4][8][4]), zero-padded
 * to a whole quad and, in a last group of fewer than 8 rows, to 8 rows. The tile then reads all 8
 * rows at one pointer with constant offsets.
 */
export function pack8(xp: usize, x: usize, rows: i32, inDim: i32): void {
  const xs = (<usize>inDim) << 2;
  const k4 = (<usize>(inDim & ~3)) << 2;
  const gs = packedGroupBytes(inDim);
  for (let g = 0; g < rows; g += 8) {
    const src = x + <usize>g * xs;
    const dst = xp + (<usize>(g >> 3)) * gs;
    const n = <usize>min(8, rows - g);
    for (let k: usize = 0; k < k4; k += 16) {
      const d = dst + (k << 3);
      for (let r: usize = 0; r < 8; r++) v128.store(d + (r << 4), r < n ? v128.load(src + r * xs + k) : f32x4.splat(0));
    }
    if (k4 < xs) {
      const d = dst + (k4 << 3);
      for (let r: usize = 0; r < 8; r++) {
        for (let i: usize = 0; i < 16; i += 4) {
          store<f32>(d + (r << 4) + i, r < n && k4 + i < xs ? load<f32>(src + r * xs + k4 + i) : 0);
        }
      }
    }
  }
}

/**
 * Reads [a, b) once, 128 bytes per iteration, so that it is in L2 before a compute loop runs over
 * it. A compute-heavy loop that misses L2 gets only a few cache lines ahead of itself (its reorder
 * window is full of arithmetic), while a loop of plain loads keeps dozens in flight: on one core,
 * 8 x-rows against weights beyond L2 ran at 20 GFLOP/s and at 44 from L2, and a read-only pass
 * streams ~22 GB/s, so reading first and then computing from L2 reaches 30. The loads' values are
 * discarded; a load that may trap is never removed (Binaryen keeps it, as the .wat shows, and V8
 * too: the pass still brings that speed-up with nothing reading its result).
 */
function touch(a: usize, b: usize): void {
  let s0 = i32x4.splat(0), s1 = i32x4.splat(0);
  let p = a;
  for (; p + 128 <= b; p += 128) {
    s0 = v128.or(s0, v128.or(v128.load(p), v128.load(p, 16)));
    s1 = v128.or(s1, v128.or(v128.load(p, 32), v128.load(p, 48)));
    s0 = v128.or(s0, v128.or(v128.load(p, 64), v128.load(p, 80)));
    s1 = v128.or(s1, v128.or(v128.load(p, 96), v128.load(p, 112)));
  }
  for (; p < b; p += 64) s0 = v128.or(s0, v128.load32_zero(p));
}

/**
 * `touch` with one load per 64-byte line: a quarter of its instructions, so the out-of-order
 * window holds four times as many lines in flight.
 */
@inline
function touchLines(a: usize, b: usize): void {
  let s: u32 = 0;
  let p = a;
  for (; p + 256 <= b; p += 256) s |= load<u32>(p) | load<u32>(p, 64) | load<u32>(p, 128) | load<u32>(p, 192);
  for (; p < b; p += 64) s |= load<u32>(p);
}

/**
 * out[r][j] for the first `nrows` (1–8) rows of one packed group (xp, from `pack8`; out points at
 * the group's first output row), columns j in [c0, c1): two weight rows at a time against 4 rows and
 * then, for more than 4, the other 4 (8 accumulators, 6 loads per 8 multiply-adds; the pair of weight
 * rows is in L1 for the second 4). With the rows packed, every x load is one pointer plus a constant:
 * on one core 44 GFLOP/s from L2, against 30 for the same tile over 4 row pointers and 30 for one
 * weight row against 8 rows. Padding rows are computed and not stored; an odd last column is
 * computed as a pair with itself and stored once.
 */
function tile8<W>(out: usize, xp: usize, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32, nrows: i32): void {
  const xs = (<usize>inDim) << 2;
  const ws = <usize>inDim * sizeof<W>();
  const os = (<usize>outDim) << 2;
  const k4 = (<usize>(inDim & ~3)) << 2;
  const hEnd = <usize>nrows;
  for (let j = c0; j < c1; j += 2) {
    const w0 = w + <usize>j * ws;
    const pair = j + 1 < c1;
    const w1 = pair ? w0 + ws : w0;
    for (let h: usize = 0; h < hEnd; h += 4) {
      let a00 = f32x4.splat(0), a10 = f32x4.splat(0), a20 = f32x4.splat(0), a30 = f32x4.splat(0);
      let a01 = f32x4.splat(0), a11 = f32x4.splat(0), a21 = f32x4.splat(0), a31 = f32x4.splat(0);
      let p = xp + (h << 4);
      for (let k: usize = 0; k < k4; k += 16) {
        const b0 = wload4<W>(w0 + wk<W>(k));
        const b1 = wload4<W>(w1 + wk<W>(k));
        let v = v128.load(p);
        a00 = fma(a00, v, b0);
        a01 = fma(a01, v, b1);
        v = v128.load(p, 16);
        a10 = fma(a10, v, b0);
        a11 = fma(a11, v, b1);
        v = v128.load(p, 32);
        a20 = fma(a20, v, b0);
        a21 = fma(a21, v, b1);
        v = v128.load(p, 48);
        a30 = fma(a30, v, b0);
        a31 = fma(a31, v, b1);
        p += 128;
      }
      const c0v = reduce4(a00, a10, a20, a30);
      const c1v = reduce4(a01, a11, a21, a31);
      const jo = out + h * os + ((<usize>j) << 2);
      const live = hEnd - h; // real rows from h on: the padding rows of a last group are not stored
      store<f32>(jo, f32x4.extract_lane(c0v, 0));
      if (live > 1) store<f32>(jo + os, f32x4.extract_lane(c0v, 1));
      if (live > 2) store<f32>(jo + 2 * os, f32x4.extract_lane(c0v, 2));
      if (live > 3) store<f32>(jo + 3 * os, f32x4.extract_lane(c0v, 3));
      if (pair) {
        store<f32>(jo, f32x4.extract_lane(c1v, 0), 4);
        if (live > 1) store<f32>(jo + os, f32x4.extract_lane(c1v, 1), 4);
        if (live > 2) store<f32>(jo + 2 * os, f32x4.extract_lane(c1v, 2), 4);
        if (live > 3) store<f32>(jo + 3 * os, f32x4.extract_lane(c1v, 3), 4);
      }
      // The last k % 4 values: p is at the zero-padded quad.
      for (let k = k4; k < xs; k += 4) {
        const bb0 = wload1<W>(w0 + wk<W>(k));
        const bb1 = wload1<W>(w1 + wk<W>(k));
        const at = p + (k - k4);
        for (let i: usize = 0; i < 4 && i < live; i++) {
          const o = jo + i * os;
          const xv = load<f32>(at + (i << 4));
          store<f32>(o, load<f32>(o) + xv * bb0);
          if (pair) store<f32>(o, load<f32>(o, 4) + xv * bb1, 4);
        }
      }
    }
  }
}

/**
 * out[rows][outDim] = x[rows][inDim] · w[outDim][inDim]ᵀ, output columns [c0, c1) only. Up to three
 * rows (decode) stream the weights (`matvecRow`, `matvecRows2`); four or more read the chunk of
 * weight rows into L2 and run `tile8` over x packed by `pack8` at xp, 8 rows at a time (a last
 * group of 2–7 rows computes 4 or 8; with 4- and 3-row tiles that spilled registers, decode
 * batches of 4–7 rows made fewer tokens/s than batches of 8).
 */
function matmulCols<W>(
  out: usize, x: usize, xp: usize, w: usize, rows: i32, inDim: i32, outDim: i32, c0: i32, c1: i32,
): void {
  if (rows == 1) {
    matvecRow<W>(out, x, w, 0, inDim, outDim, c0, c1);
    return;
  }
  if (rows <= 3) {
    // Streamed (STREAMED_ROWS in wasm-kernels.ts): two rows in one pass, a third from L2 (the
    // chunk is ≤ 128 weight rows).
    matvecRows2<W>(out, x, w, inDim, outDim, c0, c1);
    if (rows == 3) matvecRow<W>(out, x, w, 2, inDim, outDim, c0, c1);
    return;
  }
  const ws = <usize>inDim * sizeof<W>();
  touch(w + <usize>c0 * ws, w + <usize>c1 * ws);
  const os = (<usize>outDim) << 2;
  const gs = packedGroupBytes(inDim);
  for (let r = 0; r < rows; r += 8) {
    const n = min(8, rows - r);
    // A row past a multiple of 4 would cost the tile a padded half: a matvec over the chunk, now
    // in L2, is a quarter of that.
    const tiled = (n & 3) == 1 ? n - 1 : n;
    if (tiled > 0) tile8<W>(out + <usize>r * os, xp + (<usize>(r >> 3)) * gs, w, inDim, outDim, c0, c1, tiled);
    if (tiled < n) matvecRow<W>(out, x, w, r + tiled, inDim, outDim, c0, c1);
  }
}

/**
 * One or more matmuls over the same x (q/k/v, gate/up: one job, one packing of x), in chunks of
 * `rowChunk` rows (a multiple of 8) × `colChunk` output columns (row blocks outer, so a row block of
 * x stays in L2 while the weights stream; then the segments in order). `segs` holds one record of
 * 4 i32 per matmul: out address, weight address, outDim, and the number of column chunks of the
 * segments before it. Every participating thread calls it with the same arguments but `first`
 * (0 for the main thread, 1 for the worker); see `claim` for how they share the chunks. The caller
 * zeroes both counters and packs x into xp (`pack8`) first.
 */
export function matmulPar(
  x: usize, xp: usize, rows: i32, inDim: i32, segs: usize, numSegs: i32, counter: usize, colChunk: i32, rowChunk: i32,
  first: i32, dtype: i32,
): void {
  const last = segs + (<usize>(numSegs - 1) << 4);
  const perBlock = load<i32>(last, 12) + (load<i32>(last, 8) + colChunk - 1) / colChunk;
  const n = ((rows + rowChunk - 1) / rowChunk) * perBlock;
  const gs = packedGroupBytes(inDim);
  for (;;) {
    const c = claim(counter, n, first);
    if (c < 0) return;
    const r0 = (c / perBlock) * rowChunk;
    const k = c % perBlock;
    let sg = segs;
    while (sg < last && load<i32>(sg, 28) <= k) sg += 16;
    const outDim = load<i32>(sg, 8);
    const c0 = (k - load<i32>(sg, 12)) * colChunk;
    const c1 = min(c0 + colChunk, outDim);
    const rn = min(rowChunk, rows - r0);
    const o = <usize>load<i32>(sg) + ((<usize>r0 * <usize>outDim) << 2);
    const w = <usize>load<i32>(sg, 4);
    if ((dtype & 7) >= DT_Q4_K) {
      matmulColsK(o, xp, rows, r0, rn, w, inDim, outDim, c0, c1, dtype & 7);
      continue;
    }
    if (dtype >= DT_Q8_0) {
      const quads = (dtype & DT_DOT_ADD) != 0;
      if ((dtype & 7) == DT_Q8_0) matmulColsQ<i8>(o, xp, rows, r0, rn, w, inDim, outDim, c0, c1, quads);
      else matmulColsQ<u8>(o, xp, rows, r0, rn, w, inDim, outDim, c0, c1, quads);
      continue;
    }
    const xr = x + ((<usize>r0 * <usize>inDim) << 2);
    const p = xp + (<usize>(r0 >> 3)) * gs;
    if (dtype == DT_F32) matmulCols<f32>(o, xr, p, w, rn, inDim, outDim, c0, c1);
    else if (dtype == DT_BF16) matmulCols<u16>(o, xr, p, w, rn, inDim, outDim, c0, c1);
    else matmulCols<i16>(o, xr, p, w, rn, inDim, outDim, c0, c1);
  }
}

// ---------------------------------------------------------------------------------------------
// quantised weights: int8 dot products against Q8_0-quantised activations (as llama.cpp on CPUs)

/**
 * Quantises rows of x[rows][inDim] (inDim a multiple of 32) for the Q8_0/Q4_0 matmul, at xq: the
 * int8 quants [rows][inDim], then (from `qScalesAt`) each 32-block's scale d = amax/127 as f32
 * [rows][inDim/32], then d·8·Σq per block [rows][inDim/32] (the Q4_0 offset's share); these are
 * what `qRow` reads. Quants are x·(1/d) rounded to nearest even (f32x4.nearest, as ggml's AVX
 * quantize_row_q8_0). For two or more rows the same quants and scales are also laid out for
 * `qTile16` (from `qTileAt`): per group of 16 rows (the last one zero-padded), the quants as i16
 * [inDim/2][16][2] (each pair of values k, k+1 of the 16 rows next to each other, 64 bytes, so
 * one load gives 4 rows' pairs) and then, after all groups' quants, the scales [nb][16] per group.
 */
export function quantizeRowsQ8(xq: usize, x: usize, rows: i32, inDim: i32, quads: i32): void {
  const nb = inDim >> 5;
  const xd = qScalesAt(xq, rows, inDim);
  const xc = xd + ((<usize>(rows * nb)) << 2);
  for (let r = 0; r < rows; r++) {
    for (let b = 0; b < nb; b++) {
      const i = r * nb + b;
      const p = x + ((<usize>i) << 7);
      let m = f32x4.abs(v128.load(p));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 16)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 32)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 48)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 64)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 80)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 96)));
      m = f32x4.pmax(m, f32x4.abs(v128.load(p, 112)));
      const amax = max(max(f32x4.extract_lane(m, 0), f32x4.extract_lane(m, 1)), max(f32x4.extract_lane(m, 2), f32x4.extract_lane(m, 3)));
      const d: f32 = amax / 127;
      const iv = f32x4.splat(d != 0 ? <f32>1 / d : 0);
      const q0 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p), iv)));
      const q1 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 16), iv)));
      const q2 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 32), iv)));
      const q3 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 48), iv)));
      const q4 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 64), iv)));
      const q5 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 80), iv)));
      const q6 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 96), iv)));
      const q7 = i32x4.trunc_sat_f32x4_s(f32x4.nearest(f32x4.mul(v128.load(p, 112), iv)));
      const b0 = i8x16.narrow_i16x8_s(i16x8.narrow_i32x4_s(q0, q1), i16x8.narrow_i32x4_s(q2, q3));
      const b1 = i8x16.narrow_i16x8_s(i16x8.narrow_i32x4_s(q4, q5), i16x8.narrow_i32x4_s(q6, q7));
      const o = xq + ((<usize>i) << 5);
      v128.store(o, b0);
      v128.store(o, b1, 16);
      const sq = i32x4.add(
        i32x4.extadd_pairwise_i16x8_s(i16x8.extadd_pairwise_i8x16_s(b0)),
        i32x4.extadd_pairwise_i16x8_s(i16x8.extadd_pairwise_i8x16_s(b1)),
      );
      const sum = i32x4.extract_lane(sq, 0) + i32x4.extract_lane(sq, 1) + i32x4.extract_lane(sq, 2) + i32x4.extract_lane(sq, 3);
      store<f32>(xd + ((<usize>i) << 2), d);
      store<f32>(xc + ((<usize>i) << 2), d * 8 * <f32>sum);
    }
  }
  if (rows > 1) qTileLayout(xq, rows, inDim, quads != 0);
}

/** Bytes `quantizeRowsQ8` writes for rows × inDim (the loader sizes its buffer by it). */
export function quantizedBytes(rows: i32, inDim: i32): i32 {
  const end = qTileAt(0, rows, inDim);
  if (rows == 1) return <i32>end;
  return <i32>(end + (<usize>((rows + 15) >> 4)) * (((<usize>inDim) << 5) + ((<usize>(inDim >> 5)) << 7)));
}

/** Where `quantizeRowsQ8` puts the `qTile16` layout: after the Σ terms, at 16 bytes. */
@inline
function qTileAt(xq: usize, rows: i32, inDim: i32): usize {
  return (qScalesAt(xq, rows, inDim) + ((<usize>(rows * (inDim >> 5))) << 3) + 15) & ~(<usize>15);
}

/**
 * Copies the int8 quants and scales of `quantizeRowsQ8` into the tile layout: per 16-row group
 * (inDim·32 bytes apart) the quants as i16 pairs for `qTile16` [inDim/2][16][2] or, with `quads`,
 * as int8 quads for `qTileDot16` [inDim/4][16][4]; after all groups the scales [nb][16] f32 of
 * each group, then −8·Σq [nb][16] i32 of each group (Q4_0's offset in `qTileDot16`).
 */
function qTileLayout(xq: usize, rows: i32, inDim: i32, quads: bool): void {
  const nb = inDim >> 5;
  const xd = qScalesAt(xq, rows, inDim);
  const t = qTileAt(xq, rows, inDim);
  const groups = (rows + 15) >> 4;
  const qs = (<usize>inDim) << 5; // one group's quants
  const ss = (<usize>nb) << 6; // one group's scales (or offsets)
  const sAt = t + <usize>groups * qs;
  const cAt = sAt + <usize>groups * ss;
  for (let r = 0; r < groups << 4; r++) {
    const live = r < rows;
    const rr = (<usize>(r & 15)) << 2;
    const dq = t + <usize>(r >> 4) * qs + rr;
    const ds = sAt + <usize>(r >> 4) * ss + rr;
    const dc = cAt + <usize>(r >> 4) * ss + rr;
    for (let b = 0; b < nb; b++) {
      const src = xq + <usize>r * <usize>inDim + ((<usize>b) << 5);
      const lo = live ? v128.load(src) : i8x16.splat(0);
      const hi = live ? v128.load(src, 16) : i8x16.splat(0);
      if (quads) {
        const o = dq + ((<usize>b) << 9);
        qStorePairs(o, lo);
        qStorePairs(o + 256, hi);
      } else {
        const o = dq + ((<usize>b) << 10);
        qStorePairs(o, i16x8.extend_low_i8x16_s(lo));
        qStorePairs(o + 256, i16x8.extend_high_i8x16_s(lo));
        qStorePairs(o + 512, i16x8.extend_low_i8x16_s(hi));
        qStorePairs(o + 768, i16x8.extend_high_i8x16_s(hi));
      }
      const sq = i32x4.add(
        i32x4.extadd_pairwise_i16x8_s(i16x8.extadd_pairwise_i8x16_s(lo)),
        i32x4.extadd_pairwise_i16x8_s(i16x8.extadd_pairwise_i8x16_s(hi)),
      );
      const sum = i32x4.extract_lane(sq, 0) + i32x4.extract_lane(sq, 1) + i32x4.extract_lane(sq, 2) + i32x4.extract_lane(sq, 3);
      store<f32>(ds + ((<usize>b) << 6), live ? load<f32>(xd + ((<usize>(r * nb + b)) << 2)) : 0);
      store<i32>(dc + ((<usize>b) << 6), -8 * sum);
    }
  }
}

/** The four i32 lanes of v (i16 pairs or int8 quads) at o, o + 64, o + 128, o + 192 (one row's slots). */
@inline
function qStorePairs(o: usize, v: v128): void {
  v128.store32_lane(o, v, 0);
  v128.store32_lane(o, v, 1, 64);
  v128.store32_lane(o, v, 2, 128);
  v128.store32_lane(o, v, 3, 192);
}

/** Where `quantizeRowsQ8` puts the scales: after the quants, rounded up to 16 bytes. */
@inline
function qScalesAt(xq: usize, rows: i32, inDim: i32): usize {
  return xq + ((<usize>(rows * inDim) + 15) & ~(<usize>15));
}

/**
 * acc + the int8 dot product of a and b in i32 lanes (each lane the sum of four products). In the
 * relaxed-SIMD build `i16x8.relaxed_dot_i8x16_i7x16_s` (pairs of products, at most 2·127·127, so
 * no saturation) and one pairwise add, exact because b is always in [0, 127] (Q4_0 nibbles, or |q|
 * of Q8_0 with q's sign moved onto a: `signTo`). Not `i32x4.relaxed_dot_i8x16_i7x16_add_s`: Node
 * 20's V8 (11.3, behind its flag) returns twice the dot product from it (docs/weights.md). In the
 * plain build two widening multiplies and two pairwise adds (products ≤ 127·127 fit i16).
 */
@inline
function idot(acc: v128, a: v128, b: v128): v128 {
  if (ASC_FEATURE_RELAXED_SIMD) return i32x4.add(acc, i32x4.extadd_pairwise_i16x8_s(i16x8.relaxed_dot_i8x16_i7x16_s(a, b)));
  const lo = i32x4.extadd_pairwise_i16x8_s(i16x8.extmul_low_i8x16_s(a, b));
  const hi = i32x4.extadd_pairwise_i16x8_s(i16x8.extmul_high_i8x16_s(a, b));
  return i32x4.add(acc, i32x4.add(lo, hi));
}

/**
 * For the relaxed dot: x with the sign of the weights `neg` marks (lanes all ones where w < 0), so
 * x·|w| = x·w: (x ^ m) − m negates where m = −1 (x is never −128). Two single-instruction ops; a
 * negate and a bitselect were about five x86 instructions.
 */
@inline
function signTo(x: v128, neg: v128): v128 {
  if (ASC_FEATURE_RELAXED_SIMD) return i8x16.sub(v128.xor(x, neg), neg);
  return x;
}

/** The weight operand of `idot`: |w| for Q8_0 in the relaxed build (see `signTo`), else w. */
@inline
function dotW(w: v128): v128 {
  if (ASC_FEATURE_RELAXED_SIMD) return i8x16.abs(w);
  return w;
}

/**
 * The 16 weights of half h (0 or 1) of the block at bp as int8 values: Q8_0's quants 16h…16h+15;
 * Q4_0's low (h = 0) or high nibbles minus 8, which are values 0–15 or 16–31 of its block.
 */
@inline
function qHalf<Q>(bp: usize, h: i32): v128 {
  if (isSigned<Q>()) return h == 0 ? v128.load(bp, 2) : v128.load(bp, 18);
  const v = v128.load(bp, 2);
  const n = h == 0 ? v128.and(v, i8x16.splat(0x0f)) : i8x16.shr_u(v, 4);
  return i8x16.sub(n, i8x16.splat(8));
}

/**
 * out[r][j] for the `nrows` (2–16) rows of one 16-row group of quantised activations (xt: the
 * group's i16 quants, xs: its scales, from `qTileLayout`) against weight rows [c0, c1) in blocks Q
 * (i8: Q8_0 34-byte blocks, u8: Q4_0 18-byte blocks); 4·sizeof<N>() rows are computed (N: u8, u16
 * or u32 for 4, 8 or 16), padding rows are zeros and not stored. The lanes of each accumulator are
 * 4 activation rows: each weight block is widened to i16 once, each pair of its values broadcast
 * (one shuffle) and multiplied against 4 rows' pairs by `i32x4.dot_i16x8_s` (pmaddwd: 8 exact
 * multiply-adds, no sign handling), so a block needs no horizontal sum: one convert and one
 * multiply-add by d_w·d_x per 4 rows. Per block and 16 rows: 64 dot products and 60 adds, 16
 * shuffles, 4 widenings. A block goes in quarters (4 weight pairs), each row group's sum in turn:
 * written out whole, with every pair's dot for the 4 row groups side by side, V8's TurboFan ran
 * each row group's 16 dots in one chain, so it held all 16 broadcasts and read all 64 x vectors
 * ahead, spilling them to the stack (`perf annotate`: a 1 KB frame, a reload for most dots);
 * a quarter needs 4 broadcasts, 4 sums and 4 accumulators in registers. A loop, not written out
 * four times: written out, TurboFan merged the quarters again (docs/benchmarks.md §5a).
 */
function qTile16<Q, N>(
  out: usize, xt: usize, xs: usize, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32, nrows: i32,
): void {
  const nb = <usize>(inDim >> 5);
  const bs: usize = isSigned<Q>() ? 34 : 18;
  const wsb = nb * bs;
  const os = (<usize>outDim) << 2;
  for (let j = c0; j < c1; j++) {
    const w0 = w + <usize>j * wsb;
    let f0 = f32x4.splat(0), f1 = f32x4.splat(0), f2 = f32x4.splat(0), f3 = f32x4.splat(0);
    let p = xt;
    let sp = xs;
    for (let b: usize = 0; b < nb; b++) {
      const bp = w0 + b * bs;
      let i0 = i32x4.splat(0), i1 = i32x4.splat(0), i2 = i32x4.splat(0), i3 = i32x4.splat(0);
      if (sizeof<N>() >= 4) {
        // 16 rows: the block in quarters, each row group's sum in turn (see above).
        for (let q = 0; q < 4; q++) {
          const n = qHalf<Q>(bp, q >> 1);
          const e = (q & 1) == 0 ? i16x8.extend_low_i8x16_s(n) : i16x8.extend_high_i8x16_s(n);
          const s0 = v128.shuffle<i32>(e, e, 0, 0, 0, 0);
          const s1 = v128.shuffle<i32>(e, e, 1, 1, 1, 1);
          const s2 = v128.shuffle<i32>(e, e, 2, 2, 2, 2);
          const s3 = v128.shuffle<i32>(e, e, 3, 3, 3, 3);
          const pq = p + ((<usize>q) << 8);
          i0 = i32x4.add(i0, qDot4(pq, s0, s1, s2, s3));
          i1 = i32x4.add(i1, qDot4(pq + 16, s0, s1, s2, s3));
          i2 = i32x4.add(i2, qDot4(pq + 32, s0, s1, s2, s3));
          i3 = i32x4.add(i3, qDot4(pq + 48, s0, s1, s2, s3));
        }
      } else {
        // 4 or 8 rows: written out (in quarters they were 0.85× as fast on Node 24 at 8 rows).
        let n: v128, e: v128, s: v128;
        n = qHalf<Q>(bp, 0);
        e = i16x8.extend_low_i8x16_s(n);
        s = v128.shuffle<i32>(e, e, 0, 0, 0, 0);
        i0 = i32x4.dot_i16x8_s(v128.load(p, 0), s);
        if (sizeof<N>() >= 2) i1 = i32x4.dot_i16x8_s(v128.load(p, 16), s);
        s = v128.shuffle<i32>(e, e, 1, 1, 1, 1);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 64), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 80), s));
        s = v128.shuffle<i32>(e, e, 2, 2, 2, 2);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 128), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 144), s));
        s = v128.shuffle<i32>(e, e, 3, 3, 3, 3);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 192), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 208), s));
        e = i16x8.extend_high_i8x16_s(n);
        s = v128.shuffle<i32>(e, e, 0, 0, 0, 0);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 256), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 272), s));
        s = v128.shuffle<i32>(e, e, 1, 1, 1, 1);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 320), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 336), s));
        s = v128.shuffle<i32>(e, e, 2, 2, 2, 2);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 384), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 400), s));
        s = v128.shuffle<i32>(e, e, 3, 3, 3, 3);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 448), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 464), s));
        n = qHalf<Q>(bp, 1);
        e = i16x8.extend_low_i8x16_s(n);
        s = v128.shuffle<i32>(e, e, 0, 0, 0, 0);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 512), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 528), s));
        s = v128.shuffle<i32>(e, e, 1, 1, 1, 1);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 576), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 592), s));
        s = v128.shuffle<i32>(e, e, 2, 2, 2, 2);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 640), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 656), s));
        s = v128.shuffle<i32>(e, e, 3, 3, 3, 3);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 704), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 720), s));
        e = i16x8.extend_high_i8x16_s(n);
        s = v128.shuffle<i32>(e, e, 0, 0, 0, 0);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 768), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 784), s));
        s = v128.shuffle<i32>(e, e, 1, 1, 1, 1);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 832), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 848), s));
        s = v128.shuffle<i32>(e, e, 2, 2, 2, 2);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 896), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 912), s));
        s = v128.shuffle<i32>(e, e, 3, 3, 3, 3);
        i0 = i32x4.add(i0, i32x4.dot_i16x8_s(v128.load(p, 960), s));
        if (sizeof<N>() >= 2) i1 = i32x4.add(i1, i32x4.dot_i16x8_s(v128.load(p, 976), s));
      }
      const dw = f32x4.splat(f16ToF32(<u32>load<u16>(bp)));
      f0 = fma(f0, f32x4.convert_i32x4_s(i0), f32x4.mul(dw, v128.load(sp)));
      if (sizeof<N>() >= 2) f1 = fma(f1, f32x4.convert_i32x4_s(i1), f32x4.mul(dw, v128.load(sp, 16)));
      if (sizeof<N>() >= 4) f2 = fma(f2, f32x4.convert_i32x4_s(i2), f32x4.mul(dw, v128.load(sp, 32)));
      if (sizeof<N>() >= 4) f3 = fma(f3, f32x4.convert_i32x4_s(i3), f32x4.mul(dw, v128.load(sp, 48)));
      p += 1024;
      sp += 64;
    }
    const o = out + ((<usize>j) << 2);
    qStoreRows(o, os, f0, nrows);
    if (sizeof<N>() >= 2) qStoreRows(o + 4 * os, os, f1, nrows - 4);
    if (sizeof<N>() >= 4) qStoreRows(o + 8 * os, os, f2, nrows - 8);
    if (sizeof<N>() >= 4) qStoreRows(o + 12 * os, os, f3, nrows - 12);
  }
}

/** Four weight pairs' dot products with one row group's pairs at p, p + 64, p + 128, p + 192, summed. */
@inline
function qDot4(p: usize, s0: v128, s1: v128, s2: v128, s3: v128): v128 {
  const a = i32x4.add(i32x4.dot_i16x8_s(v128.load(p), s0), i32x4.dot_i16x8_s(v128.load(p, 64), s1));
  const b = i32x4.add(i32x4.dot_i16x8_s(v128.load(p, 128), s2), i32x4.dot_i16x8_s(v128.load(p, 192), s3));
  return i32x4.add(a, b);
}

/** The first `live` (up to 4) lanes of v at o, o + os, o + 2·os, o + 3·os. */
@inline
function qStoreRows(o: usize, os: usize, v: v128, live: i32): void {
  if (live > 0) store<f32>(o, f32x4.extract_lane(v, 0));
  if (live > 1) store<f32>(o + os, f32x4.extract_lane(v, 1));
  if (live > 2) store<f32>(o + 2 * os, f32x4.extract_lane(v, 2));
  if (live > 3) store<f32>(o + 3 * os, f32x4.extract_lane(v, 3));
}

/**
 * acc + the int8 dot products of a and b (b in [0, 127]) in i32 lanes, four products a lane:
 * `i32x4.relaxed_dot_i8x16_i7x16_add_s`, one vpdpbusd on a CPU with AVX-VNNI where V8 12+ (Node
 * 22, 24) compiles it so. Node 20's V8 returns a wrong sum (twice the products, no acc), so the
 * loader runs `qTileDot16` only where `dotAddExact` says the engine gets it right. The plain build
 * (never chosen: `dotAddExact` is 0 there) computes it with `idot`.
 */
@inline
function dotAdd(a: v128, b: v128, acc: v128): v128 {
  if (ASC_FEATURE_RELAXED_SIMD) return i32x4.relaxed_dot_i8x16_i7x16_add_s(a, b, acc);
  return idot(acc, a, b);
}

/** 1 where this engine's `i32x4.relaxed_dot_i8x16_i7x16_add_s` is the exact dot product plus acc (p: 48 scratch bytes). */
export function dotAddExact(p: usize): i32 {
  if (!ASC_FEATURE_RELAXED_SIMD) return 0;
  for (let i: usize = 0; i < 16; i++) {
    store<i8>(p + i, <i8>(<i32>i * 17 - 128));
    store<u8>(p + 16 + i, <u8>((<i32>i * 29) & 127));
  }
  v128.store(p, i32x4.splat(100000), 32);
  const r = dotAdd(v128.load(p), v128.load(p, 16), v128.load(p, 32));
  for (let l = 0; l < 4; l++) {
    let want = 100000;
    for (let i = 0; i < 4; i++) want += <i32>load<i8>(p + <usize>(4 * l + i)) * <i32>load<u8>(p + 16 + <usize>(4 * l + i));
    if (laneI32(r, l) != want) return 0;
  }
  return 1;
}

@inline
function laneI32(v: v128, l: i32): i32 {
  return l == 0 ? i32x4.extract_lane(v, 0) : l == 1 ? i32x4.extract_lane(v, 1) : l == 2 ? i32x4.extract_lane(v, 2) : i32x4.extract_lane(v, 3);
}

/** |w| of half h of a weight block for `qTileDot16`: Q8_0's |q| (in [0, 127]), Q4_0's raw nibbles (0–15). */
@inline
function qAbsHalf<Q>(bp: usize, h: i32): v128 {
  if (isSigned<Q>()) return i8x16.abs(h == 0 ? v128.load(bp, 2) : v128.load(bp, 18));
  const v = v128.load(bp, 2);
  return h == 0 ? v128.and(v, i8x16.splat(0x0f)) : i8x16.shr_u(v, 4);
}

/** Q8_0's sign mask of half h (lanes all ones where q < 0); Q4_0 has none. */
@inline
function qNegHalf<Q>(bp: usize, h: i32): v128 {
  if (isSigned<Q>()) return i8x16.lt_s(h == 0 ? v128.load(bp, 2) : v128.load(bp, 18), i8x16.splat(0));
  return i8x16.splat(0);
}

/** x with Q8_0's weight signs moved onto it (`signTo`); Q4_0's x as it is. */
@inline
function qSign<Q>(x: v128, m: v128): v128 {
  if (isSigned<Q>()) return i8x16.sub(v128.xor(x, m), m);
  return x;
}

/**
 * `qTile16` on the relaxed int8 dot with accumulate (`dotAdd`), over the int8-quad layout of
 * `qTileLayout`: each quad of 4 weights, |w| broadcast to the 4 lanes, against 4 rows' quads
 * (16 multiply-adds an instruction, accumulated in it); Q8_0's signs go onto x (`qSign`, two ops),
 * Q4_0's nibbles need none: its −8 offset starts each block's integer sum at −8·Σq_x. The
 * integer sums, and so the results, equal `qTile16`'s.
 */
function qTileDot16<Q, N>(
  out: usize, xt: usize, xs: usize, xc: usize, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32, nrows: i32,
): void {
  const nb = <usize>(inDim >> 5);
  const bs: usize = isSigned<Q>() ? 34 : 18;
  const wsb = nb * bs;
  const os = (<usize>outDim) << 2;
  for (let j = c0; j < c1; j++) {
    const w0 = w + <usize>j * wsb;
    let f0 = f32x4.splat(0), f1 = f32x4.splat(0), f2 = f32x4.splat(0), f3 = f32x4.splat(0);
    let p = xt;
    let sp = xs;
    let cp = xc;
    for (let b: usize = 0; b < nb; b++) {
      const bp = w0 + b * bs;
      let i0 = isSigned<Q>() ? i32x4.splat(0) : v128.load(cp);
      let i1 = isSigned<Q>() ? i32x4.splat(0) : v128.load(cp, 16);
      let i2 = isSigned<Q>() ? i32x4.splat(0) : v128.load(cp, 32);
      let i3 = isSigned<Q>() ? i32x4.splat(0) : v128.load(cp, 48);
      let a: v128, m: v128, s: v128;
      let sm = i8x16.splat(0);
      a = qAbsHalf<Q>(bp, 0);
      m = qNegHalf<Q>(bp, 0);
      s = v128.shuffle<i32>(a, a, 0, 0, 0, 0);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 0, 0, 0, 0);
      i0 = dotAdd(qSign<Q>(v128.load(p, 0), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 16), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 32), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 48), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 1, 1, 1, 1);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 1, 1, 1, 1);
      i0 = dotAdd(qSign<Q>(v128.load(p, 64), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 80), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 96), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 112), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 2, 2, 2, 2);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 2, 2, 2, 2);
      i0 = dotAdd(qSign<Q>(v128.load(p, 128), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 144), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 160), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 176), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 3, 3, 3, 3);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 3, 3, 3, 3);
      i0 = dotAdd(qSign<Q>(v128.load(p, 192), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 208), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 224), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 240), sm), s, i3);
      a = qAbsHalf<Q>(bp, 1);
      m = qNegHalf<Q>(bp, 1);
      s = v128.shuffle<i32>(a, a, 0, 0, 0, 0);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 0, 0, 0, 0);
      i0 = dotAdd(qSign<Q>(v128.load(p, 256), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 272), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 288), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 304), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 1, 1, 1, 1);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 1, 1, 1, 1);
      i0 = dotAdd(qSign<Q>(v128.load(p, 320), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 336), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 352), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 368), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 2, 2, 2, 2);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 2, 2, 2, 2);
      i0 = dotAdd(qSign<Q>(v128.load(p, 384), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 400), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 416), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 432), sm), s, i3);
      s = v128.shuffle<i32>(a, a, 3, 3, 3, 3);
      if (isSigned<Q>()) sm = v128.shuffle<i32>(m, m, 3, 3, 3, 3);
      i0 = dotAdd(qSign<Q>(v128.load(p, 448), sm), s, i0);
      if (sizeof<N>() >= 2) i1 = dotAdd(qSign<Q>(v128.load(p, 464), sm), s, i1);
      if (sizeof<N>() >= 4) i2 = dotAdd(qSign<Q>(v128.load(p, 480), sm), s, i2);
      if (sizeof<N>() >= 4) i3 = dotAdd(qSign<Q>(v128.load(p, 496), sm), s, i3);
      const dw = f32x4.splat(f16ToF32(<u32>load<u16>(bp)));
      f0 = fma(f0, f32x4.convert_i32x4_s(i0), f32x4.mul(dw, v128.load(sp)));
      if (sizeof<N>() >= 2) f1 = fma(f1, f32x4.convert_i32x4_s(i1), f32x4.mul(dw, v128.load(sp, 16)));
      if (sizeof<N>() >= 4) f2 = fma(f2, f32x4.convert_i32x4_s(i2), f32x4.mul(dw, v128.load(sp, 32)));
      if (sizeof<N>() >= 4) f3 = fma(f3, f32x4.convert_i32x4_s(i3), f32x4.mul(dw, v128.load(sp, 48)));
      p += 512;
      sp += 64;
      cp += 64;
    }
    const o = out + ((<usize>j) << 2);
    qStoreRows(o, os, f0, nrows);
    if (sizeof<N>() >= 2) qStoreRows(o + 4 * os, os, f1, nrows - 4);
    if (sizeof<N>() >= 4) qStoreRows(o + 8 * os, os, f2, nrows - 8);
    if (sizeof<N>() >= 4) qStoreRows(o + 12 * os, os, f3, nrows - 12);
  }
}

/** `qTile4` for one row: the batch-1 matvec, one weight stream, two independent accumulators. */
function qRow<Q>(out: usize, xq: usize, xd: usize, xc: usize, w: usize, inDim: i32, c0: i32, c1: i32): void {
  const nb = <usize>(inDim >> 5);
  const bs: usize = isSigned<Q>() ? 34 : 18;
  const wsb = nb * bs;
  const nib = i8x16.splat(0x0f);
  const zero = i8x16.splat(0);
  for (let j = c0; j < c1; j++) {
    const w0 = w + <usize>j * wsb;
    let f0 = f32x4.splat(0);
    let e0: f32 = 0;
    for (let b: usize = 0; b < nb; b++) {
      const bp = w0 + b * bs;
      const xb = xq + (b << 5);
      let a: v128;
      if (isSigned<Q>()) {
        const ra = v128.load(bp, 2);
        const rb = v128.load(bp, 18);
        a = idot(i32x4.splat(0), signTo(v128.load(xb), i8x16.lt_s(ra, zero)), dotW(ra));
        a = idot(a, signTo(v128.load(xb, 16), i8x16.lt_s(rb, zero)), dotW(rb));
      } else {
        const v = v128.load(bp, 2);
        a = idot(i32x4.splat(0), v128.load(xb), v128.and(v, nib));
        a = idot(a, v128.load(xb, 16), i8x16.shr_u(v, 4));
      }
      const dw = f16ToF32(<u32>load<u16>(bp));
      f0 = fma(f0, f32x4.convert_i32x4_s(a), f32x4.splat(dw * load<f32>(xd + (b << 2))));
      if (!isSigned<Q>()) e0 += dw * load<f32>(xc + (b << 2));
    }
    store<f32>(out + ((<usize>j) << 2), hsum(f0) - e0);
  }
}

/**
 * `matmulCols` for quantised weights: rows [r0, r0 + rn) of the `rows` activation rows quantised
 * by `quantizeRowsQ8` at xq (r0 a multiple of 16). One row streams the weights (`qRow`); more read
 * the chunk of weight rows into L2 first and run `qTile16` over 16 rows at a time (a last group of
 * up to 4 or 8 rows computes 4 or 8; a single row left over runs `qRow`, from L2).
 */
function matmulColsQ<Q>(
  out: usize, xq: usize, rows: i32, r0: i32, rn: i32, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32, quads: bool,
): void {
  const nb = <usize>(inDim >> 5);
  const xd = qScalesAt(xq, rows, inDim);
  const xc = xd + ((<usize>rows * nb) << 2);
  const os = (<usize>outDim) << 2;
  if (rn > 1) {
    const wsb = nb * (isSigned<Q>() ? 34 : 18);
    touch(w + <usize>c0 * wsb, w + <usize>c1 * wsb);
  }
  const t = qTileAt(xq, rows, inDim);
  const groups = <usize>((rows + 15) >> 4);
  const sAt = t + groups * ((<usize>inDim) << 5);
  const cAt = sAt + groups * (nb << 6);
  for (let r = r0; r < r0 + rn; r += 16) {
    const n = min(16, r0 + rn - r);
    const ru = <usize>r;
    const o = out + <usize>(r - r0) * os;
    if (n == 1) {
      qRow<Q>(o, xq + ru * <usize>inDim, xd + ((ru * nb) << 2), xc + ((ru * nb) << 2), w, inDim, c0, c1);
      continue;
    }
    const xt = t + (ru >> 4) * ((<usize>inDim) << 5);
    const xs = sAt + (ru >> 4) * (nb << 6);
    if (quads) {
      const xc = cAt + (ru >> 4) * (nb << 6);
      if (n <= 4) qTileDot16<Q, u8>(o, xt, xs, xc, w, inDim, outDim, c0, c1, n);
      else if (n <= 8) qTileDot16<Q, u16>(o, xt, xs, xc, w, inDim, outDim, c0, c1, n);
      else qTileDot16<Q, u32>(o, xt, xs, xc, w, inDim, outDim, c0, c1, n);
      continue;
    }
    if (n <= 4) qTile16<Q, u8>(o, xt, xs, w, inDim, outDim, c0, c1, n);
    else if (n <= 8) qTile16<Q, u16>(o, xt, xs, w, inDim, outDim, c0, c1, n);
    else qTile16<Q, u32>(o, xt, xs, w, inDim, outDim, c0, c1, n);
  }
}

/**
 * The next of n work items for thread `first` (0 or 1), or -1 when none is left. The items are cut
 * in two halves with a counter each, at `counter` and `counter` + 64 (a cache line apart): a thread
 * takes its own half from the front, then helps with the other's. One shared counter made every
 * claim move a cache line between the cores, which costs most when the two vCPUs sit on different
 * L3s.
 */
function claim(counter: usize, n: i32, first: i32): i32 {
  const mid = n >> 1;
  for (let h = 0; h < 2; h++) {
    const half = first ^ h;
    const c = atomic.add<i32>(counter + (<usize>half << 6), 1) + (half == 0 ? 0 : mid);
    if (c < (half == 0 ? mid : n)) return c;
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// k-quants: llama.cpp's Q4_K, Q5_K and Q6_K (256-weight blocks, src/kernels/k-quants.ts has the
// layouts) against the activations `quantizeRowsQ8` quantised in 32-value blocks, as for Q4_0

/** Q4_K/Q5_K's 6-bit scale (m = 0) or min (m = 4) of sub-block s, from the 12 scale bytes at p. */
@inline
function kScale(p: usize, s: i32, m: i32): f32 {
  if (s < 4) return <f32>(<i32>load<u8>(p + <usize>(s + m)) & 63);
  const lo = <i32>load<u8>(p + <usize>(s + 4));
  const hi = <i32>load<u8>(p + <usize>(s - 4 + m)) >> 6;
  return <f32>((m == 0 ? lo & 15 : lo >> 4) | (hi << 4));
}

/** Q5_K's fifth bits for sub-block s: bit s of each of the 16 qh bytes in h, as 16 (or 0). */
@inline
function kHigh(h: v128, s: i32): v128 {
  return i8x16.shl(v128.and(i8x16.shr_u(h, <u32>s), i8x16.splat(1)), 4);
}

/**
 * out[i][j] (rows i < nrows, output stride os) for columns j in [c0, c1) of Q4_K (B: u8) or Q5_K
 * (B: u16) weights at w, against rows of quantised activations: quants at xq (a row every inDim
 * bytes), 32-block scales d_x at xd and d_x·8·Σq at xc (a row every inDim/32 floats). N: u8 for one
 * row, u32 for four (rows past nrows repeat the last and are not stored). Each 32-weight sub-block
 * is one activation block: its integer dot (nibbles, with Q5_K's fifth bit, are in [0, 31], so
 * `idot`'s relaxed form is exact) times d·sc·d_x, less dmin·m·d_x·Σq for its min. The weight
 * vectors are decoded once per sub-block for all the rows.
 */
function kq45Cols<B, N>(
  out: usize, os: usize, xq: usize, xd: usize, xc: usize, w: usize, inDim: i32, c0: i32, c1: i32, nrows: i32,
): void {
  const five = sizeof<B>() == 2;
  const bs: usize = five ? 176 : 144;
  const nbk = <usize>(inDim >> 8);
  const xs = <usize>inDim;
  const ds = (<usize>(inDim >> 5)) << 2;
  const r1: usize = sizeof<N>() == 4 ? <usize>min(1, nrows - 1) : 0;
  const r2: usize = sizeof<N>() == 4 ? <usize>min(2, nrows - 1) : 0;
  const r3: usize = sizeof<N>() == 4 ? <usize>min(3, nrows - 1) : 0;
  const nib = i8x16.splat(0x0f);
  const zero = i32x4.splat(0);
  for (let j = c0; j < c1; j++) {
    let a0 = f32x4.splat(0), a1 = f32x4.splat(0), a2 = f32x4.splat(0), a3 = f32x4.splat(0);
    let e0: f32 = 0, e1: f32 = 0, e2: f32 = 0, e3: f32 = 0;
    const wj = w + <usize>j * nbk * bs;
    for (let b: usize = 0; b < nbk; b++) {
      const bp = wj + b * bs;
      const d = f16ToF32(<u32>load<u16>(bp));
      const dmin = f16ToF32(<u32>load<u16>(bp, 2)) * 0.125;
      const qs = bp + (five ? 48 : 16);
      for (let g = 0; g < 4; g++) {
        const v0 = v128.load(qs + <usize>(g << 5));
        const v1 = v128.load(qs + <usize>(g << 5), 16);
        let lo0 = v128.and(v0, nib), lo1 = v128.and(v1, nib);
        let hi0 = i8x16.shr_u(v0, 4), hi1 = i8x16.shr_u(v1, 4);
        if (five) {
          const h0 = v128.load(bp, 16);
          const h1 = v128.load(bp, 32);
          lo0 = v128.or(lo0, kHigh(h0, 2 * g));
          lo1 = v128.or(lo1, kHigh(h1, 2 * g));
          hi0 = v128.or(hi0, kHigh(h0, 2 * g + 1));
          hi1 = v128.or(hi1, kHigh(h1, 2 * g + 1));
        }
        const ds1 = d * kScale(bp + 4, 2 * g, 0);
        const ds2 = d * kScale(bp + 4, 2 * g + 1, 0);
        const dm1 = dmin * kScale(bp + 4, 2 * g, 4);
        const dm2 = dmin * kScale(bp + 4, 2 * g + 1, 4);
        const kb = (b << 3) + <usize>(2 * g); // the first activation block of the pair
        const xo = kb << 5;
        const so = kb << 2;
        // Row 0, then (N = u32) rows 1–3: the same code on each row's pointers.
        let x = xq + xo;
        let s = xd + so;
        let c = xc + so;
        let p = idot(idot(zero, v128.load(x), lo0), v128.load(x, 16), lo1);
        let q = idot(idot(zero, v128.load(x, 32), hi0), v128.load(x, 48), hi1);
        a0 = fma(a0, f32x4.convert_i32x4_s(p), f32x4.splat(ds1 * load<f32>(s)));
        a0 = fma(a0, f32x4.convert_i32x4_s(q), f32x4.splat(ds2 * load<f32>(s, 4)));
        e0 += dm1 * load<f32>(c) + dm2 * load<f32>(c, 4);
        if (sizeof<N>() == 4) {
          x = xq + r1 * xs + xo;
          s = xd + r1 * ds + so;
          c = xc + r1 * ds + so;
          p = idot(idot(zero, v128.load(x), lo0), v128.load(x, 16), lo1);
          q = idot(idot(zero, v128.load(x, 32), hi0), v128.load(x, 48), hi1);
          a1 = fma(a1, f32x4.convert_i32x4_s(p), f32x4.splat(ds1 * load<f32>(s)));
          a1 = fma(a1, f32x4.convert_i32x4_s(q), f32x4.splat(ds2 * load<f32>(s, 4)));
          e1 += dm1 * load<f32>(c) + dm2 * load<f32>(c, 4);
          x = xq + r2 * xs + xo;
          s = xd + r2 * ds + so;
          c = xc + r2 * ds + so;
          p = idot(idot(zero, v128.load(x), lo0), v128.load(x, 16), lo1);
          q = idot(idot(zero, v128.load(x, 32), hi0), v128.load(x, 48), hi1);
          a2 = fma(a2, f32x4.convert_i32x4_s(p), f32x4.splat(ds1 * load<f32>(s)));
          a2 = fma(a2, f32x4.convert_i32x4_s(q), f32x4.splat(ds2 * load<f32>(s, 4)));
          e2 += dm1 * load<f32>(c) + dm2 * load<f32>(c, 4);
          x = xq + r3 * xs + xo;
          s = xd + r3 * ds + so;
          c = xc + r3 * ds + so;
          p = idot(idot(zero, v128.load(x), lo0), v128.load(x, 16), lo1);
          q = idot(idot(zero, v128.load(x, 32), hi0), v128.load(x, 48), hi1);
          a3 = fma(a3, f32x4.convert_i32x4_s(p), f32x4.splat(ds1 * load<f32>(s)));
          a3 = fma(a3, f32x4.convert_i32x4_s(q), f32x4.splat(ds2 * load<f32>(s, 4)));
          e3 += dm1 * load<f32>(c) + dm2 * load<f32>(c, 4);
        }
      }
    }
    kStore<N>(out + ((<usize>j) << 2), os, nrows, hsum(a0) - e0, hsum(a1) - e1, hsum(a2) - e2, hsum(a3) - e3);
  }
}

/** Stores the column's sums of the first nrows rows (one for N: u8). */
@inline
function kStore<N>(o: usize, os: usize, nrows: i32, s0: f32, s1: f32, s2: f32, s3: f32): void {
  store<f32>(o, s0);
  if (sizeof<N>() == 1) return;
  if (nrows > 1) store<f32>(o + os, s1);
  if (nrows > 2) store<f32>(o + 2 * os, s2);
  if (nrows > 3) store<f32>(o + 3 * os, s3);
}

/**
 * `kq45Cols` for Q6_K weights: per 128-weight half, each quarter (32 weights: one activation
 * block) takes 4 low bits from ql and 2 high bits from qh, minus 32, so weights are in [−32, 31];
 * its two 16-weight sub-blocks' integer dots are scaled by their int8 scales and added as integers,
 * then times d·d_x. In the relaxed build the weights' signs move onto the activations (`signTo`, as
 * for Q8_0), so `idot`'s second operand |q − 32| is in [0, 32].
 */
function kq6Cols<N>(
  out: usize, os: usize, xq: usize, xd: usize, w: usize, inDim: i32, c0: i32, c1: i32, nrows: i32,
): void {
  const nbk = <usize>(inDim >> 8);
  const xs = <usize>inDim;
  const ds = (<usize>(inDim >> 5)) << 2;
  const r1: usize = sizeof<N>() == 4 ? <usize>min(1, nrows - 1) : 0;
  const r2: usize = sizeof<N>() == 4 ? <usize>min(2, nrows - 1) : 0;
  const r3: usize = sizeof<N>() == 4 ? <usize>min(3, nrows - 1) : 0;
  const nib = i8x16.splat(0x0f);
  const three = i8x16.splat(3);
  const off = i8x16.splat(32);
  const zero = i32x4.splat(0);
  for (let j = c0; j < c1; j++) {
    let a0 = f32x4.splat(0), a1 = f32x4.splat(0), a2 = f32x4.splat(0), a3 = f32x4.splat(0);
    const wj = w + <usize>j * nbk * 210;
    for (let b: usize = 0; b < nbk; b++) {
      const bp = wj + b * 210;
      const d = f16ToF32(<u32>load<u16>(bp, 208));
      for (let n = 0; n < 2; n++) {
        const ql = bp + <usize>(n << 6);
        const qh = bp + 128 + <usize>(n << 5);
        const sc = bp + 192 + <usize>(n << 3);
        const h0 = v128.load(qh);
        const h1 = v128.load(qh, 16);
        for (let k = 0; k < 4; k++) {
          const l0 = v128.load(ql + <usize>((k & 1) << 5));
          const l1 = v128.load(ql + <usize>((k & 1) << 5), 16);
          const w0 = i8x16.sub(
            v128.or(k < 2 ? v128.and(l0, nib) : i8x16.shr_u(l0, 4), i8x16.shl(v128.and(i8x16.shr_u(h0, <u32>(2 * k)), three), 4)),
            off,
          );
          const w1 = i8x16.sub(
            v128.or(k < 2 ? v128.and(l1, nib) : i8x16.shr_u(l1, 4), i8x16.shl(v128.and(i8x16.shr_u(h1, <u32>(2 * k)), three), 4)),
            off,
          );
          const n0 = i8x16.lt_s(w0, i8x16.splat(0));
          const n1 = i8x16.lt_s(w1, i8x16.splat(0));
          const u0 = dotW(w0);
          const u1 = dotW(w1);
          const s0 = i32x4.splat(<i32>load<i8>(sc + <usize>(2 * k)));
          const s1 = i32x4.splat(<i32>load<i8>(sc + <usize>(2 * k + 1)));
          const kb = (b << 3) + <usize>((n << 2) + k);
          const xo = kb << 5;
          const so = kb << 2;
          let x = xq + xo;
          let dot = i32x4.add(
            i32x4.mul(idot(zero, signTo(v128.load(x), n0), u0), s0),
            i32x4.mul(idot(zero, signTo(v128.load(x, 16), n1), u1), s1),
          );
          a0 = fma(a0, f32x4.convert_i32x4_s(dot), f32x4.splat(d * load<f32>(xd + so)));
          if (sizeof<N>() == 4) {
            x = xq + r1 * xs + xo;
            dot = i32x4.add(
              i32x4.mul(idot(zero, signTo(v128.load(x), n0), u0), s0),
              i32x4.mul(idot(zero, signTo(v128.load(x, 16), n1), u1), s1),
            );
            a1 = fma(a1, f32x4.convert_i32x4_s(dot), f32x4.splat(d * load<f32>(xd + r1 * ds + so)));
            x = xq + r2 * xs + xo;
            dot = i32x4.add(
              i32x4.mul(idot(zero, signTo(v128.load(x), n0), u0), s0),
              i32x4.mul(idot(zero, signTo(v128.load(x, 16), n1), u1), s1),
            );
            a2 = fma(a2, f32x4.convert_i32x4_s(dot), f32x4.splat(d * load<f32>(xd + r2 * ds + so)));
            x = xq + r3 * xs + xo;
            dot = i32x4.add(
              i32x4.mul(idot(zero, signTo(v128.load(x), n0), u0), s0),
              i32x4.mul(idot(zero, signTo(v128.load(x, 16), n1), u1), s1),
            );
            a3 = fma(a3, f32x4.convert_i32x4_s(dot), f32x4.splat(d * load<f32>(xd + r3 * ds + so)));
          }
        }
      }
    }
    kStore<N>(out + ((<usize>j) << 2), os, nrows, hsum(a0), hsum(a1), hsum(a2), hsum(a3));
  }
}

/**
 * `matmulColsQ` for the k-quants (dtype DT_Q4_K, DT_Q5_K or DT_Q6_K): rows [r0, r0 + rn) of the
 * `rows` activation rows `quantizeRowsQ8` quantised at xq, four at a time (each weight sub-block
 * decoded once for the four; a single row streams the weights), columns [c0, c1). Batches first
 * read the chunk of weight rows into L2, as `matmulColsQ`.
 */
function matmulColsK(
  out: usize, xq: usize, rows: i32, r0: i32, rn: i32, w: usize, inDim: i32, outDim: i32, c0: i32, c1: i32, dtype: i32,
): void {
  const nb = <usize>(inDim >> 5);
  const xd = qScalesAt(xq, rows, inDim);
  const xc = xd + ((<usize>rows * nb) << 2);
  const os = (<usize>outDim) << 2;
  if (rn > 1) {
    const wsb = <usize>(inDim >> 8) * (dtype == DT_Q4_K ? 144 : dtype == DT_Q5_K ? 176 : 210);
    touch(w + <usize>c0 * wsb, w + <usize>c1 * wsb);
  }
  for (let r = r0; r < r0 + rn; r += 4) {
    const n = min(4, r0 + rn - r);
    const ru = <usize>r;
    const o = out + <usize>(r - r0) * os;
    const q = xq + ru * <usize>inDim;
    const s = xd + ((ru * nb) << 2);
    const c = xc + ((ru * nb) << 2);
    if (dtype == DT_Q6_K) {
      if (n == 1) kq6Cols<u8>(o, os, q, s, w, inDim, c0, c1, n);
      else kq6Cols<u32>(o, os, q, s, w, inDim, c0, c1, n);
    } else if (dtype == DT_Q5_K) {
      if (n == 1) kq45Cols<u16, u8>(o, os, q, s, c, w, inDim, c0, c1, n);
      else kq45Cols<u16, u32>(o, os, q, s, c, w, inDim, c0, c1, n);
    } else {
      if (n == 1) kq45Cols<u8, u8>(o, os, q, s, c, w, inDim, c0, c1, n);
      else kq45Cols<u8, u32>(o, os, q, s, c, w, inDim, c0, c1, n);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// element-wise kernels

/** out[i] = a[i] + b[i] for i < n. */
export function add(out: usize, a: usize, b: usize, n: i32): void {
  const nb = (<usize>n) << 2;
  const nv = (<usize>(n & ~3)) << 2;
  let i: usize = 0;
  for (; i < nv; i += 16) v128.store(out + i, f32x4.add(v128.load(a + i), v128.load(b + i)));
  for (; i < nb; i += 4) store<f32>(out + i, load<f32>(a + i) + load<f32>(b + i));
}

/** out[r][j] += bias[j] for r < rows, j < n. */
export function addBias(out: usize, bias: usize, rows: i32, n: i32): void {
  const rb = (<usize>n) << 2;
  for (let r = 0; r < rows; r++) add(out + <usize>r * rb, out + <usize>r * rb, bias, n);
}

/** RMSNorm of `rows` rows of n floats: out = x / sqrt(mean(x²) + eps) · weight (out may alias x). */
export function rmsnorm(out: usize, x: usize, weight: usize, n: i32, eps: f64, rows: i32): void {
  const rb = (<usize>n) << 2;
  const nv = (<usize>(n & ~7)) << 2;
  for (let r = 0; r < rows; r++) {
    const xr = x + <usize>r * rb;
    const or = out + <usize>r * rb;
    let a = f32x4.splat(0);
    let b = f32x4.splat(0);
    let i: usize = 0;
    for (; i < nv; i += 32) {
      const v = v128.load(xr + i);
      const u = v128.load(xr + i, 16);
      a = fma(a, v, v);
      b = fma(b, u, u);
    }
    let s = <f64>hsum(f32x4.add(a, b));
    for (; i < rb; i += 4) {
      const v = <f64>load<f32>(xr + i);
      s += v * v;
    }
    const scale = <f32>(1.0 / Math.sqrt(s / <f64>n + eps));
    const sv = f32x4.splat(scale);
    const n4 = (<usize>(n & ~3)) << 2;
    i = 0;
    for (; i < n4; i += 16) v128.store(or + i, f32x4.mul(f32x4.mul(v128.load(xr + i), sv), v128.load(weight + i)));
    for (; i < rb; i += 4) store<f32>(or + i, load<f32>(xr + i) * scale * load<f32>(weight + i));
  }
}

/**
 * Rotary embedding in place on x[rows][numHeads][headDim] (rotate_half), row r at position
 * positions[r] (i32), with f64 tables cos/sin[position][headDim/2].
 */
export function rope(x: usize, positions: usize, cos: usize, sin: usize, rows: i32, numHeads: i32, headDim: i32): void {
  const half = headDim >> 1;
  const hb = (<usize>half) << 2;
  for (let r = 0; r < rows; r++) {
    const t = (<usize>load<i32>(positions + ((<usize>r) << 2)) * <usize>half) << 3;
    for (let h = 0; h < numHeads; h++) {
      const base = x + ((<usize>(r * numHeads + h) * <usize>headDim) << 2);
      for (let i = 0; i < half; i++) {
        const c = load<f64>(cos + t + ((<usize>i) << 3));
        const s = load<f64>(sin + t + ((<usize>i) << 3));
        const p = base + ((<usize>i) << 2);
        const a = <f64>load<f32>(p);
        const b = <f64>load<f32>(p + hb);
        store<f32>(p, <f32>(a * c - b * s));
        store<f32>(p + hb, <f32>(b * c + a * s));
      }
    }
  }
}

/** out[i] = silu(gate[i]) · up[i], silu(g) = g / (1 + e^(−g)); out may alias either input. */
export function swiglu(out: usize, gate: usize, up: usize, n: i32): void {
  const nb = (<usize>n) << 2;
  const nv = (<usize>(n & ~3)) << 2;
  const one = f32x4.splat(1.0);
  let i: usize = 0;
  for (; i < nv; i += 16) {
    const g = v128.load(gate + i);
    const e = expv(f32x4.neg(g));
    v128.store(out + i, f32x4.mul(f32x4.div(g, f32x4.add(one, e)), v128.load(up + i)));
  }
  for (; i < nb; i += 4) {
    const g = load<f32>(gate + i);
    store<f32>(out + i, (g / (1.0 + exps(-g))) * load<f32>(up + i));
  }
}

/** swiglu over chunks of `chunk` floats claimed from the counter (see matmulPar). */
export function swigluPar(out: usize, gate: usize, up: usize, n: i32, counter: usize, chunk: i32): void {
  const nc = (n + chunk - 1) / chunk;
  for (;;) {
    const c = atomic.add<i32>(counter, 1);
    if (c >= nc) return;
    const s = c * chunk;
    const o = (<usize>s) << 2;
    swiglu(out + o, gate + o, up + o, min(chunk, n - s));
  }
}

// ---------------------------------------------------------------------------------------------
// attention
//
// The KV pool's element type is the type parameter K of the kernels below (src/kvcache/kv-layout.ts):
// f32 for an f32 pool, u16 for IEEE f16 and i16 for bf16 (both 2-byte raw bits; the signedness only
// picks the widening). `kvLoad4<K>` reads four K or V elements and widens them to f32x4, so the
// attention loops are one source for the three dtypes and each build is branch-free inside.
// `kvAt<K>(f32Bytes)` turns an offset counted in f32 bytes into the pool's bytes.
//
// An f16 widens to its value times 2^-112 (`kvScale`): placing its bits in an f32 leaves the
// exponent's bias 15 where an f32's is 127. Instead of a multiply per four elements, the attention
// scales the other operands once: the query rows it reads by 2^64 (copied to the scratch; 2^112
// would overflow a query component of 2^16) and each score by 2^48 more, and the softmax weights
// it stores by 2^112. Powers of two scale exactly, so the sums are those of the exact values.

/** 2^112 for f16 (see above), else 1. */
@inline
function kvScale<K>(): f32 {
  return sizeof<K>() == 2 && !isSigned<K>() ? reinterpret<f32>(0x77800000) : 1;
}

/** Bytes of the pool at an offset given in f32 bytes (four per element). */
@inline
function kvAt<K>(f32Bytes: usize): usize {
  return sizeof<K>() == 4 ? f32Bytes : f32Bytes >> 1;
}

/**
 * Four KV elements at a, widened to f32 (f16: times 2^-112, see above). bf16: the bits shifted up
 * 16. f16, table-free in two integer operations: sign-extend each half to 32 bits and shift left
 * 13, which puts its exponent and mantissa in an f32's low exponent bits and mantissa and its sign
 * in bit 31; the mask clears the three copies of the sign above the exponent. Exact for every
 * finite half, subnormals included (an f16 NaN or infinity would come out finite, and the KV write
 * never stores an infinity: it saturates).
 */
@inline
function kvLoad4<K>(a: usize): v128 {
  if (sizeof<K>() == 4) return v128.load(a);
  if (isSigned<K>()) return i32x4.shl(v128.load16x4_u(a), 16);
  return v128.and(i32x4.shl(v128.load16x4_s(a), 13), i32x4.splat(0x8fffe000));
}

/** One KV element at a, widened to f32 (scalar `kvLoad4`). */
@inline
function kvLoad1<K>(a: usize): f32 {
  if (sizeof<K>() == 4) return load<f32>(a);
  if (isSigned<K>()) return reinterpret<f32>((<u32>load<u16>(a)) << 16);
  return reinterpret<f32>(((<u32>(<i32>load<i16>(a))) << 13) & 0x8fffe000);
}

@inline
function dot<K>(a: usize, b: usize, headDim: i32): f32 {
  const nb = (<usize>headDim) << 2;
  const n8 = (<usize>(headDim & ~7)) << 2;
  const n4 = (<usize>(headDim & ~3)) << 2;
  let s0 = f32x4.splat(0);
  let s1 = f32x4.splat(0);
  let d: usize = 0;
  for (; d < n8; d += 32) {
    s0 = fma(s0, v128.load(a + d), kvLoad4<K>(b + kvAt<K>(d)));
    s1 = fma(s1, v128.load(a + d, 16), kvLoad4<K>(b + kvAt<K>(d + 16)));
  }
  for (; d < n4; d += 16) s0 = fma(s0, v128.load(a + d), kvLoad4<K>(b + kvAt<K>(d)));
  let s = hsum(f32x4.add(s0, s1));
  for (; d < nb; d += 4) s += load<f32>(a + d) * kvLoad1<K>(b + kvAt<K>(d));
  return s;
}

/** acc[d] += p · v[d] for d < headDim (v of element type K). */
@inline
function axpy<K>(acc: usize, p: f32, v: usize, headDim: i32): void {
  const nb = (<usize>headDim) << 2;
  const n4 = (<usize>(headDim & ~3)) << 2;
  const pv = f32x4.splat(p);
  let d: usize = 0;
  for (; d < n4; d += 16) v128.store(acc + d, fma(v128.load(acc + d), pv, kvLoad4<K>(v + kvAt<K>(d))));
  for (; d < nb; d += 4) store<f32>(acc + d, load<f32>(acc + d) + p * kvLoad1<K>(v + kvAt<K>(d)));
}

/**
 * One work item of paged causal attention: query row i (activation row rowStart+i) against KV heads
 * [g0, g1) over context positions [ta, tb), for all query heads that share each KV head, so each K
 * and V vector is read once for its whole group. The heads are interleaved page by page: within one
 * page every KV head's part of each K (then V) row is read before the next page, so the page's
 * contiguous K|V block is consumed in one sweep rather than one third of each row per pass. Writes
 * each query head's softmax-weighted V sum (normalised over this range) at o + h·oStride (h counted
 * from g0's first query head), and, when ml ≠ 0, the range's score max and exp-sum at
 * ml + h·mlStride (for attentionMerge). `scratch` holds (g1−g0)·group·(tb−ta) f32 scores, then (for
 * f16) the scaled query rows, (g1−g0)·group·headDim f32.
 */
function attendRange<K>(
  o: usize, oStride: usize, ml: usize, mlStride: usize, q: usize, pool: usize, blockTable: usize, scratch: usize,
  i: i32, g0: i32, g1: i32, ta: i32, tb: i32, rowStart: i32, layer: i32, numLayers: i32,
  numHeads: i32, numKvHeads: i32, headDim: i32, pageSize: i32,
): void {
  const group = numHeads / numKvHeads;
  const heads = (g1 - g0) * group;
  const n = tb - ta;
  const rowBytes = kvAt<K>((<usize>(numKvHeads * headDim)) << 2);
  const pageBytes = <usize>(numLayers * 2 * pageSize) * rowBytes;
  const kBase = <usize>(layer * 2 * pageSize) * rowBytes;
  const vBase = kBase + <usize>pageSize * rowBytes;
  let scale = <f32>(1.0 / Math.sqrt(<f64>headDim));
  const headBytes = (<usize>headDim) << 2;
  let qRow = q + ((<usize>((rowStart + i) * numHeads + g0 * group) * <usize>headDim) << 2);
  const nBytes = (<usize>n) << 2;
  const kvs = kvScale<K>();
  if (kvs != 1) {
    // f16: the query rows times 2^64, after the scores in the scratch; the scores times 2^48.
    const qs = scratch + <usize>heads * nBytes;
    const qBytes = <usize>heads * headBytes;
    const q64: f32 = reinterpret<f32>(0x5f800000);
    const sv = f32x4.splat(q64);
    let x: usize = 0;
    for (; x + 16 <= qBytes; x += 16) v128.store(qs + x, f32x4.mul(v128.load(qRow + x), sv));
    for (; x < qBytes; x += 4) store<f32>(qs + x, load<f32>(qRow + x) * q64);
    qRow = qs;
    scale *= reinterpret<f32>(0x57800000);
  }
  const tiled3 = (headDim & 3) == 0 ? group - group % 3 : 0;

  // Where the range's K and V rows fit in a core's L2 together (a context split of 512 tokens:
  // 384 KB at the 135M shape in f16), the V rows are read in with the K rows, page by page: one
  // sweep over each page's contiguous K|V block, rather than a second sweep over V after the
  // softmax (docs/benchmarks.md §5a).
  const vEarly = <usize>n * rowBytes * 2 <= 512 << 10;

  // Scores: page by page, every KV head of the range per page, every query head of the group per
  // K vector; query heads in register tiles of 3.
  let t = ta;
  while (t < tb) {
    const p = t / pageSize;
    const end = min(tb, (p + 1) * pageSize);
    const page = <usize>load<i32>(blockTable + ((<usize>p) << 2));
    const pageOff = (<usize>(t - p * pageSize)) * rowBytes;
    const kRows = pool + kBase + page * pageBytes + pageOff;
    touchLines(kRows, kRows + <usize>(end - t) * rowBytes);
    if (vEarly) {
      const vRows = pool + vBase + page * pageBytes + pageOff;
      touchLines(vRows, vRows + <usize>(end - t) * rowBytes);
    }
    for (let g = g0; g < g1; g++) {
      const kb = pool + kBase + kvAt<K>((<usize>(g * headDim)) << 2);
      const hg = (g - g0) * group;
      const qg = qRow + <usize>hg * headBytes;
      const sg = scratch + <usize>hg * nBytes + ((<usize>(t - ta)) << 2);
      for (let h0 = 0; h0 < tiled3; h0 += 3) {
        scoresTile3<K>(sg + <usize>h0 * nBytes, nBytes, qg + <usize>h0 * headBytes, headBytes, kb, blockTable, t, end, pageSize, pageBytes, rowBytes, scale);
      }
      let kp = kb + page * pageBytes + pageOff;
      for (let u = t; u < end; u++) {
        const so = sg + ((<usize>(u - t)) << 2);
        for (let h = tiled3; h < group; h++) {
          store<f32>(so + <usize>h * nBytes, dot<K>(qg + <usize>h * headBytes, kp, headDim) * scale);
        }
        kp += rowBytes;
      }
    }
    t = end;
  }

  // Softmax per head, normalised over the range.
  const cv = (<usize>(n & ~3)) << 2;
  for (let h = 0; h < heads; h++) {
    const sh = scratch + <usize>h * nBytes;
    let mv = f32x4.splat(-Infinity);
    let u: usize = 0;
    for (; u < cv; u += 16) mv = f32x4.pmax(mv, v128.load(sh + u));
    let m = max(max(f32x4.extract_lane(mv, 0), f32x4.extract_lane(mv, 1)), max(f32x4.extract_lane(mv, 2), f32x4.extract_lane(mv, 3)));
    for (; u < nBytes; u += 4) m = max(m, load<f32>(sh + u));
    const ms = f32x4.splat(m);
    let sv = f32x4.splat(0);
    u = 0;
    for (; u < cv; u += 16) {
      const e = expv(f32x4.sub(v128.load(sh + u), ms));
      v128.store(sh + u, e);
      sv = f32x4.add(sv, e);
    }
    let sum = hsum(sv);
    for (; u < nBytes; u += 4) {
      const e = exps(load<f32>(sh + u) - m);
      store<f32>(sh + u, e);
      sum += e;
    }
    const invs = (<f32>1.0 / sum) * kvs;
    const inv = f32x4.splat(invs);
    u = 0;
    for (; u < cv; u += 16) v128.store(sh + u, f32x4.mul(v128.load(sh + u), inv));
    for (; u < nBytes; u += 4) store<f32>(sh + u, load<f32>(sh + u) * invs);
    if (ml != 0) {
      store<f32>(ml + <usize>h * mlStride, m);
      store<f32>(ml + <usize>h * mlStride, sum, 4);
    }
    memory.fill(o + <usize>h * oStride, 0, headBytes);
  }

  // Σ p·V: page by page, every KV head of the range per page, accumulated into o; query heads in
  // register tiles of 3 × 8 dims.
  const vtiled3 = (headDim & 7) == 0 ? tiled3 : 0;
  t = ta;
  while (t < tb) {
    const p = t / pageSize;
    const end = min(tb, (p + 1) * pageSize);
    const page = <usize>load<i32>(blockTable + ((<usize>p) << 2));
    const pageOff = (<usize>(t - p * pageSize)) * rowBytes;
    if (!vEarly) {
      const vRows = pool + vBase + page * pageBytes + pageOff;
      touchLines(vRows, vRows + <usize>(end - t) * rowBytes);
    }
    for (let g = g0; g < g1; g++) {
      const vb = pool + vBase + kvAt<K>((<usize>(g * headDim)) << 2);
      const hg = (g - g0) * group;
      const sg = scratch + <usize>hg * nBytes + ((<usize>(t - ta)) << 2);
      for (let h0 = 0; h0 < vtiled3; h0 += 3) {
        valuesTile3<K>(o + <usize>(hg + h0) * oStride, oStride, headBytes, sg + <usize>h0 * nBytes, nBytes, vb, blockTable, t, end, pageSize, pageBytes, rowBytes);
      }
      let vp = vb + page * pageBytes + pageOff;
      for (let u = t; u < end; u++) {
        const so = sg + ((<usize>(u - t)) << 2);
        for (let h = vtiled3; h < group; h++) {
          axpy<K>(o + <usize>(hg + h) * oStride, load<f32>(so + <usize>h * nBytes), vp, headDim);
        }
        vp += rowBytes;
      }
    }
    t = end;
  }
}

/** [Σa, Σb, Σc, Σd] of four accumulators. */
@inline
function reduce4(a: v128, b: v128, c: v128, d: v128): v128 {
  const ab = f32x4.add(v128.shuffle<f32>(a, b, 0, 4, 1, 5), v128.shuffle<f32>(a, b, 2, 6, 3, 7));
  const cd = f32x4.add(v128.shuffle<f32>(c, d, 0, 4, 1, 5), v128.shuffle<f32>(c, d, 2, 6, 3, 7));
  return f32x4.add(v128.shuffle<f32>(ab, cd, 0, 1, 4, 5), v128.shuffle<f32>(ab, cd, 2, 3, 6, 7));
}

/**
 * Scores of 3 query heads (q at q, q+qStride, q+2·qStride) against K rows [ta, tb), 2 tokens at a
 * time (a 3×2 tile of dot products over headDim, which must be a multiple of 4); score of head h,
 * token t goes to s + h·sStride + (t−ta)·4. 6 accumulators, 2 K, the 3 query vectors V8 loads up
 * front and the f16 widening's mask fit its 15 SIMD registers; a 3×3 tile did not with an f16 pool
 * and kept an accumulator on the stack, loaded and stored on every step (×0.85 the attention's
 * time at 4,096 tokens with 3×2, docs/benchmarks.md §5a; a 3×4 tile spilled 4).
 */
function scoresTile3<K>(
  s: usize, sStride: usize, q: usize, qStride: usize, kb: usize, blockTable: usize,
  ta: i32, tb: i32, pageSize: i32, pageBytes: usize, rowBytes: usize, scale: f32,
): void {
  const hd = qStride; // headDim bytes
  const q1 = q + qStride;
  const q2 = q1 + qStride;
  const sc = f32x4.splat(scale);
  let t = ta;
  while (t < tb) {
    const p = t / pageSize;
    const end = min(tb, (p + 1) * pageSize);
    let k0 = kb + <usize>load<i32>(blockTable + ((<usize>p) << 2)) * pageBytes + <usize>(t - p * pageSize) * rowBytes;
    for (; t + 2 <= end; t += 2) {
      const k1 = k0 + rowBytes;
      let a00 = f32x4.splat(0), a01 = f32x4.splat(0);
      let a10 = f32x4.splat(0), a11 = f32x4.splat(0);
      let a20 = f32x4.splat(0), a21 = f32x4.splat(0);
      for (let d: usize = 0; d < hd; d += 16) {
        const c0 = kvLoad4<K>(k0 + kvAt<K>(d));
        const c1 = kvLoad4<K>(k1 + kvAt<K>(d));
        let v = v128.load(q + d);
        a00 = fma(a00, v, c0);
        a01 = fma(a01, v, c1);
        v = v128.load(q1 + d);
        a10 = fma(a10, v, c0);
        a11 = fma(a11, v, c1);
        v = v128.load(q2 + d);
        a20 = fma(a20, v, c0);
        a21 = fma(a21, v, c1);
      }
      const so = s + ((<usize>(t - ta)) << 2);
      const r0 = f32x4.mul(reduce4(a00, a01, a10, a11), sc);
      const r1 = f32x4.mul(reduce4(a20, a21, a20, a21), sc);
      store<f32>(so, f32x4.extract_lane(r0, 0));
      store<f32>(so, f32x4.extract_lane(r0, 1), 4);
      store<f32>(so + sStride, f32x4.extract_lane(r0, 2));
      store<f32>(so + sStride, f32x4.extract_lane(r0, 3), 4);
      store<f32>(so + 2 * sStride, f32x4.extract_lane(r1, 0));
      store<f32>(so + 2 * sStride, f32x4.extract_lane(r1, 1), 4);
      k0 = k1 + rowBytes;
    }
    // A page's odd last token: the same sums in the same order as in the tile, so a score does
    // not depend on where its token falls in a page (the golden parity test sits within a few 1e-5
    // of its bound on kvfence-tiny, whose attention scores run to several hundred).
    for (; t < end; t++) {
      let a0 = f32x4.splat(0), a1 = f32x4.splat(0), a2 = f32x4.splat(0);
      for (let d: usize = 0; d < hd; d += 16) {
        const c = kvLoad4<K>(k0 + kvAt<K>(d));
        a0 = fma(a0, v128.load(q + d), c);
        a1 = fma(a1, v128.load(q1 + d), c);
        a2 = fma(a2, v128.load(q2 + d), c);
      }
      const r = f32x4.mul(reduce4(a0, a1, a2, a2), sc);
      const so = s + ((<usize>(t - ta)) << 2);
      store<f32>(so, f32x4.extract_lane(r, 0));
      store<f32>(so + sStride, f32x4.extract_lane(r, 1));
      store<f32>(so + 2 * sStride, f32x4.extract_lane(r, 2));
      k0 += rowBytes;
    }
  }
}

/** The first three lanes of v at a. */
@inline
function store3(a: usize, v: v128): void {
  store<f32>(a, f32x4.extract_lane(v, 0));
  store<f32>(a, f32x4.extract_lane(v, 1), 4);
  store<f32>(a, f32x4.extract_lane(v, 2), 8);
}

/**
 * o_h += Σ_t p[h][t]·V_t for 3 heads (o at o, o+oStride, o+2·oStride; p at s + h·sStride), 8 dims
 * at a time in 6 register accumulators (headDim must be a multiple of 8), over V rows [ta, tb).
 * 6 accumulators + 2 V + 3 weights fit V8's 15 SIMD registers (16 dims at a time needs 17 and
 * spilled 4 accumulators to the stack on every token).
 */
function valuesTile3<K>(
  o: usize, oStride: usize, hd: usize, s: usize, sStride: usize, vb: usize, blockTable: usize,
  ta: i32, tb: i32, pageSize: i32, pageBytes: usize, rowBytes: usize,
): void {
  for (let db: usize = 0; db < hd; db += 32) {
    const o0 = o + db;
    const o1 = o0 + oStride;
    const o2 = o1 + oStride;
    let a00 = v128.load(o0), a01 = v128.load(o0, 16);
    let a10 = v128.load(o1), a11 = v128.load(o1, 16);
    let a20 = v128.load(o2), a21 = v128.load(o2, 16);
    let t = ta;
    while (t < tb) {
      const p = t / pageSize;
      const end = min(tb, (p + 1) * pageSize);
      let vp = vb + <usize>load<i32>(blockTable + ((<usize>p) << 2)) * pageBytes + <usize>(t - p * pageSize) * rowBytes + kvAt<K>(db);
      let sp = s + ((<usize>(t - ta)) << 2);
      for (; t < end; t++) {
        const v0 = kvLoad4<K>(vp);
        const v1 = kvLoad4<K>(vp + kvAt<K>(16));
        let w = v128.load32_splat(sp);
        a00 = fma(a00, w, v0);
        a01 = fma(a01, w, v1);
        w = v128.load32_splat(sp + sStride);
        a10 = fma(a10, w, v0);
        a11 = fma(a11, w, v1);
        w = v128.load32_splat(sp + 2 * sStride);
        a20 = fma(a20, w, v0);
        a21 = fma(a21, w, v1);
        vp += rowBytes;
        sp += 4;
      }
    }
    v128.store(o0, a00);
    v128.store(o0, a01, 16);
    v128.store(o1, a10);
    v128.store(o1, a11, 16);
    v128.store(o2, a20);
    v128.store(o2, a21, 16);
  }
}

/**
 * Paged causal attention (the contract of reference.ts `pagedAttention`, GQA-aware) for numSeqs
 * sequences at once. `seqs` holds one record of 5 i32 per sequence: the activation row of its first
 * query row, its number of query rows, the position of that row, the byte address of its block
 * table, and the index of its first work item. Work items (sequence, query row, part of the KV
 * heads, context split) are claimed from the counter: kvParts (a divisor of numKvHeads) parts of
 * numKvHeads/kvParts KV heads each, read page by page together (1 part reads each page's K and V
 * rows whole); each thread passes its own `scratch` of at least
 * numHeads·(ceil(context/splits)+1+headDim) f32 for the longest context. With splits = 1 the result goes straight to `out`; splits > 1 (one
 * sequence only) makes each item cover 1/splits of its row's context and write a partial result to
 * `partial` ([rows][numHeads][splits][headDim] f32) and its max and exp-sum to `ml`
 * ([rows][numHeads][splits][2] f32), and attentionMerge combines them after both threads finish.
 * `kvDtype` is the pool's element type: 0 f32, 1 f16, 2 bf16 (`kvDtypeCode` in kv-layout.ts).
 */
export function attentionPar(
  out: usize, q: usize, pool: usize, seqs: usize, numSeqs: i32, scratch: usize,
  layer: i32, numLayers: i32, numHeads: i32, numKvHeads: i32, headDim: i32, pageSize: i32,
  counter: usize, splits: i32, partial: usize, ml: usize, kvParts: i32, kvDtype: i32,
): void {
  if (kvDtype == 1) {
    attentionItems<u16>(out, q, pool, seqs, numSeqs, scratch, layer, numLayers, numHeads, numKvHeads, headDim, pageSize, counter, splits, partial, ml, kvParts);
  } else if (kvDtype == 2) {
    attentionItems<i16>(out, q, pool, seqs, numSeqs, scratch, layer, numLayers, numHeads, numKvHeads, headDim, pageSize, counter, splits, partial, ml, kvParts);
  } else {
    attentionItems<f32>(out, q, pool, seqs, numSeqs, scratch, layer, numLayers, numHeads, numKvHeads, headDim, pageSize, counter, splits, partial, ml, kvParts);
  }
}

function attentionItems<K>(
  out: usize, q: usize, pool: usize, seqs: usize, numSeqs: i32, scratch: usize,
  layer: i32, numLayers: i32, numHeads: i32, numKvHeads: i32, headDim: i32, pageSize: i32,
  counter: usize, splits: i32, partial: usize, ml: usize, kvParts: i32,
): void {
  const group = numHeads / numKvHeads;
  const perKv = numKvHeads / kvParts;
  const perRow = kvParts * splits;
  const lastSeq = seqs + <usize>(numSeqs - 1) * 20;
  const n = load<i32>(lastSeq, 16) + load<i32>(lastSeq, 4) * perRow;
  const headBytes = (<usize>headDim) << 2;
  let sq = seqs;
  for (;;) {
    const c = atomic.add<i32>(counter, 1);
    if (c >= n) return;
    // Claims only grow, so the sequence of item c is at or after the previous one's.
    while (sq < lastSeq && load<i32>(sq, 36) <= c) sq += 20;
    const rowStart = load<i32>(sq);
    const rows = load<i32>(sq, 4);
    const startPos = load<i32>(sq, 8);
    const blockTable = <usize>load<i32>(sq, 12);
    const local = c - load<i32>(sq, 16);
    // Longest rows of a sequence first.
    const i = rows - 1 - local / perRow;
    const rem = local % perRow;
    const g0 = (rem / splits) * perKv;
    const sp = rem % splits;
    const ctx = startPos + i + 1;
    if (splits == 1) {
      const o = out + ((<usize>((rowStart + i) * numHeads + g0 * group) * <usize>headDim) << 2);
      attendRange<K>(o, headBytes, 0, 0, q, pool, blockTable, scratch, i, g0, g0 + perKv, 0, ctx, rowStart, layer, numLayers, numHeads, numKvHeads, headDim, pageSize);
    } else {
      const ta = <i32>((<i64>ctx * sp) / splits);
      const tb = <i32>((<i64>ctx * (sp + 1)) / splits);
      const slot = <usize>((i * numHeads + g0 * group) * splits + sp);
      const o = partial + slot * headBytes;
      const m = ml + (slot << 3);
      attendRange<K>(o, <usize>splits * headBytes, m, <usize>splits << 3, q, pool, blockTable, scratch, i, g0, g0 + perKv, ta, tb, rowStart, layer, numLayers, numHeads, numKvHeads, headDim, pageSize);
    }
  }
}

/** Combines the context splits of attentionPar into `out` (softmax over the whole context). */
export function attentionMerge(
  out: usize, partial: usize, ml: usize, rowStart: i32, rows: i32, numHeads: i32, headDim: i32, splits: i32,
): void {
  const headBytes = (<usize>headDim) << 2;
  for (let i = 0; i < rows; i++) {
    for (let h = 0; h < numHeads; h++) {
      const slot0 = <usize>((i * numHeads + h) * splits);
      let m: f32 = -Infinity;
      for (let sp = 0; sp < splits; sp++) m = max(m, load<f32>(ml + ((slot0 + <usize>sp) << 3)));
      let total: f32 = 0;
      for (let sp = 0; sp < splits; sp++) {
        const a = ml + ((slot0 + <usize>sp) << 3);
        total += load<f32>(a, 4) * exps(load<f32>(a) - m);
      }
      const o = out + ((<usize>((rowStart + i) * numHeads + h) * <usize>headDim) << 2);
      memory.fill(o, 0, headBytes);
      for (let sp = 0; sp < splits; sp++) {
        const a = ml + ((slot0 + <usize>sp) << 3);
        const wgt = (load<f32>(a, 4) * exps(load<f32>(a) - m)) / total;
        axpy<f32>(o, wgt, partial + (slot0 + <usize>sp) * headBytes, headDim);
      }
    }
  }
}

/**
 * The KV write: n f32 at src into the pool at dst as `kvDtype` (0 f32: a copy; 1 f16, 2 bf16:
 * rounded to nearest, ties to even, as `roundKv` in src/kernels/reference.ts does it). An f16 beyond
 * ±65504 saturates to ±65504 (an infinity would turn every score of its head into NaN); a NaN
 * stays a (quiet) NaN.
 */
export function kvStore(dst: usize, src: usize, n: i32, kvDtype: i32): void {
  const nb = (<usize>n) << 2;
  if (kvDtype == 0) {
    memory.copy(dst, src, nb);
    return;
  }
  for (let d: usize = 0; d < nb; d += 4) {
    const b = load<u32>(src + d);
    store<u16>(dst + (d >> 1), kvDtype == 1 ? f16Bits(b) : bf16Bits(b));
  }
}

/** The bf16 nearest to the f32 with bits b (ties to even); a NaN stays a quiet NaN. */
@inline
function bf16Bits(b: u32): u16 {
  if ((b & 0x7fffffff) > 0x7f800000) return <u16>((b >> 16) | 0x40);
  return <u16>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

/** The f16 nearest to the f32 with bits b (ties to even), saturating at ±65504; NaN stays NaN. */
function f16Bits(b: u32): u16 {
  const sign = (b >> 16) & 0x8000;
  const a = b & 0x7fffffff;
  if (a > 0x7f800000) return <u16>(sign | 0x7e00);
  const exp = <i32>(a >> 23) - 112;
  const mant = a & 0x7fffff;
  if (exp >= 31) return <u16>(sign | 0x7bff);
  if (exp <= 0) {
    const shift = 14 - exp;
    if (shift > 24) return <u16>sign;
    const full = mant | 0x800000;
    let m = full >> <u32>shift;
    const rem = full & ((<u32>1 << <u32>shift) - 1);
    const half = <u32>1 << <u32>(shift - 1);
    if (rem > half || (rem == half && (m & 1) != 0)) m++;
    return <u16>(sign | m);
  }
  let h = ((<u32>exp) << 10) | (mant >> 13);
  const rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1) != 0)) h++;
  if (h >= 0x7c00) h = 0x7bff;
  return <u16>(sign | h);
}
