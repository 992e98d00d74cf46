/**
 * Loads a Hugging Face model folder: config.json (+ generation_config.json), the weights
 * (`model.safetensors`, or shards listed by `model.safetensors.index.json`), tokenizer.json,
 * tokenizer_config.json and its chat template.
 *
 * Every tensor the config implies must be present with exactly the implied shape; tensors the
 * config does not account for (an extra layer, an o_proj bias, ...) are refused rather than
 * ignored, because a silently dropped tensor means silently wrong output. The only tolerated
 * extras are RoPE `inv_freq` buffers (recomputed from rope_theta) and an `lm_head.weight` saved
 * beside tied embeddings. Problems surface as one-line `bad_model_folder` / `unsupported_model`
 * errors naming the file.
 */
import { statSync } from "node:fs";
import { basename, join, resolve } from "node:path";
import { convertMatrix, type Matrix, matrixBytes, type WeightDType } from "../kernels/weight-format.js";
import type { ByteRange } from "../lib/byte-range.js";
import { isGgufPath } from "../tokenizer/gguf-tokenizer.js";
import { badModelFolder, readJsonFile } from "../tokenizer/model-files.js";
import {
  type ChatTemplate,
  ggufTokenizer,
  loadChatTemplate,
  ModelTokenizer,
} from "../tokenizer/tokenizer.js";
import {
  type GenerationDefaults,
  loadGenerationDefaults,
  loadModelConfig,
  parseModelConfig,
} from "./config-loader.js";
import { type GgufModel, ggufMatrix, readGgufModel } from "./gguf.js";
import type { LayerWeights, ModelConfig, ModelWeights } from "./model-config.js";
import { readWholeFile, SafetensorsFile } from "./safetensors.js";

export interface LoadProgress {
  /** The weights file being read or converted. */
  readonly file: string;
  /** Bytes read so far over all weight files. */
  readonly bytesRead: number;
  readonly totalBytes: number;
  /** Tensors converted to f32 so far. */
  readonly tensorsLoaded: number;
  readonly tensorsTotal: number;
}

const BAR_WIDTH = 24;

/** A one-line progress bar, e.g. `Loading weights: 42% [##########              ] 226.0 of 538.1 MB, 120/272 tensors`. */
export function formatLoadProgress(p: LoadProgress): string {
  const share = p.totalBytes === 0 ? 1 : Math.min(1, p.bytesRead / p.totalBytes);
  const percent = Math.floor(share * 100);
  const filled = Math.floor(share * BAR_WIDTH);
  const bar = `[${"#".repeat(filled)}${" ".repeat(BAR_WIDTH - filled)}]`;
  const mb = (bytes: number) => (bytes / 1e6).toFixed(1);
  return `Loading weights: ${percent}% ${bar} ${mb(p.bytesRead)} of ${mb(p.totalBytes)} MB, ${p.tensorsLoaded}/${p.tensorsTotal} tensors`;
}

/**
 * An `onProgress` that shows the bar only once loading has taken `delayMs` (default 1 s: a fast
 * load shows nothing), then at each new percent; `now` is the clock in ms (tests give their own).
 */
export function delayedProgress(
  show: (line: string) => void,
  options?: { readonly delayMs?: number; readonly now?: () => number },
): (p: LoadProgress) => void {
  const now = options?.now ?? (() => performance.now());
  const start = now();
  const delay = options?.delayMs ?? 1000;
  let lastPercent = -1;
  return (p) => {
    if (now() - start < delay) return;
    const percent = p.totalBytes === 0 ? 100 : Math.floor((100 * p.bytesRead) / p.totalBytes);
    if (percent === lastPercent) return;
    lastPercent = percent;
    show(formatLoadProgress(p));
  };
}

export interface LoadModelOptions {
  /** Called after each chunk read and each tensor converted. */
  readonly onProgress?: (progress: LoadProgress) => void;
  /** Put the weights in SharedArrayBuffers so worker threads can use them without copies. */
  readonly shared?: boolean;
  /**
   * Quantise every weight matrix (embeddings and LM head included, as llama.cpp's q8_0/q4_0 files
   * do) from its stored f32/f16/bf16 into these blocks (`--quantize`); norms and biases stay f32.
   */
  readonly quantize?: "q8_0" | "q4_0";
  /**
   * Where each weight file's bytes go (a window of the engines' shared memory,
   * src/engine/engine-memory.ts): the file is read straight into it in pieces and its tensors are
   * views of it, so no other copy of the file exists. A byte range, not a Uint8Array: a file may
   * pass 4 GiB, more than one typed array holds. Absent: a fresh (Shared)ArrayBuffer per file.
   */
  readonly into?: (bytes: number) => ByteRange;
  /**
   * Maps a weight file into the memory in place of `into` and reading it (`ReadFileOptions.map`,
   * src/model/safetensors.ts); null: it is read as usual.
   */
  readonly map?: (fd: number, bytes: number) => ByteRange | null;
}

