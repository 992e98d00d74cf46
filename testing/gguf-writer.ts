/**
 * Writes a GGUF file from a Hugging Face model folder, for tests: what llama.cpp's
 * convert_hf_to_gguf.py (and llama-quantize for Q8_0/Q4_0) would write for it, derived from the
 * published format (ggml's GGUF specification and llama.cpp's gguf-py), since llama.cpp's tools cannot run here.
 *
 * The metadata (the `general.*`, `ARCH.*` and `tokenizer.*` keys) is serialised by
 * `@huggingface/gguf`'s `serializeGgufMetadata`; the tensor table that follows it (name, dims
 * innermost first, type, offset) and the data (each tensor 32-byte aligned) are written here, since
 * the library writes only the metadata. As the converter does: Llama's Q and K rows are permuted
 * (`permute`), 1-D tensors stay F32, every matrix takes the requested type (Q8_0/Q4_0 blocks by
 * ggml's reference quantisation, src/kernels/weight-format.ts) or the type and bytes an `encode`
 * hook gives it (ggml's own k-quants, scripts/kquant-fixtures.mjs), special added tokens are CONTROL and
 * other added tokens USER_DEFINED, ids beyond the tokenizer are `[PADn]`. The pre-tokenizer is
 * written as "gpt2" (the byte-level one; the test tokenizers have no merges, so any split encodes the same).
 */
import { closeSync, openSync, readFileSync, writeSync } from "node:fs";
import { join } from "node:path";
import { GGMLQuantizationType, GGUFValueType, serializeGgufMetadata } from "@huggingface/gguf";
import { decodeMatrix, encodeWeight, type Matrix, type WeightDType } from "../src/kernels/weight-format.js";
import { loadModel } from "../src/model/load-model.js";
import type { ModelConfig, ModelWeights } from "../src/model/model-config.js";

/** Types a matrix may be written in: the weight formats, and llama.cpp's Q5_0 / Q5_1 (kvfence widens them at load). */
export type GgufMatrixType = WeightDType | "q5_0" | "q5_1";

const GGUF_TYPE: Record<GgufMatrixType, GGMLQuantizationType> = {
  f32: GGMLQuantizationType.F32,
  f16: GGMLQuantizationType.F16,
  bf16: GGMLQuantizationType.BF16,
  q8_0: GGMLQuantizationType.Q8_0,
  q4_0: GGMLQuantizationType.Q4_0,
  q4_K: GGMLQuantizationType.Q4_K,
  q5_K: GGMLQuantizationType.Q5_K,
  q6_K: GGMLQuantizationType.Q6_K,
  q5_0: GGMLQuantizationType.Q5_0,
  q5_1: GGMLQuantizationType.Q5_1,
};
const ALIGN = 32;

interface Entry {
  value: unknown;
  type: GGUFValueType;
  subType?: GGUFValueType;
}

interface OutTensor {
  name: string;
  /** Hugging Face order (outermost first). */
  shape: readonly number[];
  type: GGMLQuantizationType;
  bytes: Uint8Array;
}

/** A matrix's stored form: its type and its bytes in that type's layout. */
export interface EncodedMatrix {
  readonly dtype: GgufMatrixType;
  readonly bytes: Uint8Array;
}

export interface WriteGgufOptions {
  /** Type of every matrix (1-D tensors stay F32). */
  readonly dtype: WeightDType;
  /**
   * Encodes each matrix instead (by GGUF name; `data` [rows][cols] f32 as the file holds it, Llama's
   * Q/K rows permuted): a mix of types, or bytes made by another quantiser.
   */
  readonly encode?: (ggufName: string, data: Float32Array, rows: number, cols: number) => EncodedMatrix;
  /** Metadata to add or override (tests of refusals), by key. */
  readonly extraMetadata?: Record<string, Entry>;
  /** Leave these keys out. */
  readonly dropMetadata?: readonly string[];
  /** Override a tensor's GGML type code by GGUF name (to write an unsupported type's table entry). */
  readonly tensorTypeOverride?: Record<string, number>;
}

/** convert_hf_to_gguf.py's `permute` of a [heads·hd][cols] matrix's rows. */
export function permuteRows(w: Float32Array, rows: number, cols: number, heads: number): Float32Array {
  const hd = rows / heads;
  const half = hd / 2;
  const out = new Float32Array(w.length);
  for (let h = 0; h < heads; h++) {
    for (let i = 0; i < half; i++) {
      for (let j = 0; j < 2; j++) {
        const from = (h * hd + j * half + i) * cols;
        out.set(w.subarray(from, from + cols), (h * hd + 2 * i + j) * cols);
      }
    }
  }
  return out;
}

