/**
 * Structured output end to end (issue #34), through the official `openai` client over real HTTP on
 * 127.0.0.1, in two topologies — one engine, and the threaded default (the prefill node samples
 * the first token, the decode node the rest: both apply the mask) — on tiny-qwen2 at temperature
 * 1, seeded: every vendor's field (OpenAI's `response_format` and `/v1/responses` `text.format`,
 * vLLM's `guided_*` and `structured_outputs`, SGLang's `ebnf`, llama.cpp's `grammar`) gives outputs
 * that match, checked independently of the grammar engine — JSON with ajv, regexes with
 * JavaScript's RegExp. Conflicting or malformed constraints are 400s naming the field.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Ajv } from "ajv";
import OpenAI from "openai";
import { assertPoolIdle, modelDir } from "../../testing/start-server.js";
import { startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "tiny-qwen2";
const KEY = "sk-structured-output-1";
/** Enough for every constrained answer below to end on its own (EOS once the grammar is complete). */
const MAX_TOKENS = 400;

/** Extension fields the `openai` types do not know: sent as they are in the body. */
type Extra = Record<string, unknown>;

const PERSON = {
  type: "object",
  properties: {
    name: { type: "string", pattern: "^[A-Z][a-z]{1,8}$" },
    age: { type: "integer", minimum: 0, maximum: 120 },
    mood: { enum: ["happy", "sad", "calm"] },
    tags: { type: "array", items: { enum: ["a", "b", "c"] }, maxItems: 2 },
    score: { type: "number", minimum: -1, maximum: 1 },
    pet: {
      type: "object",
      properties: { kind: { enum: ["cat", "dog"] }, legs: { type: "integer", minimum: 0, maximum: 4 } },
      required: ["kind"],
      additionalProperties: false,
    },
  },
  required: ["name", "age", "mood"],
  additionalProperties: false,
} as const;

const validPerson = new Ajv({ strict: true }).compile(PERSON);

function assertPerson(text: string | null | undefined, where: string): void {
  assert.ok(typeof text === "string", `${where}: no text`);
  let value: unknown;
  assert.doesNotThrow(
    () => {
      value = JSON.parse(text);
    },
    `${where}: not JSON: ${JSON.stringify(text)}`,
  );
  assert.ok(validPerson(value), `${where}: ${JSON.stringify(text)}: ${JSON.stringify(validPerson.errors)}`);
}

