/**
 * Acceptance (issue #22 item 4): the operator endpoints leak nothing to the public. On real servers
 * on 127.0.0.1: with an operator key, /metrics and /kvfence/nodes answer 401 with the OpenAI error
 * envelope without it (or with a tenant's API key, or a wrong key) and 200 with it; without one,
 * the front door refuses them and only the loopback operator listener serves them; tenants' names
 * never appear in /metrics unless the operator asks for them. The tenants' traffic goes through the
 * official `openai` client.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { modelDir, startTestServer, TEST_OPERATOR_KEY, type TestServer } from "../../testing/start-server.js";
import { KvfenceError } from "../lib/errors.js";
import { operatorListener, parseServeConfig } from "../server/serve-config.js";

const MODEL = "kvfence-tiny";
const KEYS = { "sk-alpha-corp-0001": "alpha-corp", "sk-beta-corp-00002": "beta-corp" };
const OPERATOR_PATHS = ["/metrics", "/kvfence/nodes"];

async function get(url: string, authorization?: string) {
  const res = await fetch(url, authorization === undefined ? {} : { headers: { authorization } });
  return { status: res.status, text: await res.text(), headers: res.headers };
}

function assertRefused(res: { status: number; text: string; headers: Headers }, what: string): string {
  assert.equal(res.status, 401, `${what}: ${res.text}`);
  assert.equal(res.headers.get("www-authenticate"), "Bearer", what);
  const body = JSON.parse(res.text) as { error: Record<string, unknown> };
  assert.deepEqual(Object.keys(body.error), ["message", "type", "param", "code"], what);
  assert.equal(body.error.type, "authentication_error", what);
  assert.equal(body.error.code, "invalid_api_key", what);
  assert.equal(body.error.param, null, what);
  return body.error.message as string;
}

async function traffic(server: TestServer): Promise<void> {
  for (const apiKey of Object.keys(KEYS)) {
    const client = new OpenAI({ baseURL: server.baseURL, apiKey, maxRetries: 0 });
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hello" }],
      max_tokens: 2,
      temperature: 0,
    });
    assert.equal(res.choices.length, 1);
  }
}

describe("a server with an operator key", { timeout: 120_000 }, () => {
  let server: TestServer;
  before(async () => {
    server = await startTestServer({ model: modelDir(MODEL), apiKeys: KEYS });
    await traffic(server);
  });
  after(() => server?.close());

  test("/metrics and /kvfence/nodes answer 401 without the operator key and 200 with it", async () => {
    assert.equal(server.operatorUrl, null, "no operator listener when the key guards the front door");
    for (const path of OPERATOR_PATHS) {
      const url = `${server.url}${path}`;
      assert.match(assertRefused(await get(url), `${path} without a key`), /needs the operator key/);
      assertRefused(await get(url, "Bearer sk-alpha-corp-0001"), `${path} with a tenant's key`);
      assertRefused(await get(url, "Bearer not-the-operator-key"), `${path} with a wrong key`);
      assertRefused(await get(url, TEST_OPERATOR_KEY), `${path} without "Bearer"`);
      const ok = await get(url, `Bearer ${TEST_OPERATOR_KEY}`);
      assert.equal(ok.status, 200, `${path}: ${ok.text}`);
    }
    // Tenants and load balancers still get what they need.
    assert.equal((await get(`${server.url}/health`)).status, 200);
  });

  test("/metrics names no tenant: its labels are opaque ids", async () => {
    const text = (await get(`${server.url}/metrics`, `Bearer ${TEST_OPERATOR_KEY}`)).text;
    assert.doesNotMatch(text, /alpha-corp|beta-corp/);
    const labels = new Set([...text.matchAll(/\{tenant="([^"]+)"/g)].map((m) => m[1]!));
    labels.delete("-");
    assert.equal(labels.size, 2, [...labels].join(", "));
    for (const label of labels) assert.match(label, /^t-[0-9a-f]{12}$/);
  });
});

test("--metrics-tenant-names puts the tenants' names in /metrics", { timeout: 120_000 }, async (t) => {
  const server = await startTestServer({ model: modelDir(MODEL), apiKeys: KEYS, metricsTenantNames: true });
  t.after(() => server.close());
  await traffic(server);
  const text = (await get(`${server.url}/metrics`, `Bearer ${TEST_OPERATOR_KEY}`)).text;
  assert.match(text, /kvfence_completion_tokens_total\{tenant="alpha-corp",endpoint="chat"\} 2/);
  assert.match(text, /kvfence_completion_tokens_total\{tenant="beta-corp",endpoint="chat"\} 2/);
});

test("without an operator key only the loopback operator listener serves /metrics and /kvfence/nodes", {
  timeout: 120_000,
}, async (t) => {
  const server = await startTestServer({ model: modelDir(MODEL), apiKeys: KEYS, operatorKey: null });
  t.after(() => server.close());
  await traffic(server);
  assert.match(server.operatorUrl ?? "", /^http:\/\/127\.0\.0\.1:\d+$/);
  for (const path of OPERATOR_PATHS) {
    const refused = assertRefused(await get(`${server.url}${path}`), `front door ${path}`);
    assert.match(refused, /operator listener/);
    // Not even a key opens them on the front door when none is configured.
    assertRefused(await get(`${server.url}${path}`, "Bearer sk-alpha-corp-0001"), `front door ${path}`);
    const ok = await get(`${server.operatorUrl}${path}`);
    assert.equal(ok.status, 200, `operator listener ${path}: ${ok.text}`);
  }
  assert.doesNotMatch((await get(`${server.operatorUrl}/metrics`)).text, /alpha-corp|beta-corp/);
  assert.equal((await get(`${server.operatorUrl}/health`)).status, 200);
  // The operator listener serves nothing of the API.
  const api = await get(`${server.operatorUrl}/v1/models`, "Bearer sk-alpha-corp-0001");
  assert.equal(api.status, 404);
  assert.equal((JSON.parse(api.text) as { error: { code: string } }).error.code, "not_found");
});

test("the operator listener: --port + 1 by default, none with a key, never beyond loopback without one", () => {
  const base = {
    host: "127.0.0.1",
    model: "m",
    pageSize: "16",
    scrubOnFree: false,
    disaggregation: false,
    logLevel: "silent",
  };
  const invalid = (raw: Record<string, unknown>, pattern: RegExp) =>
    assert.throws(
      () => parseServeConfig({ ...base, ...raw }),
      (err: unknown) =>
        err instanceof KvfenceError && err.code === "config_invalid" && pattern.test(err.message),
    );
  invalid({ port: "8000", metricsHost: "0.0.0.0" }, /--metrics-host: .*beyond loopback.*--operator-key/);
  invalid({ port: "8000", operatorKey: "short" }, /--operator-key: must be at least 16 characters/);
  invalid({ port: "65535" }, /--metrics-port: the default \(--port \+ 1\) does not exist/);
  const listener = (raw: Record<string, unknown>) => operatorListener(parseServeConfig({ ...base, ...raw }));
  assert.deepEqual(listener({ port: "8000" }), { host: "127.0.0.1", port: 8001 });
  assert.deepEqual(listener({ port: "0" }), { host: "127.0.0.1", port: 0 });
  assert.equal(listener({ port: "8000", operatorKey: TEST_OPERATOR_KEY }), null);
  assert.deepEqual(listener({ port: "8000", metricsPort: "9100" }), { host: "127.0.0.1", port: 9100 });
  assert.equal(listener({ port: "8000", role: "decode", clusterSecret: "x".repeat(32) }), null);
  // With a key, a listener beyond loopback is the operator's choice: the key guards it.
  assert.doesNotThrow(() =>
    parseServeConfig({
      ...base,
      port: "8000",
      metricsHost: "0.0.0.0",
      metricsPort: "9100",
      operatorKey: TEST_OPERATOR_KEY,
    }),
  );
});
