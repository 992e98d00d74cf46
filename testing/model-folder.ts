/**
 * Writes small synthetic Hugging Face model folders into a temp dir for tests: config.json,
 * generation_config.json, a byte-level ChatML tokenizer, and seeded random weights (single file or
 * sharded with an index, in F32/F16/BF16). Options override config fields, edit the tensor list
 * and replace or delete any file, so each test can build exactly the broken folder it needs.
 */
import {
  closeSync,
  ftruncateSync,
  mkdtempSync,
  openSync,
  rmSync,
  unlinkSync,
  writeFileSync,
  writeSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  byteLevelTokenizerJson,
  chatmlTokenizerConfig,
  fillRandom,
  generationConfigJson,
  llamaConfigJson,
  type ModelShape,
  shapeToConfig,
} from "../src/model/gen-model.js";
import { expectedTensors } from "../src/model/load-model.js";
import {
  encodeTensorData,
  safetensorsHeader,
  type TensorToWrite,
  writeAllSync,
  writeSafetensors,
} from "../src/model/safetensors.js";

export const TINY_SHAPE: ModelShape = {
  hiddenSize: 16,
  numLayers: 2,
  numHeads: 4,
  numKvHeads: 2,
  headDim: 4,
  intermediateSize: 24,
  vocabSize: 300,
  tieWordEmbeddings: false,
  ropeTheta: 10000,
  maxPositionEmbeddings: 256,
  rmsNormEps: 1e-5,
};

export interface ModelFolderOptions {
  readonly architecture?: "llama" | "mistral" | "qwen2";
  readonly shape?: Partial<ModelShape>;
  /** Merged into config.json; a value of undefined deletes the key. */
  readonly config?: Record<string, unknown>;
  readonly dtype?: "F32" | "F16" | "BF16";
  /** More than 1 writes model-0000i-of-0000n.safetensors shards and model.safetensors.index.json. */
  readonly shards?: number;
  /**
   * One file whose data starts with a tensor the loader ignores (a RoPE `inv_freq` buffer) of this
   * many bytes (a multiple of 4), written as a hole: a sparse file past 4 GiB costs no disk, and
   * every weight lies past it (`writeSparseSafetensors`).
   */
  readonly holeBytes?: number;
  /** Edits the tensor list before it is written. */
  readonly editTensors?: (tensors: TensorToWrite[]) => TensorToWrite[];
  /** Replaces (string) or deletes (null) files after everything is written. */
  readonly files?: Record<string, string | Uint8Array | null>;
  readonly seed?: number;
}

export interface ModelFolder {
  readonly dir: string;
  readonly config: Record<string, unknown>;
  /** The tensors as written (f32 values before any F16/BF16 rounding). */
  readonly tensors: readonly TensorToWrite[];
  remove(): void;
}

