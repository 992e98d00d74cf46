/**
 * The grammar of a JSON number between a JSON schema's bounds (`minimum`, `maximum`,
 * `exclusiveMinimum`, `exclusiveMaximum`), exact at the bounds. xgrammar 0.1.27 writes a bounded
 * `number` wrongly: for [-1, 1] it allows `-1.6782` and `1.5` and refuses `-0.5`; for [0.5, 2.5]
 * it allows `0x5`; it ignores `exclusiveMinimum`. So json-schema-ebnf.ts swaps each bounded number
 * schema for a placeholder and puts back this grammar.
 *
 * A number is written as xgrammar writes one: an optional `-`, an integer part without leading
 * zeros, and at most `FRACTION_DIGITS` fraction digits; no exponent, no `-0`. Bounds are compared
 * digit by digit as decimals (a bound of 0.1 is 0.1, not the double nearest it).
 */
import { KvfenceError } from "../lib/errors.js";

/** Fraction digits a bounded number may have (xgrammar's own limit). */
export const FRACTION_DIGITS = 6;

/** A non-negative decimal: its integer part without leading zeros ("0" for none), its fraction without trailing zeros. */
interface Decimal {
  readonly int: string;
  readonly frac: string;
}

/** One side of the range: a decimal magnitude and whether it is excluded. */
interface Side {
  readonly at: Decimal;
  readonly exclusive: boolean;
}

/** A schema's bounds, as JSON numbers; null: unbounded on that side. */
export interface NumberBounds {
  readonly min: number | null;
  readonly minExclusive: boolean;
  readonly max: number | null;
  readonly maxExclusive: boolean;
}

/**
 * The bounds of `schema` when it is a bounded `number` schema this module writes (type "number",
 * at least one bound, every bound a finite number, no `multipleOf`), else null.
 */
export function numberBounds(schema: Record<string, unknown>): NumberBounds | null {
  if (schema.type !== "number" || "multipleOf" in schema || "enum" in schema || "const" in schema)
    return null;
  const { minimum, maximum, exclusiveMinimum, exclusiveMaximum } = schema;
  const finite = (v: unknown): v is number => typeof v === "number" && Number.isFinite(v);
  for (const v of [minimum, maximum]) if (v !== undefined && !finite(v)) return null;
  for (const v of [exclusiveMinimum, exclusiveMaximum])
    if (v !== undefined && typeof v !== "boolean" && !finite(v)) return null;
  const lower = side(minimum as number | undefined, exclusiveMinimum as number | boolean | undefined, 1);
  const upper = side(maximum as number | undefined, exclusiveMaximum as number | boolean | undefined, -1);
  if (lower === null && upper === null) return null;
  return {
    min: lower?.value ?? null,
    minExclusive: lower?.exclusive ?? false,
    max: upper?.value ?? null,
    maxExclusive: upper?.exclusive ?? false,
  };
}

/**
 * The stricter of an inclusive bound and an exclusive one (draft 6: a number; draft 4: a boolean
 * that makes the inclusive one exclusive). `toward` is 1 for a lower bound, -1 for an upper one.
 */
function side(
  inclusive: number | undefined,
  exclusive: number | boolean | undefined,
  toward: 1 | -1,
): { value: number; exclusive: boolean } | null {
  if (typeof exclusive === "boolean") return inclusive === undefined ? null : { value: inclusive, exclusive };
  if (exclusive === undefined) return inclusive === undefined ? null : { value: inclusive, exclusive: false };
  if (inclusive === undefined || (exclusive - inclusive) * toward >= 0)
    return { value: exclusive, exclusive: true };
  return { value: inclusive, exclusive: false };
}

/**
 * The EBNF expression of the numbers within `bounds`. Throws `invalid_request` (field `param`)
 * when no number is, naming the bounds.
 */
export function numberRangeEbnf(bounds: NumberBounds, param: string): string {
  const alternatives = [nonNegative(bounds), negative(bounds)].filter((a) => a !== null);
  if (alternatives.length === 0) {
    const { min, max } = bounds;
    const shown = [
      min === null ? null : `${bounds.minExclusive ? "exclusiveMinimum" : "minimum"} ${min}`,
      max === null ? null : `${bounds.maxExclusive ? "exclusiveMaximum" : "maximum"} ${max}`,
    ].filter((s) => s !== null);
    throw new KvfenceError(
      "invalid_request",
      `The JSON schema's number bounds admit no number: ${shown.join(", ")}; loosen them`,
      { param },
    );
  }
  return alternativesOf(alternatives)!;
}

/** Zero and up: from the lower bound (or 0) to the upper one; null: none. */
function nonNegative({ min, minExclusive, max, maxExclusive }: NumberBounds): string | null {
  if (max !== null && (max < 0 || (max === 0 && maxExclusive))) return null;
  const lo: Side =
    min !== null && min >= 0 ? { at: decimal(min), exclusive: minExclusive } : { at: ZERO, exclusive: false };
  return magnitude(lo, max === null ? null : { at: decimal(max), exclusive: maxExclusive });
}

