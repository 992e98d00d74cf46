/**
 * No 500 from input (issue #22, docs/errors.md): fast-check throws generated requests at the real
 * server (`startTestServer`, the real engine worker and a real model) over keep-alive HTTP on
 * 127.0.0.1, at least 10,000 per endpoint: POST /v1/chat/completions, POST /v1/completions, and the
 * GET routes with fuzzed paths and queries. Every answer must be a 2xx or a 4xx; every 4xx must
 * carry the OpenAI error envelope with a code from the error table and that code's status; every
 * 2xx must be a complete completion (or a stream ending in `[DONE]` with no server error in it).
 * Afterwards a normal request succeeds, /health answers 200, /metrics counts no 5xx and every KV
 * page is FREE again.
 *
 * Most generated requests look valid (so validation is exercised field by field, and the few that
 * pass generate at most 2 tokens); the rest are wrong types, huge and non-finite numbers, unicode
 * edge cases (lone surrogates, special tokens, right-to-left marks), nesting 100,000 deep,
 * duplicate keys, raw bytes, other Content-Types and broken percent-encoding in paths.
 *
 * The seed is fixed so that CI runs are reproducible; fast-check prints the seed and the shrunk
 * counterexample on failure. `KVFENCE_FUZZ_SEED=random` (or a number) changes the seed and
 * `KVFENCE_FUZZ_RUNS=N` the number of cases per endpoint.
 */
import assert from "node:assert/strict";
import { Agent, request } from "node:http";
import { after, before, describe, test } from "node:test";
import fc from "fast-check";
import OpenAI from "openai";
import {
  assertPoolIdle,
  modelDir,
  scrape,
  startTestServer,
  type TestServer,
} from "../../testing/start-server.js";
import { ERROR_TABLE } from "../lib/errors.js";
import { chatCompletionRequestSchema, completionRequestSchema, EXTENSIONS } from "./openai-schemas.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-fuzz-tenant-1";
const RUNS = positiveInt(process.env.KVFENCE_FUZZ_RUNS, 10_000);
const SEED = fuzzSeed(process.env.KVFENCE_FUZZ_SEED);
const ANSWER_TIMEOUT_MS = 20_000;
/** A frozen server fails the run in bounded time (fast-check reports the case it has by then). */
const RUN_TIME_LIMIT_MS = Math.max(240_000, RUNS * 25);

function positiveInt(text: string | undefined, fallback: number): number {
  if (text === undefined || text === "") return fallback;
  const n = Number(text);
  if (!Number.isSafeInteger(n) || n < 1)
    throw new Error(`KVFENCE_FUZZ_RUNS must be a positive integer: ${text}`);
  return n;
}

