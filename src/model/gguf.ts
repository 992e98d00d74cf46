/**
 * llama.cpp's GGUF files (`--model FILE.gguf`): the header parsed by `@huggingface/gguf`, turned
 * into what a Hugging Face folder gives the rest of the server — a config.json object (checked by
 * the same code as a folder's, src/model/config-loader.ts), a tokenizer.json and a
 * tokenizer_config.json with the chat template (src/tokenizer/gguf-tokenizer.ts, which also reads
 * the header) — and the tensors under their Hugging Face names, read straight from the file into
 * the memory the caller hands out (src/model/load-model.ts).
 *
 * Served: the `llama` and `qwen2` architectures, tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K
 * and Q6_K (the block layouts are llama.cpp's: 34-byte Q8_0 blocks of an f16 scale and 32 int8,
 * 18-byte Q4_0 blocks of an f16 scale and 32 nibbles, low nibbles first; the k-quants' 256-weight
 * blocks of src/kernels/k-quants.ts, so a Q4_K_M or Q5_K_M file, which mixes them with F32 norms,
 * serves as it is) and Q5_0 / Q5_1 (llama.cpp's fallback for rows that are not whole 256-blocks in
 * those files; widened exactly at load by gguf-q5.ts), and the tokenizers
 * gguf-tokenizer.ts serves. Anything else is refused with a one-line `unsupported_model` error
 * naming the architecture, tensor type or tokenizer. The tensors stay in their stored format: the
 * file is read whole (into the engines' shared memory when serving) and each matrix is a view of
 * it, widened or dequantised inside the kernels (src/kernels/weight-format.ts).
 *
 * llama.cpp's converter permutes the rows of Llama's Q and K projections (`permute` in
 * convert_hf_to_gguf.py: within each head, the two halves of the rotary dimensions are
 * interleaved, because ggml's Llama RoPE rotates adjacent pairs); the loader undoes it so the
 * weights are the Hugging Face model's and the forward pass (rotate-half RoPE) computes the same
 * numbers. Qwen2 is converted without a permutation (llama.cpp runs it with NeoX RoPE).
 */
import { basename } from "node:path";
import { decodeRange, type Matrix, type WeightDType } from "../kernels/weight-format.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import {
  endOfTurnIds,
  type GgufMetadata,
  ggufNumber,
  ggufTokenizerFiles,
  readGgufHeader,
  type TokenizerFiles,
} from "../tokenizer/gguf-tokenizer.js";
import { badModelFolder, unsupportedModel } from "../tokenizer/model-files.js";
import { Q5_BLOCK_BYTES, q5_0ToQ8_0, q5_1ToF32 } from "./gguf-q5.js";

/** Architectures served, with the Hugging Face class each stands for. */
const GGUF_ARCHITECTURES: Readonly<Record<string, string>> = {
  llama: "LlamaForCausalLM",
  qwen2: "Qwen2ForCausalLM",
};

/**
 * Tensor types served (by their `ggml_type` ids, `GGMLQuantizationType` in @huggingface/gguf), with
 * bytes per block and weights per block.
 */
const GGUF_TYPES: ReadonlyMap<number, { name: string; blockBytes: number; blockWeights: number }> = new Map([
  [0, { name: "F32", blockBytes: 4, blockWeights: 1 }],
  [1, { name: "F16", blockBytes: 2, blockWeights: 1 }],
  [30, { name: "BF16", blockBytes: 2, blockWeights: 1 }],
  [8, { name: "Q8_0", blockBytes: 34, blockWeights: 32 }],
  [2, { name: "Q4_0", blockBytes: 18, blockWeights: 32 }],
  [12, { name: "Q4_K", blockBytes: 144, blockWeights: 256 }],
  [13, { name: "Q5_K", blockBytes: 176, blockWeights: 256 }],
  [14, { name: "Q6_K", blockBytes: 210, blockWeights: 256 }],
  // Widened exactly at load (gguf-q5.ts): Q5_0 to Q8_0, Q5_1 to F32.
  [6, { name: "Q5_0", blockBytes: Q5_BLOCK_BYTES.Q5_0, blockWeights: 32 }],
  [7, { name: "Q5_1", blockBytes: Q5_BLOCK_BYTES.Q5_1, blockWeights: 32 }],
]);

const SERVED_TYPES = [...GGUF_TYPES.values()].map((t) => t.name).join(", ");

/** One tensor of a GGUF file under its Hugging Face name. */
export interface GgufTensor {
  /** Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`. */
  readonly name: string;
  /** GGUF name, e.g. `blk.0.attn_q.weight`. */
  readonly ggufName: string;
  /** Row-major shape as Hugging Face states it (GGUF lists dimensions innermost first). */
  readonly shape: readonly number[];
  /** A name of GGUF_TYPES: `F32`, `F16`, `BF16`, `Q8_0`, `Q4_0`, `Q4_K`, `Q5_K`, `Q6_K`, `Q5_0` or `Q5_1`. */
  readonly type: string;
  readonly fileOffset: number;
  readonly byteLength: number;
  /** Rows to un-permute (Llama's Q and K): the number of heads, else 0. */
  readonly unpermuteHeads: number;
}

