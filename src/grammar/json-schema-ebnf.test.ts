/**
 * JSON schemas whose strings xgrammar 0.1.27 writes raw (length bounds, patterns) give valid JSON
 * through json-schema-ebnf.ts: random walks through the mask over kvfence-tiny's byte vocabulary
 * (every byte a token, so a walk reaches raw quotes and control characters wherever the grammar
 * lets it) end in text that `JSON.parse` reads and ajv validates against the schema.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Ajv } from "ajv";
import { Prng } from "../lib/prng.js";
import { ModelTokenizer } from "../tokenizer/tokenizer.js";
import { GrammarEngine } from "./grammar-engine.js";
import { grammarVocab } from "./grammar-vocab.js";

const tokenizer = ModelTokenizer.fromFolder(
  new URL("../../../models/kvfence-tiny", import.meta.url).pathname,
);
const vocab = grammarVocab(tokenizer);
const VOCAB = 264;
const EOS = tokenizer.tokenId("<|im_end|>") ?? tokenizer.tokenId("<|endoftext|>")!;
const WALKS = 300;

/** Walks the matcher of `schema`, each token drawn uniformly among those allowed, `WALKS` times. */
async function walks(schema: object, seed: number): Promise<string[]> {
  const engine = await GrammarEngine.create(vocab, VOCAB);
  const rng = new Prng(seed);
  const logits = new Float32Array(VOCAB);
  const texts: string[] = [];
  for (let w = 0; w < WALKS; w++) {
    const m = engine.matcher(1, { kind: "json_schema", schema: JSON.stringify(schema), strict: true }, [EOS]);
    const ids: number[] = [];
    for (let step = 0; step < 400 && !m.terminated; step++) {
      logits.fill(0);
      m.mask(logits);
      const allowed = [...logits.keys()].filter((i) => logits[i] === 0);
      const id = allowed[rng.nextInt(allowed.length)]!;
      assert.equal(
        m.accept(id),
        true,
        `walk ${w}: token ${id} (${JSON.stringify(tokenizer.decode([id]))}) allowed after ${JSON.stringify(tokenizer.decode(ids))}`,
      );
      if (id !== EOS) ids.push(id);
    }
    assert.ok(m.terminated, `walk ${w} ended: ${tokenizer.decode(ids)}`);
    m.dispose();
    texts.push(tokenizer.decode(ids));
  }
  return texts;
}

describe("jsonSchemaEbnf()", () => {
  it("strings with length bounds and patterns stay valid JSON that validates (random walks through the mask)", async () => {
    const schema = {
      type: "object",
      properties: {
        name: { type: "string", minLength: 1, maxLength: 6 },
        code: { type: "string", pattern: "^[A-Z]\\.[^x]{2,4}$" },
        quoted: { type: "string", pattern: '^a"b.c\\\\$' },
        tags: { type: "array", items: { type: "string", maxLength: 3 }, maxItems: 2 },
      },
      required: ["name", "code", "quoted", "tags"],
      additionalProperties: false,
    };
    const validate = new Ajv().compile(schema);
    const texts = await walks(schema, 11);
    let escapes = 0;
    for (const text of texts) {
      let value: unknown;
      assert.doesNotThrow(
        () => {
          value = JSON.parse(text);
        },
        `not JSON: ${JSON.stringify(text)}`,
      );
      assert.ok(validate(value), `${text}: ${JSON.stringify(validate.errors)}`);
      if (/\\"/.test(text)) escapes++;
    }
    assert.equal(escapes, WALKS, "the pattern's literal quote is written escaped in every output");
  });
});
