/**
 * `--kv-cache-dtype` is part of the KV layout (src/kvcache/kv-layout.ts): a prefill node writing
 * f32 pages and a decode node reading f16 ones cannot share a page, so a router started over such
 * a pair refuses to start, naming both layouts and the flag to fix, instead of serving garbage or
 * failing each request. Real processes: one prefill node, one decode node, one router.
 */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, describe, test } from "node:test";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { modelDir } from "../../testing/start-server.js";

const MODEL = "kvfence-tiny";
const env = { KVFENCE_CLUSTER_SECRET: randomBytes(24).toString("hex") };
const nodeArgs = (role: "prefill" | "decode", dtype: string) => [
  "--role",
  role,
  "--port",
  "0",
  "--model",
  modelDir(MODEL),
  "--kv-pages",
  "256",
  "--kv-cache-dtype",
  dtype,
];

describe("a router over nodes with different KV cache dtypes", { timeout: 120_000 }, () => {
  const started: ServeProcess[] = [];
  after(async () => {
    await Promise.all(started.map((p) => p.stop()));
  });

  test("refuses to start, naming both layouts and --kv-cache-dtype", async () => {
    const [prefill, decode] = await Promise.all([
      spawnServe(nodeArgs("prefill", "f32"), { env }),
      spawnServe(nodeArgs("decode", "f16"), { env }),
    ]);
    started.push(prefill, decode);
    const router = spawnServe(
      [
        "--role",
        "router",
        "--port",
        "0",
        "--model",
        modelDir(MODEL),
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
      ],
      { env, timeoutMs: 60_000 },
    );
    await assert.rejects(router, (err: Error) => {
      assert.match(err.message, /exited with \d+ during startup/);
      assert.match(err.message, /The nodes disagree on the KV layout/);
      assert.match(err.message, /kv=f32/);
      assert.match(err.message, /kv=f16/);
      assert.match(err.message, /--kv-cache-dtype/);
      return true;
    });
  });
});
