/**
 * Writes random-weight model folders with the exact shapes of a known model, for benchmarks
 * (`kvfence gen-model --like smollm2-135m`) and tests.
 *
 * The folder is a complete Hugging Face-style Llama folder: config.json, generation_config.json, a
 * byte-level BPE tokenizer.json with ChatML special tokens, tokenizer_config.json with a ChatML
 * chat template, and model.safetensors in f32 (or f16/bf16 with `dtype`, rounded to nearest even). Every tensor gets its own data from one seeded
 * xorshift32 stream (splitmix32-seeded per tensor): linear weights uniform with std 0.02, norms
 * 1 ± 0.05, biases std 0.02. The tokenizer is the one of kvfence-tiny and tiny-qwen2
 * (scripts/tokenizer_files.py): ids 0–255 are the bytes, 256–258 `<|endoftext|>`, `<|im_start|>`,
 * `<|im_end|>`; then filler tokens (" a", " b", ..., " zz", ...) up to the config's vocabulary, so
 * every id decodes to readable text even though nothing was trained.
 */
import { closeSync, mkdirSync, openSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { KvfenceError } from "../lib/errors.js";
import { BYTE_TO_CHAR } from "../tokenizer/tokenizer.js";
import { addedToken, bpeTokenizerJson, byteLevel } from "../tokenizer/tokenizer-json.js";
import { expectedTensors } from "./load-model.js";
import type { ModelConfig } from "./model-config.js";
import { encodeTensorData, safetensorsHeader, writeAllSync } from "./safetensors.js";

/** Shapes of a Llama-family model, as config.json states them. */
export interface ModelShape {
  readonly hiddenSize: number;
  readonly numLayers: number;
  readonly numHeads: number;
  readonly numKvHeads: number;
  readonly headDim: number;
  readonly intermediateSize: number;
  readonly vocabSize: number;
  readonly tieWordEmbeddings: boolean;
  readonly ropeTheta: number;
  readonly maxPositionEmbeddings: number;
  readonly rmsNormEps: number;
}

/** Models `gen-model --like` can imitate. `tiny` is a small shape for tests. */
export const MODEL_SHAPES: Readonly<Record<string, ModelShape>> = {
  "smollm2-135m": {
    hiddenSize: 576,
    numLayers: 30,
    numHeads: 9,
    numKvHeads: 3,
    headDim: 64,
    intermediateSize: 1536,
    vocabSize: 49152,
    tieWordEmbeddings: true,
    ropeTheta: 100000,
    maxPositionEmbeddings: 8192,
    rmsNormEps: 1e-5,
  },
  // SmolLM2-1.7B's config.json: 1.71 B parameters, 3.42 GB in bf16.
  "smollm2-1.7b": {
    hiddenSize: 2048,
    numLayers: 24,
    numHeads: 32,
    numKvHeads: 32,
    headDim: 64,
    intermediateSize: 8192,
    vocabSize: 49152,
    tieWordEmbeddings: true,
    ropeTheta: 130000,
    maxPositionEmbeddings: 8192,
    rmsNormEps: 1e-5,
  },
  // Llama-3.2-3B's config.json (its rope_scaling left out): 3.21 B parameters, 6.43 GB in bf16 —
  // past what a wasm32 memory addresses (issue #33 item 4).
  "llama-3.2-3b": {
    hiddenSize: 3072,
    numLayers: 28,
    numHeads: 24,
    numKvHeads: 8,
    headDim: 128,
    intermediateSize: 8192,
    vocabSize: 128256,
    tieWordEmbeddings: true,
    ropeTheta: 500000,
    maxPositionEmbeddings: 131072,
    rmsNormEps: 1e-5,
  },
  tiny: {
    hiddenSize: 64,
    numLayers: 2,
    numHeads: 4,
    numKvHeads: 2,
    headDim: 16,
    intermediateSize: 128,
    vocabSize: 512,
    tieWordEmbeddings: true,
    ropeTheta: 10000,
    maxPositionEmbeddings: 1024,
    rmsNormEps: 1e-5,
  },
};

export const SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] as const;
/** Id of the first special token (the 256 byte tokens come first). */
export const FIRST_SPECIAL_ID = 256;
/** Number of ids before the filler tokens: the 256 byte tokens and the specials. */
export const BYTE_TOKENIZER_BASE = 256 + SPECIAL_TOKENS.length;

/**
 * ChatML, as used by SmolLM2-Instruct and kvfence-tiny, with tools in Qwen2.5's prompt format
 * (issue #34): the `tools` variable listed in the system turn inside `<tools></tools>`, earlier
 * calls as `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks (arguments a mapping or a
 * string), tool results as `<tool_response>` blocks of one user turn. Without tools it renders
 * exactly as plain ChatML; the `<tool_call>` marker names the `hermes` parser (tool-call-parser.ts).
 */
