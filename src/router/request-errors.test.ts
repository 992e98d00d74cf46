/**
 * Requests that used to get a 500, a bare status line or no answer at all, and the Content-Type
 * rule (docs/api.md "Content-Type", docs/errors.md): each now gets a 4xx with the OpenAI error
 * envelope, and the server keeps serving. The HTTP layer against a scripted engine
 * (testing/scripted-engine.ts); the fuzz test (fuzz.e2e.test.ts) looks for more of them.
 */
import assert from "node:assert/strict";
import { connect } from "node:net";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { BYTE_EOS, byteTokenizer, ScriptedEngine } from "../../testing/scripted-engine.js";
import { KvfenceError } from "../lib/errors.js";
import { createLogger } from "../lib/logger.js";
import { TenantDirectory } from "./api-keys.js";
import { parseChatRequest, parseCompletionRequest } from "./openai-schemas.js";
import { RouterServer } from "./router-server.js";

const MODEL = "tiny-test";
const CHAT = JSON.stringify({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 2 });

interface ErrorBody {
  readonly error: { message: string; type: string; param: string | null; code: string };
}

/** One raw HTTP/1.1 exchange on a fresh connection: what the server wrote until it closed. */
function rawExchange(port: number, bytes: Buffer): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, "127.0.0.1", () => socket.end(bytes));
    const chunks: Buffer[] = [];
    socket.on("data", (c: Buffer) => chunks.push(c));
    socket.on("error", reject);
    socket.on("close", () => resolve(Buffer.concat(chunks).toString("utf8")));
  });
}

function envelopeOf(raw: string): ErrorBody {
  const body = raw.slice(raw.indexOf("\r\n\r\n") + 4);
  return JSON.parse(body) as ErrorBody;
}