/** Below zero: "-" and a magnitude above 0 (or from -max) up to -min; null: none. */
function negative({ min, minExclusive, max, maxExclusive }: NumberBounds): string | null {
  if (min !== null && min >= 0) return null;
  const lo: Side =
    max !== null && max < 0 ? { at: decimal(-max), exclusive: maxExclusive } : { at: ZERO, exclusive: true };
  const m = magnitude(lo, min === null ? null : { at: decimal(-min), exclusive: minExclusive });
  return m === null ? null : `"-" ${m}`;
}

const ZERO: Decimal = { int: "0", frac: "" };

/** `x` (≥ 0) as an exact decimal: the shortest digits that read back as `x`. */
export function decimal(x: number): Decimal {
  const m = /^(\d+)(?:\.(\d+))?(?:e([+-]\d+))?$/.exec(String(x));
  if (m === null) throw new Error(`not a non-negative finite number: ${x}`);
  const digits = m[1]! + (m[2] ?? "");
  const point = m[1]!.length + Number(m[3] ?? 0);
  const int = point <= 0 ? "0" : digits.slice(0, point).padEnd(point, "0");
  const frac = point <= 0 ? "0".repeat(-point) + digits : digits.slice(point);
  return { int: int.replace(/^0+(?=\d)/, ""), frac: frac.replace(/0+$/, "") };
}

/**
 * The magnitudes (an integer part, and an optional `.` and 1 to FRACTION_DIGITS digits) from `lo`
 * to `hi` (null: unbounded); null when there are none.
 */
function magnitude(lo: Side, hi: Side | null): string | null {
  const loInt = BigInt(lo.at.int);
  const hiInt = hi === null ? null : BigInt(hi.at.int);
  if (hiInt !== null && loInt > hiInt) return null;
  const alternatives: string[] = [];
  const add = (int: string, fraction: string | null): void => {
    if (fraction !== null) alternatives.push(then(`"${int}"`, fraction));
  };
  if (hi !== null && hiInt === loInt) {
    const [a, ea, b, eb] = [lo.at.frac, lo.exclusive, hi.at.frac, hi.exclusive];
    add(
      lo.at.int,
      fractionPart(a === "" && !ea && (b !== "" || !eb), between(a, b, FRACTION_DIGITS, ea, eb, true)),
    );
    return alternativesOf(alternatives);
  }
  const a = lo.at.frac;
  add(lo.at.int, fractionPart(a === "" && !lo.exclusive, atLeast(a, FRACTION_DIGITS, lo.exclusive, true)));
  const middle = integers(loInt + 1n, hiInt === null ? null : hiInt - 1n);
  if (middle !== null) alternatives.push(`${middle} ("." [0-9]{1,${FRACTION_DIGITS}})?`);
  if (hi !== null) {
    const b = hi.at.frac;
    add(hi.at.int, fractionPart(b !== "" || !hi.exclusive, atMost(b, FRACTION_DIGITS, hi.exclusive, true)));
  }
  return alternativesOf(alternatives);
}

/**
 * What may follow an integer part: nothing (the fraction 0) when `empty`, or "." and the digits
 * `digits` allows (null: none). `'""'` alone: only nothing; null: neither.
 */
function fractionPart(empty: boolean, digits: string | null): string | null {
  const options = [...(empty ? ['""'] : []), ...(digits === null ? [] : [`"." ${digits}`])];
  if (options.length === 0) return null;
  return options.length === 1 ? options[0]! : `(${options.join(" | ")})`;
}

/** `[0-9]` repeated `min` to `max` times ("" when max is 0), followed by a space when not empty. */
function anyDigits(min: number, max: number): string {
  if (max === 0) return "";
  return min === max ? `[0-9]{${min}} ` : `[0-9]{${min},${max}} `;
}

/** `head` followed by `rest` (`'""'`: nothing). */
function then(head: string, rest: string): string {
  return rest === '""' ? head : `${head} ${rest}`;
}

/**
 * The fraction digit strings s of at most `room` digits (at least one when `need`) with
 * 0.s ≥ 0.f (> with `exclusive`); null: none.
 */
function atLeast(f: string, room: number, exclusive: boolean, need: boolean): string | null {
  const options: string[] = [];
  if (f === "") {
    if (!exclusive && !need) options.push('""');
    if (room > 0) {
      if (!exclusive) options.push(anyDigits(1, room).trim());
      else {
        options.push(`[1-9] ${anyDigits(0, room - 1)}`.trim());
        const rest = atLeast("", room - 1, true, true);
        if (rest !== null) options.push(then('"0"', rest));
      }
    }
  } else if (room > 0) {
    const c = Number(f[0]);
    if (c < 9) options.push(`[${c + 1}-9] ${anyDigits(0, room - 1)}`.trim());
    const rest = atLeast(f.slice(1), room - 1, exclusive, false);
    if (rest !== null) options.push(then(`"${c}"`, rest));
  }
  return alternativesOf(options);
}

