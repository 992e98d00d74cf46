/**
 * JSON text made a chunk at a time, so that a large answer is never serialised in one call that
 * holds the event loop: `jsonChunks(value)` yields the same text as `JSON.stringify(value)` in
 * strings of about `chunkChars` characters, and does only the work of one chunk per step. A caller
 * writes each chunk to its socket and yields to the event loop between them (src/router/json-writer.ts).
 *
 * Three markers keep a large answer from being built whole before it is written: a `LazyArray`'s
 * items are made only as they are serialised (each position's top log-probabilities, say); a
 * `SharedArray` is a lazy array that appears in several places (the prompt's log-probabilities in
 * every choice of a request): it is serialised the first time it is met and that text is reused
 * after; an `ArrayConcat` is one array made of several (echo's prompt tokens followed by a choice's
 * own), written without copying them.
 *
 * Values are what the router's answers hold: plain objects, arrays, strings, numbers, booleans and
 * null (undefined skipped in objects and null in arrays, non-finite numbers null, as
 * `JSON.stringify`); anything else (an object with `toJSON`, say) is handed to `JSON.stringify`
 * whole.
 */

/** An array whose items are made as they are serialised: `at(i)` for each `i` below `length`. */
export class LazyArray {
  readonly length: number;
  readonly at: (index: number) => unknown;

  constructor(length: number, at: (index: number) => unknown) {
    this.length = length;
    this.at = at;
  }
}

/** A lazy array that appears in several places of one answer: serialised once, its text reused. */
export class SharedArray extends LazyArray {
  /** `items` shared: an array's items as they are, a lazy array's as it makes them. */
  static of(items: readonly unknown[] | LazyArray): SharedArray {
    return items instanceof LazyArray
      ? new SharedArray(items.length, items.at)
      : new SharedArray(items.length, (i) => items[i]);
  }
}

/** Each shared array's items as text (no brackets), once the chunker has serialised them all. */
const sharedTexts = new WeakMap<SharedArray, string>();

/** An array's items: a plain array's, or those a lazy array makes. */
type Items = readonly unknown[] | LazyArray;

/** One JSON array made of several, in order: `[...parts[0], ...parts[1], …]`, none of them copied. */
export class ArrayConcat {
  readonly parts: readonly Items[];

  constructor(parts: readonly Items[]) {
    this.parts = parts;
  }
}

/** The chunk size `jsonChunks` aims at by default. */
export const JSON_CHUNK_CHARS = 16 * 1024;

/** Containers with at most this many entries, none of them a container, are stringified whole. */
const FLAT_MAX_ENTRIES = 256;

/** `value` as JSON text, in chunks of about `chunkChars` characters (the last one shorter). */
export function* jsonChunks(
  value: unknown,
  chunkChars = JSON_CHUNK_CHARS,
): Generator<string, void, undefined> {
  const chunker = new Chunker(chunkChars);
  yield* chunker.value(value);
  if (chunker.size > 0) yield chunker.take();
}

/** `value` as JSON text in one string (the markers resolved); for tests and small values. */
export function jsonText(value: unknown): string {
  return Array.from(jsonChunks(value)).join("");
}

/** Whether `value` (an object or array) holds no object or array, and few entries. */
function isFlat(values: readonly unknown[]): boolean {
  if (values.length > FLAT_MAX_ENTRIES) return false;
  for (const v of values) if (typeof v === "object" && v !== null) return false;
  return true;
}

function isPlainObject(value: object): value is Record<string, unknown> {
  const proto = Object.getPrototypeOf(value);
  return (
    (proto === Object.prototype || proto === null) &&
    typeof (value as { toJSON?: unknown }).toJSON !== "function"
  );
}

/** Buffers pieces of text; each generator step yields a chunk once the buffer holds `chunkChars`. */
class Chunker {
  readonly #chunkChars: number;
  #pieces: string[] = [];
  size = 0;

  constructor(chunkChars: number) {
    this.#chunkChars = chunkChars;
  }

