/**
 * Attack reproduction, finding 3 of the second adversarial run (issue #31): DNS rebinding on the
 * keyless operator listener. Without `--operator-key` the operator listener (the front door's port
 * + 1: /metrics, /kvfence/nodes, /kvfence/ui, …) asks for no key because it is bound to loopback —
 * yet it answered any `Host` (`curl -H 'Host: evil.example' http://127.0.0.1:PORT+1/metrics` → 200),
 * so a web page in a browser on the operator's machine, its name re-pointed at 127.0.0.1, could
 * read the metrics, the nodes' addresses and the pool map.
 *
 * Now it answers only `Host` values naming this machine — `localhost` and loopback literals, with
 * or without a port — and refuses every other one, and a request without `Host`, with 421
 * `misdirected_request` in the OpenAI error envelope, saying what to do; the refusals are counted
 * in `kvfence_requests_total{status="421"}`. A real server (the bundled model, one engine) on
 * 127.0.0.1, raw HTTP requests on real sockets.
 */
import assert from "node:assert/strict";
import net from "node:net";
import { after, before, describe, test } from "node:test";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";
import { parsePrometheusText } from "../tools/incident/prometheus-text.js";
import { isLoopbackHost } from "./operator-host.js";

/** Every route of the operator listener. */
const PATHS = ["/metrics", "/kvfence/nodes", "/kvfence/state", "/kvfence/ui", "/health"];

/** One raw HTTP request (the request line and headers as given) and its answer. */
async function raw(url: string, head: string): Promise<{ status: number; body: string }> {
  const { hostname, port } = new URL(url);
  const socket = net.connect({ host: hostname, port: Number(port) });
  // Written, not ended: the server closes the connection once it answered (Connection: close).
  socket.write(`${head}\r\nConnection: close\r\n\r\n`);
  const chunks: Buffer[] = [];
  for await (const chunk of socket) chunks.push(chunk as Buffer);
  const text = Buffer.concat(chunks).toString("utf8");
  const status = Number(/^HTTP\/1\.[01] (\d{3})/.exec(text)?.[1] ?? 0);
  return { status, body: text.slice(text.indexOf("\r\n\r\n") + 4) };
}

const get = (url: string, path: string, host: string | null, version = "1.1") =>
  raw(url, `GET ${path} HTTP/${version}${host === null ? "" : `\r\nHost: ${host}`}`);

test("isLoopbackHost() accepts localhost and loopback literals only, with or without a port", () => {
  for (const host of [
    "localhost",
    "LOCALHOST:8001",
    "127.0.0.1",
    "127.0.0.1:8001",
    "127.9.8.7",
    "127.1",
    "[::1]",
    "[::1]:8001",
    "[0:0:0:0:0:0:0:1]",
  ])
    assert.equal(isLoopbackHost(host), true, host);
  for (const host of [
    undefined,
    "",
    "evil.example",
    "evil.example:8001",
    "localhost.evil.example",
    "127.0.0.1.nip.io",
    "evil.example@127.0.0.1",
    "127.0.0.1/x",
    "10.0.0.1",
    "0.0.0.0",
    "[::]",
    "[::2]",
    "localhost:8001:1",
    "[::1",
  ])
    assert.equal(isLoopbackHost(host), false, String(host));
});

describe("the keyless operator listener answers loopback Host names only", { timeout: 120_000 }, () => {
  let server: TestServer;
  let operator: string;
  before(async () => {
    server = await startTestServer({ model: modelDir("kvfence-tiny"), operatorKey: null });
    operator = server.operatorUrl!;
  });
  after(() => server?.close());

  test("a Host that is not this machine's gets 421 misdirected_request on every route, and nothing of it", async () => {
    const { port } = new URL(operator);
    let refused = 0;
    for (const path of PATHS) {
      for (const host of [
        "evil.example",
        `evil.example:${port}`,
        "127.0.0.1.nip.io",
        `localhost.evil.example:${port}`,
      ]) {
        const res = await get(operator, path, host);
        refused++;
        assert.equal(res.status, 421, `${path} with Host ${host}: ${res.body}`);
        const { error } = JSON.parse(res.body) as { error: Record<string, unknown> };
        assert.deepEqual(Object.keys(error), ["message", "type", "param", "code"]);
        assert.equal(error.code, "misdirected_request");
        assert.equal(error.type, "invalid_request_error");
        assert.match(
          String(error.message),
          /loopback Host .*DNS rebinding: \S+; connect to http:\/\/127\.0\.0\.1 .*--operator-key/,
        );
        assert.ok(String(error.message).includes(`: ${host};`), "the message names the Host");
        assert.doesNotMatch(res.body, /kvfence_|pool_tokens|<html/i, "nothing of the route's answer");
      }
    }
    // No Host at all (HTTP/1.0 may leave it out): refused the same way.
    const none = await get(operator, "/metrics", null, "1.0");
    refused++;
    assert.equal(none.status, 421, none.body);
    assert.match(none.body, /DNS rebinding: \(none\);/);
    // HTTP/1.1 requires one: Node's parser answers 400 before the router sees it.
    const none11 = await get(operator, "/metrics", null);
    assert.equal(none11.status, 400, none11.body);
    assert.doesNotMatch(none11.body, /kvfence_/);

    const metrics = parsePrometheusText((await get(operator, "/metrics", `127.0.0.1:${port}`)).body);
    const counted = [...metrics].filter(
      ([k]) => k.startsWith("kvfence_requests_total{") && k.includes('status="421"'),
    );
    assert.equal(
      counted.reduce((s, [, v]) => s + v, 0),
      refused,
      "every refusal is counted in kvfence_requests_total",
    );
  });

  test("localhost and loopback literals, with or without a port, are answered", async () => {
    const { port } = new URL(operator);
    for (const host of [
      `127.0.0.1:${port}`,
      "127.0.0.1",
      `localhost:${port}`,
      "LOCALHOST",
      "127.0.0.2",
      "127.1",
      `[::1]:${port}`,
    ]) {
      for (const path of PATHS) {
        const res = await get(operator, path, host);
        assert.equal(res.status, 200, `${path} with Host ${host}: ${res.body.slice(0, 200)}`);
      }
    }
    const metrics = await fetch(`${operator}/metrics`);
    assert.equal(metrics.status, 200, "as any HTTP client sends it");
    assert.match(await metrics.text(), /kvfence_requests_total/);
  });
});
