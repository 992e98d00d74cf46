/**
 * The tokenizer.json of a byte-level BPE model, in Hugging Face's format, for the two places that
 * write one: the random-weight model folders (src/model/gen-model.ts) and the GGUF reader, which
 * builds a folder's files from a file's `tokenizer.ggml.*` metadata (gguf-tokenizer.ts). Keys come
 * in the order Hugging Face writes them, so a folder's file reads as one written by `tokenizers`.
 */

/** The ByteLevel pre-tokenizer or decoder; `useRegex` splits on GPT-2's regex first. */
export function byteLevel(useRegex: boolean): Record<string, unknown> {
  return { type: "ByteLevel", add_prefix_space: false, trim_offsets: false, use_regex: useRegex };
}

/** One entry of `added_tokens`: a whole token matched before the model runs (`special`: a control token). */
export function addedToken(id: number, content: string, special: boolean): Record<string, unknown> {
  return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special };
}

/** What differs between byte-level BPE tokenizers. */
export interface BpeTokenizerParts {
  readonly vocab: Record<string, number>;
  readonly merges: readonly string[];
  readonly addedTokens: readonly Record<string, unknown>[];
  readonly preTokenizer: unknown;
  readonly postProcessor: unknown;
  readonly decoder: unknown;
  /** Whether a word already in the vocabulary skips the merges (Llama 3's `ignore_merges`). */
  readonly ignoreMerges: boolean;
}

/** A tokenizer.json of a byte-level BPE model, no normalizer, no unknown token, no byte fallback. */
export function bpeTokenizerJson(parts: BpeTokenizerParts): Record<string, unknown> {
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: parts.addedTokens,
    normalizer: null,
    pre_tokenizer: parts.preTokenizer,
    post_processor: parts.postProcessor,
    decoder: parts.decoder,
    model: {
      type: "BPE",
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: parts.ignoreMerges,
      vocab: parts.vocab,
      merges: parts.merges,
    },
  };
}
