import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { parseChatRequest, parseCompletionRequest } from "./openai-schemas.js";
import { samplingParams } from "./request-sampling.js";
import { parseResponsesRequest } from "./responses-request.js";

const chat = { model: "m", messages: [{ role: "user", content: "hi" }] };
const completion = { model: "m", prompt: "hi" };
const schema = { type: "object", properties: { a: { type: "integer" } }, required: ["a"] };
const schemaJson = JSON.stringify(schema);

function refusal(fn: () => unknown): KvfenceError {
  try {
    fn();
  } catch (err) {
    assert.ok(err instanceof KvfenceError, String(err));
    assert.equal(err.code, "invalid_request");
    return err;
  }
  throw new Error("expected a refusal");
}

test("parseChatRequest() and parseCompletionRequest() read every vendor's structured-output field into one constraint", () => {
  const cases: [Record<string, unknown>, OutputConstraint | undefined][] = [
    [{ response_format: { type: "text" } }, undefined],
    [{ response_format: { type: "json_object" } }, { kind: "json_object" }],
    [
      { response_format: { type: "json_schema", json_schema: { name: "a", schema, strict: true } } },
      { kind: "json_schema", schema: schemaJson, strict: true },
    ],
    [
      { response_format: { type: "json_schema", json_schema: { name: "a", schema } } },
      { kind: "json_schema", schema: schemaJson, strict: false },
    ],
    [{ guided_json: schema }, { kind: "json_schema", schema: schemaJson, strict: true }],
    [{ guided_json: schemaJson }, { kind: "json_schema", schema: schemaJson, strict: true }],
    [{ guided_regex: "\\d+" }, { kind: "regex", pattern: "\\d+" }],
    [{ guided_choice: ["yes", "no"] }, { kind: "choice", choices: ["yes", "no"] }],
    [{ guided_grammar: 'root ::= "a"' }, { kind: "grammar", ebnf: 'root ::= "a"' }],
    [{ structured_outputs: { json: schema } }, { kind: "json_schema", schema: schemaJson, strict: true }],
    [{ structured_outputs: { regex: "a+", disable_fallback: true } }, { kind: "regex", pattern: "a+" }],
    [{ structured_outputs: { choice: ["x"] } }, { kind: "choice", choices: ["x"] }],
    [{ structured_outputs: { grammar: 'root ::= "b"' } }, { kind: "grammar", ebnf: 'root ::= "b"' }],
    [{ structured_outputs: { json_object: true } }, { kind: "json_object" }],
    [{ json_schema: schemaJson }, { kind: "json_schema", schema: schemaJson, strict: true }],
    [{ json_schema: schema }, { kind: "json_schema", schema: schemaJson, strict: true }],
    [{ regex: "[a-z]{2}" }, { kind: "regex", pattern: "[a-z]{2}" }],
    [{ ebnf: 'root ::= "c"' }, { kind: "grammar", ebnf: 'root ::= "c"' }],
    [{ grammar: 'root ::= "d"' }, { kind: "grammar", ebnf: 'root ::= "d"' }],
    [
      { guided_decoding_backend: "xgrammar", guided_regex: "a" },
      { kind: "regex", pattern: "a" },
    ],
  ];
  for (const [extra, want] of cases) {
    const field = Object.keys(extra).find((k) => k !== "guided_decoding_backend")!;
    const inner = Object.keys((extra.structured_outputs as object | undefined) ?? {})[0];
    const schemaField = field === "response_format" && want?.kind === "json_schema";
    const param = schemaField
      ? "response_format.json_schema.schema"
      : inner === undefined
        ? field
        : `${field}.${inner}`;
    for (const parsed of [
      parseChatRequest({ ...chat, ...extra }),
      parseCompletionRequest({ ...completion, ...extra }),
    ]) {
      assert.deepEqual(parsed.constraint, want, JSON.stringify(extra));
      // The field a refusal to compile it names.
      assert.equal(parsed.constraintParam, want === undefined ? undefined : param, JSON.stringify(extra));
      // The sampling every node receives carries it.
      assert.deepEqual(samplingParams(parsed, { eosTokenIds: [2] }).constraint, want, JSON.stringify(extra));
    }
  }
});