/** The formats `--quantize` makes at load. */
export const QUANTIZE_TYPES: readonly ("q8_0" | "q4_0")[] = ["q8_0", "q4_0"];

/**
 * A model's config, names and sampling defaults, without its tokenizer (`openModelHeader`): what
 * sizing the KV pools and naming the model need, read before the tokenizer is parsed.
 */
export interface ModelHeader {
  /** The folder's base name (a GGUF file's without `.gguf`). */
  readonly name: string;
  /** The folder, or the GGUF file. */
  readonly dir: string;
  /** A GGUF file's parsed header (its tensor table), absent for a folder. */
  readonly gguf?: GgufModel;
  readonly config: ModelConfig;
  readonly generationDefaults: GenerationDefaults;
}

/** Everything of a model folder but its weights: what a router needs to tokenize and admit. */
export interface ModelMeta extends ModelHeader {
  readonly tokenizer: ModelTokenizer;
  /** Null when the folder has no chat template. */
  readonly chatTemplate: ChatTemplate | null;
}

export interface LoadedModel extends ModelMeta {
  readonly weights: ModelWeights;
}

/** The tensors a config implies, in load order, with their shapes. */
export function expectedTensors(config: ModelConfig): Map<string, readonly number[]> {
  const h = config.hiddenSize;
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  const ff = config.intermediateSize;
  const out = new Map<string, readonly number[]>();
  out.set("model.embed_tokens.weight", [config.vocabSize, h]);
  for (let i = 0; i < config.numLayers; i++) {
    const p = `model.layers.${i}`;
    out.set(`${p}.input_layernorm.weight`, [h]);
    out.set(`${p}.self_attn.q_proj.weight`, [q, h]);
    out.set(`${p}.self_attn.k_proj.weight`, [kv, h]);
    out.set(`${p}.self_attn.v_proj.weight`, [kv, h]);
    if (config.attentionBias) {
      out.set(`${p}.self_attn.q_proj.bias`, [q]);
      out.set(`${p}.self_attn.k_proj.bias`, [kv]);
      out.set(`${p}.self_attn.v_proj.bias`, [kv]);
    }
    out.set(`${p}.self_attn.o_proj.weight`, [h, q]);
    out.set(`${p}.post_attention_layernorm.weight`, [h]);
    out.set(`${p}.mlp.gate_proj.weight`, [ff, h]);
    out.set(`${p}.mlp.up_proj.weight`, [ff, h]);
    out.set(`${p}.mlp.down_proj.weight`, [h, ff]);
  }
  out.set("model.norm.weight", [h]);
  if (!config.tieWordEmbeddings) out.set("lm_head.weight", [config.vocabSize, h]);
  return out;
}

function isIgnorable(name: string, config: ModelConfig): boolean {
  return name.endsWith(".rotary_emb.inv_freq") || (config.tieWordEmbeddings && name === "lm_head.weight");
}

/** Finds the weight files: the single file, or the shards of the index (each must exist). */
export function weightFiles(dir: string): { files: string[]; label: string } {
  const single = join(dir, "model.safetensors");
  if (isFile(single)) return { files: [single], label: single };
  const indexPath = join(dir, "model.safetensors.index.json");
  const index = readJsonFile(indexPath, { optional: true });
  if (index === undefined) {
    throw badModelFolder(
      dir,
      "no model.safetensors or model.safetensors.index.json; put the weights in safetensors format in the folder",
    );
  }
  const map = (index as { weight_map?: unknown } | null)?.weight_map;
  if (typeof map !== "object" || map === null || Array.isArray(map))
    throw badModelFolder(indexPath, "weight_map is missing or not an object");
  const shards: string[] = [];
  for (const [tensor, shard] of Object.entries(map)) {
    if (typeof shard !== "string" || shard.includes("/") || shard.includes("\\")) {
      throw badModelFolder(
        indexPath,
        `weight_map entry for ${tensor} is not a file name in the folder: ${JSON.stringify(shard)}`,
      );
    }
    if (!shards.includes(shard)) shards.push(shard);
  }
  if (shards.length === 0) throw badModelFolder(indexPath, "weight_map is empty");
  for (const shard of shards) {
    if (!isFile(join(dir, shard)))
      throw badModelFolder(indexPath, `shard ${shard} is missing from the folder`);
  }
  return { files: shards.map((s) => join(dir, s)), label: indexPath };
}