/** Writes a synthetic model folder into a new temp dir. */
export function writeModelFolder(options: ModelFolderOptions = {}): ModelFolder {
  const arch = options.architecture ?? "llama";
  const shape: ModelShape = { ...TINY_SHAPE, ...options.shape };
  const config: Record<string, unknown> = llamaConfigJson(shape);
  if (arch === "qwen2") {
    config.architectures = ["Qwen2ForCausalLM"];
    config.model_type = "qwen2";
    delete config.attention_bias;
    delete config.mlp_bias;
    config.sliding_window = 4096;
    config.use_sliding_window = false;
  } else if (arch === "mistral") {
    config.architectures = ["MistralForCausalLM"];
    config.model_type = "mistral";
    delete config.attention_bias;
    delete config.mlp_bias;
    config.sliding_window = null;
  }
  for (const [key, value] of Object.entries(options.config ?? {})) {
    if (value === undefined) delete config[key];
    else config[key] = value;
  }

  const modelConfig = { ...shapeToConfig(shape), architecture: arch, attentionBias: arch === "qwen2" };
  const seed = options.seed ?? 1;
  let tensors: TensorToWrite[] = [...expectedTensors(modelConfig)].map(([name, dims], index) => {
    const data = new Float32Array(dims.reduce((a, b) => a * b, 1));
    const norm = name.endsWith("norm.weight");
    fillRandom(data, { seed, stream: index, mean: norm ? 1 : 0, std: norm ? 0.05 : 0.02 });
    return { name, shape: dims, data, dtype: options.dtype ?? "F32" };
  });
  if (options.editTensors !== undefined) tensors = options.editTensors(tensors);

  const dir = mkdtempSync(join(tmpdir(), "kvfence-model-"));
  const writeJson = (name: string, value: unknown) =>
    writeFileSync(join(dir, name), JSON.stringify(value, null, 2));
  writeJson("config.json", config);
  writeJson("generation_config.json", generationConfigJson());
  writeJson("tokenizer.json", byteLevelTokenizerJson(shape.vocabSize));
  writeJson("tokenizer_config.json", chatmlTokenizerConfig());

  const shards = options.shards ?? 1;
  if (options.holeBytes !== undefined) {
    writeSparseSafetensors(join(dir, "model.safetensors"), tensors, options.holeBytes);
  } else if (shards <= 1) {
    writeSafetensors(join(dir, "model.safetensors"), tensors, { format: "pt" });
  } else {
    const weightMap: Record<string, string> = {};
    const perShard = Math.ceil(tensors.length / shards);
    for (let s = 0; s < shards; s++) {
      const file = `model-${String(s + 1).padStart(5, "0")}-of-${String(shards).padStart(5, "0")}.safetensors`;
      const part = tensors.slice(s * perShard, (s + 1) * perShard);
      for (const t of part) weightMap[t.name] = file;
      writeSafetensors(join(dir, file), part, { format: "pt" });
    }
    writeJson("model.safetensors.index.json", { metadata: { total_size: 0 }, weight_map: weightMap });
  }

  for (const [name, content] of Object.entries(options.files ?? {})) {
    if (content === null) unlinkSync(join(dir, name));
    else writeFileSync(join(dir, name), content);
  }
  return { dir, config, tensors, remove: () => rmSync(dir, { recursive: true, force: true }) };
}

/**
 * A safetensors file of `tensors` after an F32 `model.rotary_emb.inv_freq` of `holeBytes` zero
 * bytes that are never written (ftruncate): the file is sparse.
 */
export function writeSparseSafetensors(
  path: string,
  tensors: readonly TensorToWrite[],
  holeBytes: number,
): void {
  const hole = { name: "model.rotary_emb.inv_freq", shape: [holeBytes / 4], dtype: "F32" };
  const { header } = safetensorsHeader(
    [hole, ...tensors.map((t) => ({ name: t.name, shape: t.shape, dtype: t.dtype ?? "F32" }))],
    { format: "pt" },
  );
  const fd = openSync(path, "w");
  try {
    writeAllSync(fd, header);
    let at = header.byteLength + holeBytes;
    ftruncateSync(fd, at);
    for (const t of tensors) {
      const bytes = encodeTensorData(t.data, t.dtype ?? "F32");
      for (let done = 0; done < bytes.byteLength; )
        done += writeSync(fd, bytes, done, bytes.byteLength - done, at + done);
      at += bytes.byteLength;
    }
  } finally {
    closeSync(fd);
  }
}

/** Raw safetensors bytes for arbitrary dtypes (e.g. I8, F64) from a header and given data bytes. */
export function rawSafetensors(
  entries: readonly { name: string; shape: readonly number[]; dtype: string; bytes: Uint8Array }[],
): Uint8Array {
  const { header } = safetensorsHeader(entries);
  const total = header.byteLength + entries.reduce((sum, e) => sum + e.bytes.byteLength, 0);
  const out = new Uint8Array(total);
  out.set(header, 0);
  let offset = header.byteLength;
  for (const e of entries) {
    out.set(e.bytes, offset);
    offset += e.bytes.byteLength;
  }
  return out;
}

/** The bytes of a safetensors file holding `tensors` (F32 unless a tensor says otherwise). */
export function safetensorsBytes(tensors: readonly TensorToWrite[]): Uint8Array {
  return rawSafetensors(
    tensors.map((t) => ({
      name: t.name,
      shape: t.shape,
      dtype: t.dtype ?? "F32",
      bytes: encodeTensorData(t.data, t.dtype ?? "F32"),
    })),
  );
}
