import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { type ModelFolderOptions, rawSafetensors, writeModelFolder } from "../../testing/model-folder.js";
import { decodeMatrix, matrixBytes, matrixElements } from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import { delayedProgress, formatLoadProgress, type LoadProgress, loadModel } from "./load-model.js";
import { encodeTensorData, type TensorToWrite } from "./safetensors.js";

/** Builds a folder, runs `fn` on it, and removes it. */
function withFolder<T>(
  options: ModelFolderOptions,
  fn: (dir: string, tensors: readonly TensorToWrite[]) => T,
): T {
  const folder = writeModelFolder(options);
  try {
    return fn(folder.dir, folder.tensors);
  } finally {
    folder.remove();
  }
}

/** Asserts loadModel(dir) fails with `code` and a one-line message matching `message` (a function of dir). */
function assertLoadFails(
  options: ModelFolderOptions,
  code: string,
  message: (dir: string) => RegExp | string,
): void {
  withFolder(options, (dir) => {
    assert.throws(
      () => loadModel(dir),
      (err: unknown) => {
        assert.ok(err instanceof KvfenceError, String(err));
        assert.equal(err.code, code);
        const expected = message(dir);
        if (typeof expected === "string") assert.equal(err.message, expected);
        else assert.match(err.message, expected);
        assert.ok(!err.message.includes("\n"), "one-line message");
        return true;
      },
    );
  });
}

const escapeRegExp = (s: string) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
const dropTensor = (name: string) => (ts: TensorToWrite[]) => ts.filter((t) => t.name !== name);

function roundTrip(data: Float32Array, dtype: "F32" | "F16" | "BF16"): number[] {
  if (dtype === "F32") return Array.from(data);
  const half = new Uint16Array(encodeTensorData(data, dtype).buffer);
  if (dtype === "BF16")
    return Array.from(half, (h) => new Float32Array(new Uint32Array([h << 16]).buffer)[0] as number);
  return Array.from(half, (h) => {
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    const sign = h & 0x8000 ? -1 : 1;
    return exp === 0 ? sign * frac * 2 ** -24 : sign * (1 + frac / 1024) * 2 ** (exp - 15);
  });
}

test("loadModel() loads a Llama folder with every tensor in place", () => {
  withFolder({}, (dir, tensors) => {
    const model = loadModel(dir);
    assert.equal(model.config.architecture, "llama");
    assert.equal(model.weights.layers.length, 2);
    const byName = new Map(tensors.map((t) => [t.name, t.data]));
    assert.deepEqual(model.weights.embed, byName.get("model.embed_tokens.weight"));
    assert.deepEqual(model.weights.lmHead, byName.get("lm_head.weight"));
    assert.deepEqual(model.weights.finalNorm, byName.get("model.norm.weight"));
    const layer = model.weights.layers[1];
    assert.ok(layer !== undefined);
    assert.deepEqual(layer.q, byName.get("model.layers.1.self_attn.q_proj.weight"));
    assert.deepEqual(layer.o, byName.get("model.layers.1.self_attn.o_proj.weight"));
    assert.deepEqual(layer.down, byName.get("model.layers.1.mlp.down_proj.weight"));
    assert.deepEqual(layer.postNorm, byName.get("model.layers.1.post_attention_layernorm.weight"));
    assert.equal(layer.qBias, null);
    assert.notEqual(model.weights.lmHead, model.weights.embed);
    assert.equal(model.tokenizer.decode(model.tokenizer.encode("hello")), "hello");
    assert.ok(model.chatTemplate !== null);
    assert.equal(model.generationDefaults.temperature, 0);
    assert.match(model.name, /^kvfence-model-/);
  });
});

test("loadModel() shares embed and lmHead when embeddings are tied, ignoring a saved lm_head", () => {
  withFolder({ shape: { tieWordEmbeddings: true } }, (dir) => {
    const model = loadModel(dir);
    assert.equal(model.weights.lmHead, model.weights.embed);
  });
  withFolder(
    {
      shape: { tieWordEmbeddings: true },
      editTensors: (ts) => [
        ...ts,
        { name: "lm_head.weight", shape: [300, 16], data: new Float32Array(300 * 16) },
      ],
    },
    (dir) => {
      const model = loadModel(dir);
      assert.equal(model.weights.lmHead, model.weights.embed);
    },
  );
});

