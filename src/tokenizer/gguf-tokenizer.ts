/**
 * The tokenizer of a llama.cpp GGUF file (`--model FILE.gguf`): its header parsed by
 * `@huggingface/gguf`, and the `tokenizer.ggml.*` metadata and `tokenizer.chat_template` turned
 * into the tokenizer.json and tokenizer_config.json a Hugging Face folder holds (tokenizer.ts reads
 * them as it reads a folder's). src/model/gguf.ts builds the rest of the file's model (its config
 * and tensors) on the same header.
 *
 * Served: the byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") with the pre-tokenizers
 * llama.cpp names gpt2/default, llama-bpe (Llama 3), qwen2 and smollm. Anything else is refused
 * with a one-line `unsupported_model` error naming the tokenizer.
 */
import type { GGUFTensorInfo } from "@huggingface/gguf";
import { badModelFolder, unsupportedModel } from "./model-files.js";
import { addedToken, bpeTokenizerJson, byteLevel } from "./tokenizer-json.js";

/** GGUF token types (llama.cpp's `llama_token_type`). */
const TOKEN_CONTROL = 3;
const TOKEN_USER_DEFINED = 4;

/** A GGUF file's metadata: its key → value table. */
export type GgufMetadata = Readonly<Record<string, unknown>>;

/** A GGUF file's header: its metadata and tensor table, not the tensors' bytes. */
export interface GgufHeader {
  readonly metadata: GgufMetadata;
  readonly tensorInfos: readonly GGUFTensorInfo[];
  /** Where the tensors' data starts in the file. */
  readonly tensorDataOffset: number;
}

/** A tokenizer.json and tokenizer_config.json equivalent, and the file they came from. */
export interface TokenizerFiles {
  readonly path: string;
  /** A tokenizer.json equivalent for `@huggingface/tokenizers`. */
  readonly tokenizerJson: Record<string, unknown>;
  /** A tokenizer_config.json equivalent (bos/eos text, the chat template). */
  readonly tokenizerConfig: Record<string, unknown>;
}

export function isGgufPath(path: string): boolean {
  return path.toLowerCase().endsWith(".gguf");
}

/**
 * Parses a GGUF file's header (metadata and tensor table) with `@huggingface/gguf`, imported on
 * first use (with its dependency it costs each thread about 12 MB, which a folder never needs).
 */
export async function readGgufHeader(path: string): Promise<GgufHeader> {
  const { gguf } = await import("@huggingface/gguf");
  let parsed: Awaited<ReturnType<typeof gguf>>;
  try {
    parsed = await gguf(path, { allowLocalFile: true });
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ENOENT") throw badModelFolder(path, "file is missing", err);
    throw badModelFolder(path, `not a readable GGUF file: ${(err as Error).message}`, err);
  }
  return {
    metadata: parsed.metadata as unknown as GgufMetadata,
    tensorInfos: parsed.tensorInfos,
    tensorDataOffset: Number(parsed.tensorDataOffset),
  };
}

/** The tokenizer files of the GGUF file at `path`, read from its header alone. */
export async function readGgufTokenizerFiles(path: string): Promise<TokenizerFiles> {
  return ggufTokenizerFiles(path, (await readGgufHeader(path)).metadata);
}

export function ggufNumber(meta: GgufMetadata, key: string): number | undefined {
  const v = meta[key];
  if (typeof v === "number") return v;
  if (typeof v === "bigint") return Number(v);
  return undefined;
}

/** Control tokens that end a turn by their text, as llama.cpp's end-of-generation set has them. */
export function endOfTurnIds(meta: GgufMetadata): number[] {
  const tokens = meta["tokenizer.ggml.tokens"];
  const types = meta["tokenizer.ggml.token_type"];
  if (!Array.isArray(tokens) || !Array.isArray(types)) return [];
  const ends = ["<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<|eom_id|>", "<end_of_turn>"];
  const out: number[] = [];
  for (const text of ends) {
    const id = tokens.indexOf(text);
    if (id >= 0 && types[id] === TOKEN_CONTROL) out.push(id);
  }
  return out;
}

/**
 * llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) as Hugging Face pre_tokenizer objects: the
 * regexes are llama.cpp's (llama-vocab.cpp), spelled without inline `(?i:` groups.
 */