function fuzzSeed(text: string | undefined): number {
  if (text === undefined || text === "") return 22;
  if (text === "random") return (Math.random() * 0x7fff_ffff) | 0;
  const n = Number(text);
  if (!Number.isSafeInteger(n)) throw new Error(`KVFENCE_FUZZ_SEED must be an integer or "random": ${text}`);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Cases

interface HttpCase {
  readonly method: string;
  readonly path: string;
  readonly headers: Readonly<Record<string, string>>;
  readonly body: Buffer | null;
}

function preview(text: string, max = 300): string {
  return text.length <= max ? text : `${text.slice(0, max)}… (${text.length} chars)`;
}

/** A case as fast-check prints it in a failure report: short, even for a 300 kB body. */
function httpCase(c: HttpCase): HttpCase {
  return Object.assign(c, {
    [fc.toStringMethod]: () =>
      `${c.method} ${preview(c.path, 200)} ${JSON.stringify(c.headers)} body=${
        c.body === null ? "none" : JSON.stringify(preview(c.body.toString("latin1")))
      }`,
  });
}

/** JSON text spliced into a body as it is (numbers JSON.stringify cannot write, deep nesting). */
class RawJson {
  constructor(readonly text: string) {}
}

/** Marks a field to delete from a generated body. */
const ABSENT = Symbol("absent");

function serialize(value: unknown): string {
  const raws: string[] = [];
  const text = JSON.stringify(value, (_key, v: unknown) =>
    v instanceof RawJson ? `\u0000raw${raws.push(v.text) - 1}\u0000` : v,
  );
  return (text ?? "null").replace(/"\\u0000raw(\d+)\\u0000"/g, (_m, i: string) => raws[Number(i)]!);
}

const text = fc.oneof(
  { weight: 4, arbitrary: fc.string({ maxLength: 12 }) },
  { weight: 2, arbitrary: fc.string({ unit: "grapheme", maxLength: 8 }) },
  { weight: 2, arbitrary: fc.string({ unit: "binary", maxLength: 8 }) },
  {
    weight: 2,
    arbitrary: fc.constantFrom(
      "",
      " ",
      "\u0000",
      "\uD800",
      "\uDFFF",
      "a\uDC00b",
      "\uFFFD",
      "\uFEFF",
      "\u202E",
      "e\u0301",
      "🦀👩‍👩‍👧",
      "\r\n\r\n",
      "<|im_start|>",
      "<|im_end|>",
      "<|endoftext|>",
      "{{ messages }}",
      "{% for m in messages %}",
      "data: [DONE]\n\n",
      "%E0%A4%A",
    ),
  },
);

/** Numbers at and past the edges, as JSON text (1e999 parses to Infinity). */
const hugeNumber = fc
  .constantFrom(
    "1e999",
    "-1e999",
    "1e308",
    "-1e308",
    "5e-324",
    "1e-400",
    "-0",
    "0.0",
    "1.0",
    "2e0",
    "4294967295",
    "4294967296",
    "-4294967297",
    "9007199254740991",
    "9007199254740993",
    "-9007199254740993",
    "123456789012345678901234567890",
  )
  .map((t) => new RawJson(t));

/** Arrays or objects nested up to 100,000 deep (JSON.parse copes; recursive code does not). */
const deepNesting = fc
  .tuple(fc.oneof(fc.integer({ min: 1, max: 64 }), fc.constantFrom(10_000, 100_000)), fc.boolean())
  .map(([depth, arrays]) =>
    arrays
      ? new RawJson(`${"[".repeat(depth)}${"]".repeat(depth)}`)
      : new RawJson(`${'{"a":'.repeat(depth)}1${"}".repeat(depth)}`),
  );

/** Anything a field could be sent as. */
const weirdValue: fc.Arbitrary<unknown> = fc.oneof(
  { weight: 3, arbitrary: fc.jsonValue({ maxDepth: 3 }) },
  {
    weight: 3,
    arbitrary: fc.constantFrom(
      null,
      true,
      false,
      0,
      -1,
      1,
      2,
      1.5,
      3,
      "",
      "text",
      "none",
      [],
      {},
      [null],
      [1],
    ),
  },
  { weight: 2, arbitrary: text },
  { weight: 2, arbitrary: hugeNumber },
  { weight: 1, arbitrary: deepNesting },
  { weight: 1, arbitrary: fc.constant(ABSENT) },
);

const maxTokens = fc.constantFrom(1, 2);

const message = fc.record(
  {
    role: fc.oneof(
      { weight: 19, arbitrary: fc.constantFrom("system", "developer", "user", "assistant", "tool") },
      { weight: 1, arbitrary: text },
    ),
    content: fc.oneof(
      { weight: 6, arbitrary: text },
      { weight: 2, arbitrary: fc.array(fc.record({ type: fc.constant("text"), text }), { maxLength: 3 }) },
      { weight: 1, arbitrary: fc.constant(null) },
    ),
    name: text,
  },
  { requiredKeys: ["role"] },
);

/** Sampling fields with values the server accepts (some combinations it still refuses). */
const samplingFields = {
  stream: fc.oneof(
    fc.boolean(),
    fc.record({ include_usage: fc.boolean() }, { requiredKeys: [] }).map((options) => ({ options })),
  ),
  temperature: fc.oneof(fc.constant(0), fc.double({ min: 0, max: 2, noNaN: true })),
  top_p: fc.double({ min: 0.001, max: 1, noNaN: true }),
  top_k: fc.integer({ min: -1, max: 100 }),
  seed: fc.oneof(fc.integer(), fc.maxSafeInteger()),
  stop: fc.oneof(text, fc.array(text, { maxLength: 4 })),
  n: fc.constant(1),
  user: text,
  frequency_penalty: fc.constant(0),
  presence_penalty: fc.constant(0),
  logit_bias: fc.constant({}),
  response_format: fc.constant({ type: "text" }),
  repetition_penalty: fc.constant(1),
  min_p: fc.constant(0),
  ignore_eos: fc.constant(false),
  skip_special_tokens: fc.constant(true),
  stop_token_ids: fc.constant([]),
};

const validChat = fc.record(
  {
    model: fc.constant(MODEL),
    messages: fc.array(message, { minLength: 1, maxLength: 3 }),
    max_tokens: maxTokens,
    ...samplingFields,
    logprobs: fc.constant(false),
    top_logprobs: fc.constant(0),
    tools: fc.constant([]),
    tool_choice: fc.constant("none"),
  },
  { requiredKeys: ["model", "messages", "max_tokens"] },
);

const validCompletion = fc.record(
  {
    model: fc.constant(MODEL),
    prompt: fc.oneof(
      text,
      text.map((t) => [t]),
    ),
    max_tokens: maxTokens,
    ...samplingFields,
    echo: fc.constant(false),
    best_of: fc.constant(1),
    suffix: fc.constant(""),
  },
  { requiredKeys: ["model", "prompt", "max_tokens"] },
);

type Endpoint = "chat" | "completions";

function fieldNames(endpoint: Endpoint): string[] {
  const schema = endpoint === "chat" ? chatCompletionRequestSchema : completionRequestSchema;
  return [...Object.keys(schema.shape), ...Object.keys(EXTENSIONS), "unknown_field", ""];
}

/** A valid-looking body, then at most two fields replaced by anything, deleted, or duplicated. */
function bodyObject(endpoint: Endpoint): fc.Arbitrary<Record<string, unknown>> {
  const edit = fc.tuple(fc.constantFrom(...fieldNames(endpoint)), weirdValue);
  const edits = fc.oneof(
    { weight: 3, arbitrary: fc.constant([]) },
    { weight: 2, arbitrary: fc.array(edit, { minLength: 1, maxLength: 1 }) },
    { weight: 1, arbitrary: fc.array(edit, { minLength: 2, maxLength: 2 }) },
  );
  return fc.tuple(endpoint === "chat" ? validChat : validCompletion, edits).map(([valid, edits]) => {
    const body: Record<string, unknown> = { ...valid };
    // stream_options only beside stream: true (an edit may still break that rule).
    if (typeof body.stream === "object") {
      body.stream_options = (body.stream as { options: unknown }).options;
      body.stream = true;
    }
    for (const [field, value] of edits) {
      if (value === ABSENT) delete body[field];
      else body[field] = value;
    }
    // Never an unbounded generation: a body that leaves both limits out gets one.
    if (body.max_tokens == null && body.max_completion_tokens == null) body.max_tokens = 1;
    return body;
  });
}

/** Ways to write a body's JSON text (`pair` is one more `"field":value`): mostly plain. */
const LAYOUTS: ReadonlyArray<readonly [number, (json: string, pair: string) => string]> = [
  [12, (json) => json],
  [1, (json, pair) => (json === "{}" ? `{${pair}}` : `{${pair},${json.slice(1)}`)], // duplicate key, first
  [1, (json, pair) => (json === "{}" ? `{${pair}}` : `${json.slice(0, -1)},${pair}}`)], // duplicate key, last
  [1, (json) => `\uFEFF${json}`],
  [1, (json) => ` \n\t${json}\r\n `],
  [1, (json) => `${json}}`],
  [1, (json) => json.slice(0, Math.floor(json.length / 2))],
];

/** JSON text of a body, sometimes with a duplicate key, a BOM, whitespace or garbage around it. */
function bodyText(endpoint: Endpoint): fc.Arbitrary<string> {
  return fc
    .tuple(
      bodyObject(endpoint),
      fc.oneof(...LAYOUTS.map(([weight, layout]) => ({ weight, arbitrary: fc.constant(layout) }))),
      fc.constantFrom(...fieldNames(endpoint)),
      weirdValue,
    )
    .map(([body, layout, field, value]) =>
      layout(serialize(body), `${JSON.stringify(field)}:${serialize(value === ABSENT ? null : value)}`),
    );
}

/** Tokens of JSON in any order: mostly malformed. */
const jsonish = fc
  .array(
    fc.constantFrom(
      "{",
      "}",
      "[",
      "]",
      ":",
      ",",
      '"',
      "\\",
      '"model"',
      '"messages"',
      '"prompt"',
      `"${MODEL}"`,
      '"role"',
      '"content"',
      '"\\ud800"',
      '"\\u00"',
      "null",
      "true",
      "1",
      "-",
      "1e999",
      " ",
    ),
    { maxLength: 40 },
  )
  .map((parts) => parts.join(""));

function postBody(endpoint: Endpoint): fc.Arbitrary<Buffer> {
  return fc.oneof(
    { weight: 14, arbitrary: bodyText(endpoint).map((t) => Buffer.from(t, "utf8")) },
    { weight: 1, arbitrary: bodyText(endpoint).map((t) => Buffer.from(t, "utf16le")) },
    {
      weight: 1,
      arbitrary: fc
        .tuple(bodyText(endpoint), fc.nat(), fc.constantFrom(0x80, 0xc0, 0xed, 0xf5, 0xff))
        .map(([t, at, byte]) => {
          const bytes = Buffer.from(t, "utf8");
          const i = bytes.length === 0 ? 0 : at % bytes.length;
          return Buffer.concat([bytes.subarray(0, i), Buffer.from([byte]), bytes.subarray(i)]);
        }),
    },
    { weight: 2, arbitrary: fc.jsonValue().map((v) => Buffer.from(JSON.stringify(v) ?? "null", "utf8")) },
    { weight: 1, arbitrary: deepNesting.map((raw) => Buffer.from(raw.text, "utf8")) },
    { weight: 2, arbitrary: jsonish.map((t) => Buffer.from(t, "utf8")) },
    { weight: 1, arbitrary: fc.uint8Array({ maxLength: 64 }).map((b) => Buffer.from(b)) },
  );
}

/** Printable header text (what node:http lets a client send). */
const headerText = fc.string({
  unit: fc.integer({ min: 0x20, max: 0x7e }).map((c) => String.fromCharCode(c)),
});

const contentType = fc.oneof(
  { weight: 20, arbitrary: fc.constant("application/json") },
  {
    weight: 4,
    arbitrary: fc.constantFrom(
      "application/json; charset=utf-8",
      "Application/JSON;Charset=UTF-8",
      'application/json; charset="utf-8"',
      "application/json;",
      "application/json; charset=latin1",
      "application/json; charset=utf-16",
      "application/x-www-form-urlencoded",
      "text/plain;charset=UTF-8",
      "multipart/form-data; boundary=x",
      "application/vnd.api+json",
      "application/jsonx",
      "json",
      "",
      ";",
      "*/*",
    ),
  },
  { weight: 1, arbitrary: headerText },
  { weight: 1, arbitrary: fc.constant(null) },
);

const authorization = fc.oneof(
  { weight: 20, arbitrary: fc.constant(`Bearer ${KEY}`) },
  {
    weight: 3,
    arbitrary: fc.constantFrom(
      null,
      "",
      "Bearer",
      "Bearer ",
      `bearer ${KEY}`,
      `Basic ${KEY}`,
      "Bearer sk-wrong-key-1",
    ),
  },
  { weight: 1, arbitrary: headerText },
);

function headers(ct: string | null, auth: string | null): Record<string, string> {
  const out: Record<string, string> = {};
  if (ct !== null) out["content-type"] = ct;
  if (auth !== null) out.authorization = auth;
  return out;
}

function postCase(endpoint: Endpoint): fc.Arbitrary<HttpCase> {
  const path = endpoint === "chat" ? "/v1/chat/completions" : "/v1/completions";
  return fc
    .record({
      method: fc.oneof(
        { weight: 30, arbitrary: fc.constant("POST") },
        fc.constantFrom("GET", "PUT", "PATCH"),
      ),
      path: fc.oneof(
        { weight: 30, arbitrary: fc.constant(path) },
        fc.constantFrom(`${path}/`, `${path}?stream=true`, `/${path}`, `${path}%00`),
      ),
      contentType,
      authorization,
      body: postBody(endpoint),
    })
    .map((c) =>
      httpCase({
        method: c.method,
        path: c.path,
        headers: headers(c.contentType, c.authorization),
        body: c.method === "GET" ? null : c.body,
      }),
    );
}

/** Bytes node:http lets a request target hold (0x21–0xFF): mostly ASCII; Node's parser refuses the rest. */
const targetChar = fc
  .oneof(
    { weight: 15, arbitrary: fc.integer({ min: 0x21, max: 0x7e }) },
    fc.integer({ min: 0x7f, max: 0xff }),
  )
  .map((c) => String.fromCharCode(c));

const percentEscape = fc.oneof(
  fc.constantFrom(
    "%",
    "%E0%A4%A",
    "%E0%A4",
    "%C3",
    "%FF",
    "%ZZ",
    "%2",
    "%00",
    "%2F",
    "%2e%2e",
    "%C0%AF",
    "%ED%A0%80",
  ),
  text.map((t) => encodeURIComponent(t.replace(/[\uD800-\uDFFF]/g, "x"))),
);

const segment = fc.oneof(
  {
    weight: 6,
    arbitrary: fc.constantFrom(
      "v1",
      "models",
      MODEL,
      "health",
      "metrics",
      "kvfence",
      "nodes",
      "chat",
      "completions",
      "",
      ".",
      "..",
    ),
  },
  { weight: 3, arbitrary: percentEscape },
  { weight: 2, arbitrary: fc.string({ unit: targetChar, maxLength: 10 }) },
);

const getPath = fc
  .tuple(
    fc.oneof(
      {
        weight: 4,
        arbitrary: fc.constantFrom(
          "/v1/models",
          `/v1/models/${MODEL}`,
          "/health",
          "/metrics",
          "/kvfence/nodes",
        ),
      },
      {
        weight: 4,
        arbitrary: fc.constantFrom("/v1/models/", "/", "//", "/v1/", "/v1//models/", "/kvfence/"),
      },
      { weight: 1, arbitrary: fc.constantFrom("http://127.0.0.1/v1/models", "*", "http://[::1", "/\\") },
    ),
    fc.array(segment, { maxLength: 3 }),
    fc.option(fc.string({ unit: targetChar, maxLength: 16 }), { freq: 2 }),
  )
  .map(([start, segments, query]) => {
    const path =
      segments.length === 0 ? start : `${start}${start.endsWith("/") ? "" : "/"}${segments.join("/")}`;
    return query === null ? path : `${path}?${query}`;
  });

const getCase: fc.Arbitrary<HttpCase> = fc
  .record({
    method: fc.oneof(
      { weight: 12, arbitrary: fc.constant("GET") },
      { weight: 2, arbitrary: fc.constant("HEAD") },
      { weight: 1, arbitrary: fc.constantFrom("POST", "DELETE", "OPTIONS", "TRACE") },
    ),
    path: getPath,
    authorization,
  })
  .map((c) =>
    httpCase({ method: c.method, path: c.path, headers: headers(null, c.authorization), body: null }),
  );

// ---------------------------------------------------------------------------------------------
// Sending and checking

interface Answer {
  readonly status: number;
  readonly contentType: string;
  readonly body: string;
}

function send(agent: Agent, port: number, c: HttpCase): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = request(
      { host: "127.0.0.1", port, method: c.method, path: c.path, headers: c.headers, agent },
      (res) => {
        const chunks: Buffer[] = [];
        res.on("data", (chunk: Buffer) => chunks.push(chunk));
        res.on("error", reject);
        res.on("end", () =>
          resolve({
            status: res.statusCode ?? 0,
            contentType: res.headers["content-type"] ?? "",
            body: Buffer.concat(chunks).toString("utf8"),
          }),
        );
      },
    );
    // A request left unanswered fails its case (a generation here is at most 2 tokens).
    req.setTimeout(ANSWER_TIMEOUT_MS, () =>
      req.destroy(new Error(`no answer within ${ANSWER_TIMEOUT_MS} ms`)),
    );
    req.on("error", reject);
    req.end(c.body ?? undefined);
  });
}

