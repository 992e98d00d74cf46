/**
 * Stop strings, matched on the detokenized text as it streams. Text that could still turn out to
 * be the start of a stop string is held back (at most the longest stop string minus one
 * character), so a client never sees part of a stop string; on a match, the text before it is
 * released and the rest is dropped (OpenAI trims the stop string from the output).
 */
export interface StopMatchStep {
  /** Text that can go to the client now. */
  readonly text: string;
  /** True once a stop string matched; no more text follows. */
  readonly stopped: boolean;
}

export class StopMatcher {
  readonly #stops: readonly string[];
  readonly #holdBack: number;
  #pending = "";
  #stopped = false;

  constructor(stops: readonly string[]) {
    this.#stops = stops.filter((s) => s.length > 0);
    this.#holdBack = this.#stops.reduce((max, s) => Math.max(max, s.length - 1), 0);
  }

  get stopped(): boolean {
    return this.#stopped;
  }

  /** Feed newly decoded text. */
  push(text: string): StopMatchStep {
    if (this.#stopped) return { text: "", stopped: true };
    if (this.#stops.length === 0) return { text, stopped: false };
    const buffer = this.#pending + text;
    let cut = -1;
    for (const stop of this.#stops) {
      const at = buffer.indexOf(stop);
      if (at !== -1 && (cut === -1 || at < cut)) cut = at;
    }
    if (cut !== -1) {
      this.#stopped = true;
      this.#pending = "";
      return { text: buffer.slice(0, cut), stopped: true };
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