export const CHATML_TEMPLATE =
  "{%- if tools %}{{- '<|im_start|>system\\n' }}" +
  "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}" +
  "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}" +
  "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}" +
  '{{- \'\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}' +
  "{%- endif %}" +
  "{%- for message in messages %}" +
  "{%- if tools and loop.first and message['role'] == 'system' %}" +
  "{%- elif message['role'] == 'assistant' and message.tool_calls %}" +
  "{{- '<|im_start|>assistant\\n' + message['content'] }}" +
  "{%- for call in message.tool_calls %}" +
  "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}" +
  '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}' +
  "{%- if call.function.arguments is string %}{{- call.function.arguments }}{%- else %}{{- call.function.arguments | tojson }}{%- endif %}" +
  "{{- '}\\n</tool_call>' }}" +
  "{%- endfor %}{{- '<|im_end|>\\n' }}" +
  "{%- elif message['role'] == 'tool' %}" +
  "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}" +
  "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}" +
  "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}" +
  "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}" +
  "{%- endif %}{%- endfor %}" +
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/** config.json of a Llama model with `shape`. */
export function llamaConfigJson(shape: ModelShape): Record<string, unknown> {
  return {
    architectures: ["LlamaForCausalLM"],
    model_type: "llama",
    hidden_size: shape.hiddenSize,
    num_hidden_layers: shape.numLayers,
    num_attention_heads: shape.numHeads,
    num_key_value_heads: shape.numKvHeads,
    head_dim: shape.headDim,
    intermediate_size: shape.intermediateSize,
    vocab_size: shape.vocabSize,
    tie_word_embeddings: shape.tieWordEmbeddings,
    rope_theta: shape.ropeTheta,
    rope_scaling: null,
    max_position_embeddings: shape.maxPositionEmbeddings,
    rms_norm_eps: shape.rmsNormEps,
    hidden_act: "silu",
    attention_bias: false,
    mlp_bias: false,
    bos_token_id: 256,
    eos_token_id: 258,
    pad_token_id: 256,
    torch_dtype: "float32",
  };
}

function fillerToken(index: number): string {
  let s = "";
  let n = index;
  do {
    s = String.fromCharCode(97 + (n % 26)) + s;
    n = Math.floor(n / 26) - 1;
  } while (n >= 0);
  return `Ġ${s}`;
}

/**
 * A byte-level BPE tokenizer.json: ids 0–255 are the bytes (id = byte value), 256–258 are
 * `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, then filler tokens up to `vocabSize` (which must be
 * at least 259). There are no merges, so text encodes one token per byte.
 */
export function byteLevelTokenizerJson(vocabSize: number): Record<string, unknown> {
  if (vocabSize < BYTE_TOKENIZER_BASE)
    throw new KvfenceError(
      "invalid_request",
      `Vocabulary must hold at least ${BYTE_TOKENIZER_BASE} tokens: ${vocabSize}`,
    );
  const vocab: Record<string, number> = {};
  for (let b = 0; b < 256; b++) vocab[BYTE_TO_CHAR[b] as string] = b;
  for (let id = BYTE_TOKENIZER_BASE; id < vocabSize; id++) vocab[fillerToken(id - BYTE_TOKENIZER_BASE)] = id;
  return bpeTokenizerJson({
    vocab,
    merges: [],
    addedTokens: SPECIAL_TOKENS.map((content, i) => addedToken(FIRST_SPECIAL_ID + i, content, true)),
    preTokenizer: byteLevel(false),
    postProcessor: null,
    decoder: byteLevel(false),
    ignoreMerges: false,
  });
}

/** tokenizer_config.json for the byte-level ChatML tokenizer (as kvfence-tiny's). */
export function chatmlTokenizerConfig(modelMaxLength = 2048): Record<string, unknown> {
  return {
    tokenizer_class: "PreTrainedTokenizerFast",
    added_tokens_decoder: Object.fromEntries(
      SPECIAL_TOKENS.map((content, i) => [
        String(FIRST_SPECIAL_ID + i),
        { content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true },
      ]),
    ),
    additional_special_tokens: ["<|im_start|>", "<|im_end|>"],
    bos_token: null,
    eos_token: "<|im_end|>",
    pad_token: "<|endoftext|>",
    unk_token: null,
    add_bos_token: false,
    add_eos_token: false,
    clean_up_tokenization_spaces: false,
    model_max_length: modelMaxLength,
    chat_template: CHATML_TEMPLATE,
  };
}

/** generation_config.json for generated models: greedy, ends at <|im_end|> or <|endoftext|>. */
export function generationConfigJson(): Record<string, unknown> {
  return {
    bos_token_id: 256,
    eos_token_id: [258, 256],
    pad_token_id: 256,
    do_sample: false,
    max_new_tokens: 256,
  };
}