function assertEnvelope(value: unknown, status: number | null, where: string): void {
  const error = (value as { error?: Record<string, unknown> } | null)?.error;
  assert.ok(typeof error === "object" && error !== null, `${where}: no error envelope`);
  assert.equal(typeof error.message, "string", `${where}: error.message`);
  assert.ok((error.message as string).length > 0, `${where}: an empty error.message`);
  assert.equal(typeof error.type, "string", `${where}: error.type`);
  assert.ok(error.param === null || typeof error.param === "string", `${where}: error.param`);
  const row = ERROR_TABLE[error.code as keyof typeof ERROR_TABLE];
  assert.ok(row !== undefined, `${where}: error.code ${String(error.code)} is not in the error table`);
  assert.equal(error.type, row.type, `${where}: error.type of ${String(error.code)}`);
  if (status !== null) assert.equal(status, row.status, `${where}: the status of ${String(error.code)}`);
  else assert.ok(row.status < 500, `${where}: a server error in a stream: ${JSON.stringify(error)}`);
}

function errorCode(c: HttpCase, a: Answer): string {
  if (c.method === "HEAD") return "(HEAD)";
  return String((JSON.parse(a.body) as { error: { code: string } }).error.code);
}

function checkAnswer(c: HttpCase, a: Answer): void {
  const where = `${c.method} ${preview(c.path, 80)} → ${a.status} ${preview(a.body, 300)}`;
  const ok = a.status >= 200 && a.status < 300;
  assert.ok(ok || (a.status >= 400 && a.status < 500), `${where}: neither 2xx nor 4xx`);
  if (c.method === "HEAD") return;
  if (!ok) {
    assert.match(a.contentType, /^application\/json/, `${where}: a 4xx that is not JSON`);
    assertEnvelope(JSON.parse(a.body), a.status, where);
    return;
  }
  if (c.method !== "POST") return;
  if (a.contentType.startsWith("text/event-stream")) {
    assert.ok(a.body.endsWith("data: [DONE]\n\n"), `${where}: a stream that does not end with [DONE]`);
    for (const frame of a.body.split("\n\n")) {
      if (!frame.startsWith("data: {")) continue;
      const event = JSON.parse(frame.slice("data: ".length)) as Record<string, unknown>;
      if ("error" in event) assertEnvelope(event, null, where);
    }
    return;
  }
  const body = JSON.parse(a.body) as { object?: string; choices?: unknown[] };
  assert.ok(
    body.object === "chat.completion" || body.object === "text_completion",
    `${where}: a 2xx that is not a completion`,
  );
  assert.equal(body.choices?.length, 1, `${where}: one choice`);
}