test("loadModel() loads sharded BF16 Qwen2 with q/k/v biases", () => {
  withFolder({ architecture: "qwen2", dtype: "BF16", shards: 3 }, (dir, tensors) => {
    const model = loadModel(dir);
    assert.equal(model.config.architecture, "qwen2");
    const byName = new Map(tensors.map((t) => [t.name, t.data]));
    const layer = model.weights.layers[0];
    assert.ok(layer?.qBias && layer.kBias && layer.vBias);
    assert.equal(layer.kBias.length, 2 * 4);
    assert.deepEqual(
      Array.from(layer.qBias),
      roundTrip(byName.get("model.layers.0.self_attn.q_proj.bias") as Float32Array, "BF16"),
    );
    assert.deepEqual(
      Array.from(decodeMatrix(model.weights.lmHead)),
      roundTrip(byName.get("lm_head.weight") as Float32Array, "BF16"),
    );
  });
});

test("loadModel() loads F16 Mistral weights", () => {
  withFolder({ architecture: "mistral", dtype: "F16" }, (dir, tensors) => {
    const model = loadModel(dir);
    assert.equal(model.config.architecture, "mistral");
    const up = tensors.find((t) => t.name === "model.layers.0.mlp.up_proj.weight");
    assert.deepEqual(
      Array.from(decodeMatrix(model.weights.layers[0]?.up ?? new Float32Array())),
      roundTrip(up?.data ?? new Float32Array(), "F16"),
    );
  });
});

