/**
 * Tokenizer and chat template of a Hugging Face model folder or a GGUF file: a model's text side.
 * This folder (src/tokenizer/) reads nothing of a model's weights and runs no forward pass, so the
 * router, which tokenizes only, may import it; src/model builds on it.
 *
 * `ModelTokenizer` wraps `@huggingface/tokenizers` (tokenizer.json + tokenizer_config.json) with an
 * Int32Array API and a streaming detokenizer. Byte-level BPE tokens can split a multibyte UTF-8
 * character across tokens, so streaming decodes each token to its raw bytes and feeds them to a
 * streaming `TextDecoder`, which holds an incomplete character until its last byte arrives. For
 * other decoders (SentencePiece byte fallback, Metaspace, ...) the stream decoder re-decodes a
 * short window of recent ids and emits only the new text, holding it while it ends in U+FFFD.
 *
 * `ChatTemplate` renders tokenizer_config.json's `chat_template` (or `chat_template.jinja`) with
 * `@huggingface/jinja`. Special tokens in the rendered text (`<|im_start|>`, ...) are added tokens
 * of the tokenizer, so encoding the text yields their special ids.
 */
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";
import { KvfenceError } from "../lib/errors.js";
import { isGgufPath, readGgufTokenizerFiles, type TokenizerFiles } from "./gguf-tokenizer.js";
import { badModelFolder, readJsonFile } from "./model-files.js";

/** GPT-2's byte ↔ printable-character map used by byte-level BPE vocabularies. */
export const BYTE_TO_CHAR: readonly string[] = (() => {
  const keep: number[] = [];
  for (let b = 33; b <= 126; b++) keep.push(b);
  for (let b = 161; b <= 172; b++) keep.push(b);
  for (let b = 174; b <= 255; b++) keep.push(b);
  const table: string[] = new Array(256);
  let extra = 0;
  for (let b = 0; b < 256; b++) table[b] = String.fromCharCode(keep.includes(b) ? b : 256 + extra++);
  return table;
})();

/** The inverse of BYTE_TO_CHAR by UTF-16 code unit (its characters are U+0000–U+0143); -1 for any other. */
const CODE_TO_BYTE: Int16Array = (() => {
  const table = new Int16Array(512).fill(-1);
  BYTE_TO_CHAR.forEach((c, b) => {
    table[c.charCodeAt(0)] = b;
  });
  return table;
})();
const EMPTY_BYTES = new Uint8Array(0);
/** Decodes one token's bytes alone (never streaming, so it holds no state between calls). */
const PIECE_DECODER = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

interface TokenizerJson {
  decoder?: { type?: string } | null;
  pre_tokenizer?: unknown;
  normalizer?: unknown;
}

interface TokenizerConfigJson {
  bos_token?: unknown;
  eos_token?: unknown;
  chat_template?: unknown;
}

function tokenContent(value: unknown): string | null {
  if (typeof value === "string") return value;
  if (
    typeof value === "object" &&
    value !== null &&
    typeof (value as { content?: unknown }).content === "string"
  ) {
    return (value as { content: string }).content;
  }
  return null;
}

/** A model's tokenizer: encode to Int32Array, decode, and stream-decode token by token. */
export class ModelTokenizer {
  readonly bosToken: string | null;
  readonly eosToken: string | null;
  /** tokenizer.json's `decoder` (how ids become text: `ByteLevel`, a `Sequence` with `ByteFallback`, ...). */
  readonly decoderJson: unknown;
  /** tokenizer.json's `pre_tokenizer` and `normalizer` (where a SentencePiece model prepends its space). */
  readonly preTokenizerJson: unknown;
  readonly normalizerJson: unknown;
  readonly #tokenizer: Tokenizer;
  readonly #byteLevel: boolean;
  readonly #specialIds: ReadonlySet<number>;
  readonly #addedIds: ReadonlySet<number>;
  #packed: { readonly bytes: Uint8Array; readonly offsets: Uint32Array } | undefined;
  readonly #encoder = new TextEncoder();

