import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { makeEngine, prompt, recorder, request, runAll, testModel } from "../../testing/engine-harness.js";
import { randomModel } from "../../testing/random-model.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { EngineClient } from "./engine-client.js";

const OPTIONS = {
  model: testModel(),
  numPages: 64,
  pageSize: 4,
  maxBatchTokens: 64,
  maxSequences: 8,
} as const;

/** A long window, so a request outlives any scheduling hiccup between its first token and an abort. */
const LONG = {
  ...OPTIONS,
  model: randomModel({ seed: 11, vocabSize: 64, maxPositionEmbeddings: 4096, numLayers: 1 }),
  numPages: 1024,
} as const;

let client: EngineClient;

before(async () => {
  client = await EngineClient.start(OPTIONS);
});

after(async () => {
  await client.close();
});

/** Submits through `handle` and resolves when the request ends (finish or error). */
function submitAndWait(handle: EngineClient, r: GenerationRequest) {
  const rec = recorder();
  const done = new Promise<typeof rec.outcome>((resolve) => {
    handle.submit(r, {
      onTokens: (ids) => rec.events.onTokens(ids),
      onFinish: (reason, usage) => {
        rec.events.onFinish(reason, usage);
        resolve(rec.outcome);
      },
      onError: (error) => {
        rec.events.onError(error);
        resolve(rec.outcome);
      },
    });
  });
  return { outcome: rec.outcome, done };
}

async function waitIdle(handle: EngineClient): Promise<void> {
  for (;;) {
    const s = await handle.stats();
    if (s.queue.running + s.queue.waiting === 0) {
      assert.equal(s.pages.free, s.pages.total, "an idle engine holds no pages");
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

test("EngineClient.start() reports the worker engine's capacity", () => {
  assert.deepEqual(client.capacity, { poolTokens: 256, pageSize: 4, maxModelLen: 256, maxSequences: 8 });
});

test("EngineClient streams the same tokens as the in-thread engine", async () => {
  const requests = [request(1, prompt(7, 1), 9), request(2, prompt(18, 2), 5), request(3, prompt(3, 3), 12)];
  const expected = runAll(makeEngine({ numPages: 64, pageSize: 4 }), requests);
  const outcomes = await Promise.all(requests.map((r) => submitAndWait(client, r).done));
  assert.deepEqual(outcomes, expected);
  await waitIdle(client);
});

test("EngineClient.abort() stops a running request at once and frees its pages", async () => {
  const long = await EngineClient.start(LONG);
  try {
    let tokensSeen = 0;
    let ended = false;
    const aborted = new Promise<void>((resolve) => {
      long.submit(request(10, prompt(20, 4), 4000), {
        onTokens: (ids) => {
          tokensSeen += ids.length;
          long.abort(10); // as the router does on a client disconnect
          long.abort(10);
          resolve();
        },
        onFinish: () => {
          ended = true;
        },
        onError: () => {
          ended = true;
        },
      });
    });
    await aborted;
    const atAbort = tokensSeen;
    const s = await long.stats(); // ordered after the abort on the same port
    assert.equal(s.queue.running, 0);
    assert.equal(s.pages.free, s.pages.total);
    assert.equal(s.counters.aborts, 1);
    assert.ok(s.counters.completionTokens < 4000, "the abort landed long before the request could finish");
    await new Promise((resolve) => setTimeout(resolve, 20));
    assert.equal(tokensSeen, atAbort, "no tokens after abort");
    assert.equal(ended, false, "no terminal event after abort");
  } finally {
    await long.close();
  }
});

test("EngineClient passes the engine's door refusal through onError", async () => {
  const { done } = submitAndWait(client, request(20, prompt(200, 5), 100));
  const outcome = await done;
  assert.equal(outcome.error?.code, "context_length_exceeded");
  assert.match(outcome.error!.message, /200 prompt tokens plus 100 max_tokens: 300/);
});

test("EngineClient.close() ends open requests with node_unavailable", async () => {
  const own = await EngineClient.start(LONG);
  const { done } = submitAndWait(own, request(1, prompt(10, 6), 4000));
  await own.close();
  const outcome = await done;
  assert.equal(outcome.error?.code, "node_unavailable");
  const late = recorder();
  own.submit(request(2, [1], 1), late.events);
  await new Promise((resolve) => setImmediate(resolve));
  assert.equal(late.outcome.error?.code, "node_unavailable");
  await assert.rejects(own.stats(), { code: "node_unavailable" });
});

test("EngineClient.start() rejects with the worker's error when the engine cannot be built", async () => {
  await assert.rejects(EngineClient.start({ ...OPTIONS, numPages: 0 }), { code: "config_invalid" });
});

test("EngineClient holds a tenant at its share in front of the worker; another tenant's request goes at once", async () => {
  const own = await EngineClient.start(LONG, { fairShare: { tenants: 2, maxQueue: 8 } });
  try {
    assert.deepEqual(own.health(), { live: true, ready: true, reason: null });
    // Eight sequence slots, two tenants: tenant 0 may have four requests in the worker.
    const flood = Array.from({ length: 8 }, (_, i) =>
      submitAndWait(own, request(30 + i, prompt(10, i + 1), 200, { tenant: 0 })),
    );
    assert.equal(own.fairShare.runningOf(0), 4);
    assert.equal(own.fairShare.waitingOf(0), 4);
    const other = submitAndWait(own, request(50, prompt(10, 9), 4, { tenant: 1 }));
    assert.equal(own.fairShare.runningOf(1), 1, "tenant 1 is not behind tenant 0's queue");
    const over = submitAndWait(own, request(60, prompt(10, 9), 4, { tenant: 0 }));
    assert.equal(
      (await over.done).error?.code,
      "rate_limit_exceeded",
      "tenant 0 has its 4 of 8 places waiting",
    );
    assert.equal((await other.done).finish, "length");
    for (const f of flood) assert.equal((await f.done).finish, "length");
    const s = await own.stats();
    assert.equal(s.queue.waiting, 0);
  } finally {
    await own.close();
  }
  assert.equal(own.health().live, false, "a closed engine is not live");
});
