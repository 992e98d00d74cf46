/**
 * Golden parity: the paged TypeScript forward pass against an independent float64 PyTorch
 * implementation (scripts/golden.py), for the two bundled models, at every position of every
 * golden prompt, with pages in order and shuffled, prefill in one chunk and in several, plus the
 * 64-token greedy continuations.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, it } from "node:test";
import {
  blockTable,
  greedyContinuation,
  layoutFor,
  logitsAtEveryPosition,
  makePool,
} from "../../testing/forward-driver.js";
import { maxAbsDiff } from "../kernels/assert-all-close.js";
import { packageRoot } from "../lib/package-root.js";
import { ForwardPass } from "./forward.js";
import { loadModel } from "./load-model.js";

interface GoldenPrompt {
  tokens: number[];
  logits: string;
  greedy: number[];
  minGreedyMargin: number;
}
interface Golden {
  model: string;
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

for (const name of ["kvfence-tiny", "tiny-qwen2"]) {
  describe(`golden parity: ${name}`, () => {
    const root = packageRoot();
    const golden = JSON.parse(
      readFileSync(join(root, "testing", "fixtures", `golden-${name}.json`), "utf8"),
    ) as Golden;
    const model = loadModel(join(root, "models", name));
    const { config, weights } = model;
    const maxLen = Math.max(...golden.prompts.map((p) => p.tokens.length)) + golden.continuation;
    const pagesNeeded = Math.ceil(maxLen / PAGE_SIZE);
    const numPages = pagesNeeded * 2 + 3; // pool larger than needed, so shuffled pages scatter
    const layout = layoutFor(config, PAGE_SIZE);
    const fp = new ForwardPass(config, weights, layout, { maxBatchTokens: 128, maxSequences: 4 });

    it(`ForwardPass.step() logits are within ${TOLERANCE} of the float64 reference at every position (pages in order and shuffled, one chunk and several)`, () => {
      assert.equal(golden.vocabSize, config.vocabSize);
      const lines: string[] = [];
      let worstOverall = 0;
      for (const prompt of golden.prompts) {
        const tokens = Int32Array.from(prompt.tokens);
        const expected = decodeLogits(prompt.logits, config.vocabSize);
        assert.equal(expected.length, tokens.length);
        for (const shuffled of [false, true]) {
          for (const chunks of [[tokens.length], [5, 11, 3]]) {
            const pool = makePool(layout, numPages);
            const table = blockTable(pagesNeeded, numPages, shuffled, tokens.length);
            const got = logitsAtEveryPosition(fp, pool, table, tokens, chunks);
            let worst = 0;
            for (let i = 0; i < tokens.length; i++) {
              const d = maxAbsDiff(got[i] as Float32Array, expected[i] as Float32Array);
              assert.ok(
                d <= TOLERANCE,
                `prompt ${tokens.length}, position ${i}, shuffled=${shuffled}, chunks=${chunks}: max |Δlogit| ${d}`,
              );
              worst = Math.max(worst, d);
            }
            worstOverall = Math.max(worstOverall, worst);
          }
        }
        lines.push(`${tokens.length}`);
      }
      console.log(
        `${name}: prompts of ${lines.join(", ")} tokens; max |Δlogit| ${worstOverall.toExponential(2)}`,
      );
    });

    it(`ForwardPass.step() reproduces the reference ${golden.continuation}-token greedy continuations with shuffled pages`, () => {
      for (const prompt of golden.prompts) {
        const pool = makePool(layout, numPages);
        const table = blockTable(pagesNeeded, numPages, true, 99 + prompt.tokens.length);
        const got = greedyContinuation(fp, pool, table, Int32Array.from(prompt.tokens), golden.continuation);
        assert.deepEqual(got, prompt.greedy, `prompt of ${prompt.tokens.length} tokens`);
      }
    });
  });
}
