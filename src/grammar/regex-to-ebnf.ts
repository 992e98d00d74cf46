/**
 * Regular expressions and choice lists as grammars: the EBNF (xgrammar's dialect, GBNF-like, start
 * rule `root`) that accepts exactly the strings a regex fully matches, or exactly one of the given
 * strings. The regex is parsed by `regjsparser` (ECMAScript syntax, no flags; the syntax vLLM's and
 * SGLang's clients write for JSON-ish values); its AST is printed as one `root` rule. Constructs a
 * grammar cannot express — backreferences, lookarounds, word boundaries, anchors anywhere but the
 * two ends — are refused with an `invalid_request` naming the construct.
 *
 * Character classes are sets of code points. xgrammar 0.1.27 matches a class's ASCII ranges and a
 * negated class of ASCII characters, but not a positive range of non-ASCII code points, and it
 * widens a negated class naming non-ASCII ones (mlc-ai/xgrammar#848). So a class is printed from
 * what works: its ASCII members as a class, "every non-ASCII character" as `[^\x00-\x7f]`, and a few
 * (≤ `MAX_LISTED_CHARS`) non-ASCII members as literal strings. A class whose non-ASCII members are
 * none of these (`.`, `\S`, `[^é]`, `[一-龥]`) keeps only its ASCII members: the output always
 * matches the regex, at the price of those characters (docs/api.md says so).
 */
import regjsparser, { type RootNode as AnyRootNode, type AstNode, type CharacterClass } from "regjsparser";
import { KvfenceError } from "../lib/errors.js";

/** The longest regex taken (it is parsed on the router's event loop, to name the field it is in). */
export const MAX_REGEX_CHARS = 16_384;
/** The largest bound of a `{m,n}` repetition. */
export const MAX_REPEAT = 10_000;
/** A class's non-ASCII members are listed as literals when there are at most this many. */
const MAX_LISTED_CHARS = 256;
const MAX_CODE_POINT = 0x10ffff;

/** The syntax read: ES2018's named groups and lookbehinds (the latter to refuse them by name). */
type Syntax = { namedGroups: true; lookbehind: true };
type RootNode = AnyRootNode<Syntax>;
type Node = AstNode<Syntax>;

/** Code point ranges, inclusive, sorted and disjoint. */
type Ranges = readonly (readonly [number, number])[];

interface Options {
  /** The request field the regex came from, for the error's `param` (default `regex`). */
  readonly param?: string;
}

/** The EBNF grammar (start rule `root`) accepting exactly the strings `pattern` fully matches. */
export function regexToEbnf(pattern: string, options: Options = {}): string {
  const param = options.param ?? "regex";
  if (pattern.length > MAX_REGEX_CHARS) {
    throw new KvfenceError(
      "invalid_request",
      `Regex too long: ${pattern.length} characters, at most ${MAX_REGEX_CHARS}; send a shorter one or a JSON schema`,
      { param },
    );
  }
  let ast: RootNode;
  try {
    ast = regjsparser.parse<Syntax>(pattern, "", { namedGroups: true, lookbehind: true });
  } catch (err) {
    const reason = err instanceof Error ? err.message.split("\n")[0]! : String(err);
    // regjsparser's "character at position 9: )" means that `)` was expected there.
    const detail = reason.startsWith("character at position") ? `expected ${reason}` : reason;
    throw new KvfenceError("invalid_request", `Invalid regex: ${detail}`, { param });
  }
  return `root ::= ${new Printer(param).top(ast)}\n`;
}

/** The EBNF grammar (start rule `root`) accepting exactly one of `choices`. */
export function choiceToEbnf(choices: readonly string[], options: Options = {}): string {
  if (choices.length === 0) {
    throw new KvfenceError("invalid_request", "A choice list needs at least one string: got []", {
      param: options.param ?? "choice",
    });
  }
  return `root ::= ${[...new Set(choices)].map(ebnfString).join(" | ")}\n`;
}

