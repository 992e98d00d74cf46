/**
 * Structured output at the engine (issue #34's acceptance): 1,000 samples at temperature 1 from a
 * random-weight model with a real byte-level BPE tokenizer (models/kvfence-tiny), for a nested JSON
 * schema, a GBNF grammar, a regex and a choice list; every output parses and validates — the JSON with ajv, not with
 * the grammar engine. Also the decode node's path (its matcher first accepts prefill's token) and
 * a prefill node's n > 1 siblings. Each engine's grammars live on its grammar thread
 * (src/grammar/grammar-thread.ts), as in a server.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Ajv } from "ajv";
import { makeEngine, recorder, request, stepUntilIdle, withSampling } from "../../testing/engine-harness.js";
import { randomModel } from "../../testing/random-model.js";
import { GrammarThreads } from "../grammar/grammar-thread.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { ModelTokenizer } from "../tokenizer/tokenizer.js";
import type { Engine } from "./engine.js";

const TOKENIZER_DIR = new URL("../../../models/kvfence-tiny", import.meta.url).pathname;
const tokenizer = ModelTokenizer.fromFolder(TOKENIZER_DIR);
const VOCAB = 264;
const EOS = tokenizer.tokenId("<|im_end|>") ?? tokenizer.tokenId("<|endoftext|>")!;
const model = randomModel({ seed: 5, vocabSize: VOCAB, maxPositionEmbeddings: 256, eosTokenIds: [EOS] });
const SAMPLES = 1000;
const BATCH = 50;

const SCHEMA = {
  type: "object",
  properties: {
    kind: { enum: ["cat", "dog", "eel"] },
    age: { type: "integer", minimum: 0, maximum: 30 },
    ok: { type: "boolean" },
    tags: { type: "array", items: { enum: ["a", "b"] }, maxItems: 2 },
    owner: {
      type: "object",
      properties: { id: { type: "integer", minimum: 1, maximum: 9 }, vip: { type: "boolean" } },
      required: ["id", "vip"],
    },
  },
  required: ["kind", "age", "ok", "tags", "owner"],
};
const GBNF = 'root ::= item ("," item){0,3}\nitem ::= [a-c] [0-9]';

function engine(): Engine {
  return makeEngine({
    model,
    numPages: 512,
    maxSequences: BATCH,
    maxBatchTokens: 512,
    grammar: () => Promise.resolve(new GrammarThreads({ tokenizerPath: TOKENIZER_DIR, vocabSize: VOCAB })),
  });
}

/**
 * `count` samples of `constraint` at temperature 1, batch by batch, each one's text (every one must
 * end on its grammar's end: finish `stop`); `stopTokenIds` the request's (none: `ignore_eos`).
 */
async function samples(
  constraint: OutputConstraint,
  count: number,
  maxTokens: number,
  stopTokenIds: readonly number[] = [EOS],
): Promise<string[]> {
  const e = engine();
  const texts: string[] = [];
  for (let start = 0; start < count; start += BATCH) {
    const outcomes = [];
    for (let i = start; i < Math.min(count, start + BATCH); i++) {
      const { events, outcome } = recorder();
      const sampling = withSampling({ temperature: 1, seed: i, stopTokenIds, constraint });
      e.submit(request(i + 1, [1 + (i % 50), 7, 9], maxTokens, { ...sampling, tenant: i % 3 }), events);
      outcomes.push(outcome);
    }
    // The grammar is bound to each sequence asynchronously, by its grammar thread (between steps).
    await stepUntilIdle(e);
    for (const o of outcomes) {
      assert.equal(o.error, null);
      assert.equal(o.finish, "stop", `a sample ran out of tokens: ${tokenizer.decode(o.tokens)}`);
      texts.push(tokenizer.decode(o.tokens));
    }
  }
  e.close();
  return texts;
}

