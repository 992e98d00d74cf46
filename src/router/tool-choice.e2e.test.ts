/**
 * Issue #34's acceptance for `tool_choice` "required" and a named function, with the official
 * `openai` client against the real server and engine (kvfence-tiny, its ChatML template with tools):
 * at temperature 1, 200 of 200 answers under each carry tool calls whose arguments validate (ajv)
 * against the called tool's parameters schema — the grammar engine (src/grammar/) enforces the
 * calls' array where tokens are sampled, and the router parses it into `tool_calls` — and a streamed
 * answer is assembled by the client's stream helper into the same well-formed calls.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Ajv, type ValidateFunction } from "ajv";
import OpenAI from "openai";
import { modelDir, startTestServer, type TestServer } from "../../testing/start-server.js";

const MODEL = "kvfence-tiny";

const TOOLS: OpenAI.Chat.ChatCompletionFunctionTool[] = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The forecast of a city",
      parameters: {
        type: "object",
        properties: {
          city: { enum: ["Paris", "Lyon", "Oslo"] },
          days: { type: "integer", minimum: 1, maximum: 7 },
        },
        required: ["city", "days"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "adopt_pet",
      parameters: {
        type: "object",
        properties: {
          kind: { enum: ["cat", "dog"] },
          age: { type: "integer", minimum: 0, maximum: 20 },
          tags: { type: "array", items: { enum: ["a", "b"] }, maxItems: 2 },
        },
        required: ["kind", "age", "tags"],
      },
    },
  },
];
const VALIDATORS = new Map<string, ValidateFunction>(
  TOOLS.map((t) => [t.function.name, new Ajv({ strict: true }).compile(t.function.parameters!)]),
);
const MESSAGES = [{ role: "user" as const, content: "Plan a trip and adopt a pet" }];

/** Why a message's calls are not well-formed (named: only that function), or null. */
function problem(message: OpenAI.Chat.ChatCompletionMessage, only?: string): string | null {
  const calls = message.tool_calls ?? [];
  if (calls.length === 0) return `no tool calls: ${JSON.stringify(message)}`;
  for (const call of calls) {
    if (call.type !== "function") return `not a function call: ${call.type}`;
    const validate = VALIDATORS.get(call.function.name);
    if (validate === undefined || (only !== undefined && call.function.name !== only))
      return `unexpected function ${call.function.name}`;
    let args: unknown;
    try {
      args = JSON.parse(call.function.arguments);
    } catch {
      return `arguments are not JSON: ${call.function.arguments}`;
    }
    if (!validate(args)) return `${call.function.arguments}: ${JSON.stringify(validate.errors)}`;
  }
  return null;
}

describe("tool_choice required and named, enforced by the grammar (kvfence-tiny, real engine)", {
  timeout: 600_000,
}, () => {
  let server: TestServer;
  let client: OpenAI;
  before(async () => {
    server = await startTestServer({ model: modelDir(MODEL), kvPages: 2048, maxModelLen: 2048 });
    client = new OpenAI({ baseURL: server.baseURL, apiKey: "none", maxRetries: 0, timeout: 300_000 });
  });
  after(() => server.close());

  /** 200 answers (8 requests of n=25) under `toolChoice`: the problems found. */
  async function twoHundred(toolChoice: OpenAI.Chat.ChatCompletionToolChoiceOption, only?: string) {
    const problems: string[] = [];
    let answers = 0;
    for (let r = 0; r < 8; r++) {
      const res = await client.chat.completions.create({
        model: MODEL,
        messages: MESSAGES,
        tools: TOOLS,
        tool_choice: toolChoice,
        // One call each: left free, a random model under the grammar adds calls until max_tokens.
        parallel_tool_calls: false,
        n: 25,
        temperature: 1,
        max_tokens: 160,
        seed: 1000 + r,
      });
      for (const choice of res.choices) {
        answers++;
        const found = problem(choice.message, only);
        if (found !== null) problems.push(`choice ${choice.index}: ${found}`);
        else if (choice.finish_reason !== "tool_calls")
          problems.push(`finish_reason ${choice.finish_reason}`);
      }
    }
    assert.equal(answers, 200);
    return problems;
  }

  test('tool_choice "required" (parallel_tool_calls false): 200 of 200 answers carry a call whose arguments validate', async () => {
    assert.deepEqual((await twoHundred("required")).slice(0, 5), []);
  });

  test("a named function: 200 of 200 answers carry one call of it whose arguments validate", async () => {
    const named = { type: "function" as const, function: { name: "adopt_pet" } };
    assert.deepEqual((await twoHundred(named, "adopt_pet")).slice(0, 5), []);
  });

  test("a streamed required call is assembled by the client's stream helper into a well-formed call", async () => {
    const final = await client.chat.completions
      .stream({
        model: MODEL,
        messages: MESSAGES,
        tools: TOOLS,
        tool_choice: "required",
        temperature: 1,
        max_tokens: 160,
        seed: 7,
        parallel_tool_calls: false,
      })
      .finalChatCompletion();
    const message = final.choices[0]!.message;
    assert.equal(problem(message), null);
    assert.equal(message.tool_calls!.length, 1);
    assert.equal(final.choices[0]!.finish_reason, "tool_calls");
  });
});
