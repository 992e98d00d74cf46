/**
 * `kvfence serve --kv-cache-dtype` counts the real bytes (src/kvcache/kv-layout.ts): the same
 * `--kv-memory` holds twice the tokens in f16 (the default) as in f32, so a pool the boot check
 * refuses in f32 serves a full-context request in f16, and `/kvfence/nodes` and `/v1/models` report
 * the f16 figures. Real processes on 127.0.0.1, the official `openai` client.
 *
 * kvfence-tiny stores 3 layers × K,V × 2 KV heads × 128 dims per token: 6,144 bytes in f32, 3,072
 * in f16, so 3 MiB holds 512 tokens in f32 and 1,024 in f16.
 */
import assert from "node:assert/strict";
import { after, describe, test } from "node:test";
import OpenAI from "openai";
import { type ServeProcess, spawnServe } from "../../testing/serve-process.js";
import { modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";

const args = (dtype: string[]) => [
  "--no-disaggregation",
  "--port",
  "0",
  "--model",
  modelDir("kvfence-tiny"),
  "--kv-memory",
  "3MiB",
  "--max-model-len",
  "1024",
  "--operator-key",
  TEST_OPERATOR_KEY,
  ...dtype,
];

describe("kvfence serve --kv-cache-dtype: capacity in real bytes", { timeout: 120_000 }, () => {
  let server: ServeProcess | undefined;
  after(async () => {
    await server?.stop();
  });

  test("in f32, 3MiB holds 512 tokens and the boot check refuses a 1,024-token context", async () => {
    await assert.rejects(spawnServe(args(["--kv-cache-dtype", "f32"])), (err: Error) => {
      assert.match(err.message, /the pool holds 512 tokens \(32 pages of 16, 3\.0 MiB\)/);
      assert.match(err.message, /context length is 1024 tokens/);
      return true;
    });
  });

  test("in f16 (the default), the same 3MiB holds 1,024 tokens: it starts, reports them and serves", async () => {
    server = await spawnServe(args([]));
    const nodes = (await (await operatorGet(server.url, "/kvfence/nodes")).json()) as {
      max_model_len: number;
      nodes: { pool_tokens: number }[];
    };
    assert.equal(nodes.nodes[0]?.pool_tokens, 1024);
    assert.equal(nodes.max_model_len, 1024);
    const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused", maxRetries: 0 });
    const models = await client.models.list();
    assert.equal((models.data[0] as unknown as { max_model_len: number }).max_model_len, 1024);
    const reply = await client.completions.create({
      model: "kvfence-tiny",
      prompt: "Hello from an f16 KV cache",
      max_tokens: 8,
      temperature: 0,
    });
    assert.equal(reply.choices.length, 1);
    assert.ok((reply.usage?.completion_tokens ?? 0) > 0);
  });
});
