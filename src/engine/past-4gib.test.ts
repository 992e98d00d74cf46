/**
 * Weights past 4 GiB on the native kernels (issue #33 item 4), without writing 4 GiB: a model
 * folder whose model.safetensors passes 4 GiB as a sparse file — a tensor the loader ignores (a
 * RoPE `inv_freq` buffer of 4 GiB + 1 MiB, a hole) first, then the real weights of a small bf16
 * model — so, read by the real loader into the engines' native memory, every weight lies past 2^32.
 * The native forward over them gives the reference kernels' logits on the same weights loaded from
 * an ordinary file; `kvfence serve --kernels native` serves the folder in the default topology
 * (prefill and decode threads sharing the one copy) with the reference kernels' greedy answer; and
 * the WebAssembly kernels refuse it, naming `--kernels native`.
 */
import assert from "node:assert/strict";
import { statSync } from "node:fs";
import { basename, join } from "node:path";
import { after, describe, it } from "node:test";
import OpenAI from "openai";
import { writeModelFolder } from "../../testing/model-folder.js";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { assertAllClose } from "../kernels/assert-all-close.js";
import { type Matrix, matrixBytes } from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import type { StepSequence } from "../model/forward.js";
import { loadModel, openModelMeta } from "../model/load-model.js";
import { engineRegionBytes, layoutOf, loadEngineMemory } from "./engine-memory.js";
import { createForward } from "./forward-setup.js";

const GIB4 = 2 ** 32;
const shape = {
  hiddenSize: 64,
  numHeads: 4,
  numKvHeads: 2,
  headDim: 16,
  intermediateSize: 128,
  vocabSize: 300,
};

describe("a model past 4 GiB", { timeout: 120_000 }, () => {
  const sparse = writeModelFolder({ shape, dtype: "BF16", seed: 7, holeBytes: GIB4 + (1 << 20) });
  const plain = writeModelFolder({ shape, dtype: "BF16", seed: 7 });
  const servers: ServeProcess[] = [];
  after(async () => {
    for (const s of servers) await s.stop();
    sparse.remove();
    plain.remove();
  });

  it("loadEngineMemory() on native reads a file past 4 GiB in pieces: every weight lies past 2^32 and the native forward gives the reference's logits", async () => {
    assert.ok(statSync(join(sparse.dir, "model.safetensors")).size > GIB4);
    const meta = await openModelMeta(sparse.dir);
    const config = meta.config;
    const layout = layoutOf(config, { pageSize: 16 });
    const sizing = { maxBatchTokens: 32, maxSequences: 2, poolPages: [8] };
    const shared = loadEngineMemory(meta, [engineRegionBytes(config, layout, sizing)], { kernels: "native" });
    const w = shared.weights;
    const matrices: Matrix[] = [
      w.embed,
      w.finalNorm,
      ...w.layers.flatMap((l) => [l.q, l.k, l.v, l.o, l.gate, l.up, l.down, l.inputNorm]),
    ];
    for (const m of matrices) assert.ok(matrixBytes(m).byteOffset > GIB4, "the weight lies past 2^32");
    const seq = (): StepSequence & { logits: Float32Array } => ({
      tokens: Int32Array.of(3, 9, 1, 7, 2, 250, 11),
      startPos: 0,
      blockTable: Int32Array.of(5, 2),
      logits: new Float32Array(config.vocabSize),
    });
    const native = await createForward(config, w, layout, {
      kernels: "native",
      kernelThreads: 2,
      ...sizing,
      shared: { memory: shared.memory, region: shared.regions[0]! },
    });
    const reference = await createForward(config, loadModel(plain.dir).weights, layout, {
      kernels: "ts",
      ...sizing,
    });
    try {
      const got = seq();
      const want = seq();
      native.forward.step(native.pools[0]!.data, [got]);
      reference.forward.step(reference.pools[0]!.data, [want]);
      assertAllClose(got.logits, want.logits, {
        rtol: 1e-4,
        atol: 1e-5,
        message: "logits over weights past 4 GiB",
      });
    } finally {
      await native.close();
      await reference.close();
    }
  });

  it("the WebAssembly kernels refuse it before reading, naming --kernels native", async () => {
    const meta = await openModelMeta(sparse.dir);
    assert.throws(
      () => loadEngineMemory(meta, [1 << 20], { kernels: "wasm" }),
      (err: unknown) =>
        err instanceof KvfenceError &&
        err.code === "config_invalid" &&
        /use --kernels native/.test(err.message),
    );
  });

  it("kvfence serve --kernels native serves it in the default topology, and on one engine, with the reference kernels' greedy answer", async () => {
    const answer = async (dir: string, args: readonly string[]): Promise<string> => {
      const server = await spawnServe(["--port", "0", "--model", dir, "--kv-pages", "64", ...args]);
      servers.push(server);
      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 });
      const r = await client.chat.completions.create({
        model: basename(dir),
        messages: [{ role: "user", content: "past four gibibytes" }],
        max_tokens: 12,
        temperature: 0,
      });
      await server.stop();
      return r.choices[0]?.message.content ?? "";
    };
    const want = await answer(plain.dir, ["--kernels", "ts"]);
    assert.ok(want.length > 0);
    // The weights cross to the node (or engine) worker threads: as views past 2^32 they arrived at
    // their offset mod 2^32 (the hole's zeros) and the answer was token 0 repeated.
    assert.equal(await answer(sparse.dir, ["--kernels", "native"]), want, "default topology");
    assert.equal(
      await answer(sparse.dir, ["--kernels", "native", "--no-disaggregation"]),
      want,
      "one engine",
    );
  });
});