function isFile(path: string): boolean {
  try {
    return statSync(path).isFile();
  } catch {
    return false;
  }
}

function sameShape(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

const shapeText = (s: readonly number[]): string => `[${s.join(",")}]`;

/**
 * Loads and validates a model folder. Throws `bad_model_folder` or `unsupported_model` with a
 * one-line message naming the file and the problem.
 */
export function loadModel(dir: string, options?: LoadModelOptions): LoadedModel {
  const meta = loadModelMeta(dir);
  return Object.freeze({ ...meta, weights: loadWeights(meta.dir, meta.config, options) });
}

/** `loadModel` for a folder or a GGUF file (`FILE.gguf`, src/model/gguf.ts). */
export async function openModel(path: string, options?: LoadModelOptions): Promise<LoadedModel> {
  const meta = await openModelMeta(path);
  return Object.freeze({ ...meta, weights: loadModelWeights(meta, options) });
}

/** `loadModelMeta` for a folder or a GGUF file. */
export async function openModelMeta(path: string): Promise<ModelMeta> {
  return withTokenizer(await openModelHeader(path));
}

/** The config, names and sampling defaults of a folder or a GGUF file (`ModelHeader`). */
export async function openModelHeader(path: string): Promise<ModelHeader> {
  if (!isGgufPath(path)) return loadModelHeader(path);
  const gguf = await readGgufModel(resolve(path));
  const config = parseModelConfig(gguf.configJson, gguf.path, undefined);
  return Object.freeze({
    name: gguf.name,
    dir: gguf.path,
    gguf,
    config,
    generationDefaults: Object.freeze({ eosTokenIds: config.eosTokenIds }),
  });
}

/** The header's model with its tokenizer and chat template, checked against its vocabulary size. */
export function withTokenizer(header: ModelHeader): ModelMeta {
  if (header.gguf !== undefined) {
    const { tokenizer, chatTemplate } = ggufTokenizer(header.gguf);
    checkTokenizerFits(header, tokenizer.numIds);
    return Object.freeze({ ...header, tokenizer, chatTemplate });
  }
  const tokenizer = ModelTokenizer.fromFolder(header.dir);
  checkTokenizerFits(header, tokenizer.numIds);
  return Object.freeze({ ...header, tokenizer, chatTemplate: loadChatTemplate(header.dir, tokenizer) });
}

/** Refuses a tokenizer of `numIds` ids (`ModelTokenizer.numIds`) with ids past the model's vocabulary. */
export function checkTokenizerFits(header: ModelHeader, numIds: number): void {
  if (header.gguf !== undefined)
    checkVocabulary(header.gguf.path, numIds, header.config, "the token embedding");
  else checkVocabulary(join(header.dir, "tokenizer.json"), numIds, header.config, "config.json");
}

/** The weights of a model whose meta is loaded: its folder's safetensors or its GGUF tensors. */
export function loadModelWeights(meta: ModelHeader, options?: LoadModelOptions): ModelWeights {
  return meta.gguf === undefined
    ? loadWeights(meta.dir, meta.config, options)
    : loadGgufWeights(meta.gguf, meta.config, options);
}

function checkVocabulary(label: string, numIds: number, config: ModelConfig, source: string): void {
  if (numIds > config.vocabSize) {
    throw badModelFolder(
      label,
      `tokenizer has token ids up to ${numIds - 1} but ${source} has vocab_size ${config.vocabSize}; the tokenizer does not belong to this model`,
    );
  }
}

/**
 * A GGUF file's tensors (already listed by `readGgufModel`), each checked against the config like
 * a folder's: the file is read whole (into `options.into`'s memory when given) and the tensors are
 * views of it in their stored format (src/model/gguf.ts), Llama's Q/K rows un-permuted in place;
 * `quantize` converts the matrices as for a folder.
 */
export function loadGgufWeights(
  model: GgufModel,
  config: ModelConfig,
  options?: LoadModelOptions,
): ModelWeights {
  const expected = expectedTensors(config);
  const file = model.path;
  const bytes = readWholeFile(file, {
    shared: options?.shared ?? false,
    ...(options?.into === undefined ? {} : { into: options.into }),
    ...(options?.map === undefined ? {} : { map: options.map }),
    onBytes: (bytesRead, totalBytes) =>
      options?.onProgress?.({ file, bytesRead, totalBytes, tensorsLoaded: 0, tensorsTotal: expected.size }),
  });
  const tensors = new Map<string, Matrix>();
  for (const t of model.tensors) {
    const shape = expected.get(t.name);
    if (shape === undefined) {
      checkUnexpected({ file, name: `${t.name} (${t.ggufName})`, shape: t.shape }, config);
      continue;
    }
    if (tensors.has(t.name)) throw badModelFolder(file, `tensor ${t.ggufName} appears twice`);
    if (!sameShape(t.shape, shape)) {
      throw badModelFolder(
        file,
        `tensor ${t.ggufName} has shape ${shapeText(t.shape)}, expected ${shapeText(shape)} from the GGUF metadata`,
      );
    }
    if (t.fileOffset + t.byteLength > bytes.byteLength)
      throw badModelFolder(file, `tensor ${t.ggufName} runs past the end of the file; the file is truncated`);
    const m = ggufMatrix(bytes, t, options?.shared ?? false);
    tensors.set(
      t.name,
      shape.length === 2 && options?.quantize !== undefined ? convertMatrix(m, shape, options.quantize) : m,
    );
  }
  for (const [name, shape] of expected) {
    if (!tensors.has(name))
      throw badModelFolder(file, `tensor ${name} is missing (expected shape ${shapeText(shape)})`);
  }
  return assembleWeights(config, tensors);
}

/** Loads and validates a model folder's config, tokenizer, chat template and defaults, not its weights. */
export function loadModelMeta(dir: string): ModelMeta {
  return withTokenizer(loadModelHeader(dir));
}

/** A folder's `ModelHeader`: its config.json and generation_config.json, not its tokenizer. */
function loadModelHeader(dir: string): ModelHeader {
  const root = resolve(dir);
  let isDir = false;
  try {
    isDir = statSync(root).isDirectory();
  } catch {
    isDir = false;
  }
  if (!isDir)
    throw badModelFolder(root, "folder does not exist; pass the path of a Hugging Face model folder");

  return Object.freeze({
    name: basename(root),
    dir: root,
    config: loadModelConfig(root),
    generationDefaults: loadGenerationDefaults(root),
  });
}

/** Reads and checks the weights of a folder whose config is already loaded. */
export function loadWeights(dir: string, config: ModelConfig, options?: LoadModelOptions): ModelWeights {
  const { files, label } = weightFiles(dir);
  const expected = expectedTensors(config);
  const totalBytes = files.reduce((sum, f) => sum + statSync(f).size, 0);
  const tensors = new Map<string, Matrix>();
  const onProgress = options?.onProgress;
  const shared = options?.shared ?? false;
  const quantize = options?.quantize;
  let bytesBefore = 0;
  let bytesRead = 0;

  for (const file of files) {
    const report = () =>
      onProgress?.({ file, bytesRead, totalBytes, tensorsLoaded: tensors.size, tensorsTotal: expected.size });
    const st = SafetensorsFile.open(file, {
      shared: options?.shared ?? false,
      // What the config ignores is not read (a tied checkpoint's saved lm_head.weight: vocab × hidden).
      skip: (name) => isIgnorable(name, config),
      ...(options?.into === undefined ? {} : { into: options.into }),
      ...(options?.map === undefined ? {} : { map: options.map }),
      onBytes: (done) => {
        bytesRead = bytesBefore + done;
        report();
      },
    });
    bytesBefore = bytesRead;
    for (const name of st.names()) {
      const stored = st.logicalShape(name);
      if (stored === undefined) continue;
      const shape = expected.get(name);
      if (shape === undefined) {
        checkUnexpected({ file, name, shape: stored }, config);
        continue;
      }
      if (tensors.has(name))
        throw badModelFolder(file, `tensor ${name} appears in more than one weight file`);
      if (!sameShape(stored, shape)) {
        throw badModelFolder(
          file,
          `tensor ${name} has shape ${shapeText(stored)}, expected ${shapeText(shape)} from config.json`,
        );
      }
      tensors.set(name, readTensor(st, name, shape, { shared, quantize }));
      report();
    }
  }
  for (const [name, shape] of expected) {
    if (!tensors.has(name))
      throw badModelFolder(
        label,
        `tensor ${name} is missing (expected shape ${shapeText(shape)} from config.json)`,
      );
  }

  return assembleWeights(config, tensors);
}

/**
 * One checked tensor: a matrix in its stored format (or quantised), a vector (norm, bias) as f32.
 * Quantising copies the small f32 vectors out of the file's buffer too, so the file's bytes do not
 * stay alive beside the quantised copies.
 */
function readTensor(
  st: SafetensorsFile,
  name: string,
  shape: readonly number[],
  options: { shared: boolean; quantize: WeightDType | undefined },
): Matrix {
  if (shape.length !== 2) {
    const v = st.toFloat32(name);
    return options.quantize === undefined ? v : ownCopy(v, options.shared);
  }
  const m = st.toMatrix(name);
  if (options.quantize === undefined) return m;
  const q = convertMatrix(m, shape, options.quantize);
  if (q instanceof Float32Array) return q;
  if (!options.shared || q.bytes.buffer instanceof SharedArrayBuffer) return q;
  const bytes = new Uint8Array(new SharedArrayBuffer(matrixBytes(q).byteLength));
  bytes.set(matrixBytes(q));
  return { ...q, bytes };
}

function ownCopy(v: Float32Array, shared: boolean): Float32Array {
  const out = new Float32Array(shared ? new SharedArrayBuffer(v.byteLength) : new ArrayBuffer(v.byteLength));
  out.set(v);
  return out;
}

/** A tensor config.json does not expect: ignorable (rotary caches and the like), or refused. */
function checkUnexpected(
  { file, name, shape }: { file: string; name: string; shape: readonly number[] },
  config: ModelConfig,
): void {
  if (isIgnorable(name, config)) return;
  const layer = /^model\.layers\.(\d+)\./.exec(name);
  if (layer !== null && Number(layer[1]) >= config.numLayers) {
    throw badModelFolder(
      file,
      `tensor ${name} belongs to layer ${layer[1]} but config.json has num_hidden_layers ${config.numLayers}`,
    );
  }
  throw badModelFolder(
    file,
    `unexpected tensor ${name} ${shapeText(shape)}: config.json does not account for it`,
  );
}

/** The frozen `ModelWeights` over a complete set of checked tensors. */
function assembleWeights(config: ModelConfig, tensors: ReadonlyMap<string, Matrix>): ModelWeights {
  const get = (name: string): Matrix => tensors.get(name) as Matrix;
  const vec = (name: string): Float32Array => tensors.get(name) as Float32Array;
  const bias = (name: string): Float32Array | null => (config.attentionBias ? vec(name) : null);
  const layers: LayerWeights[] = [];
  for (let i = 0; i < config.numLayers; i++) {
    const p = `model.layers.${i}`;
    layers.push(
      Object.freeze({
        inputNorm: vec(`${p}.input_layernorm.weight`),
        q: get(`${p}.self_attn.q_proj.weight`),
        k: get(`${p}.self_attn.k_proj.weight`),
        v: get(`${p}.self_attn.v_proj.weight`),
        qBias: bias(`${p}.self_attn.q_proj.bias`),
        kBias: bias(`${p}.self_attn.k_proj.bias`),
        vBias: bias(`${p}.self_attn.v_proj.bias`),
        o: get(`${p}.self_attn.o_proj.weight`),
        postNorm: vec(`${p}.post_attention_layernorm.weight`),
        gate: get(`${p}.mlp.gate_proj.weight`),
        up: get(`${p}.mlp.up_proj.weight`),
        down: get(`${p}.mlp.down_proj.weight`),
      }),
    );
  }
  const embed = get("model.embed_tokens.weight");
  return Object.freeze({
    embed,
    layers: Object.freeze(layers),
    finalNorm: vec("model.norm.weight"),
    lmHead: config.tieWordEmbeddings ? embed : get("lm_head.weight"),
  });
}

/** The files `loadModelWeights` reads for `meta`: the GGUF file, or the folder's safetensors. */
export function weightFilesOf(meta: ModelHeader): string[] {
  return meta.gguf === undefined ? weightFiles(meta.dir).files : [meta.gguf.path];
}
