import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { randomModel } from "../testing/random-model.js";
import { readBandwidth, weightBytes } from "./model.js";

describe("bench model helpers", () => {
  it("weightBytes() counts a tied LM head once and leaves out an untied embedding table", () => {
    const tied = randomModel({ architecture: "llama", tieWordEmbeddings: true });
    const untied = randomModel({ architecture: "qwen2", tieWordEmbeddings: false });
    const layerBytes = (m: typeof tied): number =>
      m.weights.layers.reduce(
        (sum, l) =>
          sum +
          [
            l.inputNorm,
            l.q,
            l.k,
            l.v,
            l.qBias,
            l.kBias,
            l.vBias,
            l.o,
            l.postNorm,
            l.gate,
            l.up,
            l.down,
          ].reduce((s, a) => s + (a?.byteLength ?? 0), 0),
        0,
      );
    assert.equal(
      weightBytes(tied.weights),
      layerBytes(tied) + tied.weights.embed.byteLength + tied.weights.finalNorm.byteLength,
    );
    assert.equal(
      weightBytes(untied.weights),
      layerBytes(untied) + untied.weights.lmHead.byteLength + untied.weights.finalNorm.byteLength,
    );
  });

  it("readBandwidth() sums the whole buffer", () => {
    const buf = Float64Array.from({ length: 1003 }, (_, i) => i);
    const r = readBandwidth(buf);
    assert.equal(r.sum, (1003 * 1002) / 2);
    assert.ok(r.gbps > 0);
  });
});