/** The ModelConfig a shape implies (Llama, no biases). */
export function shapeToConfig(shape: ModelShape): ModelConfig {
  return {
    architecture: "llama",
    hiddenSize: shape.hiddenSize,
    numHeads: shape.numHeads,
    numKvHeads: shape.numKvHeads,
    headDim: shape.headDim,
    intermediateSize: shape.intermediateSize,
    numLayers: shape.numLayers,
    rmsNormEps: shape.rmsNormEps,
    ropeTheta: shape.ropeTheta,
    tieWordEmbeddings: shape.tieWordEmbeddings,
    attentionBias: false,
    maxPositionEmbeddings: shape.maxPositionEmbeddings,
    vocabSize: shape.vocabSize,
    bosTokenId: 256,
    eosTokenIds: [258, 256],
  };
}

/** splitmix32: turns (seed, stream) into a well-mixed nonzero 32-bit state. */
export function splitmix32(seed: number, stream: number): number {
  let z = (Math.imul(seed | 0, 0x9e3779b9) + Math.imul(stream + 1, 0x85ebca6b)) | 0;
  z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
  z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
  z ^= z >>> 16;
  return z === 0 ? 0x6d2b79f5 : z;
}

/** Where a random fill comes from (splitmix32 of `seed` and `stream`) and what it looks like. */
export interface RandomFill {
  readonly seed: number;
  readonly stream: number;
  readonly mean: number;
  readonly std: number;
}

/**
 * Fills `out` with uniform values of mean `mean` and standard deviation `std` from an xorshift32
 * stream seeded by splitmix32(seed, stream).
 */
export function fillRandom(out: Float32Array, { seed, stream, mean, std }: RandomFill): void {
  let x = splitmix32(seed, stream);
  // Uniform on [-a, a) has std a/√3.
  const scale = (2 * std * Math.sqrt(3)) / 4294967296;
  const offset = mean - std * Math.sqrt(3);
  const n = out.length;
  for (let i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    out[i] = (x >>> 0) * scale + offset;
  }
}

export interface GenModelOptions {
  /** A key of MODEL_SHAPES. */
  readonly like: string;
  readonly seed: number;
  /** Format of the weights: F32 (default), F16 or BF16 (norms too, as a Hugging Face checkpoint). */
  readonly dtype?: "F32" | "F16" | "BF16";
  /** Called after each tensor is written. */
  readonly onProgress?: (bytesWritten: number, totalBytes: number) => void;
}

/** Writes a random-weight model folder to `dir` (created if needed); returns the bytes of model.safetensors. */
export function genModel(dir: string, options: GenModelOptions): { bytes: number } {
  const shape = MODEL_SHAPES[options.like];
  if (shape === undefined) {
    throw new KvfenceError(
      "invalid_request",
      `Unknown model to imitate: ${options.like}; choose one of ${Object.keys(MODEL_SHAPES).join(", ")}`,
      {
        param: "like",
      },
    );
  }
  if (!Number.isSafeInteger(options.seed))
    throw new KvfenceError("invalid_request", `Seed must be an integer: ${options.seed}`, { param: "seed" });
  try {
    mkdirSync(dir, { recursive: true });
  } catch (err) {
    throw new KvfenceError(
      "invalid_request",
      `Cannot create the model folder, pick a writable path: ${dir}: ${(err as Error).message}`,
      {
        cause: err,
      },
    );
  }
  const writeJson = (name: string, value: unknown) =>
    writeFileSync(join(dir, name), `${JSON.stringify(value, null, 2)}\n`);
  writeJson("config.json", llamaConfigJson(shape));
  writeJson("generation_config.json", generationConfigJson());
  writeJson("tokenizer.json", byteLevelTokenizerJson(shape.vocabSize));
  writeJson("tokenizer_config.json", chatmlTokenizerConfig(shape.maxPositionEmbeddings));

  const tensors = [...expectedTensors(shapeToConfig(shape))].map(([name, dims]) => ({
    name,
    shape: dims,
    dtype: options.dtype ?? "F32",
  }));
  const { header, dataBytes } = safetensorsHeader(tensors, {
    format: "pt",
    generator: `kvfence gen-model --like ${options.like} --seed ${options.seed} --dtype ${(options.dtype ?? "F32").toLowerCase()}`,
  });
  const totalBytes = header.byteLength + dataBytes;
  const fd = openSync(join(dir, "model.safetensors"), "w");
  try {
    writeAllSync(fd, header);
    let written = header.byteLength;
    let largest = 0;
    for (const t of tensors)
      largest = Math.max(
        largest,
        t.shape.reduce((a, b) => a * b, 1),
      );
    const scratch = new Float32Array(largest);
    tensors.forEach((t, index) => {
      const data = scratch.subarray(
        0,
        t.shape.reduce((a, b) => a * b, 1),
      );
      if (t.name.endsWith("norm.weight"))
        fillRandom(data, { seed: options.seed, stream: index, mean: 1, std: 0.05 });
      else fillRandom(data, { seed: options.seed, stream: index, mean: 0, std: 0.02 });
      const bytes = encodeTensorData(data, options.dtype ?? "F32");
      writeAllSync(fd, bytes);
      written += bytes.byteLength;
      options.onProgress?.(written, totalBytes);
    });
  } finally {
    closeSync(fd);
  }
  return { bytes: totalBytes };
}