function tensorsOf(config: ModelConfig, w: ModelWeights, options: WriteGgufOptions): OutTensor[] {
  const h = config.hiddenSize;
  const out: OutTensor[] = [];
  const matrix = (name: string, m: Matrix, rows: number, cols: number): void => {
    const data = decodeMatrix(m);
    const e = options.encode?.(name, data, rows, cols) ?? encodeWeight(data, [rows, cols], options.dtype);
    out.push({ name, shape: [rows, cols], type: GGUF_TYPE[e.dtype], bytes: e.bytes });
  };
  const vector = (name: string, data: Float32Array): void => {
    out.push({
      name,
      shape: [data.length],
      type: GGMLQuantizationType.F32,
      bytes: new Uint8Array(data.slice().buffer),
    });
  };
  const llama = config.architecture !== "qwen2";
  const q = config.numHeads * config.headDim;
  const kv = config.numKvHeads * config.headDim;
  matrix("token_embd.weight", w.embed, config.vocabSize, h);
  w.layers.forEach((l, i) => {
    const p = `blk.${i}`;
    vector(`${p}.attn_norm.weight`, l.inputNorm);
    const lq = decodeMatrix(l.q);
    const lk = decodeMatrix(l.k);
    matrix(`${p}.attn_q.weight`, llama ? permuteRows(lq, q, h, config.numHeads) : lq, q, h);
    matrix(`${p}.attn_k.weight`, llama ? permuteRows(lk, kv, h, config.numKvHeads) : lk, kv, h);
    matrix(`${p}.attn_v.weight`, l.v, kv, h);
    if (l.qBias !== null) vector(`${p}.attn_q.bias`, l.qBias);
    if (l.kBias !== null) vector(`${p}.attn_k.bias`, l.kBias);
    if (l.vBias !== null) vector(`${p}.attn_v.bias`, l.vBias);
    matrix(`${p}.attn_output.weight`, l.o, h, q);
    vector(`${p}.ffn_norm.weight`, l.postNorm);
    matrix(`${p}.ffn_gate.weight`, l.gate, config.intermediateSize, h);
    matrix(`${p}.ffn_up.weight`, l.up, config.intermediateSize, h);
    matrix(`${p}.ffn_down.weight`, l.down, h, config.intermediateSize);
  });
  vector("output_norm.weight", w.finalNorm);
  if (!config.tieWordEmbeddings) matrix("output.weight", w.lmHead, config.vocabSize, h);
  return out;
}

function tokenizerMetadata(dir: string, config: ModelConfig): Record<string, Entry> {
  const tj = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
  const tc = JSON.parse(readFileSync(join(dir, "tokenizer_config.json"), "utf8"));
  const tokens: string[] = [];
  const types: number[] = [];
  for (let id = 0; id < config.vocabSize; id++) {
    tokens.push(`[PAD${id}]`);
    types.push(5);
  }
  for (const [token, id] of Object.entries(tj.model.vocab as Record<string, number>)) {
    tokens[id] = token;
    types[id] = 1;
  }
  for (const t of tj.added_tokens as { id: number; content: string; special: boolean }[]) {
    tokens[t.id] = t.content;
    types[t.id] = t.special ? 3 : 4;
  }
  const merges = (tj.model.merges as (string | string[])[]).map((m) =>
    typeof m === "string" ? m : m.join(" "),
  );
  const idOf = (text: unknown): number | undefined =>
    typeof text === "string" && tokens.includes(text) ? tokens.indexOf(text) : undefined;
  const eos = idOf(tc.eos_token) ?? config.eosTokenIds[0];
  const bos = config.bosTokenId ?? idOf(tc.bos_token);
  const meta: Record<string, Entry> = {
    "tokenizer.ggml.model": { value: "gpt2", type: GGUFValueType.STRING },
    "tokenizer.ggml.pre": { value: "gpt2", type: GGUFValueType.STRING },
    "tokenizer.ggml.tokens": { value: tokens, type: GGUFValueType.ARRAY, subType: GGUFValueType.STRING },
    "tokenizer.ggml.token_type": { value: types, type: GGUFValueType.ARRAY, subType: GGUFValueType.INT32 },
    "tokenizer.ggml.merges": { value: merges, type: GGUFValueType.ARRAY, subType: GGUFValueType.STRING },
    "tokenizer.ggml.add_bos_token": { value: tc.add_bos_token === true, type: GGUFValueType.BOOL },
  };
  if (eos !== undefined) meta["tokenizer.ggml.eos_token_id"] = { value: eos, type: GGUFValueType.UINT32 };
  if (bos !== undefined) meta["tokenizer.ggml.bos_token_id"] = { value: bos, type: GGUFValueType.UINT32 };
  if (typeof tc.chat_template === "string")
    meta["tokenizer.chat_template"] = { value: tc.chat_template, type: GGUFValueType.STRING };
  return meta;
}

