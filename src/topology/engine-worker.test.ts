import assert from "node:assert/strict";
import { test } from "node:test";
import { MessageChannel } from "node:worker_threads";
import { makeEngine, prompt, request, runAll, testModel } from "../../testing/engine-harness.js";
import { buildEngine } from "../engine/build-engine.js";
import { PagePool } from "../kvcache/page-pool.js";
import { KvfenceError } from "../lib/errors.js";
import {
  type EngineEventsMessage,
  FINISH_STRIDE,
  type FromEngineWorker,
  type ToEngineWorker,
} from "./engine-messages.js";
import { serveEngine } from "./engine-worker.js";

test("serveEngine() sends one message per step carrying every request's new token", async () => {
  const requests = [request(1, prompt(6, 1), 8), request(2, prompt(9, 2), 8), request(3, prompt(3, 3), 8)];
  const expected = runAll(makeEngine(), requests).map((o) => o.tokens);
  const engine = makeEngine();
  const { port1, port2 } = new MessageChannel();
  serveEngine(engine, port2);
  const messages: EngineEventsMessage[] = [];
  const finished = new Promise<void>((resolve) => {
    let done = 0;
    port1.on("message", (m: FromEngineWorker) => {
      if (m.type !== "events") return;
      messages.push(m);
      done += m.finishes.length / FINISH_STRIDE;
      if (done === requests.length) resolve();
    });
  });
  for (const r of requests) port1.postMessage({ type: "submit", requests: [r] } satisfies ToEngineWorker);
  await finished;
  port1.close();

  const tokens = new Map<number, number[]>();
  let multiRequestMessages = 0;
  for (const m of messages) {
    const rids = new Set<number>();
    for (let i = 0; i < m.tokens.length; ) {
      const rid = m.tokens[i]!;
      const count = m.tokens[i + 1]!;
      rids.add(rid);
      tokens.set(rid, [...(tokens.get(rid) ?? []), ...m.tokens.slice(i + 2, i + 2 + count)]);
      i += 2 + count;
    }
    if (rids.size > 1) multiRequestMessages++;
  }
  assert.deepEqual(
    requests.map((r) => tokens.get(r.rid)),
    expected,
  );
  // All three prefill in one step and decode together: 8 steps, each one message for all of them.
  assert.equal(messages.length, 8);
  assert.equal(multiRequestMessages, 8);
});

test("serveEngine() applies an abort between two steps", async () => {
  const engine = makeEngine();
  const { port1, port2 } = new MessageChannel();
  serveEngine(engine, port2);
  let tokensAfterAbort = -1;
  let seen = 0;
  const aborted = new Promise<void>((resolve) => {
    port1.on("message", (m: FromEngineWorker) => {
      if (m.type === "events" && m.tokens.length > 0) {
        seen++;
        if (seen === 2) {
          port1.postMessage({ type: "abort", rid: 1 } satisfies ToEngineWorker);
          port1.postMessage({ type: "stats", id: 1 } satisfies ToEngineWorker);
          tokensAfterAbort = 0;
        } else if (tokensAfterAbort >= 0) {
          tokensAfterAbort++;
        }
      }
      if (m.type === "stats") {
        assert.equal(m.stats.queue.running, 0);
        assert.equal(m.stats.pages.free, m.stats.pages.total);
        resolve();
      }
    });
  });
  port1.postMessage({ type: "submit", requests: [request(1, prompt(10, 4), 200)] } satisfies ToEngineWorker);
  await aborted;
  port1.close();
  // At most the one step already running when the abort was posted.
  assert.ok(tokensAfterAbort <= 1, `tokens after abort: ${tokensAfterAbort}`);
  assert.ok(engine.stats().counters.completionTokens < 10);
});

test("buildEngine() puts the KV pool inside the WebAssembly memory by default and greedy output matches the reference", async () => {
  const model = testModel();
  const base = { model, numPages: 40, pageSize: 4, maxBatchTokens: 64, maxSequences: 8 } as const;
  const requests = [
    request(1, prompt(6, 1), 12),
    request(2, prompt(13, 2), 12),
    request(3, prompt(3, 3), 12),
  ];
  const ts = await buildEngine({ ...base, kernels: "ts" });
  for (const kernelThreads of [1, 2] as const) {
    const wasm = await buildEngine({ ...base, kernelThreads });
    const data = wasm.pool.data;
    // The pool is a window into the kernels' memory (weights before it), not a buffer of its own.
    assert.ok(data.buffer instanceof SharedArrayBuffer);
    assert.ok(data.byteOffset > 0);
    assert.ok(data.buffer.byteLength > data.byteOffset + PagePool.dataBytesFor(wasm.pool.layout, 40));
    assert.deepEqual(
      runAll(wasm, requests).map((o) => o.tokens),
      runAll(ts, requests).map((o) => o.tokens),
    );
  }
  assert.equal(ts.pool.data.byteOffset, 0);
  assert.equal(ts.pool.data.buffer.byteLength, PagePool.dataBytesFor(ts.pool.layout, 40));
});

test("buildEngine() refuses a pool the 4 GiB WebAssembly memory cannot hold, naming --kernels ts", async () => {
  await assert.rejects(
    buildEngine({ model: testModel(), numPages: 2 ** 22, pageSize: 16 }),
    (err: unknown) =>
      err instanceof KvfenceError && err.code === "config_invalid" && /--kernels ts/.test(err.message),
  );
});
