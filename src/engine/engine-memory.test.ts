/**
 * One shared memory for the weights and every engine (src/engine/engine-memory.ts): the weights are
 * read into it and used in place by two engines' forward passes (no copy), each engine's pool and
 * activations lie in its own region and never grow out of it, the logits are those of an engine
 * with its own memory, a kernel set refuses to write into or attend over another engine's region,
 * and a plan beyond 4 GiB is refused with its numbers before anything is read.
 */
import assert from "node:assert/strict";
import { closeSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, it } from "node:test";
import { writeGgufFromFolder } from "../../testing/gguf-writer.js";
import { writeModelFolder } from "../../testing/model-folder.js";
import { modelDir } from "../../testing/start-server.js";
import { nativeAddon } from "../kernels/kernel-backend.js";
import type { WasmKernels } from "../kernels/wasm-kernels.js";
import { type Matrix, matrixBytes, matrixDType } from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import type { StepSequence } from "../model/forward.js";
import { openModel, openModelMeta, weightFilesOf } from "../model/load-model.js";
import { buildEngine } from "./build-engine.js";
import {
  engineRegionBytes,
  layoutOf,
  loadEngineMemory,
  regionBytesOf,
  weightMemoryBytes,
} from "./engine-memory.js";
import { createForward } from "./forward-setup.js";