  /** Builds a tokenizer from parsed tokenizer.json and tokenizer_config.json; `label` names them in errors. */
  constructor(tokenizerJson: unknown, tokenizerConfig: unknown, options?: { label?: string }) {
    const label = options?.label ?? "tokenizer.json";
    const config = (
      typeof tokenizerConfig === "object" && tokenizerConfig !== null ? tokenizerConfig : {}
    ) as TokenizerConfigJson;
    try {
      this.#tokenizer = new Tokenizer(tokenizerJson as object, config);
    } catch (err) {
      throw badModelFolder(label, `cannot build the tokenizer: ${(err as Error).message}`, err);
    }
    this.#byteLevel = (tokenizerJson as TokenizerJson).decoder?.type === "ByteLevel";
    this.decoderJson = (tokenizerJson as TokenizerJson).decoder ?? null;
    this.preTokenizerJson = (tokenizerJson as TokenizerJson).pre_tokenizer ?? null;
    this.normalizerJson = (tokenizerJson as TokenizerJson).normalizer ?? null;
    this.bosToken = tokenContent(config.bos_token);
    this.eosToken = tokenContent(config.eos_token);
    const special = new Set<number>();
    const added = new Set<number>();
    for (const [id, token] of this.#tokenizer.get_added_tokens_decoder()) {
      added.add(id);
      if (token.special) special.add(id);
    }
    this.#specialIds = special;
    this.#addedIds = added;
  }

  /** Loads `DIR/tokenizer.json` (required) and `DIR/tokenizer_config.json` (optional). */
  static fromFolder(dir: string): ModelTokenizer {
    const path = join(dir, "tokenizer.json");
    const json = readJsonFile(path);
    const config = readJsonFile(join(dir, "tokenizer_config.json"), { optional: true }) ?? {};
    return new ModelTokenizer(json, config, { label: path });
  }

  /**
   * Token ids of `text`. `addSpecialTokens` (default true) applies the tokenizer's post-processor
   * (e.g. a BOS); pass false for text rendered by a chat template, which already carries them.
   */
  encode(text: string, options?: { addSpecialTokens?: boolean }): Int32Array {
    return Int32Array.from(
      this.#tokenizer.encode(text, { add_special_tokens: options?.addSpecialTokens ?? true }).ids,
    );
  }

