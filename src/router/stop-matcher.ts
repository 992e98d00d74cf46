/**
 * Stop strings, matched on the detokenized text as it streams. Text that could still turn out to
 * be the start of a stop string is held back (at most the longest stop string minus one
 * character), so a client never sees part of a stop string; on a match, the text before it is
 * released and the rest is dropped (OpenAI trims the stop string from the output), or, with
 * `includeStop` (vLLM's `include_stop_str_in_output`), the stop string is released too. A push that
 * is not `armed` (vLLM's `min_tokens` not yet reached) matches nothing: its text is released but
 * for what could still begin a stop string.
 */
export interface StopMatchStep {
  /** Text that can go to the client now. */
  readonly text: string;
  /** True once a stop string matched; no more text follows. */
  readonly stopped: boolean;
  /** The stop string that matched (when `stopped`). */
  readonly matched?: string;
}

export class StopMatcher {
  readonly #stops: readonly string[];
  readonly #holdBack: number;
  readonly #includeStop: boolean;
  #pending = "";
  #stopped = false;

  constructor(stops: readonly string[], includeStop = false) {
    this.#stops = stops.filter((s) => s.length > 0);
    this.#includeStop = includeStop;
    this.#holdBack = this.#stops.reduce((max, s) => Math.max(max, s.length - 1), 0);
  }

  get stopped(): boolean {
    return this.#stopped;
  }

  /** Feed newly decoded text. */
  push(text: string, armed = true): StopMatchStep {
    if (this.#stopped) return { text: "", stopped: true };
    if (this.#stops.length === 0) return { text, stopped: false };
    const buffer = this.#pending + text;
    let cut = -1;
    let matched = "";
    for (const stop of armed ? this.#stops : []) {
      const at = buffer.indexOf(stop);
      if (at !== -1 && (cut === -1 || at < cut)) {
        cut = at;
        matched = stop;
      }
    }
    if (cut !== -1) {
      this.#stopped = true;
      this.#pending = "";
      const end = this.#includeStop ? cut + matched.length : cut;
      return { text: buffer.slice(0, end), stopped: true, matched };
    }
    const keep = this.#partialSuffix(buffer);
    this.#pending = buffer.slice(buffer.length - keep);
    return { text: buffer.slice(0, buffer.length - keep), stopped: false };
  }

  /** The held-back text once generation ended without a match. */
  flush(): string {
    const out = this.#stopped ? "" : this.#pending;
    this.#pending = "";
    return out;
  }

  /** Length of the longest suffix of `buffer` that is a proper prefix of some stop string. */
  #partialSuffix(buffer: string): number {
    const max = Math.min(this.#holdBack, buffer.length);
    for (let len = max; len > 0; len--) {
      const suffix = buffer.slice(buffer.length - len);
      for (const stop of this.#stops) if (stop.startsWith(suffix)) return len;
    }
    return 0;
  }
}