describe("loadEngineMemory()", async () => {
  const meta = await openModelMeta(modelDir("tiny-qwen2"));
  const config = meta.config;
  const layout = layoutOf(config, { pageSize: 16 });
  const sizing = { maxBatchTokens: 32, maxSequences: 2, poolPages: [config.maxPositionEmbeddings / 16] };
  const regionBytes = engineRegionBytes(config, layout, sizing);

  async function twoEngines() {
    const shared = loadEngineMemory(meta, [regionBytes, regionBytes]);
    const setups = await Promise.all(
      shared.regions.map((region) =>
        createForward(config, shared.weights, layout, {
          kernels: "wasm",
          ...sizing,
          shared: { memory: shared.memory, region },
        }),
      ),
    );
    return { shared, setups };
  }

  const step = (setup: Awaited<ReturnType<typeof createForward>>): Float32Array => {
    const logits = new Float32Array(config.vocabSize);
    const pool = setup.pools[0]?.data as Float32Array;
    const seq: StepSequence = {
      tokens: Int32Array.of(3, 9, 1, 7, 2),
      startPos: 0,
      blockTable: Int32Array.of(2, 0),
      logits,
    };
    setup.forward.step(pool, [seq]);
    return logits;
  };

  it("both engines use the weights where they were read, each pool in its own region, the memory never grows", async () => {
    const { shared, setups } = await twoEngines();
    const bytes = shared.memory.buffer.byteLength;
    for (const [i, setup] of setups.entries()) {
      const k = setup.kernels as WasmKernels;
      assert.equal(k.memory, shared.memory);
      const region = shared.regions[i]!;
      for (const [a, b] of [
        [setup.weights.embed, shared.weights.embed],
        [setup.weights.layers[1]!.down, shared.weights.layers[1]!.down],
        [setup.weights.layers[0]!.qBias, shared.weights.layers[0]!.qBias],
      ] as const) {
        const [x, y] = [matrixBytes(a as Matrix), matrixBytes(b as Matrix)];
        assert.equal(x.byteOffset, y.byteOffset, "the same bytes, not a copy");
        assert.equal(x.buffer.byteLength, shared.memory.buffer.byteLength, "in the shared memory");
        assert.ok(x.byteOffset + x.byteLength <= shared.regions[0]!.start, "weights below the regions");
      }
      const pool = setup.pools[0]!.data;
      assert.ok(
        pool.byteOffset >= region.start && pool.byteOffset + pool.byteLength <= region.end,
        "pool in its region",
      );
      step(setup);
      assert.equal(k.fallbackCalls, 0);
    }
    assert.equal(shared.memory.buffer.byteLength, bytes, "the memory did not grow");
    await Promise.all(setups.map((s) => s.close()));
  });

  it("gives the logits of an engine with its own memory and its own copy of the weights", async () => {
    const { setups } = await twoEngines();
    const own = await createForward(config, (await openModel(modelDir("tiny-qwen2"))).weights, layout, {
      kernels: "wasm",
      ...sizing,
    });
    const expected = step(own);
    for (const setup of setups) assert.deepEqual(step(setup), expected);
    await Promise.all([...setups, own].map((s) => s.close()));
  });

  it("a kernel set refuses to write into, or attend over the KV pool of, another engine's region", async () => {
    const { shared, setups } = await twoEngines();
    const [a, b] = setups as [
      Awaited<ReturnType<typeof createForward>>,
      Awaited<ReturnType<typeof createForward>>,
    ];
    const ka = a.kernels as WasmKernels;
    const poolB = b.pools[0]!.data;
    const h = config.hiddenSize;
    const x = ka.allocF32(h);
    // Another engine's pool as a matmul output, and the shared weights as one: refused.
    assert.throws(
      () =>
        ka.matmul(
          new Float32Array(poolB.buffer, poolB.byteOffset, h),
          x,
          shared.weights.layers[0]!.q,
          1,
          h,
          h,
        ),
      /matmul output .* lies outside this engine's region/,
    );
    assert.throws(
      () =>
        ka.matmul(
          shared.weights.layers[0]!.inputNorm.subarray(0, h),
          x,
          shared.weights.layers[0]!.q,
          1,
          h,
          h,
        ),
      /matmul output .* lies outside this engine's region/,
    );
    // Decode through engine a's forward pass, handed b's pool: refused before any read or write.
    // A mark in the pool's element type (f16 pages hold raw bits: 0x3800 is 0.5).
    const mark = poolB instanceof Float32Array ? 0.5 : 0x3800;
    poolB.fill(mark);
    const logits = new Float32Array(config.vocabSize);
    assert.throws(
      () =>
        a.forward.step(poolB, [
          { tokens: Int32Array.of(3), startPos: 0, blockTable: Int32Array.of(0), logits },
        ]),
      /KV pool .* lies outside this engine's region/,
    );
    assert.ok(
      poolB.every((v) => v === mark),
      "nothing was written into the other engine's pool",
    );
    await Promise.all(setups.map((s) => s.close()));
  });

  it("takes a GGUF Q8_0 file whole: its blocks are used in place by the engines, as Q8_0", async () => {
    const dir = mkdtempSync(join(tmpdir(), "kvfence-mem-gguf-"));
    try {
      const path = join(dir, "m.gguf");
      writeGgufFromFolder(modelDir("tiny-qwen2"), path, { dtype: "q8_0" });
      const g = await openModelMeta(path);
      const shared = loadEngineMemory(g, [regionBytes]);
      const q = shared.weights.layers[0]!.q;
      assert.equal(matrixDType(q), "q8_0", "kept as blocks, not dequantised");
      assert.equal(matrixBytes(q).buffer, shared.memory.buffer, "a view of the file in the memory");
      const setup = await createForward(config, shared.weights, layout, {
        kernels: "wasm",
        ...sizing,
        shared: { memory: shared.memory, region: shared.regions[0]! },
      });
      assert.equal(
        matrixBytes(setup.weights.layers[0]!.q).byteOffset,
        matrixBytes(q).byteOffset,
        "not copied",
      );
      const own = await createForward(config, (await openModel(path)).weights, layout, {
        kernels: "wasm",
        ...sizing,
      });
      assert.deepEqual(step(setup), step(own));
      await Promise.all([setup.close(), own.close()]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("refuses weights plus regions beyond 4 GiB with the numbers, before reading a byte", () => {
    let read = 0;
    assert.throws(
      () => loadEngineMemory(meta, [3 * 1024 ** 3, 1024 ** 3], { onProgress: () => read++ }),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === "config_invalid" &&
        /need 4\.00 GiB \(weights 0\.00 GiB, 2 engine region\(s\) of 3\.00 GiB and 1\.00 GiB\) but WebAssembly addresses at most 4 GiB/.test(
          err.message,
        ),
    );
    assert.equal(read, 0);
  });

  it("an engine serving a shorter context than the model's window sizes its RoPE tables and staging by it, in its planned region", async () => {
    // A 65,536-position window of 64-dim heads: 32 MiB of RoPE tables an engine at the full window.
    const folder = writeModelFolder({
      shape: { headDim: 64, numHeads: 2, numKvHeads: 1, maxPositionEmbeddings: 65536 },
    });
    try {
      const m = await openModelMeta(folder.dir);
      const limits = { numPages: 8, pageSize: 16, maxModelLen: 1024 };
      const served = regionBytesOf(m.config, limits);
      const full = regionBytesOf(m.config, { numPages: 8, pageSize: 16 });
      assert.ok(
        full - served > 32 * 1024 ** 2,
        `${full} - ${served}: the full window's RoPE tables are not planned`,
      );
      const shared = loadEngineMemory(m, [served], { kernels: "native" });
      // Built at the full window, the forward pass outgrew the planned region ("memory region is full").
      const engine = await buildEngine({
        ...limits,
        kernels: "native",
        model: { config: m.config, weights: shared.weights },
        memory: { memory: shared.memory, region: shared.regions[0]! },
      });
      assert.equal(engine.contextTokens, 128, "8 pages of 16");
    } finally {
      folder.remove();
    }
  });

  it("loadEngineMemory() on native maps each weight file over its window, copy-on-write: the file's bytes, no copy, the file never written", async () => {
    const files = weightFilesOf(meta);
    assert.equal(files.length, 2, "two shards, each mapped on its own page boundary");
    const fileBytes = files.map((f) => readFileSync(f));
    const shared = loadEngineMemory(meta, [regionBytes], { kernels: "native" });
    // The mapping is the kernel's own record of it (Linux): each weight file lies in this process's maps.
    const maps = readFileSync("/proc/self/maps", "utf8");
    for (const f of files) assert.ok(maps.includes(f), `${f} is mapped`);
    const openRead = await openModel(meta.dir);
    const embed = matrixBytes(shared.weights.embed);
    assert.deepEqual(embed, matrixBytes(openRead.weights.embed), "the embeddings are the file's");
    assert.ok(
      embed.byteOffset + embed.byteLength <= 65536 + weightMemoryBytes(meta),
      "inside the weights' plan",
    );
    embed.fill(0x55); // copy-on-write: the memory changes, the file does not
    assert.deepEqual(
      files.map((f) => readFileSync(f)),
      fileBytes,
    );
    assert.equal(matrixBytes(shared.weights.embed)[0], 0x55);
  });

  it("the addon's mapFile() refuses a range past the memory and declines a misaligned one, leaving it zeros", () => {
    const addon = nativeAddon();
    const weightFile = weightFilesOf(meta)[0]!;
    const buffer = new SharedArrayBuffer(1 << 20);
    const view = new Uint8Array(buffer, 0, 16);
    const aligned = (4096 - (addon.pageOffset(view) % 4096)) % 4096;
    const fd = openSync(weightFile, "r");
    try {
      assert.throws(
        () => addon.mapFile(view, buffer.byteLength, buffer.byteLength - 8, fd, 64),
        /fileBytes must be/,
      );
      assert.equal(addon.mapFile(view, buffer.byteLength, aligned + 64, fd, 4096), false);
      assert.ok(
        new Uint8Array(buffer).every((b) => b === 0),
        "nothing mapped or written",
      );
      assert.equal(addon.mapFile(view, buffer.byteLength, aligned + 4096, fd, 4096), true);
      assert.deepEqual(
        new Uint8Array(buffer, aligned + 4096, 4096),
        new Uint8Array(readFileSync(weightFile).subarray(0, 4096)),
      );
    } finally {
      closeSync(fd);
    }
  });
});