/**
 * `text` as an EBNF string literal: quotes, backslashes, controls and non-ASCII escaped. xgrammar
 * ends a string at NUL, so a NUL stands outside the quotes, as the class `[\u0000]`.
 */
export function ebnfString(text: string): string {
  const parts: string[] = [];
  text.split("\0").forEach((piece, i) => {
    if (i > 0) parts.push("[\\u0000]");
    if (piece === "") return;
    let out = '"';
    for (const ch of piece) out += ch === '"' ? '\\"' : escapeCodePoint(ch.codePointAt(0)!);
    parts.push(`${out}"`);
  });
  return parts.length === 0 ? '""' : parts.join(" ");
}

/**
 * A code point as it may stand in an EBNF string or class (`"` and the class's specials left to the
 * caller). Escapes have a fixed width: xgrammar reads `\x` with as many hex digits as follow.
 */
function escapeCodePoint(cp: number): string {
  if (cp === 0x5c) return "\\\\";
  if (cp < 0x20 || cp === 0x7f) return `\\u${hex(cp, 4)}`;
  if (cp < 0x7f) return String.fromCodePoint(cp);
  return cp <= 0xffff ? `\\u${hex(cp, 4)}` : `\\U${hex(cp, 8)}`;
}

function hex(n: number, width: number): string {
  return n.toString(16).padStart(width, "0");
}

function classChar(cp: number): string {
  return cp === 0x5d || cp === 0x2d || cp === 0x5e ? `\\${String.fromCodePoint(cp)}` : escapeCodePoint(cp);
}

// JavaScript's character class escapes (no `u` flag: \d and \w are ASCII; \s is Unicode's white space).
const DIGIT: Ranges = [[0x30, 0x39]];
const WORD: Ranges = [
  [0x30, 0x39],
  [0x41, 0x5a],
  [0x5f, 0x5f],
  [0x61, 0x7a],
];
const SPACE: Ranges = [
  [0x09, 0x0d],
  [0x20, 0x20],
  [0xa0, 0xa0],
  [0x1680, 0x1680],
  [0x2000, 0x200a],
  [0x2028, 0x2029],
  [0x202f, 0x202f],
  [0x205f, 0x205f],
  [0x3000, 0x3000],
  [0xfeff, 0xfeff],
];
const LINE_TERMINATORS: Ranges = [
  [0x0a, 0x0a],
  [0x0d, 0x0d],
  [0x2028, 0x2029],
];
/** Every code point UTF-8 can carry beyond ASCII (no surrogates). */
const NON_ASCII: Ranges = [
  [0x80, 0xd7ff],
  [0xe000, MAX_CODE_POINT],
];

function normalize(ranges: Iterable<readonly [number, number]>): Ranges {
  const sorted = [...ranges].sort((a, b) => a[0] - b[0]);
  const out: [number, number][] = [];
  for (const [lo, hi] of sorted) {
    const last = out[out.length - 1];
    if (last !== undefined && lo <= last[1] + 1) last[1] = Math.max(last[1], hi);
    else out.push([lo, hi]);
  }
  return out;
}

function complement(ranges: Ranges): Ranges {
  const out: [number, number][] = [];
  let next = 0;
  for (const [lo, hi] of normalize(ranges)) {
    if (lo > next) out.push([next, lo - 1]);
    next = hi + 1;
  }
  if (next <= MAX_CODE_POINT) out.push([next, MAX_CODE_POINT]);
  return out;
}

function intersect(a: Ranges, b: Ranges): Ranges {
  const out: [number, number][] = [];
  for (const [alo, ahi] of a) {
    for (const [blo, bhi] of b) {
      const lo = Math.max(alo, blo);
      const hi = Math.min(ahi, bhi);
      if (lo <= hi) out.push([lo, hi]);
    }
  }
  return normalize(out);
}

function size(ranges: Ranges): number {
  return ranges.reduce((sum, [lo, hi]) => sum + hi - lo + 1, 0);
}

