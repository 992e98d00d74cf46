/**
 * The bounded-number grammar against the schema's own meaning: every number text a model could
 * write (xgrammar's number form: no exponent, at most FRACTION_DIGITS fraction digits, no -0) is
 * accepted exactly when ajv, a maintained validator, finds its value within the bounds.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { Ajv } from "ajv";
import { accepts } from "../../testing/grammar-judge.js";
import { KvfenceError } from "../lib/errors.js";
import { Prng } from "../lib/prng.js";
import { jsonSchemaEbnf } from "./json-schema-ebnf.js";
import { decimal, FRACTION_DIGITS, numberBounds } from "./number-range-ebnf.js";
import { loadXgrammar } from "./xgrammar-binding.js";

const xg = await loadXgrammar();
const ajv = new Ajv({ strict: false });

/** Number texts near the bounds and across the range, in xgrammar's number form. */
function candidates(bounds: number[], next: () => number): string[] {
  const out = new Set<string>(["0", "1", "-1", "0.5", "-0.5", "10", "-10", "100", "123.456789", "0.000001"]);
  const write = (x: number, digits: number): string => {
    const text = x
      .toFixed(digits)
      .replace(/(\.\d*?)0+$/, "$1")
      .replace(/\.$/, "");
    return text === "-0" ? "0" : text;
  };
  for (const b of bounds) {
    for (const d of [0, 1, 1e-6, 1e-3, 0.5, 1.5]) {
      for (const x of [b - d, b + d])
        for (const digits of [0, 1, 3, FRACTION_DIGITS]) out.add(write(x, digits));
    }
  }
  for (let i = 0; i < 60; i++) {
    const x = (next() - 0.5) * 10 ** Math.floor(next() * 4);
    out.add(write(x, Math.floor(next() * (FRACTION_DIGITS + 1))));
  }
  return [...out];
}

const CASES: Record<string, unknown>[] = [
  { minimum: -1, maximum: 1 },
  { minimum: 0, maximum: 1 },
  { minimum: 0, maximum: 100 },
  { minimum: 0.5, maximum: 2.5 },
  { minimum: -5, maximum: -2 },
  { minimum: 0 },
  { maximum: 10 },
  { minimum: -1 },
  { exclusiveMinimum: 0, maximum: 1 },
  { minimum: 0, exclusiveMaximum: 1 },
  { exclusiveMinimum: -0.25, exclusiveMaximum: 0.25 },
  { minimum: 0.125, maximum: 0.13 },
  { minimum: -12.5, maximum: 1234.0625 },
  { minimum: 3, maximum: 3 },
  { minimum: 1e-7, maximum: 0.001 },
  { minimum: 0, exclusiveMinimum: 0.5, maximum: 9.99 },
];

test("numberBounds() with jsonSchemaEbnf(): a bounded number's grammar accepts exactly the values ajv finds within the bounds", async () => {
  const rng = new Prng(7);
  const next = (): number => rng.next();
  for (const bounds of CASES) {
    const schema = { type: "number", ...bounds };
    const valid = ajv.compile(schema);
    const ebnf = jsonSchemaEbnf(xg.binding, JSON.stringify(schema), true, "response_format");
    const values = Object.values(bounds).filter((v): v is number => typeof v === "number");
    for (const text of candidates(values, next)) {
      assert.equal(await accepts(ebnf, text), valid(JSON.parse(text)), `${JSON.stringify(bounds)}: ${text}`);
    }
  }
});

test("jsonSchemaEbnf() keeps xgrammar's grammar for numbers it writes right, and refuses bounds no number meets", () => {
  assert.equal(numberBounds({ type: "number" }), null);
  assert.equal(numberBounds({ type: "integer", minimum: 0 }), null);
  assert.equal(numberBounds({ type: "number", minimum: 0, multipleOf: 0.5 }), null);
  assert.deepEqual(numberBounds({ type: "number", minimum: 1, exclusiveMinimum: true }), {
    min: 1,
    minExclusive: true,
    max: null,
    maxExclusive: false,
  });
  assert.throws(
    () => jsonSchemaEbnf(xg.binding, JSON.stringify({ type: "number", minimum: 2, maximum: 1 }), true, "x"),
    (err: unknown) =>
      err instanceof KvfenceError && /admit no number: minimum 2, maximum 1/.test(err.message),
  );
});

test("decimal() writes a double's shortest digits exactly", () => {
  assert.deepEqual(decimal(0.1), { int: "0", frac: "1" });
  assert.deepEqual(decimal(1e-7), { int: "0", frac: "0000001" });
  assert.deepEqual(decimal(1.5e21), { int: "1500000000000000000000", frac: "" });
  assert.deepEqual(decimal(1234.0625), { int: "1234", frac: "0625" });
  assert.deepEqual(decimal(0), { int: "0", frac: "" });
});
