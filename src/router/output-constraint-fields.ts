/**
 * The structured-output fields of every vendor, read into the one `OutputConstraint` a request's
 * sampling carries (src/protocol/output-constraint.ts):
 *
 * - OpenAI: `response_format` — `{"type": "text"}` (none), `{"type": "json_object"}`,
 *   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; on /v1/responses its
 *   `text.format`, the same with the schema's fields flat (`{"type": "json_schema", "name", "schema",
 *   "strict"}`);
 * - vLLM: `guided_json` (a schema, or its JSON text), `guided_regex`, `guided_choice`,
 *   `guided_grammar`, and its newer `structured_outputs` object (`json`, `regex`, `choice`,
 *   `grammar`, `json_object`);
 * - SGLang: `json_schema` (JSON text), `regex`, `ebnf`; llama.cpp: `grammar` (GBNF) and
 *   `json_schema` (a schema object).
 *
 * At most one constraint per request: two are refused naming both fields (which one would win is
 * each vendor's own rule, and a client sending two has a bug). A malformed value is refused naming
 * its field. A regex or a choice list is converted here once (`regexToEbnf`, `choiceToEbnf`: pure,
 * bounded), so that an error names the client's own field; a schema's or a grammar's compilation
 * is the grammar engine's, off this thread (the preparation workers' `compileCheck`).
 *
 * OpenAI's schemas are strict only with `strict: true` (no properties beyond the schema's). vLLM,
 * SGLang and llama.cpp compile every schema strictly (xgrammar's default, which both Python servers
 * use; llama.cpp's converter likewise admits no other properties unless the schema allows them).
 */