/**
 * What a GGUF file holds, parsed: everything the server needs but the tensor bytes (the tokenizer
 * files by src/tokenizer/gguf-tokenizer.ts).
 */
export interface GgufModel extends TokenizerFiles {
  /** The file's base name without `.gguf` (the served model's name). */
  readonly name: string;
  /** A Hugging Face config.json equivalent (checked by config-loader's parseModelConfig). */
  readonly configJson: Record<string, unknown>;
  readonly tensors: readonly GgufTensor[];
}

/** Reads a GGUF file's header: its config, tokenizer and tensor table, every part checked. */
export async function readGgufModel(path: string): Promise<GgufModel> {
  const header = await readGgufHeader(path);
  const { GGMLQuantizationType } = await import("@huggingface/gguf");
  const meta = header.metadata;
  const arch = meta["general.architecture"];
  if (typeof arch !== "string" || GGUF_ARCHITECTURES[arch] === undefined) {
    throw unsupportedModel(
      path,
      `GGUF architecture ${JSON.stringify(arch ?? null)} is not served; supported: ${Object.keys(GGUF_ARCHITECTURES).join(", ")}`,
    );
  }
  const dataOffset = header.tensorDataOffset;
  const byName = new Map(header.tensorInfos.map((t) => [t.name, t]));
  const configJson = ggufConfigJson(path, arch, meta, byName);
  const numHeads = configJson.num_attention_heads as number;
  const numKvHeads = configJson.num_key_value_heads as number;
  const tensors = header.tensorInfos.map((info): GgufTensor => {
    const type = GGUF_TYPES.get(info.dtype);
    if (type === undefined) {
      const typeName = GGMLQuantizationType[info.dtype] ?? `type ${info.dtype}`;
      throw unsupportedModel(
        path,
        `tensor ${info.name} is ${typeName}; kvfence serves GGUF tensors in ${SERVED_TYPES} (requantize with llama-quantize, e.g. to Q8_0)`,
      );
    }
    const shape = info.shape.map(Number).reverse();
    const elements = shape.reduce((a, b) => a * b, 1);
    const cols = shape[shape.length - 1] ?? 1;
    if (cols % type.blockWeights !== 0) {
      throw badModelFolder(
        path,
        `tensor ${info.name} is ${type.name} with rows of ${cols} weights, not a multiple of ${type.name}'s ${type.blockWeights}-weight blocks`,
      );
    }
    const name = hfTensorName(info.name);
    let unpermuteHeads = 0;
    if (arch === "llama" && name.endsWith("self_attn.q_proj.weight")) unpermuteHeads = numHeads;
    if (arch === "llama" && name.endsWith("self_attn.k_proj.weight")) unpermuteHeads = numKvHeads;
    return {
      name,
      ggufName: info.name,
      shape,
      type: type.name,
      fileOffset: dataOffset + Number(info.offset),
      byteLength: (elements / type.blockWeights) * type.blockBytes,
      unpermuteHeads,
    };
  });
  const { tokenizerJson, tokenizerConfig } = ggufTokenizerFiles(path, meta);
  return {
    path,
    name: basename(path).replace(/\.gguf$/i, ""),
    configJson,
    tokenizerJson,
    tokenizerConfig,
    tensors,
  };
}

/** llama.cpp tensor names → Hugging Face names (unknown ones keep their GGUF name, to be refused). */
function hfTensorName(name: string): string {
  const fixed: Record<string, string> = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
  };
  const whole = fixed[name];
  if (whole !== undefined) return whole;
  const m = /^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$/.exec(name);
  if (m === null) return name;
  const parts: Record<string, string> = {
    attn_norm: "input_layernorm",
    attn_q: "self_attn.q_proj",
    attn_k: "self_attn.k_proj",
    attn_v: "self_attn.v_proj",
    attn_output: "self_attn.o_proj",
    ffn_norm: "post_attention_layernorm",
    ffn_gate: "mlp.gate_proj",
    ffn_up: "mlp.up_proj",
    ffn_down: "mlp.down_proj",
  };
  const part = parts[m[2] as string];
  return part === undefined ? name : `model.layers.${m[1]}.${part}.${m[3]}`;
}