// ---------------------------------------------------------------------------------------------

describe("fuzz: no 500 from input", () => {
  let server: TestServer;
  let agent: Agent;
  let port: number;
  let client: OpenAI;
  const counts = new Map<string, number>();

  before(async () => {
    server = await startTestServer({ model: modelDir(MODEL), maxModelLen: 256, apiKeys: { [KEY]: "fuzz" } });
    port = Number(new URL(server.url).port);
    agent = new Agent({ keepAlive: true, maxSockets: 4 });
    client = new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0, timeout: ANSWER_TIMEOUT_MS });
  });
  after(async () => {
    agent.destroy();
    await server.close();
  });

  async function stillServing(): Promise<void> {
    const reply = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Hello" }],
      max_tokens: 2,
    });
    assert.equal(reply.choices.length, 1);
    const health = await fetch(`${server.url}/health`);
    assert.equal(health.status, 200);
  }

  function run(name: string, arbitrary: fc.Arbitrary<HttpCase>) {
    test(`${name}: ${RUNS} cases, every answer a 2xx or a 4xx with the OpenAI error envelope`, async (t) => {
      const started = Date.now();
      const outcomes = new Map<string, number>();
      await fc.assert(
        fc.asyncProperty(arbitrary, async (c) => {
          const answer = await send(agent, port, c);
          checkAnswer(c, answer);
          const key = `${answer.status} ${answer.status < 300 ? "ok" : errorCode(c, answer)}`;
          outcomes.set(key, (outcomes.get(key) ?? 0) + 1);
        }),
        {
          numRuns: RUNS,
          seed: SEED,
          includeErrorInReport: true,
          interruptAfterTimeLimit: RUN_TIME_LIMIT_MS,
          markInterruptAsFailure: true,
        },
      );
      const served = [...outcomes].filter(([k]) => k.startsWith("2")).reduce((n, [, k]) => n + k, 0);
      counts.set(name, served);
      const sorted = [...outcomes].sort(([a], [b]) => (a < b ? -1 : 1)).map(([k, n]) => `${k}: ${n}`);
      t.diagnostic(`seed ${SEED}; ${RUNS} cases in ${Date.now() - started} ms; ${sorted.join(", ")}`);
      await stillServing();
    });
  }

  run("POST /v1/chat/completions", postCase("chat"));
  run("POST /v1/completions", postCase("completions"));
  run("GET routes", getCase);

  test("after the fuzzing: no 5xx counted, the server serves, every KV page is FREE", async () => {
    await stillServing();
    const metrics = await scrape(server.url);
    const fiveHundreds = [...metrics].filter(([k]) => /^kvfence_requests_total\{.*status="5/.test(k));
    assert.deepEqual(fiveHundreds, [], "no request was answered with a 5xx");
    assert.ok((counts.get("POST /v1/chat/completions") ?? 0) > 0, "some chat requests were served");
    assert.ok((counts.get("POST /v1/completions") ?? 0) > 0, "some completions were served");
    await assertPoolIdle(server.url);
  });
});