import { choiceToEbnf, regexToEbnf } from "../grammar/regex-to-ebnf.js";
import { KvfenceError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";

/** The most strings a choice list may hold. */
export const MAX_CHOICES = 1024;

/** A constraint with the request field it came from (for errors). */
interface Found {
  readonly param: string;
  readonly constraint: OutputConstraint;
}

function refuse(param: string, message: string): never {
  throw new KvfenceError("invalid_request", message, { param });
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function kindOf(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "object" ? "an object" : `a ${typeof value}`;
}

/** A JSON Schema given as an object or as its JSON text, as the JSON text of an object or a boolean. */
function schemaText(param: string, value: unknown, strict: boolean): OutputConstraint {
  let schema = value;
  if (typeof value === "string") {
    try {
      schema = JSON.parse(value);
    } catch (err) {
      refuse(param, `${param} is not valid JSON: ${(err as Error).message}`);
    }
  }
  if (!isObject(schema) && typeof schema !== "boolean")
    refuse(param, `${param} must be a JSON Schema (an object): got ${kindOf(schema)}`);
  let json: string;
  try {
    json = JSON.stringify(schema);
  } catch {
    // Only a schema nested deeper than the stack (a parser that lets one through) gets here.
    refuse(param, `${param} nests too deep to be a JSON Schema: got ${kindOf(schema)}`);
  }
  return { kind: "json_schema", schema: json, strict };
}

function text(param: string, value: unknown, what: string): string {
  if (typeof value !== "string" || value === "")
    refuse(param, `${param} must be ${what}: got ${kindOf(value)}`);
  return value;
}

function regex(param: string, value: unknown): OutputConstraint {
  const pattern = text(param, value, "a regular expression (a non-empty string)");
  regexToEbnf(pattern, { param });
  return { kind: "regex", pattern };
}

function choice(param: string, value: unknown): OutputConstraint {
  if (!Array.isArray(value) || value.length === 0 || value.some((c) => typeof c !== "string"))
    refuse(param, `${param} must be a non-empty list of strings: got ${kindOf(value)}`);
  if (value.length > MAX_CHOICES)
    refuse(param, `${param} has ${value.length} choices, at most ${MAX_CHOICES}: send fewer, or a regex`);
  const choices = value as string[];
  choiceToEbnf(choices, { param });
  return { kind: "choice", choices };
}

function grammar(param: string, value: unknown): OutputConstraint {
  return { kind: "grammar", ebnf: text(param, value, "a grammar (GBNF / EBNF text, start rule root)") };
}

/** OpenAI's `response_format` (and, with `flat`, the Responses API's `text.format`), else null for text. */
function openAiFormat(param: string, value: unknown, flat: boolean): OutputConstraint | null {
  if (!isObject(value)) refuse(param, `${param} must be an object with a type: got ${kindOf(value)}`);
  switch (value.type) {
    case "text":
      return null;
    case "json_object":
      return { kind: "json_object" };
    case "json_schema": {
      const inner = flat ? value : value.json_schema;
      const innerParam = flat ? param : `${param}.json_schema`;
      if (!isObject(inner))
        refuse(
          innerParam,
          `${innerParam} must be an object ({"name", "schema", "strict"}): got ${kindOf(inner)}`,
        );
      if (inner.schema == null)
        refuse(
          `${innerParam}.schema`,
          `${innerParam}.schema is missing: send the JSON Schema the output must match`,
        );
      if (inner.strict != null && typeof inner.strict !== "boolean")
        refuse(`${innerParam}.strict`, `${innerParam}.strict must be a boolean: got ${kindOf(inner.strict)}`);
      return schemaText(`${innerParam}.schema`, inner.schema, inner.strict === true);
    }
    default:
      return refuse(
        `${param}.type`,
        `${param}.type ${JSON.stringify(value.type)?.slice(0, 40) ?? "(missing)"} is not supported: send "text", "json_object" or "json_schema"`,
      );
  }
}

/** The keys of vLLM's `structured_outputs` that name a constraint. */
const STRUCTURED_OUTPUTS_KINDS = ["json", "regex", "choice", "grammar", "json_object"] as const;

/** Keys of `structured_outputs` that change nothing here (xgrammar is the backend; no fallback). */
const STRUCTURED_OUTPUTS_NEUTRAL = new Set(["disable_fallback", "disable_additional_properties"]);

/** vLLM's `structured_outputs`: the constraints it names (one, unless the client erred). */
function structuredOutputs(value: unknown): Found[] {
  const param = "structured_outputs";
  if (!isObject(value)) refuse(param, `${param} must be an object: got ${kindOf(value)}`);
  const found: Found[] = [];
  for (const [key, field] of Object.entries(value)) {
    if (field == null || field === false) continue;
    const at = `${param}.${key}`;
    switch (key) {
      case "json":
        found.push({ param: at, constraint: schemaText(at, field, true) });
        break;
      case "regex":
        found.push({ param: at, constraint: regex(at, field) });
        break;
      case "choice":
        found.push({ param: at, constraint: choice(at, field) });
        break;
      case "grammar":
        found.push({ param: at, constraint: grammar(at, field) });
        break;
      case "json_object":
        if (field !== true) refuse(at, `${at} must be a boolean: got ${kindOf(field)}`);
        found.push({ param: at, constraint: { kind: "json_object" } });
        break;
      default:
        if (!STRUCTURED_OUTPUTS_NEUTRAL.has(key))
          refuse(
            at,
            `${at} is not supported: leave it unset; this server takes ${STRUCTURED_OUTPUTS_KINDS.join(", ")}`,
          );
    }
  }
  return found;
}

/** One request's constraint, or undefined; two or more are refused naming the first two fields. */
function single(found: readonly Found[]): OutputConstraint | undefined {
  if (found.length > 1) {
    const [a, b] = found;
    refuse(b!.param, `${a!.param} and ${b!.param} both constrain the output: send only one of them`);
  }
  return found[0]?.constraint;
}

/** The constraint of a chat or completions body (its fields as the client sent them). */
export function requestConstraint(body: Readonly<Record<string, unknown>>): OutputConstraint | undefined {
  const found: Found[] = [];
  const take = (param: string, read: (param: string, value: unknown) => OutputConstraint | null): void => {
    const value = body[param];
    if (value == null) return;
    const constraint = read(param, value);
    if (constraint !== null) found.push({ param, constraint });
  };
  take("response_format", (p, v) => openAiFormat(p, v, false));
  take("guided_json", (p, v) => schemaText(p, v, true));
  take("guided_regex", regex);
  take("guided_choice", choice);
  take("guided_grammar", grammar);
  if (body.structured_outputs != null) found.push(...structuredOutputs(body.structured_outputs));
  // SGLang's json_schema is JSON text, llama.cpp's an object: both are a schema.
  take("json_schema", (p, v) => schemaText(p, v, true));
  take("regex", regex);
  take("ebnf", grammar);
  take("grammar", grammar);
  return single(found);
}

/** The constraint of a /v1/responses body: its `text.format`. */
export function responsesConstraint(body: Readonly<Record<string, unknown>>): OutputConstraint | undefined {
  const format = isObject(body.text) ? body.text.format : undefined;
  if (format == null) return undefined;
  return openAiFormat("text.format", format, true) ?? undefined;
}