/** The config.json a GGUF's `ARCH.*` metadata stands for. */
function ggufConfigJson(
  path: string,
  arch: string,
  meta: GgufMetadata,
  tensors: ReadonlyMap<string, { shape: bigint[] }>,
): Record<string, unknown> {
  const need = (key: string): number => {
    const v = ggufNumber(meta, `${arch}.${key}`);
    if (v === undefined) throw badModelFolder(path, `GGUF metadata ${arch}.${key} is missing`);
    return v;
  };
  const hidden = need("embedding_length");
  const numHeads = need("attention.head_count");
  const headDim = ggufNumber(meta, `${arch}.attention.key_length`) ?? hidden / numHeads;
  const ropeDims = ggufNumber(meta, `${arch}.rope.dimension_count`);
  if (ropeDims !== undefined && ropeDims !== headDim) {
    throw unsupportedModel(
      path,
      `partial RoPE (${arch}.rope.dimension_count ${ropeDims} of ${headDim}) is not implemented`,
    );
  }
  const scaling = meta[`${arch}.rope.scaling.type`];
  const experts = ggufNumber(meta, `${arch}.expert_count`) ?? 0;
  if (experts > 0)
    throw unsupportedModel(path, `mixture of experts (${arch}.expert_count ${experts}) is not implemented`);
  const embed = tensors.get("token_embd.weight");
  if (embed === undefined) throw badModelFolder(path, "tensor token_embd.weight is missing");
  const eos = [
    meta["tokenizer.ggml.eos_token_id"],
    meta["tokenizer.ggml.eot_token_id"],
    meta["tokenizer.ggml.eom_token_id"],
  ]
    .filter((v) => typeof v === "number")
    .concat(endOfTurnIds(meta));
  return {
    architectures: [GGUF_ARCHITECTURES[arch]],
    model_type: arch,
    hidden_size: hidden,
    num_attention_heads: numHeads,
    num_key_value_heads: ggufNumber(meta, `${arch}.attention.head_count_kv`) ?? numHeads,
    head_dim: headDim,
    intermediate_size: need("feed_forward_length"),
    num_hidden_layers: need("block_count"),
    rms_norm_eps: need("attention.layer_norm_rms_epsilon"),
    rope_theta: ggufNumber(meta, `${arch}.rope.freq_base`) ?? 10000,
    rope_scaling: scaling === undefined || scaling === "none" ? null : { type: scaling },
    tie_word_embeddings: !tensors.has("output.weight"),
    max_position_embeddings: need("context_length"),
    vocab_size: Number(embed.shape[1]),
    bos_token_id: ggufNumber(meta, "tokenizer.ggml.bos_token_id") ?? null,
    eos_token_id: [...new Set(eos)],
  };
}

// -----------------------------------------------------------------------------------------------
// tensor data

const DTYPES: Readonly<Record<string, WeightDType>> = {
  F32: "f32",
  F16: "f16",
  BF16: "bf16",
  Q8_0: "q8_0",
  Q4_0: "q4_0",
  Q4_K: "q4_K",
  Q5_K: "q5_K",
  Q6_K: "q6_K",
  Q5_0: "q8_0",
  Q5_1: "f32",
};

/**
 * Tensor `t` of the GGUF file held in `file` (its bytes, read whole; it may pass 4 GiB), as the weights take it: a
 * matrix in its stored format as a view of `file` (an F32 one a Float32Array), Llama's Q/K rows
 * un-permuted in place; a 1-D tensor (norm, bias) as f32, a view when it is F32 (else widened into
 * a fresh buffer, a SharedArrayBuffer when `shared`).
 */
export function ggufMatrix(file: ByteRange, t: GgufTensor, shared: boolean): Matrix {
  const elements = t.shape.reduce((a, b) => a * b, 1);
  const stored = byteView(file, t.fileOffset, t.byteLength);
  const widened =
    t.type === "Q5_0"
      ? q5_0ToQ8_0(stored, elements, shared)
      : t.type === "Q5_1"
        ? new Uint8Array(q5_1ToF32(stored, elements, shared).buffer)
        : null;
  const bytes = widened ?? stored;
  const dtype = DTYPES[t.type] as WeightDType;
  if (t.unpermuteHeads > 0) unpermuteRows(bytes, t.shape[0] as number, t.unpermuteHeads);
  const f32View = (): Float32Array | null =>
    dtype === "f32" && bytes.byteOffset % 4 === 0
      ? new Float32Array(bytes.buffer, bytes.byteOffset, elements)
      : null;
  if (t.shape.length === 2) return f32View() ?? { dtype, shape: t.shape, bytes };
  const view = f32View();
  if (view !== null) return view;
  const out = new Float32Array(shared ? new SharedArrayBuffer(4 * elements) : new ArrayBuffer(4 * elements));
  return decodeRange({ dtype, shape: t.shape, bytes }, 0, elements, out);
}

/**
 * Undoes convert_hf_to_gguf.py's `permute` on the rows (each `bytes.length / rows` bytes, in any
 * format: a row is whole blocks) of a [heads·headDim][cols] matrix: the file holds, for head h,
 * row h·hd + 2i + j = the model's row h·hd + j·hd/2 + i (i < hd/2, j ∈ {0, 1}).
 */
export function unpermuteRows(bytes: Uint8Array, rows: number, heads: number): void {
  const row = bytes.length / rows;
  const hd = rows / heads;
  const half = hd / 2;
  const head = new Uint8Array(hd * row);
  for (let h = 0; h < heads; h++) {
    const base = h * hd * row;
    head.set(bytes.subarray(base, base + hd * row));
    for (let i = 0; i < half; i++) {
      for (let j = 0; j < 2; j++) {
        const from = (2 * i + j) * row;
        bytes.set(head.subarray(from, from + row), base + (j * half + i) * row);
      }
    }
  }
}