/** As `atLeast`, for 0.s ≤ 0.f (< with `exclusive`). */
function atMost(f: string, room: number, exclusive: boolean, need: boolean): string | null {
  const options: string[] = [];
  if (f === "") {
    // Only zeros reach 0, and only when 0 itself is allowed.
    if (!exclusive) {
      if (!need) options.push('""');
      if (room > 0) options.push(`[0]{1,${room}}`);
    }
  } else {
    // Shorter than f's digits, equal so far: below f (f ends in a nonzero digit).
    if (!need) options.push('""');
    if (room > 0) {
      const c = Number(f[0]);
      if (c > 0) options.push(`[0-${c - 1}] ${anyDigits(0, room - 1)}`.trim());
      const rest = atMost(f.slice(1), room - 1, exclusive, false);
      if (rest !== null) options.push(then(`"${c}"`, rest));
    }
  }
  return alternativesOf(options);
}

/** As `atLeast`, for 0.a ≤ 0.s ≤ 0.b (each end excluded by its flag); a ≤ b. */
function between(
  a: string,
  b: string,
  room: number,
  aExclusive: boolean,
  bExclusive: boolean,
  need: boolean,
): string | null {
  const options: string[] = [];
  if (!need && a === "" && !aExclusive && (b !== "" || !bExclusive)) options.push('""');
  if (room > 0) {
    const a0 = a === "" ? 0 : Number(a[0]);
    const b0 = b === "" ? 0 : Number(b[0]);
    const aRest = a.slice(1);
    const bRest = b.slice(1);
    const tail = (digit: number, rest: string | null): void => {
      if (rest !== null) options.push(then(`"${digit}"`, rest));
    };
    if (a0 === b0) tail(a0, between(aRest, bRest, room - 1, aExclusive, bExclusive, false));
    else if (a0 < b0) {
      tail(a0, atLeast(aRest, room - 1, aExclusive, false));
      if (b0 - a0 > 1) options.push(`[${a0 + 1}-${b0 - 1}] ${anyDigits(0, room - 1)}`.trim());
      tail(b0, atMost(bRest, room - 1, bExclusive, false));
    }
  }
  return alternativesOf(options);
}

function alternativesOf(options: readonly string[]): string | null {
  if (options.length === 0) return null;
  return options.length === 1 ? options[0]! : `(${options.join(" | ")})`;
}

/** The integers from `lo` to `hi` (null: unbounded) written without leading zeros; null when none. */
function integers(lo: bigint, hi: bigint | null): string | null {
  if (hi !== null && lo > hi) return null;
  const options: string[] = [];
  const lengthOf = (n: bigint): number => n.toString().length;
  const last = hi === null ? lengthOf(lo) : lengthOf(hi);
  for (let length = lengthOf(lo); length <= last; length++) {
    const first = length === 1 ? 0n : 10n ** BigInt(length - 1);
    const from = lo > first ? lo : first;
    const top = 10n ** BigInt(length) - 1n;
    const to = hi !== null && hi < top ? hi : top;
    if (from <= to) options.push(sameLength(from.toString(), to.toString()));
  }
  if (hi === null) options.push(`[1-9] [0-9]{${last}} [0-9]*`);
  return alternativesOf(options);
}

/** The digit strings of one length from `s` to `t` (s ≤ t). */
function sameLength(s: string, t: string): string {
  if (s === t) return `"${s}"`;
  let i = 0;
  while (s[i] === t[i]) i++;
  const prefix = s.slice(0, i);
  const n = s.length - i - 1;
  const s0 = Number(s[i]);
  const t0 = Number(t[i]);
  const options = [then(`"${s0}"`, digitsAtLeast(s.slice(i + 1)))];
  if (t0 - s0 > 1) options.push(`[${s0 + 1}-${t0 - 1}] ${anyDigits(n, n)}`.trim());
  options.push(then(`"${t0}"`, digitsAtMost(t.slice(i + 1))));
  const body = `(${options.join(" | ")})`;
  return prefix === "" ? body : `"${prefix}" ${body}`;
}

/** Digit strings as long as `x` that are ≥ x. */
function digitsAtLeast(x: string): string {
  if (x === "") return '""';
  const c = Number(x[0]);
  const rest = then(`"${c}"`, digitsAtLeast(x.slice(1)));
  return c < 9 ? `([${c + 1}-9] ${anyDigits(x.length - 1, x.length - 1)}| ${rest})` : rest;
}

/** Digit strings as long as `x` that are ≤ x. */
function digitsAtMost(x: string): string {
  if (x === "") return '""';
  const c = Number(x[0]);
  const rest = then(`"${c}"`, digitsAtMost(x.slice(1)));
  return c > 0 ? `([0-${c - 1}] ${anyDigits(x.length - 1, x.length - 1)}| ${rest})` : rest;
}
