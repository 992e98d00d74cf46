/**
 * A JSON schema as xgrammar EBNF whose every output is valid JSON. xgrammar 0.1.27 (its
 * `_JSONSchemaToEBNF`, the converter behind `CompileJSONSchema`) writes two kinds of string
 * content raw, as if a string's value were its JSON text:
 *
 * - a string with `minLength` / `maxLength` becomes `[^"\\\r\n]{m,n}`, which lets a model write a
 *   raw control character (a tab, a backspace) that JSON must escape: `JSON.parse` refuses the
 *   output; and a non-ASCII member may be bytes that are not UTF-8, counted as characters;
 * - a string's `pattern` becomes the regex's grammar over the JSON text, so `.` or `[^x]` lets the
 *   model close the string early with a `"` or write a raw control character.
 *
 * So the schema's patterns are swapped for placeholders before the conversion and their grammars
 * put back from `regexToEbnfExpression` in its JSON-string mode (a literal `"` written `\"`, classes
 * cut to printable ASCII without `"` and `\\`: the value still matches the pattern), and the bounded
 * strings' class is cut the same way. So such strings are ASCII (docs/structured-output.md).
 * `propertyNames` and `patternProperties` patterns are left to xgrammar.
 *
 * xgrammar also writes a bounded `number` wrongly at its bounds (src/grammar/number-range-ebnf.ts):
 * each such schema is swapped for a `const` placeholder and its grammar put back from there.
 */
import { randomBytes } from "node:crypto";
import { KvfenceError } from "../lib/errors.js";
import { type NumberBounds, numberBounds, numberRangeEbnf } from "./number-range-ebnf.js";
import { regexToEbnfExpression } from "./regex-to-ebnf.js";
import type { XgrammarBinding } from "./xgrammar-binding.js";

/**
 * The class xgrammar writes for a string with length bounds, and what it becomes: printable ASCII
 * but `"` and `\\`. Not every character JSON allows unescaped: xgrammar 0.1.27 lets a non-ASCII
 * member of a class be any byte sequence, not valid UTF-8, and counts the length in those pieces.
 */
const BOUNDED_CLASS = '[^"\\\\\\r\\n]';
const JSON_SAFE_CLASS = "[ !#-\\[\\]-~]";

/** Keywords whose values are data, not schemas: never searched for patterns. */
const DATA_KEYWORDS = new Set(["enum", "const", "default", "examples"]);

/**
 * `schema` (JSON text) as EBNF (start rule `root`): one line, `", "` and `": "` between items, no
 * properties beyond the schema's when `strict`. Throws `invalid_request` (field `param`) for a
 * pattern the grammar cannot express or JSON text that is not an object.
 */
export function jsonSchemaEbnf(
  binding: XgrammarBinding,
  schema: string,
  strict: boolean,
  param: string,
): string {
  let parsed: unknown;
  try {
    parsed = JSON.parse(schema);
  } catch (err) {
    throw new KvfenceError("invalid_request", `The JSON schema is not JSON: ${(err as Error).message}`, {
      param,
    });
  }
  const nonce = randomBytes(6).toString("hex");
  const patterns: string[] = [];
  const numbers: NumberBounds[] = [];
  const placeholder = (i: number): string => `kvfencepattern${nonce}n${i}x`;
  const numberPlaceholder = (i: number): string => `kvfencenumber${nonce}n${i}x`;
  const swapped = walkSchemas(parsed, (node) => {
    const bounds = numberBounds(node);
    if (bounds !== null) {
      numbers.push(bounds);
      return { const: numberPlaceholder(numbers.length - 1) };
    }
    if (typeof node.pattern !== "string") return node;
    patterns.push(node.pattern);
    return { ...node, pattern: `^${placeholder(patterns.length - 1)}$` };
  });
  let ebnf: string = binding._JSONSchemaToEBNF(
    JSON.stringify(swapped),
    false,
    undefined,
    undefined,
    strict,
    undefined,
    binding.JSONFormat.kJSON,
  );
  ebnf = ebnf.split(BOUNDED_CLASS).join(JSON_SAFE_CLASS);
  patterns.forEach((pattern, i) => {
    // xgrammar writes the placeholder's characters one literal each, between the string's quotes.
    const written = `"\\"" ${[...placeholder(i)].map((c) => `"${c}"`).join(" ")} "\\""`;
    const grammar = `"\\"" (${patternEbnf(pattern, param)}) "\\""`;
    ebnf = ebnf.split(written).join(grammar);
  });
  numbers.forEach((bounds, i) => {
    // A string `const` is written as one literal, quotes included.
    ebnf = ebnf.split(`"\\"${numberPlaceholder(i)}\\""`).join(`(${numberRangeEbnf(bounds, param)})`);
  });
  return ebnf;
}

/** A pattern's grammar in a JSON string; a refusal names the pattern. */
function patternEbnf(pattern: string, param: string): string {
  try {
    return regexToEbnfExpression(pattern, { param, jsonString: true });
  } catch (err) {
    if (!(err instanceof KvfenceError)) throw err;
    throw new KvfenceError(
      "invalid_request",
      `The JSON schema's pattern ${JSON.stringify(pattern)}: ${err.message}`,
      {
        param,
        cause: err,
      },
    );
  }
}

/**
 * `node` with every schema object (every object outside the data keywords) replaced by
 * `visit(it)`, children first.
 */
function walkSchemas(
  node: unknown,
  visit: (schema: Record<string, unknown>) => Record<string, unknown>,
): unknown {
  if (Array.isArray(node)) return node.map((item) => walkSchemas(item, visit));
  if (node === null || typeof node !== "object") return node;
  const out: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(node)) {
    out[key] = DATA_KEYWORDS.has(key) ? value : walkSchemas(value, visit);
  }
  return visit(out);
}
