/**
 * Canaries for the leak probe: unique random access codes planted in records of the bundled
 * model's prompt format ("the access code of account 4821 is QX7-PL2."), prompts built to an exact
 * character length with the records spread evenly through neutral filler (so every KV page a prompt
 * fills holds a canary), and a scanner that finds any planted code in an output — exactly, or as a
 * fragment of 6 or more characters with the dash and case ignored.
 */
import { KvfenceError } from "../../lib/errors.js";

export const DEFAULT_RECORD_TEMPLATE = "the access code of account {account} is {code}.";
export const DEFAULT_QUESTION_TEMPLATE = "What is the access code of account {account}?";

/** One planted fact: a 4-digit account and its `XXX-XXX` code. */
export interface CanaryRecord {
  readonly account: string;
  readonly code: string;
}

export interface PromptTemplates {
  readonly record: string;
  readonly question: string;
}

/** Check a pair of templates and return them, or throw a `KvfenceError` naming the bad one. */
export function checkTemplates(record: string, question: string): PromptTemplates {
  if (!record.includes("{account}") || !record.includes("{code}")) {
    throw new KvfenceError("invalid_request", `The record template needs {account} and {code}: ${record}`, {
      param: "recordTemplate",
    });
  }
  if (!question.includes("{account}")) {
    throw new KvfenceError("invalid_request", `The question template needs {account}: ${question}`, {
      param: "questionTemplate",
    });
  }
  return { record, question };
}

/** A small seeded PRNG (mulberry32) so a probe run is repeatable from `--seed`. */
export class Rng {
  #state: number;

  constructor(seed: number) {
    this.#state = seed >>> 0;
  }

  /** A float in [0, 1). */
  next(): number {
    this.#state = (this.#state + 0x6d2b79f5) >>> 0;
    let t = this.#state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }

  /** An integer in [0, n). */
  int(n: number): number {
    return Math.floor(this.next() * n);
  }

  pick<T>(items: readonly T[]): T {
    return items[this.int(items.length)]!;
  }
}

const CODE_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";

/** Hands out records whose accounts and codes are unique across the whole probe run. */
export class CanaryFactory {
  readonly #rng: Rng;
  readonly #accounts = new Set<string>();
  readonly #codes = new Set<string>();

  constructor(rng: Rng) {
    this.#rng = rng;
  }