describe("issue 34: structured output through the openai client, in two topologies", {
  timeout: 300_000,
}, () => {
  const servers: { name: string; server: TopologyServer; client: OpenAI }[] = [];

  before(async () => {
    const options = { model: modelDir(MODEL), kvPages: 256, maxModelLen: 1024, apiKeys: { [KEY]: "alpha" } };
    for (const name of ["single", "threads"] as const) {
      const server = await startInProcess(name, options);
      servers.push({
        name,
        server,
        client: new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0 }),
      });
    }
  });
  after(async () => {
    await Promise.all(servers.map(async ({ server }) => server.close()));
  });

  /** `n` chat answers to `extra` (temperature 1, seeded), each checked by `check`, in every topology. */
  async function chatEverywhere(extra: Extra, n: number, check: (text: string, where: string) => void) {
    for (const { name, server, client } of servers) {
      const res = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "Describe someone." }],
        max_tokens: MAX_TOKENS,
        temperature: 1,
        seed: 34,
        n,
        ...extra,
      } as OpenAI.ChatCompletionCreateParamsNonStreaming);
      assert.equal(res.choices.length, n);
      for (const choice of res.choices) {
        const where = `${name} choice ${choice.index}`;
        assert.equal(choice.finish_reason, "stop", `${where}: ${JSON.stringify(choice.message.content)}`);
        check(choice.message.content ?? "", where);
      }
      await assertPoolIdle(server.url);
    }
  }

  /** The same on /v1/completions. */
  async function completeEverywhere(extra: Extra, n: number, check: (text: string, where: string) => void) {
    for (const { name, server, client } of servers) {
      const res = await client.completions.create({
        model: MODEL,
        prompt: "The answer:",
        max_tokens: MAX_TOKENS,
        temperature: 1,
        seed: 34,
        n,
        ...extra,
      } as OpenAI.CompletionCreateParamsNonStreaming);
      assert.equal(res.choices.length, n);
      for (const choice of res.choices) {
        const where = `${name} choice ${choice.index}`;
        assert.equal(choice.finish_reason, "stop", `${where}: ${JSON.stringify(choice.text)}`);
        check(choice.text, where);
      }
      await assertPoolIdle(server.url);
    }
  }

  function matching(pattern: RegExp): (text: string, where: string) => void {
    return (text, where) => assert.match(text, pattern, where);
  }

  test("response_format json_schema (strict): every choice parses and validates against the schema (ajv)", async () => {
    const format = { type: "json_schema", json_schema: { name: "person", schema: PERSON, strict: true } };
    await chatEverywhere({ response_format: format }, 4, assertPerson);
  });

  test("response_format json_schema, streamed: the assembled choices validate", async () => {
    const format = { type: "json_schema", json_schema: { name: "person", schema: PERSON, strict: true } };
    for (const { name, server, client } of servers) {
      const stream = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: "Describe someone." }],
        max_tokens: MAX_TOKENS,
        temperature: 1,
        seed: 35,
        n: 2,
        stream: true,
        response_format: format,
      } as OpenAI.ChatCompletionCreateParamsStreaming);
      const texts = ["", ""];
      for await (const chunk of stream)
        for (const choice of chunk.choices) texts[choice.index] += choice.delta.content ?? "";
      for (const [i, text] of texts.entries()) assertPerson(text, `${name} streamed choice ${i}`);
      await assertPoolIdle(server.url);
    }
  });

  test("response_format json_object: every choice is a JSON object", async () => {
    await chatEverywhere({ response_format: { type: "json_object" } }, 3, (text, where) => {
      const value = JSON.parse(text) as unknown;
      assert.ok(typeof value === "object" && value !== null && !Array.isArray(value), `${where}: ${text}`);
    });
  });

  test("vLLM's guided_regex (completions) and structured_outputs.regex (chat): the whole output matches", async () => {
    const pattern = "\\d{3}-[a-z]{2,4}(\\.[A-Z])?";
    await completeEverywhere({ guided_regex: pattern }, 4, matching(new RegExp(`^(?:${pattern})$`, "u")));
    await chatEverywhere(
      { structured_outputs: { regex: pattern } },
      2,
      matching(new RegExp(`^(?:${pattern})$`, "u")),
    );
  });

  test("vLLM's guided_choice: every output is one of the choices", async () => {
    const choices = ["red", "green", "blue", 'dark "navy"'];
    await chatEverywhere({ guided_choice: choices }, 4, (text, where) =>
      assert.ok(choices.includes(text), `${where}: ${text}`),
    );
  });

  test("SGLang's ebnf (completions): the output is in the grammar", async () => {
    const ebnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]{1,3}';
    await completeEverywhere({ ebnf }, 3, matching(/^\(\d{1,3}(,\d{1,3})*\)$/));
  });

  test("llama.cpp's grammar (GBNF, chat): the output is in the grammar", async () => {
    const grammar = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"';
    await chatEverywhere({ grammar }, 3, matching(/^(yes|no|maybe)\.$/));
  });

  test("/v1/responses text.format json_schema: the output text validates", async () => {
    for (const { name, server, client } of servers) {
      const res = await client.responses.create({
        model: MODEL,
        input: "Describe someone.",
        max_output_tokens: MAX_TOKENS,
        temperature: 1,
        text: { format: { type: "json_schema", name: "person", schema: PERSON, strict: true } },
      });
      assert.equal(res.status, "completed", name);
      assertPerson(res.output_text, `${name} /v1/responses`);
      await assertPoolIdle(server.url);
    }
  });

  test("two constraints, or a malformed one, get a 400 naming the field", async () => {
    const { client } = servers[0]!;
    const cases: [Extra, string, RegExp][] = [
      [
        { response_format: { type: "json_object" }, guided_regex: "a+" },
        "guided_regex",
        /response_format and guided_regex both constrain the output/,
      ],
      [{ guided_regex: "(a)\\1" }, "guided_regex", /backreference/],
      [{ regex: "(?<=a)b" }, "regex", /lookbehind/],
      [{ guided_choice: [] }, "guided_choice", /non-empty list of strings/],
      [
        { response_format: { type: "json_schema", json_schema: { name: "x" } } },
        "response_format.json_schema.schema",
        /is missing/,
      ],
      [{ guided_decoding_backend: "outlines" }, "guided_decoding_backend", /not supported/],
      // What only the grammar engine can refuse (in the router's preparation workers) names the client's field too.
      [{ ebnf: 'root ::= "a" [' }, "ebnf", /cannot be compiled/],
      [{ guided_grammar: "root ::= undefined_rule" }, "guided_grammar", /cannot be compiled/],
      [
        { guided_json: { type: "object", properties: { a: { $ref: "#/$defs/missing" } } } },
        "guided_json",
        /cannot be compiled/,
      ],
    ];
    for (const [extra, param, message] of cases) {
      await assert.rejects(
        client.chat.completions.create({
          model: MODEL,
          messages: [{ role: "user", content: "hi" }],
          max_tokens: 4,
          ...extra,
        } as OpenAI.ChatCompletionCreateParamsNonStreaming),
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.BadRequestError, `${param}: ${String(err)}`);
          assert.equal((err.error as { param?: string }).param, param, JSON.stringify(err.error));
          assert.match(err.message, message);
          return true;
        },
      );
    }
    // The server still serves constrained requests after the refusals.
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "hi" }],
      max_tokens: 8,
      guided_choice: ["ok"],
    } as OpenAI.ChatCompletionCreateParamsNonStreaming);
    assert.equal(res.choices[0]!.message.content, "ok");
  });
});