const LLAMA3_SPLIT =
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_SPLIT =
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const splitThenBytes = (regex: string) => ({
  type: "Sequence",
  pretokenizers: [
    { type: "Split", pattern: { Regex: regex }, behavior: "Isolated", invert: false },
    byteLevel(false),
  ],
});
const PRE_TOKENIZERS: Readonly<Record<string, { pre: unknown; ignoreMerges: boolean }>> = {
  default: { pre: byteLevel(true), ignoreMerges: false },
  gpt2: { pre: byteLevel(true), ignoreMerges: false },
  "llama-bpe": { pre: splitThenBytes(LLAMA3_SPLIT), ignoreMerges: true },
  llama3: { pre: splitThenBytes(LLAMA3_SPLIT), ignoreMerges: true },
  qwen2: { pre: splitThenBytes(QWEN2_SPLIT), ignoreMerges: false },
  smollm: {
    pre: { type: "Sequence", pretokenizers: [{ type: "Digits", individual_digits: true }, byteLevel(true)] },
    ignoreMerges: false,
  },
};

function stringArray(path: string, meta: GgufMetadata, key: string): string[] {
  const v = meta[key];
  if (!Array.isArray(v) || !v.every((s) => typeof s === "string"))
    throw badModelFolder(path, `GGUF metadata ${key} is missing or not a list of strings`);
  return v as string[];
}

/** tokenizer.json and tokenizer_config.json from `tokenizer.ggml.*` and `tokenizer.chat_template`. */
export function ggufTokenizerFiles(path: string, meta: GgufMetadata): TokenizerFiles {
  const model = meta["tokenizer.ggml.model"];
  if (model !== "gpt2") {
    throw unsupportedModel(
      path,
      `GGUF tokenizer ${JSON.stringify(model ?? null)} is not served; supported: "gpt2" (byte-level BPE)`,
    );
  }
  const preName =
    typeof meta["tokenizer.ggml.pre"] === "string" ? (meta["tokenizer.ggml.pre"] as string) : "default";
  const pre = PRE_TOKENIZERS[preName];
  if (pre === undefined) {
    throw unsupportedModel(
      path,
      `GGUF pre-tokenizer ${JSON.stringify(preName)} is not served; supported: ${Object.keys(PRE_TOKENIZERS).join(", ")}`,
    );
  }
  const tokens = stringArray(path, meta, "tokenizer.ggml.tokens");
  const merges =
    meta["tokenizer.ggml.merges"] === undefined ? [] : stringArray(path, meta, "tokenizer.ggml.merges");
  const types = meta["tokenizer.ggml.token_type"];
  const vocab: Record<string, number> = {};
  const added: Record<string, unknown>[] = [];
  tokens.forEach((token, id) => {
    if (!Object.hasOwn(vocab, token)) vocab[token] = id;
    const type = Array.isArray(types) ? types[id] : undefined;
    if (type === TOKEN_CONTROL || type === TOKEN_USER_DEFINED) {
      added.push(addedToken(id, token, type === TOKEN_CONTROL));
    }
  });
  const text = (key: string): string | null => {
    const id = ggufNumber(meta, key);
    return id === undefined ? null : (tokens[id] ?? null);
  };
  const bos = text("tokenizer.ggml.bos_token_id");
  const addBos = meta["tokenizer.ggml.add_bos_token"] === true && bos !== null;
  const bosId = ggufNumber(meta, "tokenizer.ggml.bos_token_id");
  const tokenizerJson = bpeTokenizerJson({
    vocab,
    merges,
    addedTokens: added,
    preTokenizer: pre.pre,
    postProcessor: addBos
      ? {
          type: "TemplateProcessing",
          single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
          pair: [
            { SpecialToken: { id: bos, type_id: 0 } },
            { Sequence: { id: "A", type_id: 0 } },
            { Sequence: { id: "B", type_id: 1 } },
          ],
          special_tokens: { [bos as string]: { id: bos, ids: [bosId], tokens: [bos] } },
        }
      : null,
    decoder: byteLevel(true),
    ignoreMerges: pre.ignoreMerges,
  });
  const template = meta["tokenizer.chat_template"];
  const tokenizerConfig = {
    bos_token: bos,
    eos_token: text("tokenizer.ggml.eos_token_id"),
    add_bos_token: addBos,
    ...(typeof template === "string" ? { chat_template: template } : {}),
  };
  return { path, tokenizerJson, tokenizerConfig };
}
