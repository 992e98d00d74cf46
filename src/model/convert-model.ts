/**
 * Converting a model's weights between formats: in memory (`convertWeights`, for `kvfence bench
 * model --dtype`, `--quantize` and the parity tests) and as a folder on disk (`convertModelFolder`,
 * `kvfence quantize IN OUT --type`).
 *
 * The folder written is the input folder's config, tokenizer and chat template files, copied, and
 * one `model.safetensors` whose matrices are in the new format and whose norms and biases stay f32:
 * f32/f16/bf16 as the safetensors F32/F16/BF16 dtypes; Q8_0/Q4_0 as U8 tensors of shape
 * [rows, bytes per row] holding llama.cpp's GGUF blocks byte for byte, named with their logical
 * shape in the `kvfence.weight_formats` metadata key (docs/weights.md says why not GGUF).
 */
import { closeSync, copyFileSync, existsSync, mkdirSync, openSync } from "node:fs";
import { join, resolve } from "node:path";
import {
  convertMatrix,
  type Matrix,
  matrixBytes,
  matrixDType,
  type WeightDType,
} from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import { expectedTensors, loadModel } from "./load-model.js";
import type { ModelConfig, ModelWeights } from "./model-config.js";
import { safetensorsHeader, WEIGHT_FORMATS_KEY, writeAllSync } from "./safetensors.js";

/** The model's weight matrices in `dtype` (norms and biases stay f32); a tied LM head stays tied. */
export function convertWeights(w: ModelWeights, config: ModelConfig, dtype: WeightDType): ModelWeights {
  const h = config.hiddenSize;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  const ff = config.intermediateSize;
  const embed = convertMatrix(w.embed, [config.vocabSize, h], dtype);
  return Object.freeze({
    ...w,
    embed,
    lmHead: w.lmHead === w.embed ? embed : convertMatrix(w.lmHead, [config.vocabSize, h], dtype),
    layers: Object.freeze(
      w.layers.map((l) =>
        Object.freeze({
          ...l,
          q: convertMatrix(l.q, [q, h], dtype),
          k: convertMatrix(l.k, [kv, h], dtype),
          v: convertMatrix(l.v, [kv, h], dtype),
          o: convertMatrix(l.o, [h, q], dtype),
          gate: convertMatrix(l.gate, [ff, h], dtype),
          up: convertMatrix(l.up, [ff, h], dtype),
          down: convertMatrix(l.down, [h, ff], dtype),
        }),
      ),
    ),
  });
}

/** The safetensors dtype name of a stored format (block formats are U8 bytes). */
const FILE_DTYPE: Readonly<Record<WeightDType, string>> = {
  f32: "F32",
  f16: "F16",
  bf16: "BF16",
  q8_0: "U8",
  q4_0: "U8",
  // Never written: kvfence does not quantise to the k-quants (encodeWeight refuses them).
  q4_K: "U8",
  q5_K: "U8",
  q6_K: "U8",
};

/** Every tensor of the weights by its Hugging Face name, in load order (a tied LM head omitted). */
function namedTensors(w: ModelWeights, config: ModelConfig): Map<string, Matrix> {
  const out = new Map<string, Matrix>();
  out.set("model.embed_tokens.weight", w.embed);
  w.layers.forEach((l, i) => {
    const p = `model.layers.${i}`;
    out.set(`${p}.input_layernorm.weight`, l.inputNorm);
    out.set(`${p}.self_attn.q_proj.weight`, l.q);
    out.set(`${p}.self_attn.k_proj.weight`, l.k);
    out.set(`${p}.self_attn.v_proj.weight`, l.v);
    if (l.qBias !== null) out.set(`${p}.self_attn.q_proj.bias`, l.qBias);
    if (l.kBias !== null) out.set(`${p}.self_attn.k_proj.bias`, l.kBias);
    if (l.vBias !== null) out.set(`${p}.self_attn.v_proj.bias`, l.vBias);
    out.set(`${p}.self_attn.o_proj.weight`, l.o);
    out.set(`${p}.post_attention_layernorm.weight`, l.postNorm);
    out.set(`${p}.mlp.gate_proj.weight`, l.gate);
    out.set(`${p}.mlp.up_proj.weight`, l.up);
    out.set(`${p}.mlp.down_proj.weight`, l.down);
  });
  out.set("model.norm.weight", w.finalNorm);
  if (!config.tieWordEmbeddings) out.set("lm_head.weight", w.lmHead);
  return out;
}

/** Writes the weights as one safetensors file, each tensor in its own format (see the module header). */
export function writeWeightsFile(
  path: string,
  weights: ModelWeights,
  config: ModelConfig,
  metadata: Record<string, string> = {},
): number {
  const shapes = expectedTensors(config);
  const tensors = [...namedTensors(weights, config)];
  const blocks: Record<string, { dtype: WeightDType; shape: readonly number[] }> = {};
  const entries = tensors.map(([name, m]) => {
    const dtype = matrixDType(m);
    const shape = shapes.get(name) as readonly number[];
    if (dtype !== "q8_0" && dtype !== "q4_0") return { name, shape, dtype: FILE_DTYPE[dtype] };
    blocks[name] = { dtype, shape };
    const rows = shape[0] as number;
    return { name, shape: [rows, matrixBytes(m).byteLength / rows], dtype: "U8" };
  });
  const meta: Record<string, string> = { format: "pt", ...metadata };
  if (Object.keys(blocks).length > 0) meta[WEIGHT_FORMATS_KEY] = JSON.stringify(blocks);
  const { header, dataBytes } = safetensorsHeader(entries, meta);
  const fd = openSync(path, "w");
  try {
    writeAllSync(fd, header);
    for (const [, m] of tensors) writeAllSync(fd, matrixBytes(m));
  } finally {
    closeSync(fd);
  }
  return header.byteLength + dataBytes;
}

/** The files of a model folder besides its weights that a converted folder keeps. */
const FOLDER_FILES = [
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "chat_template.jinja",
];

/**
 * `kvfence quantize IN OUT --type`: loads the folder IN (any format kvfence reads), converts every
 * weight matrix to `dtype` and writes the folder OUT. Returns the bytes of OUT's model.safetensors.
 */
export function convertModelFolder(inDir: string, outDir: string, dtype: WeightDType): { bytes: number } {
  if (resolve(inDir) === resolve(outDir)) {
    throw new KvfenceError(
      "invalid_request",
      `The output folder must differ from the input folder: ${outDir}`,
    );
  }
  const model = loadModel(inDir);
  const weights = convertWeights(model.weights, model.config, dtype);
  try {
    mkdirSync(outDir, { recursive: true });
  } catch (err) {
    throw new KvfenceError(
      "invalid_request",
      `Cannot create the output folder, pick a writable path: ${outDir}: ${(err as Error).message}`,
      { cause: err },
    );
  }
  for (const f of FOLDER_FILES)
    if (existsSync(join(model.dir, f))) copyFileSync(join(model.dir, f), join(outDir, f));
  const bytes = writeWeightsFile(join(outDir, "model.safetensors"), weights, model.config, {
    generator: `kvfence quantize --type ${dtype}`,
  });
  return { bytes };
}