test("loadModel() reports progress per chunk and tensor up to the totals", () => {
  withFolder({ shards: 2 }, (dir) => {
    const events: LoadProgress[] = [];
    loadModel(dir, { onProgress: (p) => events.push(p) });
    const last = events.at(-1);
    assert.ok(last !== undefined);
    assert.equal(last.tensorsLoaded, last.tensorsTotal);
    assert.equal(last.tensorsTotal, 1 + 2 * 9 + 2);
    assert.equal(last.bytesRead, last.totalBytes);
    assert.equal(new Set(events.map((e) => e.file)).size, 2);
    assert.match(
      formatLoadProgress(last),
      /^Loading weights: 100% \[#{24}\] [\d.]+ of [\d.]+ MB, 21\/21 tensors$/,
    );
    for (let i = 1; i < events.length; i++) {
      assert.ok((events[i]?.tensorsLoaded ?? 0) >= (events[i - 1]?.tensorsLoaded ?? 0));
      assert.ok((events[i]?.bytesRead ?? 0) >= (events[i - 1]?.bytesRead ?? 0));
    }
  });
});

test("loadModel() puts weights in SharedArrayBuffers when shared", () => {
  withFolder({ dtype: "BF16" }, (dir) => {
    const model = loadModel(dir, { shared: true });
    assert.ok(matrixBytes(model.weights.embed).buffer instanceof SharedArrayBuffer);
    assert.ok(
      matrixBytes(model.weights.layers[0]?.gate ?? new Float32Array()).buffer instanceof SharedArrayBuffer,
    );
  });
});

test("loadModel() ignores rotary inv_freq buffers of older checkpoints", () => {
  withFolder(
    {
      editTensors: (ts) => [
        ...ts,
        { name: "model.layers.0.self_attn.rotary_emb.inv_freq", shape: [2], data: new Float32Array(2) },
      ],
    },
    (dir) => assert.equal(loadModel(dir).weights.layers.length, 2),
  );
});

test("loadModel() names a folder that does not exist", () => {
  const dir = join(tmpdir(), "kvfence-no-such-model-folder");
  assert.throws(() => loadModel(dir), {
    code: "bad_model_folder",
    message: `Bad model folder: ${dir}: folder does not exist; pass the path of a Hugging Face model folder`,
  });
  const file = join(mkdtempSync(join(tmpdir(), "kvfence-file-")), "x");
  writeFileSync(file, "");
  assert.throws(() => loadModel(file), { code: "bad_model_folder", message: /folder does not exist/ });
  rmSync(join(file, ".."), { recursive: true });
});

test("loadModel() names a missing config.json", () => {
  assertLoadFails(
    { files: { "config.json": null } },
    "bad_model_folder",
    (dir) => `Bad model folder: ${join(dir, "config.json")}: file is missing`,
  );
});

test("loadModel() names config.json when it is not valid JSON", () => {
  assertLoadFails(
    { files: { "config.json": '{"hidden_size": 16,' } },
    "bad_model_folder",
    (dir) => new RegExp(`^Bad model folder: ${escapeRegExp(join(dir, "config.json"))}: not valid JSON: `),
  );
});

test("loadModel() reports a folder without model.safetensors or an index", () => {
  assertLoadFails(
    { files: { "model.safetensors": null } },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${dir}: no model.safetensors or model.safetensors.index.json; put the weights in safetensors format in the folder`,
  );
});

test("loadModel() reports a truncated safetensors file", () => {
  withFolder({}, (dir) => {
    const path = join(dir, "model.safetensors");
    truncateSync(path, readFileSync(path).byteLength - 100);
    assert.throws(() => loadModel(dir), {
      code: "bad_model_folder",
      message: new RegExp(
        `^Bad model folder: ${escapeRegExp(path)}: tensor lm_head\\.weight data ends at byte \\d+ but the file holds only \\d+ data bytes; the file is truncated$`,
      ),
    });
  });
});

test("loadModel() reports a header length past the end of the file", () => {
  const bytes = new Uint8Array(16);
  new DataView(bytes.buffer).setBigUint64(0, 1000n, true);
  assertLoadFails(
    { files: { "model.safetensors": bytes } },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors")}: header length 1000 runs past the end of the file (16 bytes); the file is truncated or not safetensors`,
  );
});

test("loadModel() reports a safetensors header that is not JSON", () => {
  const bytes = new Uint8Array(16);
  new DataView(bytes.buffer).setBigUint64(0, 8n, true);
  bytes.set(new TextEncoder().encode("{oops!!}"), 8);
  assertLoadFails(
    { files: { "model.safetensors": bytes } },
    "bad_model_folder",
    (dir) =>
      new RegExp(
        `^Bad model folder: ${escapeRegExp(join(dir, "model.safetensors"))}: header is not valid JSON: `,
      ),
  );
});

test("loadModel() names a tensor whose shape does not match the config", () => {
  assertLoadFails(
    {
      editTensors: (ts) =>
        ts.map((t) =>
          t.name === "model.layers.0.self_attn.q_proj.weight"
            ? { ...t, shape: [16, 8], data: new Float32Array(128) }
            : t,
        ),
    },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors")}: tensor model.layers.0.self_attn.q_proj.weight has shape [16,8], expected [16,16] from config.json`,
  );
});

test("loadModel() refuses an unsupported dtype", () => {
  withFolder({}, (dir, tensors) => {
    const entries = tensors.map((t) =>
      t.name === "model.norm.weight"
        ? { name: t.name, shape: t.shape, dtype: "I8", bytes: new Uint8Array(16) }
        : { name: t.name, shape: t.shape, dtype: "F32", bytes: encodeTensorData(t.data, "F32") },
    );
    writeFileSync(join(dir, "model.safetensors"), rawSafetensors(entries));
    assert.throws(() => loadModel(dir), {
      code: "unsupported_model",
      message: `Unsupported model: ${join(dir, "model.safetensors")}: tensor model.norm.weight has dtype I8; supported dtypes: F32, F16, BF16`,
    });
  });
});

test("loadModel() names a missing tensor and its expected shape", () => {
  assertLoadFails(
    { editTensors: dropTensor("model.layers.1.mlp.gate_proj.weight") },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors")}: tensor model.layers.1.mlp.gate_proj.weight is missing (expected shape [24,16] from config.json)`,
  );
  assertLoadFails(
    {
      shape: { tieWordEmbeddings: false },
      config: { tie_word_embeddings: false },
      editTensors: dropTensor("lm_head.weight"),
    },
    "bad_model_folder",
    () => /tensor lm_head\.weight is missing/,
  );
  assertLoadFails(
    { architecture: "qwen2", editTensors: dropTensor("model.layers.0.self_attn.v_proj.bias") },
    "bad_model_folder",
    () => /tensor model\.layers\.0\.self_attn\.v_proj\.bias is missing \(expected shape \[8\]/,
  );
});

test("loadModel() refuses tensors of an extra layer and tensors the config does not account for", () => {
  const extra = (name: string, shape: number[]) => (ts: TensorToWrite[]) => [
    ...ts,
    { name, shape, data: new Float32Array(shape.reduce((a, b) => a * b, 1)) },
  ];
  assertLoadFails(
    { editTensors: extra("model.layers.2.input_layernorm.weight", [16]) },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors")}: tensor model.layers.2.input_layernorm.weight belongs to layer 2 but config.json has num_hidden_layers 2`,
  );
  assertLoadFails(
    { editTensors: extra("model.layers.0.self_attn.o_proj.bias", [16]) },
    "bad_model_folder",
    () =>
      /unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias \[16\]: config\.json does not account for it$/,
  );
});

test("loadModel() names an index entry whose shard is missing", () => {
  assertLoadFails(
    { shards: 2, files: { "model-00002-of-00002.safetensors": null } },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors.index.json")}: shard model-00002-of-00002.safetensors is missing from the folder`,
  );
  assertLoadFails(
    { shards: 2, files: { "model.safetensors.index.json": '{"weight_map": {"x": "../evil.safetensors"}}' } },
    "bad_model_folder",
    () => /is not a file name in the folder: "\.\.\/evil\.safetensors"/,
  );
});

test("loadModel() names a tensor missing from every shard by the index file", () => {
  assertLoadFails(
    { shards: 2, editTensors: dropTensor("model.norm.weight") },
    "bad_model_folder",
    (dir) =>
      `Bad model folder: ${join(dir, "model.safetensors.index.json")}: tensor model.norm.weight is missing (expected shape [16] from config.json)`,
  );
});

test("loadModel() refuses an unsupported architecture", () => {
  assertLoadFails(
    { config: { architectures: ["PhiForCausalLM"], model_type: "phi" } },
    "unsupported_model",
    (dir) =>
      new RegExp(
        `^Unsupported model: ${escapeRegExp(join(dir, "config.json"))}: architecture "PhiForCausalLM" is not implemented`,
      ),
  );
});

test("loadModel() refuses rope_scaling and sliding windows", () => {
  assertLoadFails(
    { config: { rope_scaling: { type: "dynamic", factor: 2 } } },
    "unsupported_model",
    () => /config\.json: rope_scaling \{"type":"dynamic","factor":2\} is not implemented/,
  );
  assertLoadFails(
    { architecture: "qwen2", config: { use_sliding_window: true } },
    "unsupported_model",
    () => /config\.json: sliding-window attention/,
  );
});

test("loadModel() names a missing tokenizer.json", () => {
  assertLoadFails(
    { files: { "tokenizer.json": null } },
    "bad_model_folder",
    (dir) => `Bad model folder: ${join(dir, "tokenizer.json")}: file is missing`,
  );
});

test("loadModel() refuses a tokenizer with ids beyond the config's vocabulary", () => {
  withFolder({}, (dir) => {
    const json = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8")) as {
      model: { vocab: Record<string, number> };
    };
    json.model.vocab.Ġzzz = 300;
    writeFileSync(join(dir, "tokenizer.json"), JSON.stringify(json));
    assert.throws(() => loadModel(dir), {
      code: "bad_model_folder",
      message: `Bad model folder: ${join(dir, "tokenizer.json")}: tokenizer has token ids up to 300 but config.json has vocab_size 300; the tokenizer does not belong to this model`,
    });
  });
});

test("loadModel() works without tokenizer_config.json and generation_config.json", () => {
  withFolder({ files: { "tokenizer_config.json": null, "generation_config.json": null } }, (dir) => {
    const model = loadModel(dir);
    assert.equal(model.chatTemplate, null);
    assert.deepEqual(model.generationDefaults, { eosTokenIds: [] });
    assert.deepEqual(model.config.eosTokenIds, [258]);
  });
});

test("loadModel() reports an empty folder as a bad_model_folder KvfenceError", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-empty-"));
  try {
    assert.throws(
      () => loadModel(dir),
      (err: unknown) => err instanceof KvfenceError && err.toWire().code === "bad_model_folder",
    );
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

const TINY_QWEN2 = fileURLToPath(new URL("../../../models/tiny-qwen2", import.meta.url));

test("loadModel() loads the bundled models/tiny-qwen2 (BF16, two shards, q/k/v biases)", () => {
  const json = JSON.parse(readFileSync(join(TINY_QWEN2, "config.json"), "utf8")) as Record<string, number>;
  const model = loadModel(TINY_QWEN2);
  assert.equal(model.name, "tiny-qwen2");
  assert.equal(model.config.architecture, "qwen2");
  assert.equal(model.config.attentionBias, true);
  assert.equal(model.config.hiddenSize, json.hidden_size);
  assert.equal(model.config.ropeTheta, json.rope_theta);
  assert.equal(model.config.vocabSize, json.vocab_size);
  assert.ok(model.config.eosTokenIds.includes(258), "<|im_end|> ends generation");
  assert.equal(model.weights.layers.length, json.num_hidden_layers);
  assert.equal(model.weights.layers[0]?.qBias?.length, model.config.numHeads * model.config.headDim);
  assert.notEqual(model.weights.lmHead, model.weights.embed);
  assert.ok(decodeMatrix(model.weights.embed).some((x) => x !== 0));
  const prompt = model.chatTemplate?.render([{ role: "user", content: "hé" }]) ?? "";
  const ids = Array.from(model.tokenizer.encode(prompt, { addSpecialTokens: false }));
  const bytes = (text: string) => Array.from(new TextEncoder().encode(text));
  assert.deepEqual(ids, [257, ...bytes("user\nhé"), 258, 10, 257, ...bytes("assistant\n")]);
});

test("loadModel() loads the bundled models/kvfence-tiny (Llama, F32, its own LM head)", () => {
  const dir = fileURLToPath(new URL("../../../models/kvfence-tiny", import.meta.url));
  const json = JSON.parse(readFileSync(join(dir, "config.json"), "utf8")) as Record<string, number>;
  const model = loadModel(dir);
  assert.equal(model.name, "kvfence-tiny");
  assert.equal(model.config.architecture, "llama");
  assert.equal(model.config.attentionBias, false);
  assert.equal(model.config.hiddenSize, json.hidden_size);
  assert.equal(model.config.headDim, json.head_dim);
  assert.equal(model.weights.layers.length, json.num_hidden_layers);
  assert.notEqual(model.weights.lmHead, model.weights.embed);
  assert.equal(matrixElements(model.weights.lmHead), model.config.vocabSize * model.config.hiddenSize);
  assert.equal(model.weights.layers[0]?.qBias, null);
  assert.ok(model.weights.layers.every((l) => decodeMatrix(l.q).some((x) => x !== 0)));
  assert.ok(model.config.eosTokenIds.includes(258));
  const prompt = model.chatTemplate?.render([{ role: "user", content: "ok" }]) ?? "";
  assert.equal(prompt, "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n");
  assert.equal(
    model.tokenizer.decode(model.tokenizer.encode(prompt, { addSpecialTokens: false }), {
      skipSpecialTokens: false,
    }),
    prompt,
  );
});

test("delayedProgress() shows nothing during the first second, then a bar at each new percent", () => {
  let t = 0;
  const lines: string[] = [];
  const onProgress = delayedProgress((line) => lines.push(line), { now: () => t });
  const at = (bytesRead: number): LoadProgress => ({
    file: "f",
    bytesRead,
    totalBytes: 1000,
    tensorsLoaded: 1,
    tensorsTotal: 4,
  });
  t = 999;
  onProgress(at(500));
  assert.deepEqual(lines, [], "a load that takes under a second shows no bar");
  t = 1000;
  onProgress(at(500));
  onProgress(at(504));
  onProgress(at(1000));
  assert.deepEqual(lines, [
    "Loading weights: 50% [############            ] 0.0 of 0.0 MB, 1/4 tensors",
    "Loading weights: 100% [########################] 0.0 of 0.0 MB, 1/4 tensors",
  ]);
});
