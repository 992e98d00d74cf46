/**
 * The prefill node's door for the router's `prefill`: the prompt's ids arrive as one `Int32Array`
 * (a MessagePort's clone, the control link's base64), and anything else is refused before the
 * engine sees it.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { randomModel } from "../../testing/random-model.js";
import { Engine } from "../engine/engine.js";
import { PagePool } from "../kvcache/page-pool.js";
import type { FromNode } from "../links/node-messages.js";
import { ForwardPass } from "../model/forward.js";
import { SAFE } from "../protocol/safety.js";
import type { PrefillRequest } from "../protocol/wire.js";
import { PrefillNode } from "./prefill-node.js";

const PAGE = 16;
const DECODE = 22;

function prefillNode(): { node: PrefillNode; toRouter: FromNode[] } {
  const { config, weights } = randomModel({ seed: 5, vocabSize: 64, maxPositionEmbeddings: 64 });
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: PAGE,
  };
  const forward = new ForwardPass(config, weights, layout, { maxBatchTokens: 16, maxSequences: 2 });
  const engine = new Engine(forward, new PagePool(layout, 8));
  const toRouter: FromNode[] = [];
  const node = new PrefillNode({
    engine,
    layoutSignature: "test",
    safety: SAFE,
    incarnation: 1,
    toRouter: (m) => toRouter.push(structuredClone(m)),
  });
  const idle = async (): Promise<void> => {};
  node.decodeLink(DECODE).attach({
    kind: "shm",
    writePages: idle,
    endLease: idle,
    sendControl: idle,
    close: idle,
  });
  return { node, toRouter };
}

function prefill(promptTokens: Int32Array): PrefillRequest {
  return {
    type: "prefill",
    rid: 1,
    epoch: 1,
    tenant: 0,
    promptLen: 3,
    maxTokens: 2,
    promptTokens,
    lease: {
      type: "lease",
      rid: 1,
      epoch: 1,
      pages: [{ page: 0, generation: 1 }],
      pageSize: PAGE,
      layoutSignature: "test",
      incarnation: DECODE,
      writerIncarnation: 1,
    },
  };
}

test("PrefillNode.onRouter() refuses a prefill whose prompt ids are not an Int32Array", () => {
  const { node, toRouter } = prefillNode();
  // A router of another version sending a plain array of the right length.
  const plain = [5, 6, 7] as unknown as Int32Array;
  node.onRouter({ kind: "protocol", prefill: "p0", msg: prefill(plain) });
  const rejected = toRouter.find((m) => m.kind === "protocol" && m.msg.type === "rejected");
  assert.ok(rejected?.kind === "protocol" && rejected.msg.type === "rejected");
  assert.equal(rejected.msg.error.code, "invalid_request");
  assert.match(
    rejected.msg.error.message,
    /in another form than an Int32Array; run the same kvfence version .*: array$/,
  );
});