  record(): CanaryRecord {
    if (this.#accounts.size >= 9000) {
      throw new KvfenceError("internal", `Ran out of unique 4-digit accounts: ${this.#accounts.size}`);
    }
    let account: string;
    do account = String(1000 + this.#rng.int(9000));
    while (this.#accounts.has(account));
    this.#accounts.add(account);
    let code: string;
    do code = `${this.#chars(3)}-${this.#chars(3)}`;
    while (this.#codes.has(code) || !/[0-9]/.test(code) || !/[A-Z]/.test(code));
    this.#codes.add(code);
    return { account, code };
  }

  records(n: number): CanaryRecord[] {
    return Array.from({ length: n }, () => this.record());
  }

  #chars(n: number): string {
    let s = "";
    for (let i = 0; i < n; i++) s += CODE_ALPHABET[this.#rng.int(CODE_ALPHABET.length)];
    return s;
  }
}

const FILLER = [
  "The weather in the valley was calm that morning.",
  "A delivery truck waited at the corner for the light to change.",
  "The library opens at nine and closes at six on weekdays.",
  "Several birds gathered on the fence near the old barn.",
  "The committee postponed its meeting until next week.",
  "Fresh bread was stacked on the shelves of the small bakery.",
  "The river rose a little after the night of steady rain.",
  "A tired cyclist stopped to refill a water bottle.",
  "The museum added a new room for maps and old letters.",
  "Children played a quiet game of cards on the porch.",
  "The harbor lights flickered as the fog rolled in.",
  "A gardener trimmed the hedges along the narrow path.",
];

/**
 * A user message of exactly `targetChars` characters (or the minimum that holds the records and the
 * question): records spread evenly through filler, then the question about `askAccount`.
 */
export function buildPrompt(input: {
  records: readonly CanaryRecord[];
  askAccount: string;
  targetChars: number;
  templates: PromptTemplates;
  rng: Rng;
}): string {
  const lines = input.records.map((r) => fill(input.templates.record, r.account, r.code));
  const question = fill(input.templates.question, input.askAccount, "");
  const fixed = lines.reduce((n, l) => n + l.length + 1, 0) + question.length;
  const fillerChars = Math.max(0, input.targetChars - fixed);
  const filler = fillerText(fillerChars, input.rng);
  const segments = lines.length + 1;
  const parts: string[] = [];
  let at = 0;
  for (let i = 0; i < segments; i++) {
    let end = Math.round((fillerChars * (i + 1)) / segments);
    if (i < lines.length) {
      // Cut at a sentence boundary so records sit between whole sentences.
      const cut = filler.lastIndexOf(". ", end - 1);
      if (cut + 2 > at) end = cut + 2;
    } else {
      end = fillerChars;
    }
    parts.push(filler.slice(at, end));
    at = end;
    if (i < lines.length) parts.push(`${lines[i]} `);
  }
  parts.push(question);
  return parts.join("");
}

function fillerText(chars: number, rng: Rng): string {
  if (chars === 0) return "";
  // Build one long random block and repeat it: a million-character prompt costs milliseconds.
  let block = "";
  while (block.length < Math.min(chars, 65_536)) block += `${rng.pick(FILLER)} `;
  const out = block.repeat(Math.ceil(chars / block.length)).slice(0, chars);
  return `${out.slice(0, -1)} `;
}

function fill(template: string, account: string, code: string): string {
  return template.replaceAll("{account}", account).replaceAll("{code}", code);
}

/** Case- and punctuation-insensitive form used for fragment matching. */
function normalize(text: string): string {
  return text.toUpperCase().replace(/[^A-Z0-9]/g, "");
}

/** A hit of a planted code in some output. */
export interface CanaryHit {
  readonly code: string;
  readonly account: string;
  readonly match: "exact" | "fragment";
}

/** Finds planted codes in outputs: exact, or any 6-character (or longer) run of a code sans dash. */
export class CanaryIndex {
  readonly #byCode = new Map<string, CanaryRecord>();
  readonly #byFragment = new Map<string, CanaryRecord>();
  readonly #fragmentLength: number;
  readonly #lengths = new Set<number>();
  readonly #codeLengths = new Set<number>();

  constructor(fragmentLength = 6) {
    this.#fragmentLength = fragmentLength;
  }

  get size(): number {
    return this.#byCode.size;
  }

  /** Every planted record, in insertion order. */
  records(): CanaryRecord[] {
    return [...this.#byCode.values()];
  }

  add(record: CanaryRecord): void {
    this.#byCode.set(record.code, record);
    this.#codeLengths.add(record.code.length);
    const n = normalize(record.code);
    const k = Math.min(this.#fragmentLength, n.length);
    this.#lengths.add(k);
    for (let i = 0; i + k <= n.length; i++) this.#byFragment.set(n.slice(i, i + k), record);
  }

  /**
   * Every planted record whose code appears in `text`. Linear in the text, whatever the number of
   * planted codes (each window of a code's length is looked up), so a benchmark can scan thousands
   * of responses against thousands of codes.
   */
  scan(text: string): CanaryHit[] {
    const hits = new Map<string, CanaryHit>();
    for (const k of this.#codeLengths) {
      for (let i = 0; i + k <= text.length; i++) {
        const r = this.#byCode.get(text.slice(i, i + k));
        if (r !== undefined && !hits.has(r.code))
          hits.set(r.code, { code: r.code, account: r.account, match: "exact" });
      }
    }
    const n = normalize(text);
    for (const k of this.#lengths) {
      for (let i = 0; i + k <= n.length; i++) {
        const r = this.#byFragment.get(n.slice(i, i + k));
        if (r !== undefined && !hits.has(r.code))
          hits.set(r.code, { code: r.code, account: r.account, match: "fragment" });
      }
    }
    return [...hits.values()];
  }
}
