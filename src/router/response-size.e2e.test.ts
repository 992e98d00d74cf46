/**
 * The cap on an answer's size (`--max-response-bytes`, issue #31 finding 1), on a real server
 * (kvfence-tiny, one engine, default limits) through real HTTP:
 * - the issue's request — a 1.9 KB body whose answer would be 215 MB — gets a 400
 *   `response_too_large` from the official `openai` client's point of view, naming the default
 *   limit and what to lower, before any work: the engine never sees it (no prefill token counted),
 *   and it is counted in `kvfence_admission_rejections_total{reason="response_too_large"}`;
 * - the worst case the router computes bounds every real answer: chat, completions and the
 *   Responses API, whole and streamed, with echo, every kind of log-probabilities, several prompts
 *   and choices, stop strings and vLLM's continuous usage (each worst case computed as the router
 *   does, from the same preparation of the same body).
 * Its latency side (that such an answer, once admitted, stalls no one) is
 * src/router/response-size-attack.solo.test.ts.
 */
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import OpenAI from "openai";
import type { CompletionCreateParamsNonStreaming } from "openai/resources/completions";
import { ISSUE_31_REQUEST } from "../../testing/issue-31-request.js";
import { modelDir, scrape, startTestServer, type TestServer } from "../../testing/start-server.js";
import { loadChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";
import { admit } from "./admission.js";
import { routerTokenizer } from "./model-tokenizer.js";
import { inThreadPreparer } from "./prepare-pool.js";
import type { GenerateEndpointName } from "./prepare-request.js";
import { requestLimits } from "./request-limits.js";
import { worstCaseResponseBytes } from "./response-size.js";

const MODEL = ISSUE_31_REQUEST.model;
const KEY = "sk-response-size-01";
const REJECTED = 'kvfence_admission_rejections_total{reason="response_too_large"}';
const PREFILLED = "kvfence_prefill_tokens_total";

let server: TestServer;
before(async () => {
  // Room for the issue's 64 samples at once (each 1,900 tokens: 119 pages), so that nothing but the
  // answer's size refuses it.
  server = await startTestServer({
    model: modelDir(MODEL),
    apiKeys: { [KEY]: "alpha" },
    kvPages: 8192,
    maxNumSeqs: 80,
  });
});
after(() => server?.close());

test("the issue's request gets 400 response_too_large naming the default limit, before any work", async () => {
  const client = new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0 });
  const before = await scrape(server.url);
  const refused = await client.completions
    .create(ISSUE_31_REQUEST as unknown as CompletionCreateParamsNonStreaming)
    .then(
      () => assert.fail("answered"),
      (err: unknown) => err,
    );
  assert.ok(refused instanceof OpenAI.BadRequestError, String(refused));
  assert.equal(refused.code, "response_too_large");
  assert.match(
    refused.message,
    /could take up to \d{9} bytes, over this server's limit of 67108864 bytes: lower n \(64\), max_tokens \(100\), logprobs \(20\) or prompt_logprobs \(20\), or drop echo \(the operator sets the limit with --max-response-bytes\)$/,
  );
  const afterwards = await scrape(server.url);
  assert.equal((afterwards.get(REJECTED) ?? 0) - (before.get(REJECTED) ?? 0), 1);
  assert.equal(afterwards.get(PREFILLED) ?? 0, before.get(PREFILLED) ?? 0, "the engine never saw it");
  // Lowered as the message says, it is served.
  const served = await client.completions.create({
    ...ISSUE_31_REQUEST,
    n: 2,
  } as unknown as CompletionCreateParamsNonStreaming);
  assert.equal(served.choices.length, 2);
});

/** Bodies of every shape of answer, each small enough to be served. */
const CASES: readonly { readonly endpoint: GenerateEndpointName; readonly body: Record<string, unknown> }[] =
  [
    {
      endpoint: "completions",
      body: {
        prompt: "The access code is",
        n: 3,
        echo: true,
        logprobs: 5,
        prompt_logprobs: 5,
        max_tokens: 20,
      },
    },
    {
      endpoint: "completions",
      body: { prompt: ['a\u0001"b', "é😀 c"], n: 2, echo: true, logprobs: 20, max_tokens: 12, stream: true },
    },
    {
      endpoint: "completions",
      body: {
        prompt: "x ".repeat(300),
        logprobs: 20,
        prompt_logprobs: 20,
        max_tokens: 40,
        ignore_eos: true,
        stop: ["zz", "\u0002"],
        include_stop_str_in_output: true,
      },
    },
    {
      endpoint: "chat",
      body: {
        messages: [{ role: "user", content: "What is the access code of account 4242?" }],
        n: 2,
        logprobs: true,
        top_logprobs: 20,
        prompt_logprobs: 20,
        max_tokens: 30,
        ignore_eos: true,
      },
    },
    {
      endpoint: "chat",
      body: {
        messages: [{ role: "user", content: "hi" }],
        logprobs: true,
        top_logprobs: 3,
        max_tokens: 30,
        skip_special_tokens: false,
        stream: true,
        stream_options: { include_usage: true, continuous_usage_stats: true },
      },
    },
    {
      endpoint: "responses",
      body: { input: "hi", instructions: "Answer briefly", metadata: { a: "1e20" }, max_output_tokens: 30 },
    },
    { endpoint: "responses", body: { input: "hi", max_output_tokens: 30, stream: true } },
  ];

const PATHS = { chat: "/v1/chat/completions", completions: "/v1/completions", responses: "/v1/responses" };

test("worstCaseResponseBytes() bounds every answer: whole and streamed, every endpoint, every log-probability", async (t) => {
  const dir = modelDir(MODEL);
  const tokenizer = ModelTokenizer.fromFolder(dir);
  const router = routerTokenizer(tokenizer, loadChatTemplate(dir, tokenizer));
  const limits = requestLimits(server.contextLength);
  const preparer = inThreadPreparer({ modelId: MODEL, tokenizer: router, limits });
  for (const { endpoint, body } of CASES) {
    const raw = Buffer.from(JSON.stringify({ model: MODEL, ...body }));
    const { parsed, prompts } = await preparer.prepare(endpoint, raw, 0);
    const admitted = prompts.map((tokens) => {
      const admission = admit(tokens.length, parsed.maxTokens, server.contextLength);
      assert.ok(admission.ok);
      return { tokens: tokens.length, maxTokens: admission.maxTokens };
    });
    const bound = worstCaseResponseBytes(
      { endpoint, parsed, prompts: admitted, bodyBytes: raw.length, modelId: MODEL },
      router.tokenBounds,
    );
    const res = await fetch(`${server.url}${PATHS[endpoint]}`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
      body: raw,
    });
    const answer = Buffer.from(await res.arrayBuffer());
    assert.equal(res.status, 200, answer.toString().slice(0, 300));
    t.diagnostic(`${endpoint} ${JSON.stringify(body).slice(0, 60)}: ${answer.length} bytes, bound ${bound}`);
    assert.ok(
      answer.length <= bound,
      `${answer.length} bytes over the bound of ${bound}: ${JSON.stringify(body)}`,
    );
  }
});
