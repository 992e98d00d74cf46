import assert from "node:assert/strict";
import { test } from "node:test";
import { jsonText } from "../lib/json-chunks.js";
import type { TokenLogprobs } from "../lib/token-logprobs.js";
import { choicesLogprobs } from "./choice-logprobs.js";
import { textLogprobs, vllmPromptLogprobs } from "./logprobs-wire.js";
import { CHAT_RESPONSES, TEXT_RESPONSES } from "./openai-responses.js";
import { parseChatRequest, parseCompletionRequest } from "./openai-schemas.js";

const PROMPT = Int32Array.from({ length: 300 }, (_, i) => 65 + (i % 26));
const entry = (token: number, i: number): TokenLogprobs => ({
  token,
  logprob: -i / 100,
  rank: 1 + (i % 3),
  top: Array.from({ length: 20 }, (_, j) => [65 + ((i + j) % 26), -j / 10] as const),
});
const ENTRIES = Array.from(PROMPT, (token, i) => (i === 0 ? null : entry(token, i)));
const OUTPUT = [entry(66, 1), entry(67, 2), entry(68, 3)];

/** The whole answer's logprobs of `n` echoing choices, and how many token pieces it took to write it. */
function answer(n: number) {
  let pieces = 0;
  const piece = (id: number) => {
    pieces++;
    return { text: String.fromCharCode(id), bytes: [id] };
  };
  const parsed = parseCompletionRequest({
    model: "m",
    prompt: "p",
    n,
    echo: true,
    logprobs: 5,
    prompt_logprobs: 3,
  });
  const choices = choicesLogprobs(
    Array.from({ length: n }, () => ({ request: { promptTokens: PROMPT }, echo: "prompt" })),
    { parsed, piece, responses: TEXT_RESPONSES },
  );
  choices[0]!.prompt.set(ENTRIES);
  for (const { logprobs } of choices) for (const e of OUTPUT) logprobs.push(e);
  const text = jsonText(choices.map(({ logprobs }) => logprobs.all()));
  return { text, pieces, piece };
}

test("choicesLogprobs() renders a prompt's log-probabilities once for all its choices", () => {
  const one = answer(1);
  const many = answer(64);
  // Each choice shows the same prompt entries as one choice alone…
  const single = JSON.parse(one.text) as unknown[];
  for (const choice of JSON.parse(many.text) as unknown[]) assert.deepEqual(choice, single[0]);
  // …rendered once: 64 choices take their own output tokens' pieces 64 times, the prompt's once.
  const own = 64 * OUTPUT.length * 22;
  assert.ok(many.pieces <= one.pieces + own, `${many.pieces} pieces for 64 choices, ${one.pieces} for one`);
  // The same lists as rendered directly: echo's tokens then the output's, offsets running on.
  const offset = { value: 0 };
  const items = Array.from(PROMPT, (token, i) => {
    const e = ENTRIES[i] ?? null;
    return { token, entry: e === null ? null : { ...e, top: e.top.slice(0, 5) } };
  });
  const echo = JSON.parse(jsonText(textLogprobs(items, one.piece, offset))) as Record<string, unknown[]>;
  const out = JSON.parse(
    jsonText(
      textLogprobs(
        OUTPUT.map((e) => ({ token: e.token, entry: e })),
        one.piece,
        offset,
      ),
    ),
  ) as Record<string, unknown[]>;
  const want = Object.fromEntries(Object.keys(echo).map((k) => [k, [...echo[k]!, ...out[k]!]]));
  assert.deepEqual((single[0] as { logprobs: unknown }).logprobs, want);
  assert.deepEqual(
    (single[0] as { promptLogprobs: unknown }).promptLogprobs,
    JSON.parse(jsonText(vllmPromptLogprobs(ENTRIES, 3, one.piece))),
  );
});

test("choicesLogprobs() gives each prompt of a request its own shared log-probabilities", () => {
  const other = Int32Array.from([70, 71, 72]);
  const parsed = parseChatRequest({
    model: "m",
    messages: [{ role: "user", content: "hi" }],
    logprobs: true,
    top_logprobs: 2,
    prompt_logprobs: 1,
  });
  const piece = (id: number) => ({ text: String.fromCharCode(id), bytes: [id] });
  const choices = choicesLogprobs(
    [PROMPT, PROMPT, other].map((promptTokens) => ({ request: { promptTokens }, echo: null })),
    { parsed, piece, responses: CHAT_RESPONSES },
  );
  assert.equal(choices[0]!.prompt, choices[1]!.prompt);
  assert.notEqual(choices[0]!.prompt, choices[2]!.prompt);
  assert.equal(choices[2]!.logprobs.echoed(), null);
  // Before its first sample computed them, a prompt has no prompt_logprobs to show.
  assert.equal(jsonText(choices[2]!.logprobs.all()), '{"logprobs":{"content":[],"refusal":null}}');
});