function sameRanges(a: Ranges, b: Ranges): boolean {
  return a.length === b.length && a.every(([lo, hi], i) => lo === b[i]![0] && hi === b[i]![1]);
}

function isHighSurrogate(cp: number): boolean {
  return cp >= 0xd800 && cp <= 0xdbff;
}

function isLowSurrogate(cp: number): boolean {
  return cp >= 0xdc00 && cp <= 0xdfff;
}

/** The code points of a run of values, surrogate pairs joined (the regex is read without the `u` flag). */
function joinSurrogates(codes: readonly number[]): number[] {
  const out: number[] = [];
  for (let i = 0; i < codes.length; i++) {
    const cp = codes[i]!;
    const low = codes[i + 1];
    if (isHighSurrogate(cp) && low !== undefined && isLowSurrogate(low)) {
      out.push((cp - 0xd800) * 0x400 + (low - 0xdc00) + 0x10000);
      i++;
    } else out.push(cp);
  }
  return out;
}

/** Prints a regex AST as one EBNF expression. */
class Printer {
  constructor(private readonly param: string) {}

  private refuse(construct: string, fix: string): never {
    throw new KvfenceError("invalid_request", `Regex ${construct} is not supported: ${fix}`, {
      param: this.param,
    });
  }

  /** The whole pattern: `^` may open and `$` may close each top-level alternative (the match is whole anyway). */
  top(node: RootNode): string {
    const alternatives = node.type === "disjunction" ? node.body : [node];
    return alternatives.map((alt) => this.sequence(this.stripEndAnchors(alt))).join(" | ");
  }

  private stripEndAnchors(node: RootNode): RootNode[] {
    const body = node.type === "alternative" ? [...node.body] : [node];
    const first = body[0];
    if (first?.type === "anchor" && first.kind === "start") body.shift();
    const last = body[body.length - 1];
    if (last?.type === "anchor" && last.kind === "end") body.pop();
    return body;
  }

  private sequence(nodes: readonly RootNode[]): string {
    const parts: string[] = [];
    let run: number[] = [];
    const flush = (): void => {
      if (run.length === 0) return;
      const cps = joinSurrogates(run);
      run = [];
      for (const cp of cps) if (cp >= 0xd800 && cp <= 0xdfff) this.loneSurrogate(cp);
      parts.push(ebnfString(String.fromCodePoint(...cps)));
    };
    for (const node of nodes) {
      if (node.type === "value") {
        run.push(node.codePoint);
        continue;
      }
      flush();
      parts.push(this.node(node));
    }
    flush();
    return parts.length === 0 ? '""' : parts.join(" ");
  }

  private loneSurrogate(cp: number): never {
    return this.refuse(
      `lone surrogate \\u${hex(cp, 4)}`,
      "a lone surrogate cannot be written as UTF-8; write the whole character",
    );
  }

  private node(node: Node): string {
    switch (node.type) {
      case "alternative":
        return `(${this.sequence(node.body)})`;
      case "disjunction":
        return `(${node.body.map((alt) => this.sequence(alt.type === "alternative" ? alt.body : [alt])).join(" | ")})`;
      case "group":
        if (node.behavior !== "normal" && node.behavior !== "ignore") {
          return this.refuse(
            `${node.behavior} ${node.raw.slice(0, 40)}`,
            "a grammar cannot look around; rewrite the regex without (?=…), (?!…), (?<=…) or (?<!…)",
          );
        }
        return `(${this.sequence(node.body)})`;
      case "quantifier":
        return this.quantifier(node.body[0], node.min, node.max);
      case "value":
        return this.sequence([node]);
      case "dot":
        return this.set(complement(LINE_TERMINATORS), ".");
      case "characterClassEscape":
        return this.set(this.escapeSet(node.value), node.raw);
      case "characterClass":
        return this.set(this.classSet(node), node.raw);
      case "anchor":
        return this.refuse(
          `anchor ${node.raw}`,
          "the whole output matches the regex, so ^ and $ are allowed only at its two ends, and \\b, \\B not at all",
        );
      case "reference":
        return this.refuse(
          `backreference ${node.raw}`,
          "a grammar cannot refer back to a captured group; repeat the group instead",
        );
      default:
        return this.refuse(
          `construct ${node.raw.slice(0, 40)}`,
          "use literals, classes, groups, alternation and quantifiers",
        );
    }
  }

