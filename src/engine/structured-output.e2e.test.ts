/**
 * Structured output in every topology, through the official `openai` client: one engine, the
 * threaded default (prefill samples the first token, decode the rest) and a TCP cluster of node
 * processes (the constraint crosses as JSON). Each choice of n > 1, streamed and not, parses and
 * validates against the schema with ajv; a schema the engine cannot compile is a 400 naming it.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Ajv } from "ajv";
import OpenAI from "openai";
import { modelDir } from "../../testing/start-server.js";
import { startCluster, startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const MODEL = "kvfence-tiny";
const KEY = "sk-structured-output-test-key-0001";
const SCHEMA = {
  type: "object",
  properties: {
    kind: { enum: ["cat", "dog"] },
    age: { type: "integer", minimum: 0, maximum: 20 },
    tags: { type: "array", items: { enum: ["a", "b"] }, maxItems: 2 },
  },
  required: ["kind", "age", "tags"],
};
const validate = new Ajv({ strict: true }).compile(SCHEMA);
const FORMAT = {
  type: "json_schema",
  json_schema: { name: "pet", schema: SCHEMA, strict: true },
} as const;

function valid(text: string): boolean {
  try {
    return validate(JSON.parse(text));
  } catch {
    return false;
  }
}

describe("structured output in every topology", { timeout: 240_000 }, () => {
  const servers: { name: string; server: TopologyServer }[] = [];
  const options = { model: modelDir(MODEL), kvPages: 256, maxModelLen: 1024, apiKeys: { [KEY]: "acme" } };

  before(async () => {
    const [single, threads, cluster] = await Promise.all([
      startInProcess("single", options),
      startInProcess("threads", options),
      startCluster(1, 1, options),
    ]);
    servers.push(
      { name: "single", server: single },
      { name: "threads", server: threads },
      { name: "tcp 1+1", server: cluster },
    );
  });
  after(async () => {
    await Promise.all(servers.map(({ server }) => server.close()));
  });

  test("chat.completions.create() with response_format json_schema: every choice of n=4 validates, streamed and not", async () => {
    for (const { name, server } of servers) {
      const client = new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0, timeout: 60_000 });
      const messages = [{ role: "user" as const, content: "Describe a pet as JSON" }];
      const res = await client.chat.completions.create({
        model: MODEL,
        messages,
        n: 4,
        temperature: 1,
        max_tokens: 60,
        response_format: FORMAT,
      });
      for (const choice of res.choices) {
        const text = choice.message.content ?? "";
        assert.ok(valid(text), `${name}: choice ${choice.index} does not validate: ${text}`);
        assert.equal(choice.finish_reason, "stop", name);
      }
      const stream = await client.chat.completions.create({
        model: MODEL,
        messages,
        temperature: 1,
        max_tokens: 60,
        stream: true,
        response_format: FORMAT,
      });
      let text = "";
      for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? "";
      assert.ok(valid(text), `${name}: the streamed output does not validate: ${text}`);
    }
  });

  test("completions.create() with a schema xgrammar cannot compile is a 400 naming the construct", async () => {
    for (const { name, server } of servers) {
      const client = new OpenAI({ baseURL: server.baseURL, apiKey: KEY, maxRetries: 0, timeout: 60_000 });
      const schema = { type: "object", properties: { a: { type: "string", pattern: "(?<=x)y" } } };
      await assert.rejects(
        client.completions.create({
          model: MODEL,
          prompt: "x",
          max_tokens: 4,
          // @ts-expect-error vLLM's field, not in the OpenAI client's types
          guided_json: schema,
        }),
        (err: unknown) => {
          assert.ok(err instanceof OpenAI.APIError, name);
          assert.equal(err.status, 400, name);
          assert.match(err.message, /cannot be compiled: .*Lookbehind is not supported/, name);
          return true;
        },
      );
    }
  });
});
