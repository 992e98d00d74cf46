/**
 * What xgrammar needs of a model's tokenizer to mask its logits (its `TokenizerInfo`), as plain
 * data: every token's string by id, how those strings encode bytes, and whether the tokenizer
 * prepends a space. Built from a `ModelTokenizer` (a model folder's tokenizer.json, or a GGUF's)
 * by whoever holds one: the router's preparation workers and each engine thread.
 *
 * The vocabulary type follows xgrammar's own detection from Hugging Face tokenizers:
 * - `byte_level`: GPT-2's byte-to-character map (decoder `ByteLevel`: SmolLM2, Qwen2.5, Llama 3);
 * - `byte_fallback`: SentencePiece pieces with `▁` for a space and `<0xAB>` tokens for raw bytes
 *   (a `Sequence` decoder holding `ByteFallback`: Llama 2, Mistral), where a Metaspace
 *   pre-tokenizer or a `Prepend` normalizer adds the leading space;
 * - `raw`: the strings are the text.
 * Stop tokens are the request's own (`SamplingParams.stopTokenIds`, given to each matcher), so the
 * vocabulary carries none.
 */
import type { ModelTokenizer } from "../tokenizer/tokenizer.js";

export type VocabType = "byte_level" | "byte_fallback" | "raw";

export interface GrammarVocab {
  /** Each token id's string as the vocabulary spells it. */
  readonly tokens: readonly string[];
  readonly vocabType: VocabType;
  readonly prependSpace: boolean;
}

/** The grammar engine's view of `tokenizer`'s vocabulary. */
export function grammarVocab(tokenizer: ModelTokenizer): GrammarVocab {
  return {
    tokens: tokenizer.vocabulary(),
    vocabType: vocabType(tokenizer.decoderJson),
    prependSpace: prependsSpace(tokenizer.preTokenizerJson) || prependsSpace(tokenizer.normalizerJson),
  };
}

type Json = { readonly type?: unknown; readonly [key: string]: unknown };

/** The parts of a tokenizer.json component (itself, or each of a `Sequence`'s). */
function parts(component: unknown): Json[] {
  if (typeof component !== "object" || component === null) return [];
  const c = component as Json;
  const inner = c.decoders ?? c.pretokenizers ?? c.normalizers;
  return Array.isArray(inner) ? inner.flatMap(parts) : [c];
}

function vocabType(decoder: unknown): VocabType {
  const types = parts(decoder).map((p) => p.type);
  if (types.includes("ByteLevel")) return "byte_level";
  if (types.includes("ByteFallback")) return "byte_fallback";
  return "raw";
}

function prependsSpace(component: unknown): boolean {
  return parts(component).some(
    (p) =>
      (p.type === "Metaspace" &&
        (p.add_prefix_space === true || p.prepend_scheme === "always" || p.prepend_scheme === "first")) ||
      (p.type === "Prepend" && p.prepend === "▁"),
  );
}
