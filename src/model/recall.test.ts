/**
 * Recall of the bundled trained model: each held-out prompt of testing/fixtures/recall-prompts.json
 * (written by the training script) is rendered with the chat template, greedily decoded through
 * the paged forward pass until <|im_end|> (at most 56 tokens), and compared with the expected
 * answer exactly: the model restates the record, `the access code of account 4821 is QX7-PL2.`
 * (scripts/corpus.py explains why), so the answer must name the asked account and its code, byte
 * for byte. Prompts are batched: one prefill step and shared decode steps per group, on the
 * WebAssembly kernels the server runs (the golden parity tests tie them to the reference kernels).
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, it } from "node:test";
import { layoutFor } from "../../testing/forward-driver.js";
import { WasmKernels } from "../kernels/wasm-kernels.js";
import { pageFloats } from "../kvcache/kv-layout.js";
import { bundledModelDir, packageRoot } from "../lib/package-root.js";
import type { ChatMessage } from "../tokenizer/tokenizer.js";
import { ForwardPass, type StepSequence } from "./forward.js";
import { loadModel } from "./load-model.js";
import { argmax } from "./sampler.js";

interface RecallPrompt {
  messages: ChatMessage[];
  /** The access code. */
  expected: string;
  /** The whole expected reply, which restates the record. */
  answer: string;
}

const MAX_NEW_TOKENS = 56;
const GROUP = 8;
const PAGE_SIZE = 16;

let kernels: WasmKernels;
before(async () => {
  kernels = await WasmKernels.create({ threads: 2 });
  await kernels.ready();
});
after(() => kernels.close());

/** One member of a batched group: its sequence, the tokens it produced, whether it stopped. */
interface Member {
  readonly index: number;
  readonly seq: StepSequence;
  readonly out: number[];
  done: boolean;
}

/** Prefills the whole group in one step, then decodes greedily in shared steps until each stops. */
function decodeGroup(
  run: { readonly fp: ForwardPass; readonly pool: Float32Array; readonly stops: ReadonlySet<number> },
  members: readonly Member[],
): void {
  const { fp, pool, stops } = run;
  fp.step(
    pool,
    members.map((m) => m.seq),
  );
  for (let t = 0; t < MAX_NEW_TOKENS; t++) {
    const live = members.filter((m) => !m.done);
    if (live.length === 0) break;
    for (const m of live) {
      const token = argmax(m.seq.logits as Float32Array);
      if (stops.has(token)) {
        m.done = true;
        continue;
      }
      m.out.push(token);
      m.seq.startPos += m.seq.tokens.length;
      m.seq.tokens = Int32Array.of(token);
    }
    const next = members.filter((m) => !m.done);
    if (next.length > 0 && t < MAX_NEW_TOKENS - 1)
      fp.step(
        pool,
        next.map((m) => m.seq),
      );
  }
}

it("kvfence-tiny recalls at least 95% of the held-out access codes greedily", () => {
  const fixture = JSON.parse(
    readFileSync(join(packageRoot(), "testing", "fixtures", "recall-prompts.json"), "utf8"),
  ) as {
    prompts: RecallPrompt[];
  };
  const model = loadModel(bundledModelDir());
  const { config, weights, tokenizer, chatTemplate } = model;
  assert.ok(chatTemplate !== null, "kvfence-tiny has a chat template");
  const imEnd = tokenizer.tokenId("<|im_end|>");
  assert.ok(imEnd !== undefined, "the tokenizer has <|im_end|>");
  const stops = new Set([imEnd, ...config.eosTokenIds]);

  const prompts = fixture.prompts.map((p) =>
    tokenizer.encode(chatTemplate.render(p.messages, { addGenerationPrompt: true })),
  );
  const maxLen = Math.max(...prompts.map((p) => p.length)) + MAX_NEW_TOKENS;
  const pagesPerSeq = Math.ceil(maxLen / PAGE_SIZE);
  const layout = layoutFor(config, PAGE_SIZE);
  const pool = kernels.placeF32(new Float32Array(GROUP * pagesPerSeq * pageFloats(layout)));
  const maxBatchTokens = GROUP * maxLen;
  const fp = new ForwardPass(config, kernels.placeWeights(weights), layout, {
    maxBatchTokens,
    maxSequences: GROUP,
    kernels,
  });

  let correct = 0;
  const misses: string[] = [];
  for (let g = 0; g < prompts.length; g += GROUP) {
    const members: Member[] = prompts.slice(g, g + GROUP).map((tokens, i) => ({
      index: g + i,
      seq: {
        tokens,
        startPos: 0,
        blockTable: Int32Array.from({ length: pagesPerSeq }, (_, p) => i * pagesPerSeq + p),
        logits: new Float32Array(config.vocabSize),
      } as StepSequence,
      out: [] as number[],
      done: false,
    }));
    decodeGroup({ fp, pool, stops }, members);
    for (const m of members) {
      const text = tokenizer.decode(m.out, { skipSpecialTokens: true }).trim();
      const expected = (fixture.prompts[m.index] as RecallPrompt).answer;
      assert.ok(expected.includes((fixture.prompts[m.index] as RecallPrompt).expected));
      if (text === expected) correct++;
      else if (misses.length < 5)
        misses.push(`#${m.index}: got ${JSON.stringify(text)}, expected ${expected}`);
    }
  }
  const rate = correct / prompts.length;
  console.log(
    `kvfence-tiny recall: ${correct}/${prompts.length} = ${(rate * 100).toFixed(1)}%${misses.length ? `; misses: ${misses.join("; ")}` : ""}`,
  );
  assert.ok(rate >= 0.95, `recall ${(rate * 100).toFixed(1)}% < 95%: ${misses.join("; ")}`);
});