describe("RouterServer refusals with the OpenAI error envelope", () => {
  let server: RouterServer;
  let url: string;
  let port: number;
  let client: OpenAI;

  before(async () => {
    server = new RouterServer({
      engine: new ScriptedEngine(),
      tokenizer: byteTokenizer,
      model: {
        id: MODEL,
        maxPositionEmbeddings: 2048,
        eosTokenIds: [BYTE_EOS],
        defaults: { temperature: 0 },
      },
      tenants: TenantDirectory.anonymous(),
      logger: createLogger({ level: "silent" }),
    });
    url = await server.listen(0, "127.0.0.1");
    port = Number(new URL(url).port);
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: "none", maxRetries: 0 });
  });
  after(() => server.close());

  async function stillServes(): Promise<void> {
    const reply = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      max_tokens: 2,
    });
    assert.equal(reply.choices.length, 1);
  }

  async function postChat(headers: Record<string, string>, body: string = CHAT) {
    const res = await fetch(`${url}/v1/chat/completions`, { method: "POST", headers, body });
    const text = await res.text();
    return { status: res.status, text, body: () => JSON.parse(text) as ErrorBody };
  }

  test("a POST declared as anything but JSON gets 415 unsupported_content_type saying what to send", async () => {
    for (const type of [
      "text/plain",
      "text/plain;charset=UTF-8",
      "multipart/form-data; boundary=x",
      "application/vnd.api+json",
      "application/jsonx",
      "application/json; charset=latin1",
      "application/json; charset=utf-16",
    ]) {
      const res = await postChat({ "content-type": type });
      assert.equal(res.status, 415, `${type}: ${res.text}`);
      const { error } = res.body();
      assert.equal(error.code, "unsupported_content_type", type);
      assert.equal(error.type, "invalid_request_error", type);
      assert.equal(error.param, null, type);
      assert.ok(error.message.includes(type), `${type}: the message quotes the header: ${error.message}`);
      assert.match(error.message, /application\/json|UTF-8/, type);
    }
    // What curl -d sends without -H: the message says how to fix the command.
    const curl = await postChat({ "content-type": "application/x-www-form-urlencoded" });
    assert.equal(curl.status, 415);
    assert.match(curl.body().error.message, /add -H "Content-Type: application\/json"/);
    await stillServes();
  });

  test("a POST without a Content-Type gets 415 too, as vLLM and SGLang answer it", async () => {
    const body = Buffer.from(CHAT);
    const raw = await rawExchange(
      port,
      Buffer.concat([
        Buffer.from(
          `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n`,
        ),
        body,
      ]),
    );
    assert.match(raw, /^HTTP\/1\.1 415 /);
    const { error } = envelopeOf(raw);
    assert.equal(error.code, "unsupported_content_type");
    assert.match(error.message, /^Missing Content-Type: .*Content-Type: application\/json/);
  });

  test("application/json in any case, with parameters and a utf-8 charset, is served", async () => {
    for (const type of [
      "application/json",
      "Application/JSON",
      "application/json; charset=utf-8",
      "APPLICATION/JSON;CHARSET=UTF-8",
      'application/json; charset="utf-8"',
      "application/json;charset=utf8",
      "application/json; profile=x",
      "application/json ; charset=utf-8",
    ]) {
      const res = await postChat({ "content-type": type });
      assert.equal(res.status, 200, `${type}: ${res.text}`);
    }
    // The official client sends application/json (the other tests of this file use it as well).
    await stillServes();
  });

  test("the Content-Type rule applies to /v1/completions; a 401 still comes first", async () => {
    const res = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "text/plain" },
      body: JSON.stringify({ model: MODEL, prompt: "hi", max_tokens: 1 }),
    });
    assert.equal(res.status, 415);
    const keyed = new RouterServer({
      engine: new ScriptedEngine(),
      tokenizer: byteTokenizer,
      model: { id: MODEL, maxPositionEmbeddings: 2048, eosTokenIds: [BYTE_EOS] },
      tenants: TenantDirectory.parse('{"sk-right-key-1": "a"}', "test keys"),
      logger: createLogger({ level: "silent" }),
    });
    const keyedUrl = await keyed.listen(0, "127.0.0.1");
    try {
      const noKey = await fetch(`${keyedUrl}/v1/completions`, { method: "POST", body: "x" });
      assert.equal(noKey.status, 401);
    } finally {
      await keyed.close();
    }
  });

  test("GET /v1/models/%E0%A4%A (not valid percent-encoding) gets 400, not a 500", async () => {
    for (const id of ["%E0%A4%A", "%", "%ZZ", "%ED%A0%80"]) {
      const res = await fetch(`${url}/v1/models/${id}`);
      assert.equal(res.status, 400, id);
      const { error } = (await res.json()) as ErrorBody;
      assert.equal(error.code, "invalid_request", id);
      assert.match(error.message, /not valid percent-encoded UTF-8/, id);
    }
    const ok = await fetch(`${url}/v1/models/${encodeURIComponent(MODEL)}`);
    assert.equal(ok.status, 200);
  });

  test("a request target new URL refuses (//, http://[::1) gets 400 and the server keeps serving", async () => {
    // These used to throw outside the handler's try: an unhandled rejection that ends the process.
    for (const target of ["//", "//[", "http://[::1", "/\\\\"]) {
      const raw = await rawExchange(
        port,
        Buffer.from(`GET ${target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n`),
      );
      assert.match(raw, /^HTTP\/1\.1 400 /, target);
      const { error } = envelopeOf(raw);
      assert.equal(error.code, "invalid_request", target);
      assert.match(error.message, /not a valid path/, target);
    }
    await stillServes();
  });

  test("what Node's HTTP parser refuses gets the envelope too, and HEAD gets no body", async () => {
    const bad = await rawExchange(
      port,
      Buffer.from("GET /v1/models/\xe9 HTTP/1.1\r\nHost: x\r\n\r\n", "latin1"),
    );
    assert.match(bad, /^HTTP\/1\.1 400 Bad Request\r\n/);
    assert.match(bad, /\r\nConnection: close\r\n/);
    const { error } = envelopeOf(bad);
    assert.equal(error.code, "invalid_request");
    assert.match(error.message, /malformed/);
    const head = await rawExchange(
      port,
      Buffer.from("HEAD /v1/models/\xe9 HTTP/1.1\r\nHost: x\r\n\r\n", "latin1"),
    );
    assert.match(head, /^HTTP\/1\.1 400 /);
    assert.ok(head.endsWith("\r\n\r\n"), "no body after the head of a HEAD answer");
    const huge = await rawExchange(
      port,
      Buffer.from(`GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ${"a".repeat(20_000)}\r\n\r\n`),
    );
    assert.match(huge, /^HTTP\/1\.1 431 /);
    assert.equal(envelopeOf(huge).error.code, "headers_too_large");
    await stillServes();
  });

  test("a parse error on a keep-alive connection that carried a response is answered; a pipelined one closes it", async () => {
    const socket = connect(port, "127.0.0.1");
    let seen = "";
    const closed = new Promise<void>((resolve) => socket.on("close", () => resolve()));
    socket.on("data", (c: Buffer) => {
      seen += c.toString("utf8");
      if (seen.endsWith('{"status":"ok"}'))
        socket.write(Buffer.from("GET /v1/models/\xe9 HTTP/1.1\r\nHost: x\r\n\r\n", "latin1"));
    });
    socket.write("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    await closed;
    assert.match(seen, /^HTTP\/1\.1 200 OK\r\n/);
    assert.match(seen, /\{"status":"ok"\}HTTP\/1\.1 400 Bad Request\r\n/);
    assert.equal(envelopeOf(seen.slice(seen.indexOf('{"status":"ok"}'))).error.code, "invalid_request");
    // Pipelined behind a request still being answered, a 400 would be read as that request's answer.
    const pipelined = await rawExchange(
      port,
      Buffer.from(
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models/\xe9 HTTP/1.1\r\nHost: x\r\n\r\n",
        "latin1",
      ),
    );
    assert.doesNotMatch(pipelined, /^HTTP\/1\.1 400/);
  });
});

