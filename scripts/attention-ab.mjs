// The paged attention of one decode token, alone, on two builds' WebAssembly kernels in one
// process, interleaved (ABBA by pair), at the 135M shape (30 layers, 9 query and 3 KV heads of 64
// dims): this build / the other as the geometric mean of the pairs' time ratios with a 95% CI, and
// whether the two give bit-identical outputs.
//
//   node scripts/attention-ab.mjs OTHER_CHECKOUT [context 4096] [threads 2] [kv f16|f32|bf16] [pairs 100]
//
// Both pools hold the same seeded values; KV pages are consecutive, 16 tokens each (PAGE=64 to
// change), as `kvfence bench model`'s long-context arm has them. Each timed sample is 4 steps.
import { existsSync } from "node:fs";
import { join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const [other, ctxArg, threadsArg, kvArg, pairsArg] = process.argv.slice(2);
if (other === undefined) {
  console.error("usage: node scripts/attention-ab.mjs OTHER_CHECKOUT [context] [threads] [f16|f32|bf16] [pairs]");
  process.exit(2);
}
const ctx = Number(ctxArg ?? 4096);
const threads = Number(threadsArg ?? 2);
const kv = kvArg ?? "f16";
const dtype = { f32: 0, f16: 1, bf16: 2 }[kv];
const pairs = Number(pairsArg ?? 100);
if (dtype === undefined) throw new Error(`kv dtype ${kv}: f32, f16 or bf16`);
const L = 30, H = 9, KV = 3, D = 64, P = Number(process.env.PAGE ?? 16);

async function arm(root) {
  const file = join(resolve(root), "dist", "src", "kernels", "wasm-kernels.js");
  if (!existsSync(file)) throw new Error(`${root}: no ${file} (build it with npm ci)`);
  const { WasmKernels } = await import(pathToFileURL(file).href);
  const k = await WasmKernels.create({ threads, initialBytes: 512 << 20 });
  let seed = 12345;
  const rnd = () => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
    return seed / 4294967296;
  };
  const pages = Math.ceil((ctx + 1) / P);
  const elems = pages * L * 2 * P * KV * D;
  let pool;
  if (dtype === 0) {
    pool = k.allocF32(elems);
    for (let i = 0; i < elems; i++) pool[i] = rnd() - 0.5;
  } else {
    pool = new Uint16Array(k.memory.buffer, k.allocBytes(elems * 2), elems);
    for (let i = 0; i < elems; i++)
      pool[i] = dtype === 1 ? (0x3000 + ((rnd() * 0xc00) | 0)) | (rnd() < 0.5 ? 0x8000 : 0) : 0x3e00 + ((rnd() * 0x100) | 0);
  }
  const table = Int32Array.from({ length: pages }, (_, i) => i);
  const q = k.allocF32(H * D);
  for (let i = 0; i < q.length; i++) q[i] = rnd() - 0.5;
  const out = k.allocF32(H * D);
  const scratch = new Float64Array(D + ctx + 1);
  const seqs = [{ blockTable: table, rowStart: 0, rows: 1, startPos: ctx }];
  const step = () => {
    for (let l = 0; l < L; l++) k.pagedAttentionBatch(out, q, pool, seqs, 1, scratch, l, L, H, KV, D, P, dtype);
  };
  return { step, out };
}

const here = fileURLToPath(new URL("..", import.meta.url));
const mine = await arm(here);
const theirs = await arm(other);
const time = (f) => {
  const t0 = process.hrtime.bigint();
  for (let i = 0; i < 4; i++) f();
  return Number(process.hrtime.bigint() - t0) / 4e6;
};
for (let i = 0; i < 5; i++) {
  mine.step();
  theirs.step();
}
const logs = [];
const a = [];
const b = [];
for (let p = 0; p < pairs; p++) {
  let x;
  let y;
  if (p % 2) {
    x = time(mine.step);
    y = time(theirs.step);
  } else {
    y = time(theirs.step);
    x = time(mine.step);
  }
  a.push(x);
  b.push(y);
  logs.push(Math.log(x / y));
}
const median = (v) => [...v].sort((s, t) => s - t)[v.length >> 1];
const mean = logs.reduce((s, v) => s + v, 0) / logs.length;
const sd = Math.sqrt(logs.reduce((s, v) => s + (v - mean) ** 2, 0) / (logs.length - 1));
const half = (1.96 * sd) / Math.sqrt(logs.length);
const same = mine.out.every((v, i) => Object.is(v, theirs.out[i]));
const pct = (v) => (100 * Math.exp(v)).toFixed(1);
console.log(
  `attention of one token at ${ctx} tokens, KV ${kv}, pages of ${P}, ${threads} thread(s): this build ${median(a).toFixed(2)} ms a step (median), ` +
    `${other} ${median(b).toFixed(2)} ms; time this / other ${pct(mean)}% [95% CI ${pct(mean - half)}–${pct(mean + half)}] over ${pairs} pairs; outputs bit-identical: ${same}`,
);
process.exit(0);
