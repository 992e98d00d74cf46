import assert from "node:assert/strict";
import { test } from "node:test";
import { byteTokenizer } from "../../testing/scripted-engine.js";
import { parseCompletionRequest } from "./openai-schemas.js";
import { defaultMaxResponseBytes } from "./request-limits.js";
import {
  type ResponsePlan,
  responseSizeRefusal,
  tokenBounds,
  worstCaseResponseBytes,
} from "./response-size.js";

test("tokenBounds() sums the longest token texts and byte counts of the vocabulary", () => {
  const pieces = ["a", "\u0001", "hello", '"q"', ""];
  const bounds = tokenBounds(pieces.length, (id) => ({ text: pieces[id]!, bytes: Buffer.from(pieces[id]!) }));
  // JSON with quotes: "hello" 7, "\"q\"" 7, "\u0001" 8, "a" 3, "" 2.
  assert.deepEqual(bounds.textBytes.slice(0, 7), [0, 8, 15, 22, 25, 27, 27]);
  assert.deepEqual(bounds.rawBytes.slice(0, 4), [0, 5, 8, 9]);
  assert.equal(bounds.textBytes.length, 22);
  // The byte tokenizer: `<|im_start|>` is its longest token.
  assert.equal(byteTokenizer.tokenBounds.rawBytes[1], "<|im_start|>".length);
});

const plan = (body: Record<string, unknown>, prompts: ResponsePlan["prompts"]): ResponsePlan => ({
  endpoint: "completions",
  parsed: parseCompletionRequest({ model: "m", prompt: "p", ...body }),
  prompts,
  bodyBytes: JSON.stringify(body).length,
  modelId: "m",
});

test("worstCaseResponseBytes() grows with n, max_tokens, logprobs, prompt_logprobs and echo", () => {
  const bounds = byteTokenizer.tokenBounds;
  const base = worstCaseResponseBytes(plan({}, [{ tokens: 1800, maxTokens: 100 }]), bounds);
  for (const more of [
    { n: 2 },
    { logprobs: 1 },
    { prompt_logprobs: 1 },
    { stream: true },
    { echo: true, logprobs: 1 },
  ]) {
    const bytes = worstCaseResponseBytes(plan(more, [{ tokens: 1800, maxTokens: 100 }]), bounds);
    assert.ok(bytes > base, `${JSON.stringify(more)}: ${bytes} > ${base}`);
  }
  const longer = worstCaseResponseBytes(plan({}, [{ tokens: 1800, maxTokens: 200 }]), bounds);
  assert.ok(longer > base);
});

test("responseSizeRefusal() names the answer's worst case, the limit, what to lower and the flag", () => {
  const request = { n: 64, echo: true, logprobs: 20, prompt_logprobs: 20, max_tokens: 100 };
  const issue = plan(request, [{ tokens: 1800, maxTokens: 100 }]);
  const refusal = responseSizeRefusal(issue, byteTokenizer.tokenBounds, defaultMaxResponseBytes(2048));
  assert.equal(refusal?.code, "response_too_large");
  assert.equal(refusal?.status, 400);
  assert.match(
    refusal?.message ?? "",
    /^The answer to this request could take up to \d{9} bytes, over this server's limit of 67108864 bytes: lower n \(64\), max_tokens \(100\), logprobs \(20\) or prompt_logprobs \(20\), or drop echo \(the operator sets the limit with --max-response-bytes\)$/,
  );
  const bytes = worstCaseResponseBytes(issue, byteTokenizer.tokenBounds);
  assert.equal(responseSizeRefusal(issue, byteTokenizer.tokenBounds, bytes), null);
  assert.match(
    responseSizeRefusal(issue, byteTokenizer.tokenBounds, bytes - 1)?.message ?? "",
    /limit of \d+ bytes/,
  );
  const plain = plan({ max_tokens: 10 }, [
    { tokens: 10, maxTokens: 10 },
    { tokens: 10, maxTokens: 10 },
  ]);
  assert.match(
    responseSizeRefusal(plain, byteTokenizer.tokenBounds, 100)?.message ?? "",
    /: lower the number of prompts \(2\) or max_tokens \(10\) \(the operator/,
  );
});

test("defaultMaxResponseBytes() fits one streamed choice over the whole context, without log-probabilities", () => {
  for (const context of [2048, 32_768, 131_072]) {
    const stream = {
      ...plan({ stream: true, stream_options: { include_usage: true, continuous_usage_stats: true } }, [
        { tokens: 1, maxTokens: context - 1 },
      ]),
      endpoint: "chat" as const,
    };
    const bytes = worstCaseResponseBytes(stream, byteTokenizer.tokenBounds);
    assert.ok(bytes <= defaultMaxResponseBytes(context), `${context}: ${bytes}`);
  }
});
