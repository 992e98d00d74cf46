/**
 * The reasoning parsers over answers written as the models write them, each split at every point
 * and at random points (tags cut across pieces, one character a piece): the stream's parts joined
 * equal the whole answer's split, and the two parts with the tags give back the answer.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { type ReasoningParserName, ReasoningSplitter, splitReasoning } from "./reasoning-parser.js";

/** [parser, raw answer, reasoning, content]. */
const FIXTURES: readonly [ReasoningParserName, string, string | null, string][] = [
  // DeepSeek-R1: the template opened <think>; the answer starts inside the block.
  [
    "deepseek_r1",
    "Let me add 2 and 3.\nThat is 5.\n</think>\n\nThe answer is 5.",
    "Let me add 2 and 3.\nThat is 5.\n",
    "\n\nThe answer is 5.",
  ],
  // ... or the model writes <think> itself (older templates).
  ["deepseek_r1", "<think>\nhmm</think>ok", "\nhmm", "ok"],
  // Cut off while thinking (max_tokens): all reasoning.
  ["deepseek_r1", "I think the</thi", "I think the</thi", ""],
  ["deepseek_r1", "<thi", "<thi", ""],
  // After the block everything is content, tags included.
  ["deepseek_r1", "a</think>b</think><think>c", "a", "b</think><think>c"],
  // Qwen3 thinking.
  [
    "qwen3",
    "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
    "\nThe user greets me.\n",
    "\n\nHello! How can I help?",
  ],
  // Qwen3 with thinking off: no block, no reasoning; a <think> later is content.
  ["qwen3", "Hello! <think> is a tag.", null, "Hello! <think> is a tag."],
  ["qwen3", "<thin", null, "<thin"],
  ["qwen3", "<think></think>Hi", null, "Hi"],
  ["qwen3", "<think>unfinished", "unfinished", ""],
  ["qwen3", "", null, ""],
  // Characters outside the BMP and near-tags inside the block.
  ["qwen3", "<think>🙂 </thinking> </ think></think>😀", "🙂 </thinking> </ think>", "😀"],
];

/** Streams `pieces` through a splitter: the joined reasoning and content. */
function stream(parser: ReasoningParserName, pieces: readonly string[]): [string, string] {
  const splitter = new ReasoningSplitter(parser);
  let reasoning = "";
  let content = "";
  for (const piece of [...pieces.map((p) => splitter.push(p)), splitter.flush()]) {
    reasoning += piece.reasoning;
    content += piece.content;
  }
  return [reasoning, content];
}

test("splitReasoning() splits each fixture answer into reasoning and content", () => {
  for (const [parser, raw, reasoning, content] of FIXTURES)
    assert.deepEqual(
      splitReasoning(parser, raw),
      { reasoning, content },
      `${parser}: ${JSON.stringify(raw)}`,
    );
});

test("ReasoningSplitter.push() splits the same at every cut, at random cuts and a character at a time", () => {
  let seed = 7;
  const random = () => {
    seed = (seed * 1_103_515_245 + 12_345) % 2 ** 31;
    return seed / 2 ** 31;
  };
  for (const [parser, raw, reasoning, content] of FIXTURES) {
    const want = [reasoning ?? "", content];
    for (let i = 0; i <= raw.length; i++)
      assert.deepEqual(stream(parser, [raw.slice(0, i), raw.slice(i)]), want);
    assert.deepEqual(stream(parser, [...raw]), want);
    for (let run = 0; run < 50; run++) {
      const pieces: string[] = [];
      for (let at = 0; at < raw.length; ) {
        const n = 1 + Math.floor(random() * 4);
        pieces.push(raw.slice(at, at + n));
        at += n;
      }
      assert.deepEqual(stream(parser, pieces), want, JSON.stringify(pieces));
    }
  }
});

test("ReasoningSplitter.push() holds back only what may be a tag", () => {
  const splitter = new ReasoningSplitter("qwen3");
  assert.deepEqual(splitter.push("<thi"), { reasoning: "", content: "" });
  assert.deepEqual(splitter.push("nk>abc</"), { reasoning: "abc", content: "" });
  assert.equal(splitter.inContent, false);
  assert.deepEqual(splitter.push("b>"), { reasoning: "</b>", content: "" });
  assert.deepEqual(splitter.push("</think>x"), { reasoning: "", content: "x" });
  assert.equal(splitter.inContent, true);
});
