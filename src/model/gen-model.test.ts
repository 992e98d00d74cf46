import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { command } from "../cli/gen-model.js";
import { decodeMatrix } from "../kernels/weight-format.js";
import {
  byteLevelTokenizerJson,
  chatmlTokenizerConfig,
  fillRandom,
  genModel,
  llamaConfigJson,
  MODEL_SHAPES,
} from "./gen-model.js";
import { loadModel } from "./load-model.js";

function withTempDir<T>(fn: (dir: string) => T): T {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-gen-"));
  try {
    return fn(dir);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

function stats(data: Float32Array): { mean: number; std: number } {
  let sum = 0;
  let sq = 0;
  for (const x of data) {
    sum += x;
    sq += x * x;
  }
  const mean = sum / data.length;
  return { mean, std: Math.sqrt(sq / data.length - mean * mean) };
}

test("MODEL_SHAPES['smollm2-135m'] writes SmolLM2-135M's exact config", () => {
  const shape = MODEL_SHAPES["smollm2-135m"];
  assert.ok(shape !== undefined);
  const config = llamaConfigJson(shape);
  assert.deepEqual(
    {
      architectures: config.architectures,
      hidden_size: config.hidden_size,
      num_hidden_layers: config.num_hidden_layers,
      num_attention_heads: config.num_attention_heads,
      num_key_value_heads: config.num_key_value_heads,
      head_dim: config.head_dim,
      intermediate_size: config.intermediate_size,
      vocab_size: config.vocab_size,
      tie_word_embeddings: config.tie_word_embeddings,
      rope_theta: config.rope_theta,
      max_position_embeddings: config.max_position_embeddings,
      rms_norm_eps: config.rms_norm_eps,
    },
    {
      architectures: ["LlamaForCausalLM"],
      hidden_size: 576,
      num_hidden_layers: 30,
      num_attention_heads: 9,
      num_key_value_heads: 3,
      head_dim: 64,
      intermediate_size: 1536,
      vocab_size: 49152,
      tie_word_embeddings: true,
      rope_theta: 100000,
      max_position_embeddings: 8192,
      rms_norm_eps: 1e-5,
    },
  );
});

test("MODEL_SHAPES['llama-3.2-3b'] has Llama-3.2-3B's 3,212,749,824 parameters", () => {
  const s = MODEL_SHAPES["llama-3.2-3b"];
  assert.ok(s !== undefined);
  const kv = s.numKvHeads * s.headDim;
  const perLayer =
    2 * s.hiddenSize * s.numHeads * s.headDim + 2 * s.hiddenSize * kv + 3 * s.hiddenSize * s.intermediateSize;
  const params = s.vocabSize * s.hiddenSize + s.numLayers * (perLayer + 2 * s.hiddenSize) + s.hiddenSize;
  assert.equal(params, 3_212_749_824); // the count Meta publishes for the tied-embedding model
  assert.equal(s.tieWordEmbeddings, true);
});

test("genModel() writes a folder loadModel() loads, with distinct data in every tensor", () => {
  withTempDir((dir) => {
    let lastWritten = 0;
    let total = 0;
    const { bytes } = genModel(dir, {
      like: "tiny",
      seed: 3,
      onProgress: (w, t) => {
        lastWritten = w;
        total = t;
      },
    });
    assert.equal(lastWritten, total);
    assert.equal(bytes, total);
    const model = loadModel(dir);
    const shape = MODEL_SHAPES.tiny;
    assert.equal(model.config.hiddenSize, shape?.hiddenSize);
    assert.equal(model.config.numLayers, shape?.numLayers);
    assert.equal(model.weights.lmHead, model.weights.embed);
    const all = [
      model.weights.embed,
      model.weights.finalNorm,
      ...model.weights.layers.flatMap((l) => [
        l.inputNorm,
        l.q,
        l.k,
        l.v,
        l.o,
        l.postNorm,
        l.gate,
        l.up,
        l.down,
      ]),
    ];
    const heads = new Set(all.map((t) => Array.from(decodeMatrix(t).subarray(0, 4)).join(",")));
    assert.equal(heads.size, all.length, "every tensor starts with different values");
    const q = stats(decodeMatrix(model.weights.layers[0]?.q ?? new Float32Array()));
    assert.ok(Math.abs(q.std - 0.02) < 0.003 && Math.abs(q.mean) < 0.003, JSON.stringify(q));
    const norm = stats(model.weights.finalNorm);
    assert.ok(Math.abs(norm.mean - 1) < 0.05, JSON.stringify(norm));
    assert.equal(model.tokenizer.decode(model.tokenizer.encode("héllo")), "héllo");
    assert.equal(model.tokenizer.decode([259]), " a");
    assert.equal(model.tokenizer.decode([(shape?.vocabSize ?? 0) - 1]).length > 1, true);
    assert.ok(
      model.chatTemplate
        ?.render([{ role: "user", content: "x" }])
        .startsWith("<|im_start|>user\nx<|im_end|>"),
    );
  });
});

test("genModel() is deterministic for a seed and differs across seeds", () => {
  withTempDir((dir) => {
    genModel(join(dir, "a"), { like: "tiny", seed: 1 });
    genModel(join(dir, "b"), { like: "tiny", seed: 1 });
    genModel(join(dir, "c"), { like: "tiny", seed: 2 });
    const read = (name: string) => readFileSync(join(dir, name, "model.safetensors"));
    assert.ok(read("a").equals(read("b")));
    assert.ok(!read("a").equals(read("c")));
  });
});

test("genModel() refuses an unknown model and a non-integer seed", () => {
  assert.throws(() => genModel("/nonexistent", { like: "gpt5", seed: 1 }), {
    code: "invalid_request",
    message: /^Unknown model to imitate: gpt5; choose one of smollm2-135m, smollm2-1.7b, llama-3.2-3b, tiny$/,
  });
  assert.throws(() => genModel("/dev/null/model", { like: "tiny", seed: 1 }), {
    code: "invalid_request",
    message: /^Cannot create the model folder, pick a writable path: \/dev\/null\/model: ENOTDIR/,
  });
  assert.throws(() => genModel("/nonexistent", { like: "tiny", seed: 1.5 }), {
    code: "invalid_request",
    message: "Seed must be an integer: 1.5",
  });
});

test("fillRandom() gives the requested mean and standard deviation", () => {
  const data = new Float32Array(100000);
  fillRandom(data, { seed: 9, stream: 0, mean: 1, std: 0.05 });
  const s = stats(data);
  assert.ok(Math.abs(s.mean - 1) < 0.002 && Math.abs(s.std - 0.05) < 0.002, JSON.stringify(s));
});

test("kvfence gen-model --like tiny writes a loadable folder", async () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-gen-cli-"));
  const write = process.stdout.write;
  const lines: string[] = [];
  process.stdout.write = ((chunk: string) => lines.push(String(chunk)) > 0) as typeof process.stdout.write;
  try {
    await command()
      .exitOverride()
      .parseAsync([join(dir, "m"), "--like", "tiny", "--seed", "4"], { from: "user" });
  } finally {
    process.stdout.write = write;
  }
  try {
    assert.match(
      lines.join(""),
      /^Wrote .*\/m \(like tiny, seed 4, f32, [\d.]+ MB of weights\) in [\d.]+ s\n$/,
    );
    assert.equal(loadModel(join(dir, "m")).config.vocabSize, MODEL_SHAPES.tiny?.vocabSize);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("byteLevelTokenizerJson() and chatmlTokenizerConfig() match the files of the bundled tiny models", () => {
  const dir = fileURLToPath(new URL("../../../models/tiny-qwen2", import.meta.url));
  const read = (name: string) => JSON.parse(readFileSync(join(dir, name), "utf8")) as unknown;
  assert.deepEqual(byteLevelTokenizerJson(259), read("tokenizer.json"));
  assert.deepEqual(chatmlTokenizerConfig(2048), read("tokenizer_config.json"));
});