test("a refused extension nested 100,000 deep gets its 400 naming the value's kind in a few characters", () => {
  const chat = { model: MODEL, messages: [{ role: "user", content: "hi" }] };
  const arrays = JSON.parse(`${"[".repeat(100_000)}${"]".repeat(100_000)}`) as unknown;
  const objects = JSON.parse(`${'{"a":'.repeat(100_000)}1${"}".repeat(100_000)}`) as unknown;
  const wide = Array.from({ length: 100_000 }, (_, i) => i);
  for (const [value, shown] of [
    [arrays, "got an array"],
    [objects, "got an object"],
    [wide, "got an array"],
    [{ type: "object" }, "got an object"],
  ] as const) {
    for (const parse of [
      () => parseChatRequest({ ...chat, structural_tag: value }),
      () => parseCompletionRequest({ model: MODEL, prompt: "x", guided_regex: value }),
    ]) {
      let caught: unknown;
      try {
        parse();
      } catch (err) {
        caught = err;
      }
      assert.ok(caught instanceof KvfenceError, `a KvfenceError, not ${String(caught)}`);
      assert.equal(caught.code, "invalid_request");
      assert.ok(caught.message.endsWith(shown), caught.message);
      assert.ok(caught.message.length < 200, caught.message);
    }
  }
  const long = refusalMessage(() => parseChatRequest({ ...chat, structural_tag: "x".repeat(10_000) }));
  assert.ok(long.endsWith(`got "${"x".repeat(39)}…`), long);
});

function refusalMessage(parse: () => unknown): string {
  try {
    parse();
  } catch (err) {
    if (err instanceof KvfenceError) return err.message;
    throw err;
  }
  throw new Error("expected a refusal");
}
