/**
 * A byte-level vocabulary's token bytes, packed to cross a thread boundary, and the tokenizer the
 * router's main thread answers with from them. `kvfence serve`'s first preparation worker builds
 * the model's tokenizer anyway (src/router/prepare-worker.ts) and walks every token's bytes for the
 * answer-size bounds; it hands them over (`packTokenTable`), so the main thread, which only turns
 * generated ids into text and log-probability pieces, does not parse tokenizer.json and build a
 * second Hugging Face tokenizer on its start-up path (~0.25 s CPU for a 49k vocabulary on this
 * project's machines). Encoding and whole-sequence decoding, which a server with preparation workers
 * never does on its main thread, build the full tokenizer on first use (`full`).
 *
 * Other decoders (SentencePiece byte fallback, Metaspace, …) need the Hugging Face decoder for
 * their text: no table (`packTokenTable` returns null) and the main thread builds the tokenizer.
 */
import {
  ByteLevelStreamDecoder,
  type ModelTokenizer,
  packedToken,
  pieceOf,
  type StreamDecoder,
} from "./tokenizer.js";

/** Every id's raw bytes (an added token's as its UTF-8 text) back to back, and which ids are special. */
export interface TokenTable {
  readonly numIds: number;
  readonly bytes: Uint8Array;
  /** Id `i`'s bytes are `bytes[offsets[i]]` up to `bytes[offsets[i + 1]]`. */
  readonly offsets: Uint32Array;
  readonly specialIds: Int32Array;
}

/** The table of `tokenizer`'s vocabulary; null unless it is byte-level. */
export function packTokenTable(tokenizer: ModelTokenizer): TokenTable | null {
  if (!tokenizer.byteLevel) return null;
  const { bytes, offsets } = tokenizer.packedTokenBytes();
  const special: number[] = [];
  for (let id = 0; id < tokenizer.numIds; id++) if (tokenizer.isSpecial(id)) special.push(id);
  return { numIds: tokenizer.numIds, bytes, offsets, specialIds: Int32Array.from(special) };
}

/** The reply side of a byte-level `ModelTokenizer` (same pieces, same streamed text) over its table. */
export class TableTokenizer {
  readonly #table: TokenTable;
  readonly #special: ReadonlySet<number>;
  readonly #full: () => ModelTokenizer;
  #built: ModelTokenizer | undefined;

  /** `full` builds the model's whole tokenizer, for `encode` and `decode`. */
  constructor(table: TokenTable, full: () => ModelTokenizer) {
    this.#table = table;
    this.#special = new Set(table.specialIds);
    this.#full = full;
  }

  get numIds(): number {
    return this.#table.numIds;
  }

  /** As `ModelTokenizer.tokenBytes`: "" for special tokens when skipped and for unknown ids. */
  tokenBytes(id: number, skipSpecialTokens: boolean): Uint8Array {
    return packedToken(this.#table, this.#special, id, skipSpecialTokens);
  }

  tokenPiece(id: number): { text: string; bytes: Uint8Array } {
    return pieceOf(this.tokenBytes(id, false));
  }

  streamDecoder(options?: { skipSpecialTokens?: boolean }): StreamDecoder {
    return new ByteLevelStreamDecoder(this, options?.skipSpecialTokens ?? true);
  }

  encode(text: string, options?: { addSpecialTokens?: boolean }): Int32Array {
    return this.#tokenizer().encode(text, options);
  }

  decode(ids: ArrayLike<number>, options?: { skipSpecialTokens?: boolean }): string {
    return this.#tokenizer().decode(ids, options);
  }

  #tokenizer(): ModelTokenizer {
    this.#built ??= this.#full();
    return this.#built;
  }
}
