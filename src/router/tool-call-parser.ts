/**
 * The tool calls in a model's output, parsed as the text arrives (issue #34): the formats the
 * models' own chat templates teach them, named as vLLM's `--tool-call-parser` names them —
 *
 * - `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
 *   one object per block, blocks one after another;
 * - `llama3_json` (Llama 3.1, 3.2): `{"name": …, "parameters": {…}}` at the start of the output
 *   or after `<|python_tag|>`, several separated by `;`;
 * - `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`;
 * - `json_array`: the whole output is `[{"name": …, "parameters": {…}}, …]` — what the grammar of
 *   `tool_choice` `required` or a named function (tool-request.ts) makes every model write.
 *
 * Text before a call (and any after it, blank text between calls dropped) stays the answer's
 * content. One `ToolCallStream` serves a choice, streamed or not: `push` each piece of text as it
 * arrives and `end` once, and it returns what can be shown so far — content, and for each call
 * first its id and name, then the raw text of its arguments in fragments as they come (a name that
 * comes after the arguments holds them back until it is known). Text that may still become a marker
 * (`<tool_ca…`) is held back. The arguments are the model's own JSON text, so the streamed fragments
 * and the non-streamed answer agree however the text was split. A call object without a name, or
 * a marker not followed by an object, is content after all.
 */
import { randomBytes } from "node:crypto";

/** vLLM's `--tool-call-parser` names (and the constrained array of `tool_choice` required / named). */
export type ToolCallFormat = "hermes" | "llama3_json" | "mistral" | "json_array";

/** The formats an operator may name with `--tool-call-parser`. */
export const TOOL_CALL_PARSERS = ["hermes", "llama3_json", "mistral"] as const;

/** One piece of one call: the first of a call carries its id and name (arguments ""), later ones argument text. */
export interface ToolCallDelta {
  readonly index: number;
  readonly id?: string;
  readonly name?: string;
  readonly arguments: string;
}

/** What one `push` (or `end`) makes showable. */
export interface ToolStreamDelta {
  readonly content: string;
  readonly calls: readonly ToolCallDelta[];
}

/** A whole call, as the answer reports it. */
export interface ParsedToolCall {
  readonly id: string;
  readonly name: string;
  arguments: string;
}

/** `call_` and 24 random alphanumerics (OpenAI's tool call ids). */
export function toolCallId(): string {
  const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  let out = "call_";
  for (const b of randomBytes(24)) out += alphabet[b % alphabet.length];
  return out;
}

/**
 * The format a chat template teaches its model, from the template's text: null when it names
 * none of the known markers (the operator then names one with `--tool-call-parser`).
 */
export function detectToolCallFormat(templateSource: string): ToolCallFormat | null {
  if (templateSource.includes("<tool_call>")) return "hermes";
  if (templateSource.includes("[TOOL_CALLS]")) return "mistral";
  if (templateSource.includes("<|python_tag|>") || templateSource.includes("<|start_header_id|>ipython"))
    return "llama3_json";
  if (templateSource.includes("<|start_header_id|>") && /"parameters"/.test(templateSource))
    return "llama3_json";
  return null;
}

/** Whether a chat template renders tool definitions (reads the Jinja `tools` variable). */
export function templateUsesTools(templateSource: string): boolean {
  return /\btools\b/.test(templateSource);
}

interface FormatRule {
  /** The text that opens the calls (none: the calls open the output, `json_array`). */
  readonly marker: string | null;
  /** Calls are items of a JSON array after the marker. */
  readonly array: boolean;
  /** The text that closes each call object (hermes). */
  readonly close: string | null;
  /** A call object may open the output with no marker (llama3_json). */
  readonly bareStart: boolean;
}

const RULES: Readonly<Record<ToolCallFormat, FormatRule>> = {
  hermes: { marker: "<tool_call>", array: false, close: "</tool_call>", bareStart: false },
  llama3_json: { marker: "<|python_tag|>", array: false, close: null, bareStart: true },
  mistral: { marker: "[TOOL_CALLS]", array: true, close: null, bareStart: false },
  json_array: { marker: null, array: true, close: null, bareStart: false },
};

const ARGUMENT_KEYS = new Set(["arguments", "parameters"]);
const BLANK = /\s/;

type Mode =
  /** Answer text, watching for the marker. */
  | "content"
  /** After the marker (or between array items): blank text until `{` (or `[` for an array). */
  | "await"
  /** Inside a call object. */
  | "object"
  /** After a call object: blank text until its close, the next call or the end of the array. */
  | "between"
  /** Past the calls of `json_array`: nothing more is read. */
  | "done";

/** The call object being read: the JSON scanner's state and what it found. */
interface CallScan {
  raw: string;
  depth: number;
  inString: boolean;
  escape: boolean;
  /** At depth 1: reading a key, between key and colon, or in a value. */
  slot: "key" | "colon" | "value";
  key: string;
  value: string;
  valueStarted: boolean;
  name: string | null;
  sawArguments: boolean;
  /** Argument text read before the name was known. */
  heldArguments: string;
  /** Its index among the calls, or -1 once past `maxCalls` (read, not shown). */
  index: number;
  /** The text that opened it (the marker, blank text) in case it is content after all. */
  opening: string;
  announced: boolean;
}

