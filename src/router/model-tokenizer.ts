/**
 * Adapts the model folder's tokenizer and chat template (src/tokenizer/tokenizer.ts) to the narrow
 * `RouterTokenizer` the HTTP layer uses. The router imports tokenization only, never weights or
 * the forward pass.
 */
import { KvfenceError } from "../lib/errors.js";
import type { ChatTemplate, ModelTokenizer } from "../tokenizer/tokenizer.js";
import type { TextStreamDecoder } from "./generation.js";
import type { TokenPiece } from "./logprobs-wire.js";
import type { ChatMessage, ChatTemplateOptions } from "./openai-schemas.js";
import { type TokenBounds, tokenBounds } from "./response-size.js";
import type { RouterTokenizer } from "./router-server.js";
import type { ToolCallFormat } from "./tool-call-parser.js";
import { templateToolSupport } from "./tool-request.js";

/** Token pieces kept once made (log-probabilities name the same tokens over and over). */
const MAX_CACHED_PIECES = 1 << 16;

/** What the router reads of a tokenizer: a `ModelTokenizer`, or a `TableTokenizer` (token-table.ts). */
export type TextTokenizer = Pick<
  ModelTokenizer,
  "numIds" | "tokenPiece" | "streamDecoder" | "encode" | "decode"
>;

export function routerTokenizer(
  tokenizer: TextTokenizer,
  chatTemplate: ChatTemplate | null,
  /** `--tool-call-parser`: the format of tool calls in the output, in place of the template's. */
  toolCallParser?: ToolCallFormat,
  /** The vocabulary's bounds when already walked (by a preparation worker: `PreparePool.tokenBounds`). */
  knownBounds?: TokenBounds,
): RouterTokenizer {
  const vocabSize = tokenizer.numIds;
  const pieces = new Map<number, TokenPiece>();
  let bounds: TokenBounds | null = knownBounds ?? null;
  return {
    vocabSize,
    toolSupport: templateToolSupport(chatTemplate?.source ?? null, toolCallParser),
    // Walks the vocabulary once, when first read (the router reads it at startup), past the piece cache.
    get tokenBounds(): TokenBounds {
      bounds ??= tokenBounds(vocabSize, (id) => tokenizer.tokenPiece(id));
      return bounds;
    },
    encodeChat(messages: readonly ChatMessage[], options?: ChatTemplateOptions): Int32Array {
      if (chatTemplate === null) {
        throw new KvfenceError(
          "invalid_request",
          "This model has no chat template: use /v1/completions with a raw prompt instead",
          { param: "messages" },
        );
      }
      // A field that sets a template variable (reasoning_effort) needs a template that reads it.
      for (const [variable, param] of Object.entries(options?.mustRead ?? {}))
        if (!chatTemplate.source.includes(variable))
          throw new KvfenceError(
            "invalid_request",
            `${param} is not supported by this model: its chat template never reads ${variable}; leave ${param} unset`,
            { param },
          );
      // The rendered text already carries the template's special tokens (BOS, <|im_start|>, ...).
      return tokenizer.encode(chatTemplate.render(messages, options ?? { addGenerationPrompt: true }), {
        addSpecialTokens: options?.addSpecialTokens === true,
      });
    },
    tokenPiece(id) {
      let piece = pieces.get(id);
      if (piece === undefined) {
        const { text, bytes } = tokenizer.tokenPiece(id);
        piece = { text, bytes: Array.from(bytes) };
        if (pieces.size < MAX_CACHED_PIECES) pieces.set(id, piece);
      }
      return piece;
    },
    decode: (ids) => tokenizer.decode(ids),
    encodePrompt(text: string, addSpecialTokens = true): Int32Array {
      return tokenizer.encode(text, { addSpecialTokens });
    },
    createDecoder(options): TextStreamDecoder {
      const stream = tokenizer.streamDecoder({ skipSpecialTokens: options?.skipSpecialTokens !== false });
      return {
        push(ids: readonly number[]): string {
          let out = "";
          for (const id of ids) out += stream.push(id);
          return out;
        },
        flush: () => stream.flush(),
      };
    },
  };
}
