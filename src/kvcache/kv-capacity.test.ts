import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import {
  dtypeBytes,
  estimateParameterCount,
  type HfModelConfig,
  kvBytesPerToken,
  parseBytes,
  poolCapacityVerdict,
  poolTokensFromMemory,
} from "./kv-capacity.js";

const LLAMA3_8B: HfModelConfig = {
  hidden_size: 4096,
  num_hidden_layers: 32,
  num_attention_heads: 32,
  num_key_value_heads: 8,
  intermediate_size: 14336,
  vocab_size: 128256,
  tie_word_embeddings: false,
};

const DEEPSEEK_V3: HfModelConfig = {
  hidden_size: 7168,
  num_hidden_layers: 61,
  num_attention_heads: 128,
  num_key_value_heads: 128,
  intermediate_size: 18432,
  moe_intermediate_size: 2048,
  n_routed_experts: 256,
  n_shared_experts: 1,
  first_k_dense_replace: 3,
  q_lora_rank: 1536,
  kv_lora_rank: 512,
  qk_nope_head_dim: 128,
  qk_rope_head_dim: 64,
  v_head_dim: 128,
  vocab_size: 129280,
  tie_word_embeddings: false,
};

test("poolCapacityVerdict() fails the incident's pool of 681,280 tokens against a 1,048,576 context", () => {
  const v = poolCapacityVerdict({ poolTokens: 681_280, contextLength: 1_048_576 });
  assert.equal(v.ok, false);
  assert.equal(v.shortfallTokens, 367_296);
  assert.equal(v.maxContextThatFits, 681_280);
  assert.match(v.fix, /lower the context length to 681,280 or grow the pool by 367,296 tokens/);
});

test("poolCapacityVerdict() passes a pool of 2,040,000 tokens against a 1,048,576 context", () => {
  const v = poolCapacityVerdict({ poolTokens: 2_040_000, contextLength: 1_048_576 });
  assert.equal(v.ok, true);
  assert.equal(v.shortfallTokens, 0);
  assert.equal(v.fix, "");
});

test("poolCapacityVerdict() rounds the pool down and the request up to whole pages", () => {
  assert.equal(poolCapacityVerdict({ poolTokens: 1000, contextLength: 960, pageSize: 64 }).ok, true);
  const v = poolCapacityVerdict({ poolTokens: 1000, contextLength: 961, pageSize: 64 });
  assert.equal(v.ok, false);
  assert.equal(v.usableTokens, 960);
  assert.equal(v.neededTokens, 1024);
  // Equal sizes fit exactly with page size 1.
  assert.equal(poolCapacityVerdict({ poolTokens: 5, contextLength: 5 }).ok, true);
  assert.equal(poolCapacityVerdict({ poolTokens: 4, contextLength: 5 }).ok, false);
});

test("poolCapacityVerdict() rejects a bad page size with a KvfenceError", () => {
  assert.throws(() => poolCapacityVerdict({ poolTokens: 1, contextLength: 1, pageSize: 0 }), KvfenceError);
  assert.throws(() => poolCapacityVerdict({ poolTokens: -1, contextLength: 1 }), /whole number/);
});

test("kvBytesPerToken() follows SGLang's GQA formula with kv heads split over tp", () => {
  const tp1 = kvBytesPerToken(LLAMA3_8B, { tp: 1, kvDtypeBytes: 2 });
  assert.equal(tp1.kvBytesPerToken, 8 * 128 * 32 * 2 * 2);
  assert.equal(kvBytesPerToken(LLAMA3_8B, { tp: 8, kvDtypeBytes: 2 }).kvBytesPerToken, 1 * 128 * 32 * 2 * 2);
  // More ranks than KV heads: each rank still holds one head (replicated).
  assert.equal(kvBytesPerToken(LLAMA3_8B, { tp: 16, kvDtypeBytes: 2 }).kvHeadsPerRank, 1);
});

test("kvBytesPerToken() uses the MLA latent (kv_lora_rank + qk_rope_head_dim), not split by tp", () => {
  const s = kvBytesPerToken(DEEPSEEK_V3, { tp: 8, kvDtypeBytes: 2 });
  assert.equal(s.mla, true);
  assert.equal(s.kvBytesPerToken, (512 + 64) * 61 * 2);
  assert.equal(kvBytesPerToken(DEEPSEEK_V3, { tp: 1, kvDtypeBytes: 2 }).kvBytesPerToken, s.kvBytesPerToken);
});

test("poolTokensFromMemory() computes (memory × fraction − weights) ÷ bytes per token", () => {
  const gib = 2 ** 30;
  const n = poolTokensFromMemory({
    gpuMemoryBytes: 141 * gib,
    memFraction: 0.88,
    weightsBytesPerRank: 84 * gib,
    kvBytesPerToken: 70_272,
  });
  assert.equal(n, Math.floor((141 * gib * 0.88 - 84 * gib) / 70_272));
  assert.equal(
    poolTokensFromMemory({
      gpuMemoryBytes: gib,
      memFraction: 0.5,
      weightsBytesPerRank: gib,
      kvBytesPerToken: 1,
    }),
    0,
  );
  assert.throws(
    () =>
      poolTokensFromMemory({
        gpuMemoryBytes: gib,
        memFraction: 1.5,
        weightsBytesPerRank: 0,
        kvBytesPerToken: 1,
      }),
    /fraction/,
  );
});

test("estimateParameterCount() lands within 2% of Llama-3-8B's 8.03 B parameters", () => {
  const n = estimateParameterCount(LLAMA3_8B);
  assert.ok(Math.abs(n / 8.03e9 - 1) < 0.02, String(n));
});

test("estimateParameterCount() lands within 5% of DeepSeek-V3's 671 B parameters", () => {
  const n = estimateParameterCount(DEEPSEEK_V3);
  assert.ok(Math.abs(n / 671e9 - 1) < 0.05, String(n));
});

test("parseBytes() reads binary and decimal units and rejects garbage", () => {
  assert.equal(parseBytes("141GiB"), 141 * 2 ** 30);
  assert.equal(parseBytes("80GB"), 80e9);
  assert.equal(parseBytes("1.5 TiB"), 1.5 * 2 ** 40);
  assert.equal(parseBytes("4096"), 4096);
  assert.throws(() => parseBytes("lots"), /Size must be/);
  assert.throws(() => parseBytes("5 parsecs"), KvfenceError);
});

test("dtypeBytes() maps dtype names to element sizes", () => {
  assert.equal(dtypeBytes("bf16"), 2);
  assert.equal(dtypeBytes("FP8"), 1);
  assert.equal(dtypeBytes("float32"), 4);
  // kvfence serve's --kv-cache-dtype spellings, as preflight --kv-cache-dtype takes them.
  assert.equal(dtypeBytes("f16"), 2);
  assert.equal(dtypeBytes("f32"), 4);
  assert.throws(() => dtypeBytes("fp12"), /Unknown dtype/);
});