test("parseResponsesRequest() reads text.format (the schema's fields flat)", () => {
  const base = { model: "m", input: "hi" };
  const cases: [unknown, OutputConstraint | undefined][] = [
    [{ type: "text" }, undefined],
    [{ type: "json_object" }, { kind: "json_object" }],
    [
      { type: "json_schema", name: "a", schema, strict: true },
      { kind: "json_schema", schema: schemaJson, strict: true },
    ],
  ];
  for (const [format, want] of cases) {
    const parsed = parseResponsesRequest({ ...base, text: { format } });
    assert.deepEqual(parsed.constraint, want, JSON.stringify(format));
    const param = want?.kind === "json_schema" ? "text.format.schema" : "text.format";
    assert.equal(parsed.constraintParam, want === undefined ? undefined : param);
  }
  const err = refusal(() =>
    parseResponsesRequest({ ...base, text: { format: { type: "json_schema", name: "a" } } }),
  );
  assert.equal(err.param, "text.format.schema");
  assert.match(err.message, /is missing: send the JSON Schema/);
});

test("two constraints in one request are refused naming both fields", () => {
  const pairs: [Record<string, unknown>, string, string][] = [
    [{ response_format: { type: "json_object" }, guided_regex: "a" }, "response_format", "guided_regex"],
    [{ guided_json: schema, regex: "a" }, "guided_json", "regex"],
    [
      { structured_outputs: { json: schema, regex: "a" } },
      "structured_outputs.json",
      "structured_outputs.regex",
    ],
    [{ ebnf: 'root ::= "a"', grammar: 'root ::= "a"' }, "ebnf", "grammar"],
    [{ guided_choice: ["a"], json_schema: schemaJson }, "guided_choice", "json_schema"],
  ];
  for (const [extra, first, second] of pairs) {
    const err = refusal(() => parseChatRequest({ ...chat, ...extra }));
    assert.equal(err.param, second);
    assert.equal(err.message, `${first} and ${second} both constrain the output: send only one of them`);
  }
  // `{"type": "text"}` constrains nothing: it goes with any other.
  assert.deepEqual(parseChatRequest({ ...chat, response_format: { type: "text" }, regex: "a" }).constraint, {
    kind: "regex",
    pattern: "a",
  });
});

test("malformed structured-output values are refused naming the field", () => {
  const cases: [Record<string, unknown>, string, RegExp][] = [
    [
      { response_format: { type: "grammar" } },
      "response_format.type",
      /"grammar" is not supported: send "text", "json_object" or "json_schema"/,
    ],
    [
      { response_format: { type: "json_schema", json_schema: { name: "a" } } },
      "response_format.json_schema.schema",
      /is missing/,
    ],
    [
      { response_format: { type: "json_schema", json_schema: { schema, strict: "yes" } } },
      "response_format.json_schema.strict",
      /must be a boolean: got a string/,
    ],
    [
      { response_format: { type: "json_schema", json_schema: { schema: [1] } } },
      "response_format.json_schema.schema",
      /must be a JSON Schema \(an object\): got an array/,
    ],
    [{ guided_json: "{not json" }, "guided_json", /^guided_json is not valid JSON: /],
    [{ guided_json: 3 }, "guided_json", /got a number/],
    [{ guided_regex: "(a)\\1" }, "guided_regex", /^Regex backreference \\1 is not supported/],
    [{ regex: "a(?=b)" }, "regex", /lookahead/],
    [{ structured_outputs: { regex: "\\bx" } }, "structured_outputs.regex", /anchor \\b/],
    [{ guided_regex: "" }, "guided_regex", /a non-empty string/],
    [{ guided_choice: [] }, "guided_choice", /non-empty list of strings/],
    [{ guided_choice: ["a", 1] }, "guided_choice", /non-empty list of strings/],
    [
      { guided_choice: Array.from({ length: 1025 }, (_, i) => `c${i}`) },
      "guided_choice",
      /1025 choices, at most 1024/,
    ],
    [{ guided_grammar: 42 }, "guided_grammar", /must be a grammar/],
    [{ ebnf: "" }, "ebnf", /must be a grammar/],
    [{ json_schema: "[]" }, "json_schema", /got an array/],
    [{ structured_outputs: "json" }, "structured_outputs", /must be an object: got a string/],
    [{ structured_outputs: { json_object: "yes" } }, "structured_outputs.json_object", /must be a boolean/],
    [
      { structured_outputs: { whitespace_pattern: " " } },
      "structured_outputs.whitespace_pattern",
      /is not supported/,
    ],
    [
      { guided_decoding_backend: "outlines", guided_regex: "a" },
      "guided_decoding_backend",
      /is not supported/,
    ],
  ];
  for (const [extra, param, message] of cases) {
    for (const parse of [
      () => parseChatRequest({ ...chat, ...extra }),
      () => parseCompletionRequest({ ...completion, ...extra }),
    ]) {
      const err = refusal(parse);
      assert.equal(err.param, param, JSON.stringify(extra).slice(0, 80));
      assert.match(err.message, message);
    }
  }
});
