/**
 * `--reasoning-parser` (vLLM's flag): splits a reasoning model's `<think>…</think>` block out of
 * its answer, as vLLM's parsers of the same names do. `deepseek_r1`: the answer starts inside the
 * block (DeepSeek-R1's template opens `<think>` in the prompt; a `<think>` the model writes itself
 * is dropped), everything before `</think>` is reasoning, even when `</think>` never comes.
 * `qwen3`: reasoning only when the answer opens with `<think>` (Qwen3 with thinking off writes
 * none: the whole answer is content). After `</think>` everything is content, tags included.
 *
 * `ReasoningSplitter` works on the text as it streams, piece by piece: a tag split across pieces
 * (tokens) is held back until it is told apart, so a stream and a whole answer split the same way
 * (`splitReasoning` is the splitter over the whole text). The tags themselves are in neither part;
 * everything else is in exactly one, in order.
 */

export const REASONING_PARSERS = ["deepseek_r1", "qwen3"] as const;
export type ReasoningParserName = (typeof REASONING_PARSERS)[number];

const OPEN = "<think>";
const CLOSE = "</think>";

/** One piece of text, split: the reasoning part comes before the content part. */
export interface ReasoningPiece {
  readonly reasoning: string;
  readonly content: string;
}

/** Where the splitter is: before the answer's first characters, inside the block, after it. */
type Phase = "start" | "reasoning" | "content";

export class ReasoningSplitter {
  readonly #parser: ReasoningParserName;
  #phase: Phase = "start";
  /** Text held back: a possible `<think>` at the start, or a possible `</think>` at the end. */
  #held = "";
  /** The block ended (or never opened): what follows is content. */
  get inContent(): boolean {
    return this.#phase === "content";
  }

  constructor(parser: ReasoningParserName) {
    this.#parser = parser;
  }

  /** The next piece of the answer, split; text that may be part of a tag is held back. */
  push(text: string): ReasoningPiece {
    let rest = this.#held + text;
    this.#held = "";
    if (this.#phase === "start") {
      if (rest.length < OPEN.length && OPEN.startsWith(rest)) {
        this.#held = rest;
        return { reasoning: "", content: "" };
      }
      const opened = rest.startsWith(OPEN);
      if (opened) rest = rest.slice(OPEN.length);
      this.#phase = opened || this.#parser === "deepseek_r1" ? "reasoning" : "content";
    }
    if (this.#phase === "content") return { reasoning: "", content: rest };
    const end = rest.indexOf(CLOSE);
    if (end >= 0) {
      this.#phase = "content";
      return { reasoning: rest.slice(0, end), content: rest.slice(end + CLOSE.length) };
    }
    const keep = partialSuffix(rest, CLOSE);
    this.#held = rest.slice(rest.length - keep);
    return { reasoning: rest.slice(0, rest.length - keep), content: "" };
  }

  /** The end of the answer: what was held back, in the part it belongs to. */
  flush(): ReasoningPiece {
    const held = this.#held;
    this.#held = "";
    // An answer that is only a prefix of "<think>": deepseek_r1 reads it as reasoning, qwen3 as content.
    if (this.#phase === "start") this.#phase = this.#parser === "deepseek_r1" ? "reasoning" : "content";
    return this.#phase === "reasoning" ? { reasoning: held, content: "" } : { reasoning: "", content: held };
  }
}

/** A whole answer split: `reasoning` null when there was none (or an empty block). */
export function splitReasoning(
  parser: ReasoningParserName,
  text: string,
): { readonly reasoning: string | null; readonly content: string } {
  const splitter = new ReasoningSplitter(parser);
  const a = splitter.push(text);
  const b = splitter.flush();
  const reasoning = a.reasoning + b.reasoning;
  return { reasoning: reasoning === "" ? null : reasoning, content: a.content + b.content };
}

/** The length of the longest suffix of `text` that is a proper prefix of `tag`. */
function partialSuffix(text: string, tag: string): number {
  for (let n = Math.min(text.length, tag.length - 1); n > 0; n--)
    if (tag.startsWith(text.slice(-n))) return n;
  return 0;
}
