/**
 * The threaded topology (router + prefill and decode worker threads, shared-memory transfer) at
 * the `EngineHandle` level: the effective context is the least over the model and every pool;
 * each door's rejection reaches the client unchanged (the incident's configuration: a prefill pool
 * smaller than decode's); a placeholder swapped in by prefill is caught by decode's coverage check,
 * never answered; a node worker that exits or throws fails its requests with 503, is fenced, and is
 * restarted as a new incarnation that serves again (readiness follows).
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { modelDir } from "../../testing/start-server.js";
import type { DisaggregatedEngine } from "../cluster/disaggregated-engine.js";
import type { WireError } from "../lib/errors.js";
import { loadModel } from "../model/load-model.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { contextLengthError } from "../protocol/router-machine.js";
import { makeSafety } from "../protocol/safety.js";
import { GREEDY_SAMPLING } from "../protocol/sampling-params.js";
import { startThreadedTopology } from "./threaded-topology.js";

const model = loadModel(modelDir("tiny-qwen2"), { shared: true });
const shared = { model: { config: model.config, weights: model.weights }, pageSize: 16, maxModelLen: 1024 };

function request(rid: number, promptLen: number, maxTokens: number): GenerationRequest {
  return {
    rid,
    tenant: 0,
    promptTokens: Int32Array.from({ length: promptLen }, (_, i) => (i * 13 + rid) % 250),
    maxTokens,
    sampling: GREEDY_SAMPLING,
  };
}

function run(
  engine: DisaggregatedEngine,
  r: GenerationRequest,
): Promise<{ tokens: number[]; error: WireError | null }> {
  return new Promise((resolve) => {
    const tokens: number[] = [];
    engine.submit(r, {
      onTokens: (ids) => tokens.push(...ids),
      onFinish: () => resolve({ tokens, error: null }),
      onError: (error) => resolve({ tokens, error }),
    });
  });
}

async function assertIdle(engine: DisaggregatedEngine): Promise<void> {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const s = await engine.stats();
    if ((s.pages.free === s.pages.total && engine.inFlight === 0) || Date.now() > deadline) {
      assert.deepEqual(s.pages, {
        free: s.pages.total,
        reserved: 0,
        ready: 0,
        quarantined: 0,
        total: s.pages.total,
      });
      assert.equal(engine.inFlight, 0);
      return;
    }
    await new Promise((r) => setTimeout(r, 10));
  }
}

test("DisaggregatedEngine admits by the least pool; each door's rejection reaches the client unchanged", async () => {
  // The incident's configuration: a prefill pool (128 tokens) smaller than decode's (1024).
  const options = {
    prefill: { ...shared, numPages: 8 },
    decode: { ...shared, numPages: 64 },
    maxModelLen: 1024,
  };
  const safe = await startThreadedTopology(options);
  const incident = await startThreadedTopology({
    ...options,
    safety: makeSafety({ faults: ["undersized-pool"] }),
  });
  try {
    assert.equal(safe.engine.capacity.maxModelLen, 128, "effective context: the least over model and pools");
    const expected = contextLengthError(200, 4, 128);

    // Door 1, the router: nothing contacted.
    const seen: string[] = [];
    safe.engine.observe((_node, msg) => seen.push(msg.type));
    assert.deepEqual((await run(safe.engine, request(1, 200, 4))).error, expected);
    assert.deepEqual(seen, [], "a request refused at the router reaches no node");

    // The router trusts the model's window (the fault): decode leases, prefill's door refuses with
    // its own error, unchanged; decode's quarantined lease is released by prefill's ack.
    const kinds: string[] = [];
    incident.engine.observe((node, msg) => kinds.push(`${node.hello.role}:${msg.type}`));
    const refused = await run(incident.engine, request(2, 200, 4));
    assert.deepEqual(refused, { tokens: [], error: expected });
    assert.deepEqual(kinds, ["decode:lease", "prefill:rejected"]);
    await assertIdle(incident.engine);

    // Requests that fit are served by both.
    for (const t of [safe, incident]) assert.equal((await run(t.engine, request(3, 60, 5))).tokens.length, 5);
  } finally {
    await safe.close();
    await incident.close();
  }
});

test("DisaggregatedEngine finishes a request whose first token (prefill's) is a stop token", async () => {
  // kvfence-tiny answers a raw prompt it does not recognize with <|im_end|> at once; decode used to
  // end such an attempt before the `committed` message of the same batch reached the router, which
  // then dropped the `finished` and waited for tokens forever (kvfence serve hung on the request).
  const topo = await startThreadedTopology({
    prefill: { ...shared, numPages: 16 },
    decode: { ...shared, numPages: 16 },
    maxModelLen: 1024,
  });
  try {
    const first = (await run(topo.engine, request(5, 30, 1))).tokens[0] as number;
    const kinds: string[] = [];
    topo.engine.observe((_node, msg) => kinds.push(msg.type));
    const outcome = await Promise.race([
      new Promise<{ reason: string; tokens: number[] }>((resolve, reject) => {
        const tokens: number[] = [];
        topo.engine.submit(
          {
            ...request(6, 30, 5),
            promptTokens: request(5, 30, 1).promptTokens,
            sampling: { ...GREEDY_SAMPLING, stopTokenIds: [first] },
          },
          {
            onTokens: (ids) => tokens.push(...ids),
            onFinish: (reason) => resolve({ reason, tokens }),
            onError: (error) => reject(new Error(error.message)),
          },
        );
      }),
      new Promise<never>((_, reject) =>
        setTimeout(
          () => reject(new Error(`no answer after 10 s; the router saw ${kinds.join(", ")}`)),
          10_000,
        ),
      ),
    ]);
    assert.deepEqual(outcome, { reason: "stop", tokens: [] });
    assert.ok(kinds.indexOf("committed") < kinds.indexOf("finished"), kinds.join(", "));
    await assertIdle(topo.engine);
  } finally {
    await topo.close();
  }
});

test("DisaggregatedEngine never answers from a placeholder: decode's coverage check fails the request", async () => {
  const t = await startThreadedTopology({
    prefill: { ...shared, numPages: 8 },
    decode: { ...shared, numPages: 64 },
    maxModelLen: 1024,
    safety: makeSafety({ faults: ["undersized-pool"] }),
    faults: ["placeholder-reject"],
  });
  try {
    const out = await run(t.engine, request(1, 200, 4));
    assert.deepEqual(out.tokens, [], "no token of a placeholder prompt reaches the client");
    assert.equal(out.error?.code, "coverage_mismatch");
    const nodes = await t.engine.nodeStats();
    const decode = nodes.find((n) => n.node.hello.role === "decode")!.stats!;
    assert.equal(decode.transfer.coverageFailures, 1);
    await assertIdle(t.engine);
  } finally {
    await t.close();
  }
});

/** Polls the engine's readiness (what `/ready` answers) until it is `ready`; fails after 15 s. */
async function waitReady(engine: DisaggregatedEngine, ready: boolean): Promise<void> {
  const deadline = Date.now() + 15_000;
  while (engine.health().ready !== ready) {
    if (Date.now() > deadline)
      assert.fail(`not ${ready ? "ready" : "unready"} in 15 s: ${engine.health().reason}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

test("A node worker thread that is terminated or throws: its requests fail with 503, it is fenced, restarted as a new incarnation, and served again", async () => {
  const t = await startThreadedTopology({
    prefill: { ...shared, numPages: 128, maxPrefillTokens: 4 },
    decode: { ...shared, numPages: 128 },
    maxModelLen: 1024,
  });
  try {
    const probe = request(2, 10, 4);
    const reference = await run(t.engine, probe);
    assert.equal(reference.error, null);
    const incarnations = new Set(t.engine.currentNodes.map((n) => n.hello.incarnation));

    // Prefill: terminated while it computes a prompt (chunks of 4 tokens).
    const leased = new Promise<void>((resolve) =>
      t.engine.observe((_node, msg) => {
        if (msg.type === "lease") resolve();
      }),
    );
    const pending = run(t.engine, request(1, 900, 4));
    await leased;
    const oldPrefill = t.prefillWorker;
    await oldPrefill.terminate();
    const out = await pending;
    assert.equal(out.error?.code, "node_unavailable");
    assert.equal(t.engine.health().ready, false, "not ready while prefill is down");
    // Decode fenced the lost prefill node and released its lease.
    const deadline = Date.now() + 10_000;
    for (;;) {
      const decode = (await t.engine.nodeStats()).find((n) => n.node.hello.role === "decode")!.stats!;
      if ((decode.pages.free === decode.pages.total && decode.attempts === 0) || Date.now() > deadline) {
        assert.equal(decode.pages.free, decode.pages.total);
        assert.equal(decode.attempts, 0);
        break;
      }
      await new Promise((r) => setTimeout(r, 10));
    }
    await waitReady(t.engine, true);
    assert.notEqual(t.prefillWorker, oldPrefill, "a new prefill worker");
    assert.equal(t.restarts, 1);
    assert.deepEqual(
      await run(t.engine, { ...probe, rid: 3 }),
      reference,
      "served again by the new prefill worker",
    );

    // Decode: its thread throws (a message its handler cannot read) while it generates.
    const generating = new Promise<void>((resolve) =>
      t.engine.observe((_node, msg) => {
        if (msg.type === "tokens") resolve();
      }),
    );
    const inFlight = run(t.engine, request(4, 10, 500));
    await generating;
    const oldDecode = t.decodeWorker;
    const exited = new Promise<number>((resolve) => oldDecode.once("exit", resolve));
    oldDecode.postMessage({ kind: "protocol", prefill: "prefill-0", msg: null });
    assert.notEqual(await exited, 0, "the decode thread died of the exception");
    assert.equal((await inFlight).error?.code, "node_unavailable", "its request in flight ends with 503");
    await waitReady(t.engine, false);
    await waitReady(t.engine, true);
    assert.notEqual(t.decodeWorker, oldDecode, "a new decode worker");
    assert.equal(t.restarts, 2);
    assert.deepEqual(
      await run(t.engine, { ...probe, rid: 5 }),
      reference,
      "served again by the new decode worker",
    );
    for (const n of t.engine.currentNodes)
      assert.ok(!incarnations.has(n.hello.incarnation), "new incarnations");
    await assertIdle(t.engine);
  } finally {
    await t.close();
  }
});

test("DisaggregatedEngine: the nodes' protocol state returns to empty when idle (watermarks prune every tombstone)", async () => {
  const t = await startThreadedTopology({
    prefill: { ...shared, numPages: 64 },
    decode: { ...shared, numPages: 64 },
    maxModelLen: 1024,
  });
  try {
    const tombstones = async () => {
      const nodes = await t.engine.nodeStats();
      return nodes.map((n) => ({
        role: n.node.hello.role,
        attempts: n.stats!.attempts,
        tombstones: n.stats!.tombstones,
      }));
    };
    const idle = [
      { role: "prefill", attempts: 0, tombstones: 0 },
      { role: "decode", attempts: 0, tombstones: 0 },
    ];
    for (let round = 0; round < 2; round++) {
      // 40 short requests at once, every fourth aborted by its client (silenced: it ends unseen)
      // at some point of its run, from waiting to decoding.
      const runs: Promise<unknown>[] = [];
      for (let i = 0; i < 40; i++) {
        const rid = round * 100 + i + 1;
        const r = run(t.engine, request(rid, 20, 3));
        if (i % 4 === 3) setTimeout(() => t.engine.abort(rid), i);
        else runs.push(r);
      }
      for (const r of await Promise.all(runs)) assert.equal((r as { error: unknown }).error, null);
      await assertIdle(t.engine);
      const deadline = Date.now() + 10_000;
      let seen = await tombstones();
      while (JSON.stringify(seen) !== JSON.stringify(idle) && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 10));
        seen = await tombstones();
      }
      assert.deepEqual(seen, idle, `round ${round}: no attempt and no tombstone left on either node`);
    }
  } finally {
    await t.close();
  }
});