  /** Adds a piece; true when a chunk is ready to `take`. */
  #push(piece: string): boolean {
    this.#pieces.push(piece);
    this.size += piece.length;
    return this.size >= this.#chunkChars;
  }

  take(): string {
    const chunk = this.#pieces.length === 1 ? this.#pieces[0]! : this.#pieces.join("");
    this.#pieces = [];
    this.size = 0;
    return chunk;
  }

  /** A long text in slices of a chunk, so that no chunk grows past about twice `chunkChars`. */
  *#pushLong(text: string): Generator<string, void, undefined> {
    for (let i = 0; i < text.length; i += this.#chunkChars) {
      if (this.#push(text.slice(i, i + this.#chunkChars))) yield this.take();
    }
  }

  *value(value: unknown): Generator<string, void, undefined> {
    if (typeof value !== "object" || value === null) {
      // JSON.stringify's own answer for a primitive (undefined and functions are the caller's to skip).
      if (this.#push(JSON.stringify(value) ?? "null")) yield this.take();
    } else if (Array.isArray(value)) {
      if (isFlat(value)) {
        if (this.#push(JSON.stringify(value))) yield this.take();
        return;
      }
      this.#push("[");
      yield* this.#items(value);
      if (this.#push("]")) yield this.take();
    } else if (value instanceof LazyArray) {
      this.#push("[");
      yield* value instanceof SharedArray ? this.#shared(value) : this.#items(value);
      if (this.#push("]")) yield this.take();
    } else if (value instanceof ArrayConcat) {
      yield* this.#concat(value);
    } else if (isPlainObject(value)) {
      yield* this.#object(value);
    } else if (this.#push(JSON.stringify(value))) {
      yield this.take();
    }
  }

  *#object(value: Record<string, unknown>): Generator<string, void, undefined> {
    const keys = Object.keys(value);
    if (keys.length <= FLAT_MAX_ENTRIES && isFlat(keys.map((k) => value[k]))) {
      if (this.#push(JSON.stringify(value))) yield this.take();
      return;
    }
    this.#push("{");
    let first = true;
    for (const key of keys) {
      const v = value[key];
      if (v === undefined || typeof v === "function" || typeof v === "symbol") continue;
      this.#push(first ? `${JSON.stringify(key)}:` : `,${JSON.stringify(key)}:`);
      first = false;
      yield* this.value(v);
    }
    if (this.#push("}")) yield this.take();
  }

  /** The items of an array, comma-separated, without brackets. */
  *#items(items: Items): Generator<string, void, undefined> {
    const lazy = items instanceof LazyArray;
    for (let i = 0; i < items.length; i++) {
      if (i > 0) this.#push(",");
      const item = lazy ? items.at(i) : (items as readonly unknown[])[i];
      yield* this.value(item === undefined || typeof item === "function" ? null : item);
    }
  }

  /** A shared array's items: its text when known, else serialised (and recorded) chunk by chunk. */
  *#shared(shared: SharedArray): Generator<string, void, undefined> {
    const known = sharedTexts.get(shared);
    if (known !== undefined) {
      yield* this.#pushLong(known);
      return;
    }
    const own = new Chunker(this.#chunkChars);
    const recorded: string[] = [];
    for (const chunk of own.#items(shared)) {
      recorded.push(chunk);
      if (this.#push(chunk)) yield this.take();
    }
    if (own.size > 0) {
      const rest = own.take();
      recorded.push(rest);
      if (this.#push(rest)) yield this.take();
    }
    sharedTexts.set(shared, recorded.join(""));
  }

  *#concat(concat: ArrayConcat): Generator<string, void, undefined> {
    this.#push("[");
    let first = true;
    for (const part of concat.parts) {
      if (part.length === 0) continue;
      if (!first) this.#push(",");
      first = false;
      yield* part instanceof SharedArray ? this.#shared(part) : this.#items(part);
    }
    if (this.#push("]")) yield this.take();
  }
}
