/**
 * Traces (issue #18 item 3): with `--otlp-endpoint`, one request's spans reach a real OTLP/HTTP
 * receiver (testing/otlp-receiver.ts, the exporter's peer) as one tree — the router's `request`
 * with `queue_wait`, `reservation` and `first_token`, the prefill node's `prefill` and `transfer`,
 * the decode node's `commit` and `decode` under it — in the threaded topology (nodes in worker
 * threads) and in a TCP cluster (node processes), each span carrying the client's `x-request-id`
 * and no tenant. Without the flag no span is sent and the SDK is never imported statically.
 */
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { type OtlpReceiver, type ReceivedSpan, startOtlpReceiver } from "../../testing/otlp-receiver.js";
import { modelDir } from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "tiny-qwen2";
// The batch exporter's delay (the SDK's 5 s by default), for this test's servers and node processes.
process.env.OTEL_BSP_SCHEDULE_DELAY = "200";
const KEYS = { "sk-tenant-alpha-0001": "alpha" };
const TREE: readonly [string, string][] = [
  ["kvfence-router", "queue_wait"],
  ["kvfence-router", "reservation"],
  ["kvfence-router", "first_token"],
  ["kvfence-prefill", "prefill"],
  ["kvfence-prefill", "transfer"],
  ["kvfence-decode", "commit"],
  ["kvfence-decode", "decode"],
];

async function ask(server: TopologyServer, requestId: string, stream: boolean): Promise<void> {
  const client = new OpenAI({
    baseURL: server.baseURL,
    apiKey: "sk-tenant-alpha-0001",
    maxRetries: 0,
    defaultHeaders: { "x-request-id": requestId },
  });
  const body = {
    model: MODEL,
    messages: [{ role: "user" as const, content: "Write one line about the sea" }],
    max_tokens: 6,
    temperature: 0,
  };
  if (stream) {
    for await (const _ of await client.chat.completions.create({ ...body, stream: true })) {
      // drain
    }
  } else await client.chat.completions.create(body);
}

/** The spans of `requestId` once all eight arrived (built 1 s after they end, exported in batches). */
async function spansOf(receiver: OtlpReceiver, requestId: string): Promise<ReceivedSpan[]> {
  const deadline = Date.now() + 20_000;
  for (;;) {
    const root = receiver.spans.find(
      (s) => s.name === "request" && s.attributes["kvfence.request_id"] === requestId,
    );
    const tree = root === undefined ? [] : receiver.spans.filter((s) => s.traceId === root.traceId);
    if (tree.length >= TREE.length + 1 || Date.now() > deadline) return tree;
    await new Promise((r) => setTimeout(r, 100));
  }
}

const ms = (ns: bigint): string => (Number(ns) / 1e6).toFixed(3);

function assertTree(spans: readonly ReceivedSpan[], requestId: string, where: string): void {
  const root = spans.find((s) => s.name === "request");
  assert.ok(root !== undefined, `${where}: a request span`);
  assert.equal(root.service, "kvfence-router", where);
  assert.equal(root.parentSpanId, "", `${where}: the request span is the root`);
  assert.equal(root.attributes["http.response.status_code"], 200, where);
  const children = spans.filter((s) => s !== root).map((s) => [s.service, s.name] as [string, string]);
  assert.deepEqual(children.sort(), [...TREE].sort(), `${where}: one span per phase, from its node`);
  for (const s of spans) {
    assert.equal(s.traceId, root.traceId, `${where}: ${s.name} in the request's trace`);
    if (s !== root) assert.equal(s.parentSpanId, root.spanId, `${where}: ${s.name} under the request`);
    assert.equal(s.attributes["kvfence.request_id"], requestId, `${where}: ${s.name} carries the request id`);
    assert.ok(s.endNs >= s.startNs, `${where}: ${s.name} ends after it starts`);
    // Phases lie within the request (1 ms of slack: clocks of other threads and processes).
    assert.ok(
      s.startNs >= root.startNs - 1_000_000n && s.endNs <= root.endNs + 1_000_000n,
      `${where}: ${s.name} within (starts ${ms(s.startNs - root.startNs)} ms after the request, ends ${ms(root.endNs - s.endNs)} ms before its end)`,
    );
    for (const [k, v] of Object.entries(s.attributes))
      assert.ok(!/tenant/.test(k) && v !== "alpha", `${where}: no tenant in ${s.name}`);
  }
  const at = (name: string) => spans.find((s) => s.name === name)!;
  assert.ok(at("prefill").endNs <= at("transfer").endNs, `${where}: the transfer ends after prefill`);
  assert.ok(
    at("commit").startNs >= at("transfer").startNs - 1_000_000n,
    `${where}: commit after the transfer began`,
  );
  assert.ok(at("decode").startNs >= at("commit").endNs - 1_000_000n, `${where}: decode after the commit`);
}

describe("OpenTelemetry spans of one request across router, prefill and decode", { timeout: 120_000 }, () => {
  let receiver: OtlpReceiver;
  const servers: { name: string; server: TopologyServer }[] = [];

  before(async () => {
    receiver = await startOtlpReceiver();
    const options = {
      model: modelDir(MODEL),
      kvPages: 64,
      maxModelLen: 512,
      apiKeys: KEYS,
      otlpEndpoint: receiver.url,
    };
    const [threads, cluster] = await Promise.all([
      startInProcess("threads", options),
      startCluster(1, 1, options),
    ]);
    servers.push({ name: "threads", server: threads }, { name: "tcp 1+1", server: cluster });
  });
  after(async () => {
    await Promise.all(servers.map((s) => s.server.close()));
    await receiver?.close();
  });

  test("the span tree of one request, streamed and not, in both topologies", async () => {
    for (const { name, server } of servers) {
      for (const stream of [false, true]) {
        const id = `trace-${name.replace(/\W/g, "")}-${stream ? "stream" : "whole"}`;
        await ask(server, id, stream);
        assertTree(await spansOf(receiver, id), id, `${name}, ${stream ? "streamed" : "whole"}`);
      }
    }
    assert.ok(
      receiver.contentTypes.every((t) => t.startsWith("application/json")),
      "OTLP/HTTP JSON",
    );
  });
});

test("tracing off: the OpenTelemetry SDK is imported only by src/lib/tracing.ts, and only dynamically", () => {
  const src = fileURLToPath(new URL("../../../src/", import.meta.url));
  const offenders: string[] = [];
  const walk = (dir: string): void => {
    for (const entry of readdirSync(dir, { withFileTypes: true })) {
      const path = join(dir, entry.name);
      if (entry.isDirectory()) walk(path);
      else if (entry.name.endsWith(".ts") && !entry.name.endsWith(".test.ts")) {
        const text = readFileSync(path, "utf8");
        if (/^import(?!\s+type)[^;]*from\s+"@opentelemetry\//m.test(text)) offenders.push(path);
      }
    }
  };
  walk(src);
  assert.deepEqual(offenders, []);
  const tracing = readFileSync(join(src, "lib/tracing.ts"), "utf8");
  assert.match(tracing, /import\("@opentelemetry\/sdk-trace-base"\)/);
});
