/**
 * GGUF files (src/model/gguf.ts) written from the bundled safetensors models by the test writer
 * (testing/gguf-writer.ts, llama.cpp's converter and block quantisation as published): the config,
 * tokenizer and chat template come out as the folder's, the weights as the folder's in every served
 * type (exactly for F32, Llama's Q/K permutation undone; as decode(encode(w)) for the others), and
 * what kvfence does not serve is refused with one line naming it.
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";
import { GGMLQuantizationType, GGUFValueType } from "@huggingface/gguf";
import { type WriteGgufOptions, writeGgufFromFolder } from "../../testing/gguf-writer.js";
import { modelDir } from "../../testing/start-server.js";
import {
  decodeMatrix,
  decodeWeight,
  encodeWeight,
  type Matrix,
  matrixDType,
  WEIGHT_DTYPES,
} from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import { loadModel, openModel } from "./load-model.js";
import type { ModelConfig, ModelWeights } from "./model-config.js";

const tmp = mkdtempSync(join(tmpdir(), "kvfence-gguf-"));
after(() => rmSync(tmp, { recursive: true, force: true }));

let n = 0;
function gguf(model: string, options: WriteGgufOptions): string {
  const path = join(tmp, `${model}-${options.dtype}-${n++}.gguf`);
  writeGgufFromFolder(modelDir(model), path, options);
  return path;
}

/** Every tensor of `w` with its name and, for a matrix, its [rows, cols] ([] for 1-D tensors). */
function tensorsOf(c: ModelConfig, w: ModelWeights): [string, Matrix, readonly number[]][] {
  const h = c.hiddenSize;
  const q = c.numHeads * c.headDim;
  const kv = c.numKvHeads * c.headDim;
  const ff = c.intermediateSize;
  const out: [string, Matrix, readonly number[]][] = [["embed", w.embed, [c.vocabSize, h]]];
  w.layers.forEach((l, i) => {
    const shapes = {
      q: [q, h],
      k: [kv, h],
      v: [kv, h],
      o: [h, q],
      gate: [ff, h],
      up: [ff, h],
      down: [h, ff],
    };
    for (const [k, shape] of Object.entries(shapes))
      out.push([`${i}.${k}`, l[k as keyof typeof shapes], shape]);
    for (const k of ["inputNorm", "postNorm", "qBias", "kBias", "vBias"] as const) {
      const a = l[k];
      if (a !== null) out.push([`${i}.${k}`, a, []]);
    }
  });
  out.push(["finalNorm", w.finalNorm, []], ["lmHead", w.lmHead, [c.vocabSize, h]]);
  return out;
}

const f32 = (x: number): number => Math.fround(x);

for (const model of ["kvfence-tiny", "tiny-qwen2"]) {
  const folder = loadModel(modelDir(model));
  for (const dtype of WEIGHT_DTYPES) {
    test(`a ${model} GGUF in ${dtype} loads as the folder: config, tokenizer, template, weights`, async () => {
      const g = await openModel(gguf(model, { dtype }));
      const expectConfig = {
        ...folder.config,
        rmsNormEps: f32(folder.config.rmsNormEps),
        ropeTheta: f32(folder.config.ropeTheta),
      };
      assert.deepEqual(
        { ...g.config, eosTokenIds: [...g.config.eosTokenIds].sort() },
        {
          ...expectConfig,
          eosTokenIds: [...expectConfig.eosTokenIds].sort(),
        },
      );
      assert.equal(
        g.gguf?.tensors.some((t) => t.unpermuteHeads > 0),
        model === "kvfence-tiny",
      );
      const originals = new Map(tensorsOf(folder.config, folder.weights).map(([name, a]) => [name, a]));
      for (const [name, a, shape] of tensorsOf(g.config, g.weights)) {
        const original = decodeMatrix(originals.get(name) as Matrix);
        // Matrices stay in `dtype` (2 bytes, or blocks along rows), 1-D tensors are f32.
        assert.equal(matrixDType(a), shape.length === 0 ? "f32" : dtype, `${name} kept as stored`);
        const expected = shape.length === 0 ? original : decodeWeight(encodeWeight(original, shape, dtype));
        assert.deepEqual(decodeMatrix(a), expected, `${name} in ${dtype}`);
      }
      const texts = ["hello wörld 12345", "<|im_start|>user\nthe code is QX7-PL2<|im_end|>\n", " \n\t x"];
      for (const text of texts) {
        assert.deepEqual(g.tokenizer.encode(text), folder.tokenizer.encode(text), text);
        const ids = folder.tokenizer.encode(text);
        assert.equal(g.tokenizer.decode(ids), folder.tokenizer.decode(ids));
      }
      const messages = [{ role: "user", content: "What is the access code?" }];
      assert.equal(g.chatTemplate?.render(messages), folder.chatTemplate?.render(messages));
      assert.equal(g.name.startsWith(model), true);
    });
  }
}