/** Writes `dir` (a safetensors model folder) as a GGUF file at `path`; returns the file's byte size. */
export function writeGgufFromFolder(dir: string, path: string, options: WriteGgufOptions): number {
  const model = loadModel(dir);
  const config = model.config;
  const arch = config.architecture === "qwen2" ? "qwen2" : "llama";
  const tensors = tensorsOf(config, model.weights, options);
  const f32 = GGUFValueType.FLOAT32;
  const u32 = GGUFValueType.UINT32;
  let meta: Record<string, Entry> = {
    "general.architecture": { value: arch, type: GGUFValueType.STRING },
    "general.name": { value: model.name, type: GGUFValueType.STRING },
    [`${arch}.context_length`]: { value: config.maxPositionEmbeddings, type: u32 },
    [`${arch}.embedding_length`]: { value: config.hiddenSize, type: u32 },
    [`${arch}.block_count`]: { value: config.numLayers, type: u32 },
    [`${arch}.feed_forward_length`]: { value: config.intermediateSize, type: u32 },
    [`${arch}.attention.head_count`]: { value: config.numHeads, type: u32 },
    [`${arch}.attention.head_count_kv`]: { value: config.numKvHeads, type: u32 },
    [`${arch}.attention.key_length`]: { value: config.headDim, type: u32 },
    [`${arch}.attention.value_length`]: { value: config.headDim, type: u32 },
    [`${arch}.rope.dimension_count`]: { value: config.headDim, type: u32 },
    [`${arch}.attention.layer_norm_rms_epsilon`]: { value: config.rmsNormEps, type: f32 },
    [`${arch}.rope.freq_base`]: { value: config.ropeTheta, type: f32 },
    [`${arch}.vocab_size`]: { value: config.vocabSize, type: u32 },
    ...tokenizerMetadata(dir, config),
    ...options.extraMetadata,
  };
  for (const key of options.dropMetadata ?? []) delete meta[key];
  meta = {
    version: { value: 3, type: u32 },
    tensor_count: { value: BigInt(tensors.length), type: GGUFValueType.UINT64 },
    kv_count: { value: BigInt(Object.keys(meta).length), type: GGUFValueType.UINT64 },
    ...meta,
  };
  // Alignment 1: the metadata exactly, with no padding before the tensor table.
  const head = serializeGgufMetadata(meta as unknown as Parameters<typeof serializeGgufMetadata>[0], {
    alignment: 1,
  });
  const table: Uint8Array[] = [];
  let offset = 0;
  const offsets: number[] = [];
  for (const t of tensors) {
    offsets.push(offset);
    offset = Math.ceil((offset + t.bytes.length) / ALIGN) * ALIGN;
    const name = new TextEncoder().encode(t.name);
    const entry = new Uint8Array(8 + name.length + 4 + 8 * t.shape.length + 4 + 8);
    const dv = new DataView(entry.buffer);
    let o = 0;
    dv.setBigUint64(o, BigInt(name.length), true);
    o += 8;
    entry.set(name, o);
    o += name.length;
    dv.setUint32(o, t.shape.length, true);
    o += 4;
    for (const d of [...t.shape].reverse()) {
      dv.setBigUint64(o, BigInt(d), true);
      o += 8;
    }
    dv.setUint32(o, options.tensorTypeOverride?.[t.name] ?? t.type, true);
    o += 4;
    dv.setBigUint64(o, BigInt(offsets[offsets.length - 1] as number), true);
    table.push(entry);
  }
  const fd = openSync(path, "w");
  try {
    let at = 0;
    const write = (b: Uint8Array): void => {
      writeSync(fd, b, 0, b.length, at);
      at += b.length;
    };
    write(head);
    for (const e of table) write(e);
    const dataStart = Math.ceil(at / ALIGN) * ALIGN;
    tensors.forEach((t, i) => {
      at = dataStart + (offsets[i] as number);
      write(t.bytes);
    });
    write(new Uint8Array(Math.ceil(at / ALIGN) * ALIGN - at));
    return at;
  } finally {
    closeSync(fd);
  }
}
