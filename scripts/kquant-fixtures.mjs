// Makes the committed k-quant fixtures with ggml's own quantiser (issue #33 item 3), as
// scripts/golden.py makes the PyTorch ones: run by hand to regenerate them, never at test time or
// in CI. It needs a build of ggml (the library llama.cpp quantises with) and `npm run build` first:
//
//   git --git-dir=/work/.mirror/ggml-org+ggml/repo archive HEAD | tar -x -C /tmp/ggml
//   (cd /tmp/ggml && cmake -B build -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF && cmake --build build --target ggml -j2)
//   node scripts/kquant-fixtures.mjs /tmp/ggml "$(git --git-dir=/work/.mirror/ggml-org+ggml/repo rev-parse HEAD)"
//
// (the second argument, ggml's commit, is recorded in the blocks fixture; a tree from `git archive`
// does not know it).
// It compiles a small C program (below) against that build in a temporary folder; the program
// quantises f32 rows with ggml_quantize_chunk (no importance matrix, as llama-quantize without
// --imatrix) and dequantises the blocks with ggml's to_float, and writes:
//
// - testing/fixtures/kquant-blocks.json: for Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1, 8 rows of 512 seeded values
//   (gaussians of several widths, outliers, zero and constant blocks, all-negative rows, values
//   small enough for subnormal f16 scales, large ones): ggml's blocks and ggml's dequantised f32,
//   base64 (src/kernels/k-quants.test.ts checks the TypeScript dequantisation against them).
// - testing/fixtures/kvfence-tiny-q4_k_m.gguf and -q5_k_m.gguf: models/kvfence-tiny written by
//   testing/gguf-writer.ts with every matrix quantised by ggml in llama.cpp's Q4_K_M / Q5_K_M mix
//   (llama_tensor_get_type in llama-quant.cpp): output.weight Q6_K; attn_v and ffn_down Q6_K in
//   the layers `use_more_bits` picks (here the last of three); ffn_gate in llama.cpp's fallback
//   type for rows that are not whole 256-blocks, Q5_0 (Q5_1); every other matrix Q4_K (Q5_K);
//   norms F32.
import { execFileSync, spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const { Prng } = await import(`${root}dist/src/lib/prng.js`);
const { writeGgufFromFolder } = await import(`${root}dist/testing/gguf-writer.js`);
const { weightBytes } = await import(`${root}dist/src/kernels/weight-format.js`);

const [ggml, ggmlCommit] = process.argv.slice(2);
if (ggml === undefined) {
  console.error("usage: node scripts/kquant-fixtures.mjs GGML_DIR [COMMIT] (a ggml source tree built in GGML_DIR/build)");
  process.exit(2);
}

const C_SOURCE = `
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
/* kq TYPE ROWS COLS < f32 rows > blocks, then ggml's dequantised f32 */
int main(int argc, char **argv) {
  if (argc != 4) return 2;
  enum ggml_type t = !strcmp(argv[1], "q4_K") ? GGML_TYPE_Q4_K : !strcmp(argv[1], "q5_K") ? GGML_TYPE_Q5_K
                   : !strcmp(argv[1], "q6_K") ? GGML_TYPE_Q6_K : !strcmp(argv[1], "q5_0") ? GGML_TYPE_Q5_0
                   : !strcmp(argv[1], "q5_1") ? GGML_TYPE_Q5_1 : GGML_TYPE_COUNT;
  if (t == GGML_TYPE_COUNT) return 2;
  long rows = atol(argv[2]), cols = atol(argv[3]), n = rows * cols;
  float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
  size_t bytes = ggml_row_size(t, cols) * rows;
  void *q = malloc(bytes);
  if (fread(x, sizeof(float), n, stdin) != (size_t)n) return 3;
  if (ggml_quantize_chunk(t, x, q, 0, rows, cols, NULL) != bytes) return 4;
  ggml_get_type_traits(t)->to_float(q, y, n);
  fwrite(q, 1, bytes, stdout);
  fwrite(y, sizeof(float), n, stdout);
  fprintf(stderr, "%s", ggml_commit());
  return 0;
}
`;

const tmp = mkdtempSync(join(tmpdir(), "kquant-fixtures-"));
const tool = join(tmp, "kq");
writeFileSync(join(tmp, "kq.c"), C_SOURCE);
execFileSync("gcc", [
  "-O2",
  `-I${ggml}/include`,
  join(tmp, "kq.c"),
  `${ggml}/build/src/libggml-base.a`,
  "-lm",
  "-lpthread",
  "-fopenmp",
  "-lstdc++",
  "-o",
  tool,
]);

/** ggml's blocks of x [rows][cols] in `dtype`, and ggml's dequantisation of them. */
function ggmlQuantize(dtype, x, rows, cols) {
  const input = Buffer.from(x.buffer, x.byteOffset, x.byteLength);
  const out = execFileSync(tool, [dtype, String(rows), String(cols)], {
    input,
    maxBuffer: 1 << 28,
    stdio: ["pipe", "pipe", "ignore"],
  });
  // Q5_0 / Q5_1: 22 / 24 bytes a 32-weight block (kvfence widens them at load, so no weight format has them).
  const size = dtype === "q5_0" ? (rows * cols * 22) / 32 : dtype === "q5_1" ? (rows * cols * 24) / 32 : weightBytes(dtype, rows * cols);
  const bytes = new Uint8Array(out.subarray(0, size));
  const values = new Float32Array(new Uint8Array(out.subarray(size)).buffer);
  return { bytes, values };
}

// ---------------------------------------------------------------------------------------------
// blocks

const ROWS = 8;
const COLS = 512;
function blockInputs() {
  const rng = new Prng(33);
  const x = new Float32Array(ROWS * COLS);
  const row = (r) => x.subarray(r * COLS, (r + 1) * COLS);
  rng.fillGaussian(row(0), 1);
  rng.fillGaussian(row(1), 0.02);
  rng.fillGaussian(row(2), 0.05);
  for (let i = 0; i < 8; i++) row(2)[Math.floor(rng.next() * COLS)] *= 60;
  row(3).fill(0, 0, 256);
  row(3).fill(0.37, 256, 512);
  rng.fillGaussian(row(4), 0.5);
  for (let i = 0; i < COLS; i++) row(4)[i] = -Math.abs(row(4)[i]) - 0.01;
  rng.fillGaussian(row(5), 3e-6);
  for (let i = 0; i < COLS; i++) row(6)[i] = rng.next() * 2 - 1;
  rng.fillGaussian(row(7), 900);
  return x;
}

const commit = ggmlCommit ?? spawnSync(tool, ["q4_K", "1", "256"], { input: Buffer.alloc(1024) }).stderr.toString();
const x = blockInputs();
const cases = ["q4_K", "q5_K", "q6_K", "q5_0", "q5_1"].map((dtype) => {
  const { bytes, values } = ggmlQuantize(dtype, x, ROWS, COLS);
  return {
    dtype,
    rows: ROWS,
    cols: COLS,
    blocks: Buffer.from(bytes).toString("base64"),
    dequantized: Buffer.from(values.buffer).toString("base64"),
  };
});
writeFileSync(
  join(root, "testing/fixtures/kquant-blocks.json"),
  `${JSON.stringify({ made: "scripts/kquant-fixtures.mjs", ggmlCommit: commit, cases }, null, 1)}\n`,
);

// ---------------------------------------------------------------------------------------------
// GGUF files in llama.cpp's Q4_K_M and Q5_K_M mixes

const NUM_LAYERS = 3; // models/kvfence-tiny
const useMoreBits = (i, n) => i < Math.floor(n / 8) || i >= Math.floor((7 * n) / 8) || (i - Math.floor(n / 8)) % 3 === 2;

// llama.cpp writes a matrix whose rows are not whole 256-weight blocks (SmolLM2's hidden size 576,
// Qwen2.5-0.5B's 896) in its fallback type: Q5_0 in a Q4_K_M file, Q5_1 in a Q5_K_M one. kvfence-tiny's
// rows are whole blocks, so its ffn_gate matrices stand in for such matrices here.
for (const [file, base, fallback] of [
  ["kvfence-tiny-q4_k_m.gguf", "q4_K", "q5_0"],
  ["kvfence-tiny-q5_k_m.gguf", "q5_K", "q5_1"],
]) {
  const types = {};
  const encode = (name, data, rows, cols) => {
    const layer = /^blk\.(\d+)\./.exec(name);
    const more = layer !== null && useMoreBits(Number(layer[1]), NUM_LAYERS);
    const six = name === "output.weight" || (more && /attn_v|ffn_down/.test(name));
    const dtype = six ? "q6_K" : /ffn_gate/.test(name) ? fallback : base;
    types[dtype] = (types[dtype] ?? 0) + 1;
    return { dtype, bytes: ggmlQuantize(dtype, data, rows, cols).bytes };
  };
  const bytes = writeGgufFromFolder(join(root, "models/kvfence-tiny"), join(root, "testing/fixtures", file), {
    dtype: base,
    encode,
  });
  console.log(`${file}: ${bytes} bytes, matrices ${JSON.stringify(types)}`);
}
console.log(`kquant-blocks.json: ggml ${commit}`);
rmSync(tmp, { recursive: true, force: true });
