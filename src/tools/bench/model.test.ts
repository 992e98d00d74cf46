import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { randomModel } from "../../../testing/random-model.js";
import { matrixBytes } from "../../kernels/weight-format.js";
import { bundledModelDir, packageRoot } from "../../lib/package-root.js";
import { formatModelBench, MODEL_BENCH_DEFAULTS, prefillFlops, runModelBench, weightBytes } from "./model.js";
import { BandwidthProbe } from "./roofline.js";

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
          ].reduce((s, a) => s + (a === null ? 0 : matrixBytes(a).byteLength), 0),
        0,
      );
    assert.equal(
      weightBytes(tied.weights),
      layerBytes(tied) + matrixBytes(tied.weights.embed).byteLength + tied.weights.finalNorm.byteLength,
    );
    assert.equal(
      weightBytes(untied.weights),
      layerBytes(untied) +
        matrixBytes(untied.weights.lmHead).byteLength +
        untied.weights.finalNorm.byteLength,
    );
  });

  it("prefillFlops() counts linear layers per token and causal attention per token pair", () => {
    const { config } = randomModel({ architecture: "llama", tieWordEmbeddings: true });
    const one = prefillFlops(config, 1);
    const two = prefillFlops(config, 2);
    const attentionPair = config.numLayers * config.numHeads * 4 * config.headDim;
    // Going from 1 to 2 tokens adds one token of linear work and two more attended pairs (3 - 1).
    assert.equal(
      two - one,
      one - attentionPair - 2 * config.vocabSize * config.hiddenSize + 2 * attentionPair,
    );
  });

  it("BandwidthProbe.measure() reads its buffer on 1 and on 2 threads", async () => {
    const probe = await BandwidthProbe.start(1 << 20);
    try {
      assert.equal(probe.bytes, 1 << 20);
      assert.ok(probe.measure(1) > 0);
      assert.ok(probe.measure(2) > 0);
      assert.ok(probe.measure(2) > 0);
    } finally {
      await probe.close();
    }
  });

  it("runModelBench() runs both kernel sets side by side on the tiny model, each beside its roofline", async () => {
    const r = await runModelBench({
      ...MODEL_BENCH_DEFAULTS,
      modelDir: bundledModelDir(),
      kernels: ["ts", "wasm"],
      promptTokens: 20,
      contextTokens: 8,
      longContextTokens: 64,
      decodeSteps: 2,
      batchSizes: [1, 3],
      repeats: 2,
      bandwidthBytes: 1 << 20,
    });
    assert.deepEqual(
      r.runs.map((run) => [run.kernels, run.threads]),
      [
        ["ts", 1],
        ["wasm", 2],
      ],
    );
    assert.ok(r.readGbps[2] !== null);
    for (const run of r.runs) {
      assert.ok(run.prefillTokensPerSecond.summary.median > 0);
      assert.deepEqual(
        run.decode.map((d) => d.batch),
        [1, 3],
      );
      assert.equal(run.longContext?.contextTokens, 64);
      const roof = run.decode.map((d) => d.rooflineTokensPerSecond);
      assert.ok((roof[0] as number) > 0);
      assert.ok(Math.abs((roof[1] as number) - 3 * (roof[0] as number)) < 1e-6 * (roof[1] as number));
    }
  });

  it("runModelBench() with profile times each phase's kernels: every layer's calls, each matmul shape, the LM head", async () => {
    const r = await runModelBench({
      ...MODEL_BENCH_DEFAULTS,
      modelDir: bundledModelDir(),
      kernels: ["ts", "wasm"],
      promptTokens: 12,
      contextTokens: 8,
      decodeSteps: 3,
      batchSizes: [2],
      repeats: 1,
      bandwidthBytes: 1 << 20,
      profile: true,
    });
    const { numLayers, hiddenSize, vocabSize } = r.config;
    for (const run of r.runs) {
      const phases = run.profile ?? assert.fail(`${run.kernels}: no profile`);
      assert.deepEqual(
        phases.map((p) => [p.phase, p.steps]),
        [
          ["prefill (12-token prompt)", 1],
          ["decode batch 2 (context 8)", 3],
        ],
      );
      for (const p of phases) {
        const calls = new Map(p.rows.map((row) => [row.kernel, row.calls / p.steps]));
        assert.equal(calls.get("attention"), numLayers, `${run.kernels} ${p.phase}: ${[...calls.keys()]}`);
        assert.equal(calls.get(`matmul ${hiddenSize}→${vocabSize} f32`), 1);
        const inKernels = p.rows.reduce((sum, row) => sum + row.ms, 0);
        assert.ok(
          inKernels > 0 && inKernels <= p.stepMs * p.steps,
          `${inKernels} ms of ${p.stepMs * p.steps}`,
        );
      }
    }
    assert.match(
      formatModelBench(r),
      /where a step's time goes, decode batch 2 \(context 8\): [\d.]+ ms a step\n {6}\S/,
    );
  });

  it("runModelBench() runs --kernels wasm-i16 beside wasm: Q8_0 batches on the i16 tile", async () => {
    const r = await runModelBench({
      ...MODEL_BENCH_DEFAULTS,
      modelDir: bundledModelDir(),
      kernels: ["wasm", "wasm-i16"],
      dtypes: ["q8_0"],
      promptTokens: 12,
      contextTokens: 8,
      decodeSteps: 2,
      batchSizes: [2],
      repeats: 1,
      bandwidthBytes: 1 << 20,
    });
    const [dot, i16] = r.runs;
    assert.deepEqual(
      r.runs.map((run) => [run.kernels, run.dtype]),
      [
        ["wasm", "q8_0"],
        ["wasm-i16", "q8_0"],
      ],
    );
    assert.equal(i16?.dotAdd, false);
    // The int8 dot with accumulate runs where the engine computes it exactly: not Node 20's V8.
    if (Number(process.versions.node.split(".")[0]) === 20) assert.equal(dot?.dotAdd, false);
    else if (dot?.fma === true) assert.equal(dot.dotAdd, true);
    assert.match(formatModelBench(r), /wasm-i16 q8_0/);
  });

  it("runModelBench({ baseline }) runs each arm's twin on that checkout's forward pass and pairs them by repeat", async () => {
    // This checkout as its own baseline: the twin loads dist/ through the baseline's path.
    const root = packageRoot();
    const r = await runModelBench({
      ...MODEL_BENCH_DEFAULTS,
      modelDir: bundledModelDir(),
      kernels: ["wasm"],
      promptTokens: 12,
      contextTokens: 8,
      longContextTokens: 32,
      decodeSteps: 2,
      batchSizes: [1, 2],
      repeats: 3,
      bandwidthBytes: 1 << 20,
      baseline: root,
    });
    assert.deepEqual(
      r.runs.map((run) => [run.kernels, run.build]),
      [
        ["wasm", "this"],
        ["wasm", "baseline"],
      ],
    );
    assert.equal(r.vsBaseline.length, 1);
    const v = r.vsBaseline[0];
    assert.ok(v !== undefined);
    for (const ratio of [v.prefill, ...v.decode.map((d) => d.ratio), v.longContext]) {
      assert.ok(ratio !== null);
      assert.equal(ratio.n, 3);
      assert.ok(ratio.ratio > 0 && ratio.low <= ratio.ratio && ratio.ratio <= ratio.high);
    }
    assert.match(formatModelBench(r), /this build \/ baseline/);
    await assert.rejects(
      runModelBench({ ...MODEL_BENCH_DEFAULTS, modelDir: bundledModelDir(), baseline: "/nonexistent" }),
      /--baseline \/nonexistent: no .*forward-setup\.js; give a kvfence checkout built with npm ci/,
    );
  });
});