  /** Text of `ids`; special tokens are dropped unless `skipSpecialTokens` is false. */
  decode(ids: ArrayLike<number>, options?: { skipSpecialTokens?: boolean }): string {
    const list = Array.from(ids).filter((id) => this.#tokenizer.id_to_token(id) !== undefined);
    if (list.length === 0) return "";
    return this.#tokenizer.decode(list, { skip_special_tokens: options?.skipSpecialTokens ?? true });
  }

  /**
   * One more than the largest token id (model vocabulary plus added tokens): the length of the
   * tokenizer's id → token array, which `get_vocab(true)` walks (its largest id is the last index;
   * copying it into a map took ~40 ms of a worker's start for a 49k vocabulary).
   */
  get numIds(): number {
    return this.#tokenizer.model?.vocab.length ?? 0;
  }

  /** Every token's string as the vocabulary spells it (byte-level or SentencePiece pieces), by id ("" for an unused id). */
  vocabulary(): string[] {
    const list: string[] = new Array(this.numIds).fill("");
    for (const [token, id] of this.#tokenizer.get_vocab(true)) list[id] = token;
    return list;
  }

  /** The id of a token string (e.g. "<|im_end|>"), or undefined. */
  tokenId(token: string): number | undefined {
    return this.#tokenizer.token_to_id(token);
  }

  isSpecial(id: number): boolean {
    return this.#specialIds.has(id);
  }

  /**
   * One token's own bytes and text (its bytes decoded alone, U+FFFD for part of a character), for
   * log-probabilities; special tokens included.
   */
  tokenPiece(id: number): { text: string; bytes: Uint8Array } {
    const bytes = this.#byteLevel
      ? this.tokenBytes(id, false)
      : new TextEncoder().encode(this.decode([id], { skipSpecialTokens: false }));
    return pieceOf(bytes);
  }

  /** Whether ids decode to their tokens' raw bytes (tokenizer.json's decoder is `ByteLevel`). */
  get byteLevel(): boolean {
    return this.#byteLevel;
  }

  /** A fresh incremental detokenizer (one per generated sequence). */
  streamDecoder(options?: { skipSpecialTokens?: boolean }): StreamDecoder {
    const skip = options?.skipSpecialTokens ?? true;
    return this.#byteLevel ? new ByteLevelStreamDecoder(this, skip) : new WindowStreamDecoder(this, skip);
  }

  /** Raw bytes of one byte-level token ("" for special tokens when skipped and unknown ids). */
  tokenBytes(id: number, skipSpecialTokens: boolean): Uint8Array {
    return packedToken(this.packedTokenBytes(), this.#specialIds, id, skipSpecialTokens);
  }

  /**
   * Every id's raw bytes back to back (an added token's as its UTF-8 text; id `i`'s from
   * `offsets[i]` to `offsets[i + 1]`), made in one pass when first needed: a Uint8Array a token
   * took ~80 ms for a 49k vocabulary on a preparation worker's path to ready (token-table.ts).
   */
  packedTokenBytes(): { readonly bytes: Uint8Array; readonly offsets: Uint32Array } {
    if (this.#packed !== undefined) return this.#packed;
    const numIds = this.numIds;
    const tokens = new Array<string | undefined>(numIds);
    let capacity = 0;
    for (let id = 0; id < numIds; id++) {
      const token = this.#tokenizer.id_to_token(id);
      tokens[id] = token;
      // UTF-8 takes at most 3 bytes a UTF-16 code unit; a byte-level character is one byte.
      if (token !== undefined) capacity += this.#addedIds.has(id) ? 3 * token.length : token.length;
    }
    const bytes = new Uint8Array(capacity);
    const offsets = new Uint32Array(numIds + 1);
    let at = 0;
    for (let id = 0; id < numIds; id++) {
      const token = tokens[id];
      if (token !== undefined && this.#addedIds.has(id))
        at += this.#encoder.encodeInto(token, bytes.subarray(at)).written;
      else if (token !== undefined)
        for (let i = 0; i < token.length; i++) {
          // Characters outside the byte map (none in a byte-level vocabulary) are skipped.
          const c = token.charCodeAt(i);
          const b = c < CODE_TO_BYTE.length ? (CODE_TO_BYTE[c] as number) : -1;
          if (b >= 0) bytes[at++] = b;
        }
      offsets[id + 1] = at;
    }
    this.#packed = { bytes: bytes.subarray(0, at), offsets };
    return this.#packed;
  }
}

/** Turns generated ids into text pieces, never emitting half a UTF-8 character. */
export interface StreamDecoder {
  /** Text completed by this token (often "", while a character is incomplete). */
  push(id: number): string;
  /** Whatever is still held at the end of the sequence (incomplete bytes become U+FFFD). */
  flush(): string;
}

/**
 * Id `id`'s bytes in a vocabulary packed as `ModelTokenizer.packedTokenBytes` gives it ("" for an
 * unknown id, and for a special one when skipped); the table's reader too (token-table.ts).
 */
export function packedToken(
  packed: { readonly bytes: Uint8Array; readonly offsets: Uint32Array },
  specialIds: ReadonlySet<number>,
  id: number,
  skipSpecialTokens: boolean,
): Uint8Array {
  const { bytes, offsets } = packed;
  if (!Number.isInteger(id) || id < 0 || id >= offsets.length - 1) return EMPTY_BYTES;
  if (skipSpecialTokens && specialIds.has(id)) return EMPTY_BYTES;
  return bytes.subarray(offsets[id], offsets[id + 1]);
}

/** A token's piece for log-probabilities: its bytes and their text decoded alone. */
export function pieceOf(bytes: Uint8Array): { text: string; bytes: Uint8Array } {
  return { text: PIECE_DECODER.decode(bytes), bytes };
}

/** Streams a byte-level vocabulary's tokens: each token's raw bytes into one streaming `TextDecoder`. */
export class ByteLevelStreamDecoder implements StreamDecoder {
  readonly #tokenizer: Pick<ModelTokenizer, "tokenBytes">;
  readonly #skip: boolean;
  readonly #decoder = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

  constructor(tokenizer: Pick<ModelTokenizer, "tokenBytes">, skip: boolean) {
    this.#tokenizer = tokenizer;
    this.#skip = skip;
  }

  push(id: number): string {
    return this.#decoder.decode(this.#tokenizer.tokenBytes(id, this.#skip), { stream: true });
  }

  flush(): string {
    return this.#decoder.decode();
  }
}

/** Generic fallback: decode a window of recent ids and emit the new suffix (vLLM/TGI style). */
class WindowStreamDecoder implements StreamDecoder {
  readonly #tokenizer: ModelTokenizer;
  readonly #skip: boolean;
  readonly #ids: number[] = [];
  #prefixOffset = 0;
  #readOffset = 0;

  constructor(tokenizer: ModelTokenizer, skip: boolean) {
    this.#tokenizer = tokenizer;
    this.#skip = skip;
  }

  push(id: number): string {
    this.#ids.push(id);
    const options = { skipSpecialTokens: this.#skip };
    const prefix = this.#tokenizer.decode(this.#ids.slice(this.#prefixOffset, this.#readOffset), options);
    const text = this.#tokenizer.decode(this.#ids.slice(this.#prefixOffset), options);
    if (text.length > prefix.length && !text.endsWith("\uFFFD")) {
      this.#prefixOffset = this.#readOffset;
      this.#readOffset = this.#ids.length;
      // Keep the window short: drop ids that can no longer affect the text.
      if (this.#prefixOffset > 64) {
        this.#ids.splice(0, this.#prefixOffset);
        this.#readOffset -= this.#prefixOffset;
        this.#prefixOffset = 0;
      }
      return text.slice(prefix.length);
    }
    return "";
  }

  flush(): string {
    const options = { skipSpecialTokens: this.#skip };
    const prefix = this.#tokenizer.decode(this.#ids.slice(this.#prefixOffset, this.#readOffset), options);
    const text = this.#tokenizer.decode(this.#ids.slice(this.#prefixOffset), options);
    this.#prefixOffset = this.#readOffset = this.#ids.length;
    return text.length > prefix.length ? text.slice(prefix.length) : "";
  }
}

export interface ChatMessage {
  readonly role: string;
  readonly content: string;
  /** An assistant's tool calls (OpenAI's shape, each call's arguments a mapping when JSON). */
  readonly tool_calls?: readonly object[];
  /** A tool message: the call it answers, and the function's name. */
  readonly tool_call_id?: string;
  readonly name?: string;
}

/** A message as templates read it: role and content, and the tool fields only when present. */
function templateMessage(m: ChatMessage): Record<string, unknown> {
  const out: Record<string, unknown> = { role: m.role, content: m.content };
  if (m.tool_calls !== undefined) out.tool_calls = m.tool_calls;
  if (m.tool_call_id !== undefined) out.tool_call_id = m.tool_call_id;
  if (m.name !== undefined) out.name = m.name;
  return out;
}

/** A chat template from tokenizer_config.json, parsed once. */
export class ChatTemplate {
  readonly source: string;
  readonly #template: Template;
  readonly #bosToken: string;
  readonly #eosToken: string;

  /** Parses `source`; `label` names its file in errors. */
  constructor(source: string, options: { bosToken: string | null; eosToken: string | null; label: string }) {
    this.source = source;
    try {
      this.#template = new Template(source);
    } catch (err) {
      throw badModelFolder(
        options.label,
        `chat_template is not a valid Jinja template: ${(err as Error).message}`,
        err,
      );
    }
    this.#bosToken = options.bosToken ?? "";
    this.#eosToken = options.eosToken ?? "";
  }

  /**
   * The prompt text for `messages`; ends with the assistant header when `addGenerationPrompt`
   * (default), or, with `continueFinalMessage`, right after the final message's content, left open
   * for the model to continue (as Hugging Face's and vLLM's `continue_final_message`). `kwargs` are
   * further template variables (vLLM's `chat_template_kwargs`); they cannot replace the messages or
   * the special tokens. `tools` is the template's `tools` variable (absent: undefined, as Hugging
   * Face leaves it without tools).
   */
  render(
    messages: readonly ChatMessage[],
    options?: {
      addGenerationPrompt?: boolean;
      continueFinalMessage?: boolean;
      kwargs?: Readonly<Record<string, unknown>>;
      tools?: readonly object[];
    },
  ): string {
    const continueFinal = options?.continueFinalMessage === true;
    let text: string;
    try {
      text = this.#template.render({
        ...options?.kwargs,
        messages: messages.map(templateMessage),
        ...(options?.tools === undefined ? {} : { tools: options.tools }),
        add_generation_prompt: continueFinal ? false : (options?.addGenerationPrompt ?? true),
        bos_token: this.#bosToken,
        eos_token: this.#eosToken,
      });
    } catch (err) {
      // Includes the template's own raise_exception(...) calls (provided by @huggingface/jinja).
      throw new KvfenceError(
        "invalid_request",
        `Chat template failed to render the messages: ${(err as Error).message}`,
        {
          cause: err,
        },
      );
    }
    if (!continueFinal) return text;
    const final = messages.at(-1)?.content.trim() ?? "";
    const at = final === "" ? -1 : text.lastIndexOf(final);
    if (at < 0) {
      throw new KvfenceError(
        "invalid_request",
        "continue_final_message needs a final message with content that the chat template renders as it is: add the text to continue as the last message",
        { param: "continue_final_message" },
      );
    }
    return text.slice(0, at + final.length);
  }
}

/**
 * The chat template of a model folder: `chat_template.jinja` if present, else tokenizer_config.json's
 * `chat_template` (a string, or a list of named templates from which "default" is taken) — or
 * `file` (`--chat-template FILE`) in their place. Null
 * when the folder has none.
 */
export function loadChatTemplate(dir: string, tokenizer: ModelTokenizer, file?: string): ChatTemplate | null {
  const tokens = { bosToken: tokenizer.bosToken, eosToken: tokenizer.eosToken };
  // `--chat-template FILE` replaces the folder's.
  if (file !== undefined) return new ChatTemplate(readFileSync(file, "utf8"), { ...tokens, label: file });
  const jinjaPath = join(dir, "chat_template.jinja");
  if (existsSync(jinjaPath))
    return new ChatTemplate(readFileSync(jinjaPath, "utf8"), { ...tokens, label: jinjaPath });
  const configPath = join(dir, "tokenizer_config.json");
  const config = readJsonFile(configPath, { optional: true }) as TokenizerConfigJson | undefined;
  const raw = config?.chat_template;
  if (raw === undefined || raw === null) return null;
  if (typeof raw === "string") return new ChatTemplate(raw, { ...tokens, label: configPath });
  if (Array.isArray(raw)) {
    const entry = raw.find((t: { name?: unknown }) => t?.name === "default") as
      | { template?: unknown }
      | undefined;
    if (typeof entry?.template === "string")
      return new ChatTemplate(entry.template, { ...tokens, label: configPath });
  }
  throw badModelFolder(
    configPath,
    'chat_template must be a string or a list containing a template named "default"',
  );
}

/** A model's tokenizer and chat template (null without one). */
export interface TokenizerAndTemplate {
  readonly tokenizer: ModelTokenizer;
  readonly chatTemplate: ChatTemplate | null;
}

/** The tokenizer and chat template of a model folder or a GGUF file (gguf-tokenizer.ts). */
export async function openTokenizer(path: string): Promise<TokenizerAndTemplate> {
  if (isGgufPath(path)) return ggufTokenizer(await readGgufTokenizerFiles(path));
  const tokenizer = ModelTokenizer.fromFolder(path);
  return { tokenizer, chatTemplate: loadChatTemplate(path, tokenizer) };
}

/** The tokenizer and chat template a GGUF file's metadata describes. */
export function ggufTokenizer(model: TokenizerFiles): TokenizerAndTemplate {
  const tokenizer = new ModelTokenizer(model.tokenizerJson, model.tokenizerConfig, { label: model.path });
  const source = model.tokenizerConfig.chat_template;
  const chatTemplate =
    typeof source === "string"
      ? new ChatTemplate(source, {
          bosToken: tokenizer.bosToken,
          eosToken: tokenizer.eosToken,
          label: `${model.path} (tokenizer.chat_template)`,
        })
      : null;
  return { tokenizer, chatTemplate };
}
