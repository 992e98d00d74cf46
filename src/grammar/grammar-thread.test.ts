/**
 * The engine's grammar threads (grammar-thread.ts) against this thread's grammar engine: the same
 * masks, step by step; a compile placed on a thread holding no matcher, a cache hit on the thread
 * that compiled it; a refusal as `invalid_request`.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { ModelTokenizer } from "../tokenizer/tokenizer.js";
import { GrammarEngine } from "./grammar-engine.js";
import { GrammarThreads } from "./grammar-thread.js";
import { grammarVocab } from "./grammar-vocab.js";

const DIR = new URL("../../../models/kvfence-tiny", import.meta.url).pathname;
const tokenizer = ModelTokenizer.fromFolder(DIR);
const VOCAB = 264;
const EOS = tokenizer.tokenId("<|im_end|>") ?? tokenizer.tokenId("<|endoftext|>")!;
const GRAMMAR = { kind: "grammar", ebnf: 'root ::= [a-c] [0-9] ("," [a-c] [0-9])*' } as const;

describe("grammar threads", () => {
  it("GrammarThreads.bind() masks as this thread's matcher does, token after token", async () => {
    const threads = new GrammarThreads({ tokenizerPath: DIR, vocabSize: VOCAB });
    const local = await GrammarEngine.create(grammarVocab(tokenizer), VOCAB);
    const text = Array.from(tokenizer.encode("b4,a1,c9", { addSpecialTokens: false }));
    // Bound after the first token, as a decode node's sequence is.
    const remote = await threads.bind(1, GRAMMAR, [EOS], text.slice(0, 1));
    const mine = local.matcher(1, GRAMMAR, [EOS]);
    mine.accept(text[0]!);
    for (const token of [...text.slice(1), EOS]) {
      const a = new Float32Array(VOCAB);
      const b = new Float32Array(VOCAB);
      remote.mask(a);
      mine.mask(b);
      assert.deepEqual(a, b);
      assert.equal(a[token], 0, "the text's next token is allowed");
      remote.accept(token);
      mine.accept(token);
    }
    remote.dispose();
    threads.close();
  });

  it("GrammarThreads.bind() compiles on a thread holding no matcher; a cache hit goes to the thread that compiled it", async () => {
    const threads = new GrammarThreads({ tokenizerPath: DIR, vocabSize: VOCAB });
    const first = await threads.bind(1, GRAMMAR, [EOS], []);
    assert.equal(threads.threads, 1);
    // The same tenant's same grammar: its thread's cache, though that thread holds a matcher.
    const hit = await threads.bind(1, GRAMMAR, [EOS], []);
    assert.equal(threads.threads, 1);
    // Another tenant's: a compile, so a thread of its own while the first holds matchers.
    const other = await threads.bind(2, GRAMMAR, [EOS], []);
    assert.equal(threads.threads, 2);
    for (const m of [first, hit, other]) m.dispose();
    // Every thread empty: a new compile takes one of them.
    (await threads.bind(3, { kind: "json_object" }, [EOS], [])).dispose();
    assert.equal(threads.threads, 2);
    threads.close();
  });

  it("GrammarThreads.bind() rejects a grammar xgrammar cannot compile with invalid_request naming the construct", async () => {
    const threads = new GrammarThreads({ tokenizerPath: DIR, vocabSize: VOCAB });
    await assert.rejects(
      threads.bind(1, { kind: "grammar", ebnf: "root ::= foo" }, [EOS], []),
      (err: unknown) => {
        assert.equal((err as { code?: string }).code, "invalid_request");
        assert.match((err as Error).message, /Rule "foo" is not defined/);
        return true;
      },
    );
    threads.close();
  });
});