test("Llama's Q and K come back in the Hugging Face row order (the converter's permute undone)", async () => {
  const folder = loadModel(modelDir("kvfence-tiny"));
  const g = await openModel(gguf("kvfence-tiny", { dtype: "f32" }));
  const q = g.weights.layers[0]?.q as Matrix;
  assert.deepEqual(decodeMatrix(q), decodeMatrix(folder.weights.layers[0]?.q as Matrix));
  // The file itself holds them permuted: read without the un-permutation they differ.
  const t = g.gguf?.tensors.find((x) => x.ggufName === "blk.0.attn_q.weight");
  assert.equal(t?.unpermuteHeads, folder.config.numHeads);
});

async function refusal(options: WriteGgufOptions, model = "kvfence-tiny"): Promise<KvfenceError> {
  const path = gguf(model, options);
  try {
    await openModel(path);
  } catch (err) {
    assert.ok(err instanceof KvfenceError, String(err));
    assert.ok(!err.message.includes("\n"), "one line");
    assert.ok(err.message.includes(path), "names the file");
    return err;
  }
  assert.fail("loaded");
}

test("an architecture other than llama and qwen2 is refused, named", async () => {
  const err = await refusal({
    dtype: "f32",
    extraMetadata: { "general.architecture": { value: "phi3", type: GGUFValueType.STRING } },
  });
  assert.equal(err.code, "unsupported_model");
  assert.match(err.message, /GGUF architecture "phi3" is not served; supported: llama, qwen2/);
});

test("a tensor type other than F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 is refused, named with its tensor", async () => {
  const err = await refusal({
    dtype: "f32",
    tensorTypeOverride: { "blk.1.ffn_down.weight": GGMLQuantizationType.Q4_1 },
  });
  assert.equal(err.code, "unsupported_model");
  assert.match(
    err.message,
    /tensor blk\.1\.ffn_down\.weight is Q4_1; kvfence serves GGUF tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1/,
  );
});

test("a k-quant tensor whose rows are not a multiple of 256 weights is refused, named", async () => {
  // tiny-qwen2's rows are 64 and 128 weights: whole Q8_0 blocks, never whole k-quant blocks.
  const err = await refusal(
    { dtype: "q8_0", tensorTypeOverride: { "blk.0.attn_q.weight": GGMLQuantizationType.Q4_K } },
    "tiny-qwen2",
  );
  assert.equal(err.code, "bad_model_folder");
  assert.match(
    err.message,
    /tensor blk\.0\.attn_q\.weight is Q4_K with rows of 64 weights, not a multiple of Q4_K's 256-weight blocks/,
  );
});

test("a SentencePiece tokenizer and an unknown pre-tokenizer are refused, named", async () => {
  const spm = await refusal({
    dtype: "f32",
    extraMetadata: { "tokenizer.ggml.model": { value: "llama", type: GGUFValueType.STRING } },
  });
  assert.match(spm.message, /GGUF tokenizer "llama" is not served; supported: "gpt2"/);
  const pre = await refusal({
    dtype: "f32",
    extraMetadata: { "tokenizer.ggml.pre": { value: "deepseek-llm", type: GGUFValueType.STRING } },
  });
  assert.match(
    pre.message,
    /GGUF pre-tokenizer "deepseek-llm" is not served; supported: default, gpt2, llama-bpe, llama3, qwen2, smollm/,
  );
});

test("RoPE scaling and a missing metadata key are refused, named", async () => {
  const scaled = await refusal({
    dtype: "f32",
    extraMetadata: { "llama.rope.scaling.type": { value: "yarn", type: GGUFValueType.STRING } },
  });
  assert.equal(scaled.code, "unsupported_model");
  assert.match(scaled.message, /rope_scaling \{"type":"yarn"\} is not implemented/);
  const missing = await refusal({ dtype: "f32", dropMetadata: ["llama.block_count"] });
  assert.equal(missing.code, "bad_model_folder");
  assert.match(missing.message, /GGUF metadata llama\.block_count is missing/);
});

test("every served pre-tokenizer builds a working tokenizer", async () => {
  for (const pre of ["default", "gpt2", "llama-bpe", "llama3", "qwen2", "smollm"]) {
    const g = await openModel(
      gguf("tiny-qwen2", {
        dtype: "f32",
        extraMetadata: { "tokenizer.ggml.pre": { value: pre, type: GGUFValueType.STRING } },
      }),
    );
    // Byte tokens and no merges: every split encodes to one id per byte.
    const text = "Hello, wörld! 12345\n\n  x's";
    assert.equal(g.tokenizer.decode(g.tokenizer.encode(text)), text, pre);
    assert.equal(g.tokenizer.encode(text).length, new TextEncoder().encode(text).length, pre);
  }
});

test("a file that is not GGUF, and a missing one, are bad_model_folder naming the file", async () => {
  const path = join(tmp, "not.gguf");
  writeFileSync(path, "not a gguf file at all, just text");
  await assert.rejects(openModel(path), (err: unknown) => {
    assert.ok(err instanceof KvfenceError);
    assert.equal(err.code, "bad_model_folder");
    assert.match(err.message, /not\.gguf: not a readable GGUF file: not a valid gguf file/);
    return true;
  });
  await assert.rejects(openModel(join(tmp, "missing.gguf")), /missing\.gguf: file is missing/);
});