export class ToolCallStream {
  readonly #rule: FormatRule;
  readonly #maxCalls: number;
  readonly #calls: ParsedToolCall[] = [];
  #mode: Mode;
  /** Text not shown yet: content that may become the marker, or what followed the marker. */
  #held = "";
  /** Only blank text was read so far (llama3_json's bare start). */
  #atStart = true;
  /** Inside the marker's array (mistral, json_array). */
  #inArray = false;
  /** Blank content after a call, dropped unless more content follows. */
  #afterCall = false;
  #scan: CallScan | null = null;
  #content = "";
  #deltas: ToolCallDelta[] = [];

  constructor(format: ToolCallFormat, options: { readonly maxCalls?: number } = {}) {
    this.#rule = RULES[format];
    this.#maxCalls = options.maxCalls ?? Number.POSITIVE_INFINITY;
    this.#mode = this.#rule.marker === null ? "await" : "content";
  }

  /** The calls read so far (their arguments complete once `end` was called). */
  get calls(): readonly ParsedToolCall[] {
    return this.#calls;
  }

  /** Reads `text`; returns the content and call pieces it makes showable. */
  push(text: string): ToolStreamDelta {
    for (const ch of text) this.#read(ch);
    if (this.#mode === "content") this.#releaseContent(false);
    return this.#take();
  }

  /** The output ended: whatever was held back is content (or dropped, when blank after a call). */
  end(): ToolStreamDelta {
    const scan = this.#scan;
    if (this.#mode === "object" && scan !== null && !scan.announced) {
      // A call cut before its name: content after all.
      this.#addContent(scan.opening + scan.raw);
    } else if (this.#mode === "content") {
      this.#releaseContent(true);
    } else if (this.#mode === "await" && this.#held !== "" && this.#rule.marker !== null) {
      this.#addContent(this.#held);
    }
    this.#held = "";
    this.#scan = null;
    return this.#take();
  }

  #take(): ToolStreamDelta {
    const out = { content: this.#content, calls: this.#deltas };
    this.#content = "";
    this.#deltas = [];
    return out;
  }

  #addContent(text: string): void {
    if (text === "") return;
    if (this.#afterCall) {
      if (text.trim() === "") return;
      this.#afterCall = false;
    }
    this.#content += text;
  }

