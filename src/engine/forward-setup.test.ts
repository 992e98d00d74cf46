import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { layoutFor } from "../../testing/forward-driver.js";
import { randomModel } from "../../testing/random-model.js";
import { maxAbsDiff } from "../kernels/assert-all-close.js";
import { WasmKernels } from "../kernels/wasm-kernels.js";
import { KvfenceError } from "../lib/errors.js";
import type { StepSequence } from "../model/forward.js";
import { createForward } from "./forward-setup.js";

describe("createForward()", () => {
  const { config, weights } = randomModel({ seed: 5, vocabSize: 40, maxPositionEmbeddings: 320 });
  const layout = layoutFor(config, 8);
  const pagesPerSeq = config.maxPositionEmbeddings / 8;

  for (const kernels of ["wasm", "native"] as const)
    it(`createForward() on ${kernels} puts every pool in the kernels' memory, which no step up to the full window grows`, async () => {
      const setup = await createForward(config, weights, layout, {
        kernels,
        kernelThreads: 2,
        maxBatchTokens: 64,
        maxSequences: 3,
        poolPages: [3 * pagesPerSeq, 5],
      });
      try {
        const k = setup.kernels;
        assert.ok(k instanceof WasmKernels);
        const buffer = k.memory.buffer;
        for (const pool of setup.pools) assert.equal(pool.data.buffer, buffer);
        const [a, b] = setup.pools;
        assert.ok(a !== undefined && b !== undefined);
        assert.ok(b.data.byteOffset >= a.data.byteOffset + a.data.byteLength, "the pools do not overlap");
        // Three sequences decode at the last position of the window: the attention staging is at its largest.
        const last = config.maxPositionEmbeddings - 1;
        const seqs: StepSequence[] = [0, 1, 2].map((s) => ({
          tokens: Int32Array.of(s + 1),
          startPos: last,
          blockTable: Int32Array.from({ length: pagesPerSeq }, (_, i) => s * pagesPerSeq + i),
          logits: new Float32Array(config.vocabSize),
        }));
        setup.forward.step(a.data, seqs);
        assert.equal(k.memory.buffer.byteLength, buffer.byteLength, "the memory did not grow");
        assert.equal(k.fallbackCalls, 0);
      } finally {
        await setup.close();
      }
    });

  it("createForward() gives the same logits on ts, wasm and native", async () => {
    const logits: Float32Array[] = [];
    for (const kernels of ["ts", "wasm", "native"] as const) {
      const setup = await createForward(config, weights, layout, {
        kernels,
        maxBatchTokens: 32,
        maxSequences: 1,
        poolPages: [4],
      });
      const out = new Float32Array(config.vocabSize);
      const pool = setup.pools[0]?.data as Float32Array;
      setup.forward.step(pool, [
        { tokens: Int32Array.of(3, 9, 1, 7, 2), startPos: 0, blockTable: Int32Array.of(2, 0), logits: out },
      ]);
      logits.push(out);
      await setup.close();
    }
    assert.ok(maxAbsDiff(logits[0] as Float32Array, logits[1] as Float32Array) < 1e-4);
    assert.ok(maxAbsDiff(logits[0] as Float32Array, logits[2] as Float32Array) < 1e-4);
  });

  for (const kernels of ["wasm", "native"] as const)
    it(`createForward() on ${kernels} zeroes a pool over a shared region an earlier engine used, not a fresh one`, async () => {
      const regionBytes = 32 * 1024 ** 2;
      const memory =
        kernels === "native"
          ? { buffer: new SharedArrayBuffer(65536 + regionBytes) }
          : new WebAssembly.Memory({
              initial: 1 + regionBytes / 65536,
              maximum: 1 + regionBytes / 65536,
              shared: true,
            });
      const shared = { memory, region: { start: 65536, end: 65536 + regionBytes } };
      const options = { kernels, maxBatchTokens: 8, maxSequences: 1, poolPages: [4], shared };
      const first = await createForward(config, weights, layout, options);
      assert.equal((first.kernels as WasmKernels).freshArena, true);
      first.pools[0]!.data.fill(0x3c00); // an earlier engine's KV (a worker that then exited)
      await first.close();
      // A restarted engine worker builds over the same region: its pool is zeroed, as fresh memory is.
      const second = await createForward(config, weights, layout, options);
      assert.equal((second.kernels as WasmKernels).freshArena, false);
      assert.equal(second.pools[0]!.data.byteOffset, first.pools[0]!.data.byteOffset);
      assert.ok(
        second.pools[0]!.data.every((v) => v === 0),
        "the earlier engine's KV is gone",
      );
      await second.close();
    });

  it("createForward() refuses a wasm memory beyond 4 GiB, naming --kernels ts", async () => {
    await assert.rejects(
      createForward(config, weights, layout, {
        kernels: "wasm",
        maxBatchTokens: 8,
        maxSequences: 1,
        poolPages: [2 ** 31 / (layout.numLayers * 2 * 8 * config.numKvHeads * config.headDim)],
      }),
      (err: unknown) =>
        err instanceof KvfenceError && err.code === "config_invalid" && /--kernels ts/.test(err.message),
    );
  });
});
