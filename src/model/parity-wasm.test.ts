/**
 * Golden parity on the fast path: parity.test.ts's checks (logits at every position of every golden
 * prompt within 1e-4 of the float64 PyTorch reference, pages in order and shuffled, one chunk and
 * several; the greedy continuations) with ForwardPass on the WebAssembly SIMD kernels, two threads,
 * every matmul and attention call through the worker job protocol.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import {
  blockTable,
  greedyContinuation,
  layoutFor,
  logitsAtEveryPosition,
  makePool,
} from "../../testing/forward-driver.js";
import { maxAbsDiff } from "../kernels/assert-all-close.js";
import { WasmKernels } from "../kernels/wasm-kernels.js";
import { packageRoot } from "../lib/package-root.js";
import { ForwardPass } from "./forward.js";
import { loadModel } from "./load-model.js";

interface GoldenPrompt {
  tokens: number[];
  logits: string;
  greedy: number[];
}
interface Golden {
  vocabSize: number;
  continuation: number;
  prompts: GoldenPrompt[];
}

const TOLERANCE = 1e-4;
const PAGE_SIZE = 16;

function decodeLogits(b64: string, vocab: number): Float32Array[] {
  const bytes = Buffer.from(b64, "base64");
  const all = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  const rows: Float32Array[] = [];
  for (let i = 0; i < all.length; i += vocab) rows.push(all.slice(i, i + vocab));
  return rows;
}

// Both builds: the fused multiply-add one the server takes where the engine has relaxed SIMD, and
// the plain one it falls back to.
// And the native kernels (src/kernels/kernel-backend.ts), the same class over the addon.
for (const [name, fma, backend] of [
  ["kvfence-tiny", true, "wasm"],
  ["tiny-qwen2", true, "wasm"],
  ["kvfence-tiny", false, "wasm"],
  ["tiny-qwen2", false, "wasm"],
  ["kvfence-tiny", false, "native"],
  ["tiny-qwen2", false, "native"],
] as const) {
  const build = backend === "native" ? "native" : fma ? "fused multiply-add" : "multiply, then add";
  describe(`golden parity on WasmKernels (${build}): ${name}`, () => {
    const root = packageRoot();
    const golden = JSON.parse(
      readFileSync(join(root, "testing", "fixtures", `golden-${name}.json`), "utf8"),
    ) as Golden;
    const { config, weights } = loadModel(join(root, "models", name));
    const maxLen = Math.max(...golden.prompts.map((p) => p.tokens.length)) + golden.continuation;
    const pagesNeeded = Math.ceil(maxLen / PAGE_SIZE);
    const numPages = pagesNeeded * 2 + 3;
    const layout = layoutFor(config, PAGE_SIZE);
    let k: WasmKernels;
    let fp: ForwardPass;
    before(async () => {
      k = await WasmKernels.create({ threads: 2, parallelMinWork: 0, fma, backend, initialBytes: 256 << 20 });
      await k.ready();
      assert.equal(k.name, backend);
      if (backend === "wasm") assert.equal(k.fma, fma);
      fp = new ForwardPass(config, k.placeWeights(weights), layout, {
        maxBatchTokens: 128,
        maxSequences: 4,
        kernels: k,
      });
    });
    after(async () => {
      await k.close();
    });

    it(`ForwardPass.step() on WasmKernels: logits within ${TOLERANCE} of the float64 reference at every position`, () => {
      let worstOverall = 0;
      for (const prompt of golden.prompts) {
        const tokens = Int32Array.from(prompt.tokens);
        const expected = decodeLogits(prompt.logits, config.vocabSize);
        for (const shuffled of [false, true]) {
          for (const chunks of [[tokens.length], [5, 11, 3]]) {
            const pool = k.placeF32(makePool(layout, numPages));
            const table = blockTable(pagesNeeded, numPages, shuffled, tokens.length);
            const got = logitsAtEveryPosition(fp, pool, table, tokens, chunks);
            for (let i = 0; i < tokens.length; i++) {
              const d = maxAbsDiff(got[i] as Float32Array, expected[i] as Float32Array);
              assert.ok(
                d <= TOLERANCE,
                `prompt ${tokens.length}, position ${i}, shuffled=${shuffled}, chunks=${chunks}: max |Δlogit| ${d}`,
              );
              worstOverall = Math.max(worstOverall, d);
            }
          }
        }
      }
      assert.equal(k.fallbackCalls, 0, "every kernel call ran in WebAssembly");
      console.log(`${name} on wasm (${build}): max |Δlogit| ${worstOverall.toExponential(2)}`);
    });

    it(`ForwardPass.step() on WasmKernels reproduces the reference ${golden.continuation}-token greedy continuations`, () => {
      for (const prompt of golden.prompts) {
        const pool = k.placeF32(makePool(layout, numPages));
        const table = blockTable(pagesNeeded, numPages, true, 99 + prompt.tokens.length);
        const got = greedyContinuation(fp, pool, table, Int32Array.from(prompt.tokens), golden.continuation);
        assert.deepEqual(got, prompt.greedy, `prompt of ${prompt.tokens.length} tokens`);
      }
    });
  });
}