  #read(ch: string): void {
    const mode = this.#mode;
    if (mode === "content") this.#readContent(ch);
    else if (mode === "await") this.#readAwait(ch);
    else if (mode === "object") this.#readObject(ch);
    else if (mode === "between") this.#readBetween(ch);
  }

  #readContent(ch: string): void {
    const rule = this.#rule;
    if (rule.bareStart && this.#atStart && this.#calls.length === 0) {
      if (ch === "{") {
        this.#openCall(this.#held);
        this.#held = "";
        this.#readObject(ch);
        return;
      }
      if (!BLANK.test(ch)) this.#atStart = false;
    }
    this.#held += ch;
    const marker = rule.marker!;
    if (this.#held.endsWith(marker)) {
      this.#addContent(this.#held.slice(0, -marker.length));
      this.#held = marker;
      this.#mode = "await";
    }
  }

  /** Shows the content held, but for an end that may still become the marker (all of it at the end). */
  #releaseContent(final: boolean): void {
    const held = this.#held;
    if (held === "") return;
    let keep = 0;
    if (!final) {
      if (this.#rule.bareStart && this.#atStart && held.trim() === "") return;
      const marker = this.#rule.marker!;
      for (let n = Math.min(marker.length - 1, held.length); n > 0; n--) {
        if (held.endsWith(marker.slice(0, n))) {
          keep = n;
          break;
        }
      }
    }
    this.#addContent(held.slice(0, held.length - keep));
    this.#held = held.slice(held.length - keep);
  }

  #readAwait(ch: string): void {
    if (BLANK.test(ch)) {
      this.#held += ch;
      return;
    }
    const rule = this.#rule;
    if (rule.array && !this.#inArray) {
      if (ch === "[") {
        this.#inArray = true;
        this.#held += ch;
        return;
      }
    } else if (ch === "{") {
      this.#openCall(this.#held);
      this.#held = "";
      this.#readObject(ch);
      return;
    }
    // Not a call after all.
    if (rule.marker === null) {
      this.#mode = "done";
      return;
    }
    this.#mode = "content";
    this.#inArray = false;
    const held = this.#held;
    this.#held = "";
    this.#addContent(held);
    this.#readContent(ch);
  }

  #openCall(opening: string): void {
    const index = this.#calls.length < this.#maxCalls ? this.#calls.length : -1;
    this.#scan = {
      raw: "",
      depth: 0,
      inString: false,
      escape: false,
      slot: "key",
      key: "",
      value: "",
      valueStarted: false,
      name: null,
      sawArguments: false,
      heldArguments: "",
      index,
      opening,
      announced: false,
    };
    this.#mode = "object";
    this.#afterCall = false;
  }

  #readObject(ch: string): void {
    const s = this.#scan!;
    s.raw += ch;
    if (s.depth === 0) {
      // The object's opening brace.
      s.depth = 1;
      return;
    }
    if (s.inString) {
      this.#readInString(s, ch);
      return;
    }
    if (ch === '"') {
      s.inString = true;
      if (s.depth === 1 && s.slot === "key") s.key = "";
      this.#valueChar(s, ch);
      return;
    }
    if (s.depth === 1 && (ch === "," || ch === "}")) {
      if (s.slot === "value") this.#endValue(s);
      s.slot = "key";
      s.key = "";
      if (ch === "}") {
        s.depth = 0;
        this.#closeCall(s);
      }
      return;
    }
    if (s.depth === 1 && s.slot === "colon" && ch === ":") {
      s.slot = "value";
      s.value = "";
      s.valueStarted = false;
      return;
    }
    if (ch === "{" || ch === "[") s.depth++;
    else if (ch === "}" || ch === "]") s.depth--;
    this.#valueChar(s, ch);
  }

  #readInString(s: CallScan, ch: string): void {
    if (s.escape) s.escape = false;
    else if (ch === "\\") s.escape = true;
    else if (ch === '"') s.inString = false;
    this.#valueChar(s, ch);
    if (!s.inString && s.depth === 1 && s.slot === "key") s.slot = "colon";
  }

  /** A character of the object at its place: a key's, or a value's (argument text is shown as it comes). */
  #valueChar(s: CallScan, ch: string): void {
    if (s.depth === 1 && s.slot === "key") {
      if (s.inString && !(ch === '"' && s.key === "")) s.key += ch;
      return;
    }
    if (s.slot !== "value") return;
    if (!s.valueStarted && BLANK.test(ch)) return;
    if (s.depth <= 1 && !s.inString && ch !== '"' && BLANK.test(ch)) return;
    s.valueStarted = true;
    s.value += ch;
    if (!ARGUMENT_KEYS.has(s.key)) return;
    s.sawArguments = true;
    if (s.announced) this.#emitArguments(s, ch);
    else s.heldArguments += ch;
  }

  #endValue(s: CallScan): void {
    if (s.key !== "name" || s.name !== null) return;
    let name: unknown;
    try {
      name = JSON.parse(s.value);
    } catch {
      return;
    }
    if (typeof name !== "string" || name === "") return;
    s.name = name;
    this.#announce(s);
  }

  #announce(s: CallScan): void {
    s.announced = true;
    if (s.index >= 0) {
      const call: ParsedToolCall = { id: toolCallId(), name: s.name!, arguments: "" };
      this.#calls[s.index] = call;
      this.#deltas.push({ index: s.index, id: call.id, name: call.name, arguments: "" });
    }
    if (s.heldArguments !== "") this.#emitArguments(s, s.heldArguments);
    s.heldArguments = "";
  }

  #emitArguments(s: CallScan, text: string): void {
    if (s.index < 0) return;
    this.#calls[s.index]!.arguments += text;
    const last = this.#deltas.at(-1);
    if (last !== undefined && last.index === s.index && last.name === undefined)
      this.#deltas[this.#deltas.length - 1] = { index: s.index, arguments: last.arguments + text };
    else this.#deltas.push({ index: s.index, arguments: text });
  }

  #closeCall(s: CallScan): void {
    this.#scan = null;
    if (!s.announced) {
      // No name: the object is content after all.
      this.#mode = "content";
      this.#atStart = false;
      this.#inArray = false;
      this.#addContent(s.opening + s.raw);
      return;
    }
    if (!s.sawArguments) this.#emitArguments(s, "{}");
    this.#mode = "between";
    this.#held = "";
  }

  #readBetween(ch: string): void {
    const rule = this.#rule;
    if (rule.close !== null) {
      this.#readClose(rule.close, ch);
      return;
    }
    if (BLANK.test(ch)) return;
    if (rule.array) {
      if (ch === ",") {
        this.#mode = "await";
        return;
      }
      if (ch === "]") {
        if (rule.marker === null) this.#mode = "done";
        else this.#toContentAfterCall();
        return;
      }
    } else if (ch === ";") {
      this.#mode = "await";
      return;
    } else if (ch === "{") {
      this.#openCall("");
      this.#readObject(ch);
      return;
    }
    if (rule.marker === null) {
      this.#mode = "done";
      return;
    }
    this.#toContentAfterCall();
    this.#readContent(ch);
  }

  /** hermes: the block's close after its object, then content (or the next block). */
  #readClose(close: string, ch: string): void {
    const wanted = this.#held.trimStart() + ch;
    if (BLANK.test(ch) && this.#held.trim() === "") {
      this.#held += ch;
      return;
    }
    if (close.startsWith(wanted)) {
      this.#held = wanted === close ? "" : this.#held + ch;
      if (wanted === close) this.#toContentAfterCall();
      return;
    }
    const held = this.#held;
    this.#toContentAfterCall();
    for (const c of held + ch) this.#readContent(c);
  }

  #toContentAfterCall(): void {
    this.#mode = "content";
    this.#held = "";
    this.#inArray = false;
    this.#atStart = false;
    this.#afterCall = true;
  }
}
