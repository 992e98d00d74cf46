/**
 * A full pool is a wait, not an error (threaded topology, real nodes): a request the decode pool,
 * or the prefill pool, cannot hold now waits in the router's admission queue and is served once the
 * request holding the pages lets them go — with the same greedy output as when it runs alone.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { modelDir } from "../../testing/start-server.js";
import type { WireError } from "../lib/errors.js";
import { loadModel } from "../model/load-model.js";
import type { GenerationRequest } from "../protocol/engine-api.js";
import { GREEDY_SAMPLING } from "../protocol/sampling-params.js";
import { startThreadedTopology } from "../topology/threaded-topology.js";
import type { DisaggregatedEngine } from "./disaggregated-engine.js";

const model = loadModel(modelDir("tiny-qwen2"), { shared: true });
const shared = { model: { config: model.config, weights: model.weights }, pageSize: 16, maxModelLen: 1024 };

function request(rid: number, seed: number): GenerationRequest {
  return {
    rid,
    tenant: 0,
    promptTokens: Int32Array.from({ length: 150 }, (_, i) => (i * 11 + seed) % 250),
    maxTokens: 20,
    sampling: GREEDY_SAMPLING,
  };
}

function run(engine: DisaggregatedEngine, r: GenerationRequest) {
  return new Promise<{ tokens: number[]; error: WireError | null }>((resolve) => {
    const tokens: number[] = [];
    engine.submit(r, {
      onTokens: (ids) => tokens.push(...ids),
      onFinish: () => resolve({ tokens, error: null }),
      onError: (error) => resolve({ tokens, error }),
    });
  });
}

// Two 150-token prompts with max_tokens 20 never fit a 16-page pool together: on decode they need
// 11 pages each (prompt and tail), on prefill 10 (the prompt). A full prefill pool used to answer
// 503 pool_exhausted at once (a burst of long prompts against the default server did), where a
// full decode pool made the request wait.
for (const full of ["decode", "prefill"] as const) {
  test(`DisaggregatedEngine serves a request the full ${full} pool refused once its pages free`, async () => {
    const t = await startThreadedTopology({
      prefill: { ...shared, numPages: full === "prefill" ? 16 : 64 },
      decode: { ...shared, numPages: full === "decode" ? 16 : 64 },
      maxModelLen: 1024,
    });
    try {
      const alone = await run(t.engine, request(1, 3));
      assert.equal(alone.error, null);
      const [a, b] = await Promise.all([run(t.engine, request(2, 5)), run(t.engine, request(3, 3))]);
      assert.equal(a.error, null);
      assert.equal(b.error, null, "the second request waited instead of failing with pool_exhausted");
      assert.deepEqual(b.tokens, alone.tokens, "the same greedy output as alone");
      assert.equal(t.engine.inFlight, 0);
      assert.equal(t.engine.waiting, 0);
    } finally {
      await t.close();
    }
  });
}
