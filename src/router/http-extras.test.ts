/**
 * The HTTP additions of issue #17 item 6, on the router alone (a scripted engine, the byte
 * tokenizer; real HTTP on 127.0.0.1, the official `openai` client where it applies): `x-request-id`
 * echoed or generated on every response and carried into the router's log lines; CORS with
 * `allowedOrigins` and its preflight; vLLM's /tokenize and /detokenize; /v1/completions without
 * `max_tokens` generating 16; `stream_options.continuous_usage_stats`.
 */
import assert from "node:assert/strict";
import { PassThrough } from "node:stream";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { BYTE_EOS, byteTokenizer, ScriptedEngine } from "../../testing/scripted-engine.js";
import { TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { createLogger } from "../lib/logger.js";
import { TenantDirectory } from "./api-keys.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";
const KEY = "sk-http-extras-0001";
const ORIGIN = "https://app.example";

describe("HTTP additions (issue #17)", () => {
  const engine = new ScriptedEngine({ script: () => [...Buffer.from("x".repeat(40))] });
  const logLines: Record<string, unknown>[] = [];
  let server: RouterServer;
  let url: string;
  let client: OpenAI;

  before(async () => {
    const destination = new PassThrough();
    destination.on("data", (chunk: Buffer) => {
      for (const line of chunk.toString("utf8").split("\n")) if (line !== "") logLines.push(JSON.parse(line));
    });
    server = new RouterServer({
      engine,
      tokenizer: byteTokenizer,
      model: {
        id: MODEL,
        maxPositionEmbeddings: 2048,
        eosTokenIds: [BYTE_EOS],
        defaults: { temperature: 0 },
      },
      tenants: TenantDirectory.parse(`${KEY} alpha`, "test keys"),
      logger: createLogger({ level: "info", destination }),
      operatorKey: TEST_OPERATOR_KEY,
      allowedOrigins: [ORIGIN],
    });
    url = await server.listen(0, "127.0.0.1");
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY, maxRetries: 0 });
  });
  after(() => server.close());

  const send = (path: string, init: RequestInit = {}, key: string | null = KEY) =>
    fetch(`${url}${path}`, {
      ...init,
      headers: {
        ...(init.body === undefined ? {} : { "content-type": "application/json" }),
        ...(key === null ? {} : { authorization: `Bearer ${key}` }),
        ...(init.headers as Record<string, string> | undefined),
      },
    });
  const chat = { model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 3 };

  test("x-request-id: echoed when usable, else generated, on every kind of response; in the log", async () => {
    const cases: [string, RequestInit, string | null, number][] = [
      ["/v1/chat/completions", { method: "POST", body: JSON.stringify(chat) }, KEY, 200],
      ["/v1/chat/completions", { method: "POST", body: JSON.stringify({ ...chat, stream: true }) }, KEY, 200],
      ["/v1/chat/completions", { method: "POST", body: JSON.stringify({ ...chat, n: 0 }) }, KEY, 400],
      ["/v1/models", {}, null, 401],
      ["/nowhere", {}, KEY, 404],
      ["/v1/models", { method: "DELETE" }, KEY, 405],
      ["/health", {}, null, 200],
    ];
    for (const [path, init, key, status] of cases) {
      const echoed = await send(path, { ...init, headers: { "x-request-id": "my-trace-1" } }, key);
      await echoed.text();
      assert.equal(echoed.status, status, path);
      assert.equal(echoed.headers.get("x-request-id"), "my-trace-1", `${path} ${status}`);
      for (const given of [undefined, "has space", "x".repeat(129)]) {
        const res = await send(
          path,
          { ...init, headers: given === undefined ? {} : { "x-request-id": given } },
          key,
        );
        await res.text();
        assert.match(res.headers.get("x-request-id") ?? "", /^[0-9a-f-]{36}$/, `${path} given ${given}`);
      }
    }
    const done = logLines.filter((l) => l.msg === "request done" && l.requestId === "my-trace-1");
    assert.ok(done.length >= 2, "the router's log line of each request carries its id");
  });

  test("CORS: an allowed origin gets the headers and its preflight a 204; another origin neither", async () => {
    const allowed = await send("/v1/models", { headers: { origin: ORIGIN } });
    await allowed.text();
    assert.equal(allowed.headers.get("access-control-allow-origin"), ORIGIN);
    assert.match(allowed.headers.get("access-control-expose-headers") ?? "", /x-request-id/);
    const other = await send("/v1/models", { headers: { origin: "https://evil.example" } });
    await other.text();
    assert.equal(other.headers.get("access-control-allow-origin"), null);
    const preflight = (origin: string) =>
      send(
        "/v1/chat/completions",
        {
          method: "OPTIONS",
          headers: {
            origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
          },
        },
        null,
      );
    const ok = await preflight(ORIGIN);
    assert.equal(ok.status, 204);
    assert.equal(ok.headers.get("access-control-allow-origin"), ORIGIN);
    assert.match(ok.headers.get("access-control-allow-methods") ?? "", /POST/);
    assert.match(ok.headers.get("access-control-allow-headers") ?? "", /authorization/);
    const refused = await preflight("https://evil.example");
    await refused.text();
    assert.equal(refused.status, 405);
  });

  test("/tokenize and /detokenize in vLLM's shapes, behind the API key", async () => {
    const text = await send("/tokenize", {
      method: "POST",
      body: JSON.stringify({ model: MODEL, prompt: "abc" }),
    });
    assert.deepEqual(await text.json(), {
      count: 3,
      max_model_len: 1024,
      tokens: [97, 98, 99],
      token_strs: null,
    });
    const messages = await send("/tokenize", {
      method: "POST",
      body: JSON.stringify({ messages: chat.messages }),
    });
    const tokens = (await messages.json()) as { count: number; tokens: number[] };
    assert.deepEqual(tokens.tokens, Array.from(byteTokenizer.encodeChat([{ role: "user", content: "hi" }])));
    const back = await send("/detokenize", { method: "POST", body: JSON.stringify({ tokens: [104, 105] }) });
    assert.deepEqual(await back.json(), { prompt: "hi" });
    const wrong = await send("/detokenize", { method: "POST", body: JSON.stringify({ tokens: [999] }) });
    assert.equal(wrong.status, 400);
    assert.equal(((await wrong.json()) as { error: { param: string } }).error.param, "tokens");
    const other = await send("/tokenize", {
      method: "POST",
      body: JSON.stringify({ model: "gpt-9", prompt: "a" }),
    });
    assert.equal(other.status, 404);
    const anonymous = await send(
      "/tokenize",
      { method: "POST", body: JSON.stringify({ prompt: "a" }) },
      null,
    );
    assert.equal(anonymous.status, 401);
  });

  test("/v1/completions without max_tokens generates 16 (OpenAI's legacy default); chat the rest of the context", async () => {
    const res = await client.completions.create({ model: MODEL, prompt: "abcd" });
    assert.equal(engine.submitted.at(-1)?.maxTokens, 16);
    assert.equal(res.usage?.completion_tokens, 16);
    assert.equal(res.choices[0]!.finish_reason, "length");
    await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "a" }] });
    assert.ok(engine.submitted.at(-1)!.maxTokens > 16);
  });

  test("stream_options.continuous_usage_stats: every chunk carries the usage so far", async () => {
    const stream = await client.chat.completions.create({
      ...chat,
      messages: [{ role: "user", content: "hi" }],
      max_tokens: 4,
      stream: true,
      stream_options: {
        include_usage: true,
        continuous_usage_stats: true,
      } as OpenAI.ChatCompletionStreamOptions,
    });
    const usages: (number | undefined)[] = [];
    for await (const chunk of stream) usages.push(chunk.usage?.completion_tokens);
    // The role chunk counts 0 tokens (vLLM's first chunk); each later chunk counts the tokens so far
    // (the 4th carries the finish, issue #34), then the total.
    assert.deepEqual(usages, [0, 1, 2, 3, 4, 4]);
  });
});
