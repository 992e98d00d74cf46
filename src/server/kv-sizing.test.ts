/**
 * The default KV pool follows the served context (src/server/kv-sizing.ts): one request of it and
 * at least 256 MiB, so `kvfence serve` with a context longer than 256 MiB of KV starts without
 * `--kv-memory`; and the weights and every pool must fit in the memory available, or the server
 * stops before loading with the numbers and the largest `--max-model-len` that fits. A pool past
 * 2^32 elements (what one typed array holds on Node 20) is refused the same way.
 */
import assert from "node:assert/strict";
import { basename } from "node:path";
import { after, describe, it } from "node:test";
import { writeModelFolder } from "../../testing/model-folder.js";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import type { KvLayout } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import { checkMemoryFits, poolPagesOf } from "./kv-sizing.js";

const MIB = 1024 ** 2;
const GIB = 1024 ** 3;
/** 28 layers × 8 KV heads × 128 × K,V × 2 bytes: Llama-3.2-3B's 112 KiB a token in f16, 1.75 MiB a page. */
const layout3b: KvLayout = { numLayers: 28, numKvHeads: 8, headDim: 128, pageSize: 16, dtype: "f16" };
const PAGE_3B = 1.75 * MIB;

const refusal = (pattern: RegExp) => (err: unknown) =>
  err instanceof KvfenceError && err.code === "config_invalid" && pattern.test(err.message);

describe("poolPagesOf()", () => {
  it("poolPagesOf() without --kv-memory or --kv-pages holds one request of the context, at least 256 MiB", () => {
    assert.equal(poolPagesOf({}, layout3b, 8192), 512, "8,192 tokens of a 3B model: 896 MiB");
    assert.equal(poolPagesOf({}, layout3b, 1024), Math.floor((256 * MIB) / PAGE_3B), "256 MiB");
    assert.equal(poolPagesOf({}, layout3b, 8193), 513, "whole pages");
  });

  it("poolPagesOf() takes --kv-memory and --kv-pages as given", () => {
    assert.equal(poolPagesOf({ kvMemory: 256 * MIB }, layout3b, 8192), 146);
    assert.equal(poolPagesOf({ kvPages: 7 }, layout3b, 8192), 7);
  });
});

describe("checkMemoryFits()", () => {
  // Two engines, each with 100 MiB besides its pool; a default pool follows the context.
  const engines = (fixedPages?: number) => (context: number) =>
    [0, 1].map(() => {
      const numPages = fixedPages ?? poolPagesOf({}, layout3b, context);
      return { numPages, regionBytes: numPages * PAGE_3B + 100 * MIB };
    });
  const input = {
    weightBytes: 6 * GIB,
    layout: layout3b,
    contextLength: 131072,
    contextSized: true,
    availableBytes: 21 * GIB,
  };

  it("checkMemoryFits() passes weights and pools within the memory available", () => {
    checkMemoryFits({ ...input, engines: engines(), contextLength: 8192 });
  });

  it("checkMemoryFits() refuses weights and pools beyond the memory available, naming the largest context that fits", () => {
    assert.throws(
      () => checkMemoryFits({ ...input, engines: engines() }),
      refusal(
        /^The weights \(6\.00 GiB\) and 2 engine\(s\) with KV pools of 14\.00 GiB \(131072 tokens\) and 14\.00 GiB \(131072 tokens\) need 34\.45 GiB but 21\.00 GiB of memory is available; fix: a smaller context \(--max-model-len 68128\), a smaller pool \(--kv-memory or --kv-pages\), or a smaller weight format \(--quantize q8_0\)$/,
      ),
    );
    // A pool the operator sized: a smaller context would not shrink it.
    assert.throws(
      () => checkMemoryFits({ ...input, engines: engines(8192), contextSized: false }),
      refusal(/need 34\.45 GiB but 21\.00 GiB of memory is available; fix: a smaller pool/),
    );
  });

  it("checkMemoryFits() refuses a pool past 2^32 elements, what one typed array holds", () => {
    assert.throws(
      () => checkMemoryFits({ ...input, engines: engines(), availableBytes: 64 * GIB }),
      refusal(
        /^A KV pool of 8192 pages \(14\.00 GiB\) is more than one pool holds: at most 2\^32 elements, 4681 pages \(74896 tokens\) of this layout; fix: --max-model-len 74896, or a smaller --kv-memory or --kv-pages$/,
      ),
    );
  });
});

describe("kvfence serve without --kv-memory", { timeout: 120_000 }, () => {
  // 4 layers × 4 KV heads × 64 × K,V × 2 bytes = 4 KiB a token: 256 MiB holds 65,536 tokens.
  const shape = { numLayers: 4, numKvHeads: 4, numHeads: 4, headDim: 64, hiddenSize: 256 };
  const long = writeModelFolder({ shape: { ...shape, maxPositionEmbeddings: 65536 + 4096 } });
  const huge = writeModelFolder({ shape: { ...shape, maxPositionEmbeddings: 2 ** 26 } });
  const servers: ServeProcess[] = [];
  after(async () => {
    for (const s of servers) await s.stop();
    long.remove();
    huge.remove();
  });

  it("serves a context longer than 256 MiB of KV (a fixed 256 MiB pool refused to start)", async () => {
    const server = await spawnServe(["--port", "0", "--model", long.dir, "--no-disaggregation"]);
    servers.push(server);
    const models = (await (await fetch(`${server.url}/v1/models`)).json()) as {
      data: { id: string; max_model_len: number }[];
    };
    assert.equal(models.data[0]?.id, basename(long.dir));
    assert.equal(models.data[0]?.max_model_len, 69632);
  });

  it("stops before loading when the pools for the model's window exceed the memory available", async () => {
    await assert.rejects(spawnServe(["--port", "0", "--model", huge.dir]), (err: Error) => {
      assert.match(err.message, /need \d+\.\d\d GiB but \d+\.\d\d GiB of memory is available/);
      assert.match(err.message, /fix: a smaller context \(--max-model-len \d+\)/);
      return true;
    });
  });
});
