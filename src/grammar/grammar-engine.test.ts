import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { Worker } from "node:worker_threads";
import { KvfenceError } from "../lib/errors.js";
import { ModelTokenizer } from "../tokenizer/tokenizer.js";
import { compileCheck, GrammarEngine, maskLogits } from "./grammar-engine.js";
import { grammarVocab } from "./grammar-vocab.js";

const tokenizer = ModelTokenizer.fromFolder(
  new URL("../../../models/kvfence-tiny", import.meta.url).pathname,
);
const vocab = grammarVocab(tokenizer);
const VOCAB = 264;
const EOS = tokenizer.tokenId("<|im_end|>") ?? tokenizer.tokenId("<|endoftext|>")!;

/** The ids the matcher allows next. */
function allowedIds(engine: GrammarEngine, matcher: ReturnType<GrammarEngine["matcher"]>): number[] {
  const logits = new Float32Array(engine.vocabSize);
  matcher.mask(logits);
  return [...logits.keys()].filter((i) => logits[i] === 0);
}

describe("grammar engine", () => {
  it("grammarVocab() reads a byte-level BPE vocabulary", () => {
    assert.equal(vocab.vocabType, "byte_level");
    assert.equal(vocab.prependSpace, false);
    assert.equal(vocab.tokens[EOS], tokenizer.vocabulary()[EOS]);
  });

  it("GrammarEngine.matcher() masks every token but the grammar's next, then only the stop token", async () => {
    const engine = await GrammarEngine.create(vocab, VOCAB);
    const m = engine.matcher(1, { kind: "grammar", ebnf: 'root ::= "ab" | "ac"' }, [EOS]);
    const a = tokenizer.encode("a", { addSpecialTokens: false })[0]!;
    assert.deepEqual(allowedIds(engine, m), [a]);
    assert.equal(m.accept(a), true);
    const next = allowedIds(engine, m).map((id) => tokenizer.decode([id]));
    assert.deepEqual(next.sort(), ["b", "c"]);
    assert.equal(m.accept(tokenizer.encode("b", { addSpecialTokens: false })[0]!), true);
    assert.deepEqual(allowedIds(engine, m), [EOS]);
    assert.equal(m.accept(a), false, "a token the grammar forbids is refused");
    assert.equal(m.accept(EOS), true);
    assert.equal(m.terminated, true);
    m.dispose();
    m.dispose(); // a second dispose frees nothing twice
  });

  it("GrammarEngine.compile() caches per tenant: another tenant's identical schema is its own entry", async () => {
    const engine = await GrammarEngine.create(vocab, VOCAB);
    const c = { kind: "json_schema", schema: '{"type":"object"}', strict: true } as const;
    const first = engine.compile(1, c);
    assert.equal(engine.compile(1, c), first, "tenant 1's second request hits its cache");
    assert.equal(engine.cached(2), 0);
    assert.notEqual(engine.compile(2, c), first, "tenant 2 compiles its own");
    assert.equal(engine.cached(1), 1);
    assert.equal(engine.cached(2), 1);
  });

  it("compileCheck() refuses a grammar xgrammar cannot compile with invalid_request naming the construct", async () => {
    await assert.rejects(compileCheck({ kind: "grammar", ebnf: "root ::= foo" }, vocab), (err: unknown) => {
      assert.ok(err instanceof KvfenceError);
      assert.equal(err.code, "invalid_request");
      assert.equal(err.param, "grammar");
      assert.match(err.message, /^The grammar cannot be compiled: .*Rule "foo" is not defined/);
      return true;
    });
    const lookbehind = JSON.stringify({
      type: "object",
      properties: { a: { type: "string", pattern: "(?<=a)b" } },
    });
    await assert.rejects(
      compileCheck({ kind: "json_schema", schema: lookbehind, strict: true }, vocab),
      /The JSON schema cannot be compiled: .*Lookbehind is not supported/,
    );
    await compileCheck({ kind: "json_object" }, vocab);
  });

  it("maskLogits() keeps exactly the set bits, past the last whole word too", () => {
    const logits = new Float32Array(40);
    maskLogits(logits, Int32Array.of(1 << 3, 1 << 7), 40);
    assert.deepEqual(
      [...logits.keys()].filter((i) => logits[i] === 0),
      [3, 39],
    );
  });

  it("GrammarEngine.create() loads xgrammar in a worker thread", async () => {
    const url = new URL("./grammar-engine.js", import.meta.url).href;
    const dir = new URL("../../../models/kvfence-tiny", import.meta.url).pathname;
    const worker = new Worker(
      `import { GrammarEngine } from ${JSON.stringify(url)};
       import { grammarVocab } from ${JSON.stringify(new URL("./grammar-vocab.js", import.meta.url).href)};
       import { ModelTokenizer } from ${JSON.stringify(new URL("../tokenizer/tokenizer.js", import.meta.url).href)};
       import { parentPort } from "node:worker_threads";
       const e = await GrammarEngine.create(grammarVocab(ModelTokenizer.fromFolder(${JSON.stringify(dir)})), 264);
       const l = new Float32Array(264);
       e.matcher(1, { kind: "json_object" }, [0]).mask(l);
       parentPort.postMessage(l.filter((x) => x === 0).length);`,
      { eval: true },
    );
    const allowed = await new Promise((resolve, reject) => {
      worker.once("message", resolve);
      worker.once("error", reject);
    });
    await worker.terminate();
    assert.equal(allowed, 1, "a JSON object starts with '{' only");
  });
});