describe("structured output", () => {
  it("Engine.step() masks 1,000 samples of a nested JSON schema: every one validates with ajv", async () => {
    const validate = new Ajv({ strict: true }).compile(SCHEMA);
    const schema = JSON.stringify(SCHEMA);
    const texts = await samples({ kind: "json_schema", schema, strict: true }, SAMPLES, 120);
    let invalid = 0;
    for (const text of texts) {
      let value: unknown;
      try {
        value = JSON.parse(text);
      } catch {
        invalid++;
        continue;
      }
      if (!validate(value)) invalid++;
    }
    assert.equal(invalid, 0, `${invalid} of ${texts.length} outputs do not validate, e.g. ${texts[0]}`);
    assert.ok(
      new Set(texts).size > 20,
      `temperature 1 draws varied outputs: ${new Set(texts).size} distinct`,
    );
  });

  it("Engine.submit() resumes a migrated request (resumedTokens): its grammar state, seeded draws and penalties' counts go on where they were", async () => {
    const e = engine();
    const constraint: OutputConstraint = {
      kind: "json_schema",
      schema: JSON.stringify(SCHEMA),
      strict: true,
    };
    const base = { temperature: 1, stopTokenIds: [EOS], constraint, controls: { frequencyPenalty: 0.7 } };
    const PROMPT = [3, 7, 9];
    let compared = 0;
    for (let seed = 1; seed <= 20; seed++) {
      const whole = recorder();
      e.submit(request(seed, PROMPT, 120, withSampling({ ...base, seed })), whole.events);
      await stepUntilIdle(e);
      const full = whole.outcome.tokens;
      assert.equal(whole.outcome.finish, "stop");
      // Lost after `k` tokens: the re-run's prompt is the prompt and those tokens, resumed.
      const k = Math.floor(full.length / 2);
      if (k === 0) continue;
      const rest = recorder();
      const resumed = withSampling({ ...base, seed, resumedTokens: k });
      e.submit(request(1000 + seed, [...PROMPT, ...full.slice(0, k)], 120 - k, resumed), rest.events);
      await stepUntilIdle(e);
      assert.equal(rest.outcome.error, null);
      assert.equal(
        tokenizer.decode([...full.slice(0, k), ...rest.outcome.tokens]),
        tokenizer.decode(full),
        `seed ${seed}, resumed after ${k} tokens`,
      );
      compared++;
    }
    e.close();
    assert.ok(compared >= 15, `resumed ${compared} samples`);
  });

  it("Engine.step() masks 1,000 samples of a GBNF grammar: every one matches it", async () => {
    const texts = await samples({ kind: "grammar", ebnf: GBNF }, SAMPLES, 16);
    const bad = texts.filter((t) => !/^[a-c][0-9](,[a-c][0-9]){0,3}$/.test(t));
    assert.deepEqual(bad.slice(0, 5), [], `${bad.length} of ${texts.length} outputs do not match`);
  });

  it("Engine.step() ends a constrained sample at its grammar's end under ignore_eos (no stop ids): no filler", async () => {
    const texts = await samples({ kind: "grammar", ebnf: GBNF }, 200, 24, []);
    const bad = texts.filter((t) => !/^[a-c][0-9](,[a-c][0-9]){0,3}$/.test(t));
    assert.deepEqual(bad.slice(0, 5), [], `${bad.length} of ${texts.length} outputs run past the grammar`);
  });

  it("Engine.step() masks 1,000 samples of a regex: every one matches it", async () => {
    const pattern = "[A-Z][a-z]{1,3}-(0|[1-9][0-9]?)(\\.[0-9])?";
    const texts = await samples({ kind: "regex", pattern }, SAMPLES, 16);
    const bad = texts.filter((t) => !new RegExp(`^(?:${pattern})$`).test(t));
    assert.deepEqual(bad.slice(0, 5), [], `${bad.length} of ${texts.length} outputs do not match`);
  });

  it("Engine.step() masks 1,000 samples of a choice list: every one is one of the choices", async () => {
    const choices = ["yes", "no", "maybe", "n/a", "yes please"];
    const texts = await samples({ kind: "choice", choices }, SAMPLES, 16);
    const bad = texts.filter((t) => !choices.includes(t));
    assert.deepEqual(bad.slice(0, 5), [], `${bad.length} of ${texts.length} outputs are not choices`);
    assert.ok(new Set(texts).size > 1, "temperature 1 picks different choices");
  });

  it("Engine.submitDecode() advances the matcher past prefill's first token", async () => {
    const e = engine();
    const { events, outcome } = recorder();
    // Prefill drew "b"; the grammar then allows only a digit.
    const b = tokenizer.encode("b", { addSpecialTokens: false })[0]!;
    const c = { kind: "grammar", ebnf: 'root ::= [ab] [0-9] "!"' } as const;
    const r = request(
      1,
      [3, 4, 5],
      6,
      withSampling({ temperature: 1, seed: 3, stopTokenIds: [EOS], constraint: c }),
    );
    const pages = new Int32Array(3);
    const generations = new Uint32Array(3);
    assert.ok(e.pool.table.allocate(3, 1, 1, 0, pages, generations));
    // The prompt's KV "arrived" (zeros serve a random model as well as any).
    e.pool.table.stampWriter(pages[0]!, 1, 1, 3);
    e.pool.table.markReady(pages[0]!, generations[0]!, 1, 1);
    const leased = Array.from(pages, (page, i) => ({ page, generation: generations[i]! }));
    // The host checks each step's pages (the decode state machine's part; not under test here).
    e.submitDecode(r, { epoch: 1, pages: leased, checkStep: () => true }, b, events);
    await stepUntilIdle(e);
    e.close();
    assert.equal(outcome.error, null);
    assert.match(tokenizer.decode([b, ...outcome.tokens]), /^b[0-9]!$/);
  });

  it("Engine.submit() refuses a constraint when the engine has no grammar engine", async () => {
    const e = makeEngine({ model });
    const { events, outcome } = recorder();
    e.submit(request(1, [1, 2], 4, withSampling({ constraint: { kind: "json_object" } })), events);
    assert.equal(outcome.error?.code, "invalid_request");
    assert.equal(e.busy, false);
  });
});
