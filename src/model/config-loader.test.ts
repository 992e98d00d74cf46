import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import { loadGenerationDefaults, loadModelConfig } from "./config-loader.js";

const LLAMA = {
  architectures: ["LlamaForCausalLM"],
  model_type: "llama",
  hidden_size: 64,
  intermediate_size: 128,
  num_attention_heads: 8,
  num_hidden_layers: 2,
  max_position_embeddings: 512,
  vocab_size: 300,
  rms_norm_eps: 1e-5,
  bos_token_id: 1,
  eos_token_id: 2,
};

/** Writes config.json (and optionally generation_config.json) to a temp dir and loads it. */
function load(config: Record<string, unknown>, generation?: Record<string, unknown>) {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-cfg-"));
  try {
    writeFileSync(join(dir, "config.json"), JSON.stringify(config));
    if (generation !== undefined)
      writeFileSync(join(dir, "generation_config.json"), JSON.stringify(generation));
    return loadModelConfig(dir);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

function assertRefused(config: Record<string, unknown>, pattern: RegExp, code = "unsupported_model"): void {
  assert.throws(
    () => load(config),
    (err: unknown) => {
      assert.ok(err instanceof KvfenceError);
      assert.equal(err.code, code);
      assert.match(err.message, pattern);
      assert.match(err.message, /config\.json: /);
      assert.ok(!err.message.includes("\n"));
      return true;
    },
  );
}

test("loadModelConfig() applies Llama defaults for kv heads, head_dim and rope_theta", () => {
  const c = load(LLAMA);
  assert.equal(c.architecture, "llama");
  assert.equal(c.numKvHeads, 8);
  assert.equal(c.headDim, 8);
  assert.equal(c.ropeTheta, 10000);
  assert.equal(c.tieWordEmbeddings, false);
  assert.equal(c.attentionBias, false);
  assert.equal(c.bosTokenId, 1);
  assert.deepEqual(c.eosTokenIds, [2]);
  assert.ok(Object.isFrozen(c));
  assert.ok(Object.isFrozen(c.eosTokenIds));
});

test("loadModelConfig() reads explicit head_dim, kv heads, rope_theta and tied embeddings", () => {
  const c = load({
    ...LLAMA,
    num_key_value_heads: 2,
    head_dim: 16,
    rope_theta: 100000,
    tie_word_embeddings: true,
    rope_scaling: null,
  });
  assert.equal(c.numKvHeads, 2);
  assert.equal(c.headDim, 16);
  assert.equal(c.ropeTheta, 100000);
  assert.equal(c.tieWordEmbeddings, true);
});

test("loadModelConfig() reads rope_theta from default rope_parameters", () => {
  assert.equal(
    load({ ...LLAMA, rope_parameters: { rope_type: "default", rope_theta: 500000 } }).ropeTheta,
    500000,
  );
  assertRefused(
    { ...LLAMA, rope_parameters: { rope_type: "yarn", factor: 4 } },
    /rope_parameters\.rope_type "yarn" is not implemented/,
  );
});

test("loadModelConfig() merges eos ids from a list and generation_config.json", () => {
  const c = load({ ...LLAMA, eos_token_id: [2, 5] }, { eos_token_id: [5, 0], temperature: 0.5 });
  assert.deepEqual(c.eosTokenIds, [2, 5, 0]);
  assert.deepEqual(
    load({ ...LLAMA, eos_token_id: null, bos_token_id: null }, { eos_token_id: 7 }).eosTokenIds,
    [7],
  );
  assert.equal(load({ ...LLAMA, bos_token_id: null }).bosTokenId, null);
});

test("loadModelConfig() gives Qwen2 q/k/v biases", () => {
  const c = load({
    ...LLAMA,
    architectures: ["Qwen2ForCausalLM"],
    model_type: "qwen2",
    sliding_window: 4096,
    use_sliding_window: false,
  });
  assert.equal(c.architecture, "qwen2");
  assert.equal(c.attentionBias, true);
});

test("loadModelConfig() accepts Mistral with sliding_window null or covering the context", () => {
  const mistral = { ...LLAMA, architectures: ["MistralForCausalLM"], model_type: "mistral" };
  assert.equal(load({ ...mistral, sliding_window: null }).architecture, "mistral");
  assert.equal(load({ ...mistral, sliding_window: 512 }).architecture, "mistral");
});

test("loadModelConfig() falls back to model_type when architectures is missing", () => {
  assert.equal(load({ ...LLAMA, architectures: undefined, model_type: "qwen2" }).architecture, "qwen2");
});

test("loadModelConfig() refuses an unsupported architecture", () => {
  assertRefused(
    { ...LLAMA, architectures: ["GPTNeoXForCausalLM"], model_type: "gpt_neox" },
    /architecture "GPTNeoXForCausalLM" is not implemented \(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM\)/,
  );
  assertRefused(
    { ...LLAMA, architectures: undefined, model_type: "gemma" },
    /model_type "gemma" is not implemented/,
  );
  assertRefused(
    { ...LLAMA, model_type: "mistral" },
    /model_type "mistral" does not match architecture LlamaForCausalLM/,
  );
});

test("loadModelConfig() refuses every rope_scaling", () => {
  assertRefused(
    { ...LLAMA, rope_scaling: { type: "linear", factor: 2 } },
    /rope_scaling \{"type":"linear","factor":2\} is not implemented/,
  );
  assertRefused(
    { ...LLAMA, rope_scaling: { rope_type: "llama3", factor: 8 } },
    /rope_scaling .*llama3.* is not implemented/,
  );
});

test("loadModelConfig() refuses sliding-window attention", () => {
  assertRefused(
    {
      ...LLAMA,
      architectures: ["Qwen2ForCausalLM"],
      model_type: "qwen2",
      sliding_window: 128,
      use_sliding_window: true,
    },
    /sliding-window attention \(use_sliding_window true, sliding_window 128\) is not implemented/,
  );
  assertRefused(
    {
      ...LLAMA,
      architectures: ["MistralForCausalLM"],
      model_type: "mistral",
      max_position_embeddings: 32768,
      sliding_window: 4096,
    },
    /sliding_window 4096 < max_position_embeddings 32768/,
  );
});

test("loadModelConfig() refuses mlp_bias, non-SiLU activations and attention_bias combinations", () => {
  assertRefused({ ...LLAMA, mlp_bias: true }, /mlp_bias true is not implemented/);
  assertRefused({ ...LLAMA, hidden_act: "gelu" }, /hidden_act "gelu" is not implemented/);
  assertRefused(
    { ...LLAMA, attention_bias: true },
    /attention_bias true is not implemented for llama \(it adds an o_proj bias\)/,
  );
  assertRefused(
    { ...LLAMA, architectures: ["Qwen2ForCausalLM"], model_type: "qwen2", attention_bias: false },
    /attention_bias false is not supported for Qwen2/,
  );
});

test("loadModelConfig() names each invalid or missing field", () => {
  assertRefused(
    { ...LLAMA, hidden_size: "64", vocab_size: undefined },
    /hidden_size: .*; vocab_size: /,
    "bad_model_folder",
  );
  assertRefused(
    { ...LLAMA, num_key_value_heads: 3 },
    /num_attention_heads 8 is not a multiple of num_key_value_heads 3/,
    "bad_model_folder",
  );
  assertRefused(
    { ...LLAMA, hidden_size: 60 },
    /hidden_size 60 is not a multiple of num_attention_heads 8/,
    "bad_model_folder",
  );
  assertRefused(
    { ...LLAMA, eos_token_id: 300 },
    /token id 300 is outside the vocabulary of 300/,
    "bad_model_folder",
  );
});

test("loadModelConfig() reports a missing config.json and invalid JSON with the file name", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-cfg-"));
  try {
    assert.throws(() => loadModelConfig(dir), {
      code: "bad_model_folder",
      message: `Bad model folder: ${join(dir, "config.json")}: file is missing`,
    });
    writeFileSync(join(dir, "config.json"), "{ not json");
    assert.throws(
      () => loadModelConfig(dir),
      (err: KvfenceError) => {
        assert.equal(err.code, "bad_model_folder");
        assert.match(
          err.message,
          new RegExp(`^Bad model folder: ${join(dir, "config.json")}: not valid JSON: `),
        );
        return true;
      },
    );
    writeFileSync(join(dir, "config.json"), JSON.stringify(LLAMA));
    writeFileSync(join(dir, "generation_config.json"), JSON.stringify({ top_p: 2 }));
    assert.throws(() => loadModelConfig(dir), /generation_config\.json: top_p: /);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("loadGenerationDefaults() reads sampling defaults and maps do_sample false to greedy", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-cfg-"));
  try {
    assert.deepEqual(loadGenerationDefaults(dir), { eosTokenIds: [] });
    const path = join(dir, "generation_config.json");
    writeFileSync(
      path,
      JSON.stringify({ temperature: 0.6, top_p: 0.95, top_k: 20, max_new_tokens: 64, eos_token_id: [2, 0] }),
    );
    assert.deepEqual(loadGenerationDefaults(dir), {
      temperature: 0.6,
      topP: 0.95,
      topK: 20,
      maxNewTokens: 64,
      eosTokenIds: [2, 0],
    });
    writeFileSync(path, JSON.stringify({ temperature: 0.6, do_sample: false, eos_token_id: 2 }));
    assert.deepEqual(loadGenerationDefaults(dir), { temperature: 0, eosTokenIds: [2] });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
