/**
 * Checksums off the transfer's critical path, in the real nodes (threaded topology, shared-memory
 * transport): prefill hashes each source page after the engine step that completed it and reads
 * those records into the manifest; decode hashes each page as the transport reports it landed and
 * reads those records at the commit check. The counters come from each node's `NodeStats`.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { prompt, request } from "../../testing/engine-harness.js";
import { modelDir } from "../../testing/start-server.js";
import { loadModel } from "../model/load-model.js";
import { startThreadedTopology } from "../topology/threaded-topology.js";

const model = loadModel(modelDir("tiny-qwen2"), { shared: true });
const PAGE = 16;
const shared = { model: { config: model.config, weights: model.weights }, pageSize: PAGE, maxModelLen: 1024 };

test("PrefillNode hashes pages at production and DecodeNode as they land; the commit reads the records", async () => {
  // 200 prompt tokens in chunks of 32 (2 pages): 13 pages, the last one partial.
  const t = await startThreadedTopology({
    prefill: { ...shared, numPages: 64, maxPrefillTokens: 32 },
    decode: { ...shared, numPages: 64 },
    maxModelLen: 1024,
  });
  try {
    const promptLen = 200;
    const pages = Math.ceil(promptLen / PAGE);
    for (const rid of [1, 2]) {
      const out = await new Promise<{ tokens: number; error: unknown }>((resolve) => {
        let tokens = 0;
        t.engine.submit(request(rid, prompt(promptLen, rid, 250), 3), {
          onTokens: (ids) => {
            tokens += ids.length;
          },
          onFinish: () => resolve({ tokens, error: null }),
          onError: (error) => resolve({ tokens, error }),
        });
      });
      assert.deepEqual(out, { tokens: 3, error: null });
    }
    const stats = await t.engine.nodeStats();
    const of = (role: string) => stats.find((s) => s.node.hello.role === role)?.stats?.checksums;
    const prefill = of("prefill");
    const decode = of("decode");
    // Prefill: the pages completed before the last chunk were hashed at production and served from
    // the record; only the last chunk's pages (produced in the step that sampled) are hashed at
    // `computed`.
    assert.ok(prefill !== undefined);
    assert.equal(prefill.hits + prefill.misses, 2 * pages);
    assert.ok(prefill.hits >= 2 * (pages - 2), `prefill hits: ${JSON.stringify(prefill)}`);
    assert.equal(prefill.recorded, prefill.hits);
    // Decode: every page hashed as it landed, every commit read served from that.
    assert.deepEqual(decode, { recorded: 2 * pages, hits: 2 * pages, misses: 0 });
  } finally {
    await t.close();
  }
});