  private quantifier(body: RootNode, min: number, max: number | undefined): string {
    if (min > MAX_REPEAT || (max !== undefined && max > MAX_REPEAT)) {
      return this.refuse(
        `repetition count above ${MAX_REPEAT}`,
        `use bounds of at most ${MAX_REPEAT}, or * and + for unbounded ones`,
      );
    }
    if (body.type === "anchor") return this.node(body);
    const operand = body.type === "value" ? this.sequence([body]) : this.node(body);
    const wrapped = /^[("[]/.test(operand) ? operand : `(${operand})`;
    if (max === undefined)
      return min === 0 ? `${wrapped}*` : min === 1 ? `${wrapped}+` : `${wrapped}{${min},}`;
    if (min === 0 && max === 1) return `${wrapped}?`;
    if (max === 0) return '""';
    return min === max ? `${wrapped}{${min}}` : `${wrapped}{${min},${max}}`;
  }

  private escapeSet(letter: "d" | "D" | "w" | "W" | "s" | "S"): Ranges {
    const lower = letter.toLowerCase();
    const base: Ranges = lower === "d" ? DIGIT : lower === "w" ? WORD : SPACE;
    return letter === lower ? base : complement(base);
  }

  private classSet(node: CharacterClass<Syntax>): Ranges {
    const ranges: (readonly [number, number])[] = [];
    const singles: number[] = [];
    for (const item of node.body) {
      if (item.type === "value") singles.push(item.codePoint);
      else if (item.type === "characterClassRange") ranges.push([item.min.codePoint, item.max.codePoint]);
      else if (item.type === "characterClassEscape") ranges.push(...this.escapeSet(item.value));
      else this.refuse(`class member ${item.raw}`, "use characters and ranges");
    }
    for (const cp of joinSurrogates(singles)) ranges.push([cp, cp]);
    const set = normalize(ranges);
    return node.negative ? complement(set) : set;
  }

  /** A set of code points as EBNF, from the forms xgrammar matches (see the header). */
  private set(set: Ranges, raw: string): string {
    const ascii = intersect(set, [[0, 0x7f]]);
    const nonAscii = intersect(set, NON_ASCII);
    if (ascii.length === 0 && nonAscii.length === 0) {
      return this.refuse(`class ${raw.slice(0, 40)} (it matches no character)`, "remove it");
    }
    const parts: string[] = [];
    if (sameRanges(nonAscii, NON_ASCII)) {
      const excluded = intersect(complement(ascii), [[0, 0x7f]]);
      if (excluded.length > 0) return `[^${this.classRanges(excluded)}]`;
      parts.push("[^\\x00-\\x7f]");
    } else if (size(nonAscii) <= MAX_LISTED_CHARS) {
      for (const [lo, hi] of nonAscii)
        for (let cp = lo; cp <= hi; cp++) parts.push(ebnfString(String.fromCodePoint(cp)));
    }
    if (ascii.length > 0) parts.unshift(`[${this.classRanges(ascii)}]`);
    if (parts.length === 0) {
      return this.refuse(
        `class ${raw.slice(0, 40)} (no ASCII member and more than ${MAX_LISTED_CHARS} non-ASCII ones)`,
        "list the characters as alternatives, or use a JSON schema",
      );
    }
    return parts.length === 1 ? parts[0]! : `(${parts.join(" | ")})`;
  }

  private classRanges(ranges: Ranges): string {
    return ranges
      .map(([lo, hi]) => (lo === hi ? classChar(lo) : `${classChar(lo)}-${classChar(hi)}`))
      .join("");
  }
}
