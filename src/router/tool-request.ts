/**
 * A request's tools (issue #34), from chat's `tools` / `tool_choice` / `parallel_tool_calls` and the
 * conversation's `assistant` `tool_calls` and `tool` messages (and /v1/responses' function tools and
 * `function_call` / `function_call_output` items, turned into the same): validated with zod, each
 * error naming its field; rendered through the model's own chat template as the Jinja `tools`
 * variable, as Hugging Face's `apply_chat_template` and vLLM pass them (OpenAI's shape,
 * `{"type": "function", "function": {name, description, parameters}}`), with each earlier call's
 * arguments as a mapping, as the templates of Qwen2.5 and Llama 3.x read them (`| tojson`).
 *
 * How the answer is read: `auto` parses the format the template teaches its model
 * (tool-call-parser.ts; detected from the template's text, or the operator's `--tool-call-parser`),
 * and a template that renders no tools is refused rather than served as if the tools were not
 * there. `required` and a named function are enforced as vLLM enforces them: the output must match
 * a JSON schema of an array of `{"name": <the tool's name>, "parameters": <its schema>}` (at least
 * one; at most one when `parallel_tool_calls` is false; a named function: exactly that one), which
 * the grammar engine applies where tokens are sampled (`SamplingParams.constraint`), and that array
 * is parsed into the calls. `none` renders the tools and parses nothing.
 */
import { z } from "zod";
import { KvfenceError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import type { ConstraintFields } from "./output-constraint-fields.js";
import { detectToolCallFormat, type ToolCallFormat, templateUsesTools } from "./tool-call-parser.js";

/** OpenAI's rule for a function's name. */
const functionName = z
  .string()
  .regex(/^[A-Za-z0-9_.-]{1,64}$/, { error: "a function name has 1 to 64 letters, digits, _, . or -" });

const functionFields = {
  name: functionName,
  description: z.string().nullable().optional(),
  parameters: z
    .record(z.string(), z.unknown(), { error: "expected a JSON Schema object" })
    .nullable()
    .optional(),
  strict: z.boolean().nullable().optional(),
};

/** A chat tool: `{"type": "function", "function": {name, description, parameters, strict}}`. */
export const chatTool = z.object({
  type: z.literal("function", { error: 'only function tools are supported: {"type": "function", …}' }),
  function: z.object(functionFields),
});

/** A /v1/responses function tool: `{"type": "function", name, description, parameters, strict}`. */
export const responsesTool = z.object({
  type: z.literal("function", {
    error: 'only function tools are supported ({"type": "function", "name": …}): no built-in tools',
  }),
  ...functionFields,
});

export const chatToolChoice = z.union(
  [
    z.enum(["none", "auto", "required"]),
    z.object({ type: z.literal("function"), function: z.object({ name: z.string() }) }),
  ],
  { error: 'expected "none", "auto", "required" or {"type": "function", "function": {"name": …}}' },
);

export const responsesToolChoice = z.union(
  [z.enum(["none", "auto", "required"]), z.object({ type: z.literal("function"), name: z.string() })],
  { error: 'expected "none", "auto", "required" or {"type": "function", "name": …}' },
);

/** An earlier call of the conversation, in an `assistant` message. */
export const messageToolCall = z.object({
  id: z.string(),
  type: z.literal("function").optional(),
  function: z.object({ name: z.string(), arguments: z.string() }),
});

export type ChatTool = z.infer<typeof chatTool>;
export type ChatToolChoice = z.infer<typeof chatToolChoice>;
export type MessageToolCall = z.infer<typeof messageToolCall>;

/** How the answer's calls are read, once the template is known (`resolveToolParsing`). */
export interface ToolParsing {
  readonly format: ToolCallFormat;
  /** 1 when `parallel_tool_calls` is false. */
  readonly maxCalls: number;
}

/** A request's tools, validated. */
export interface ToolRequest {
  /** The tools in OpenAI's chat shape, as the template's `tools` variable. */
  readonly tools: readonly ChatTool[];
  /** `none`, `auto`, `required`, or the one function's name. */
  readonly choice: "none" | "auto" | "required" | { readonly name: string };
  readonly parallel: boolean;
  /** Filled in where the template is at hand (prepare-request.ts); null: nothing is parsed. */
  readonly parsing: ToolParsing | null;
  /** Asked with OpenAI's deprecated `functions`: answered as `message.function_call`. */
  readonly legacy?: boolean;
}

function refuse(param: string, message: string): never {
  throw new KvfenceError("invalid_request", message, { param });
}

/** A chat request's tool fields → its `ToolRequest` (null without tools); throws naming the field. */
export function toolRequest(
  tools: readonly ChatTool[] | null | undefined,
  choice: ChatToolChoice | null | undefined,
  parallel: boolean | null | undefined,
): ToolRequest | null {
  const list = tools ?? [];
  const seen = new Set<string>();
  list.forEach((tool, i) => {
    if (seen.has(tool.function.name))
      refuse(
        `tools[${i}].function.name`,
        `Two tools are named ${tool.function.name}: give each its own name`,
      );
    seen.add(tool.function.name);
  });
  if (list.length === 0) {
    if (choice != null && choice !== "none" && choice !== "auto")
      refuse("tool_choice", "tool_choice needs tools: send tools, or leave tool_choice unset");
    return null;
  }
  let named: ToolRequest["choice"] =
    choice == null || typeof choice === "string" ? (choice ?? "auto") : choice.function;
  if (typeof named === "object") {
    const name = named.name;
    if (!seen.has(name))
      refuse(
        "tool_choice.function.name",
        `tool_choice names a function that is not in tools: ${name}; name one of ${[...seen].join(", ")}`,
      );
    named = { name };
  }
  return { tools: list, choice: named, parallel: parallel !== false, parsing: null };
}

/** The request's messages' calls as templates read them: each call's arguments a mapping when they are JSON. */
export function templateToolCalls(calls: readonly MessageToolCall[]): object[] {
  return calls.map((call) => {
    let args: unknown = call.function.arguments;
    try {
      const parsed = JSON.parse(call.function.arguments) as unknown;
      if (typeof parsed === "object" && parsed !== null && !Array.isArray(parsed)) args = parsed;
    } catch {
      // Kept as the text it is: a template prints it as it prints a string.
    }
    return { id: call.id, type: "function", function: { name: call.function.name, arguments: args } };
  });
}

/** What the served chat template offers tools: whether it renders them, and the format it teaches. */
export interface TemplateToolSupport {
  readonly usesTools: boolean;
  /** `--tool-call-parser`, else the one detected from the template's text; null: none known. */
  readonly format: ToolCallFormat | null;
}

/** The tool support of a template's text, with the operator's `--tool-call-parser` first. */
export function templateToolSupport(source: string | null, parser?: ToolCallFormat): TemplateToolSupport {
  if (source === null) return { usesTools: false, format: parser ?? null };
  return { usesTools: templateUsesTools(source), format: parser ?? detectToolCallFormat(source) };
}

/**
 * How the answer to `tools` is read with this template, or a refusal: `auto` needs a template that
 * renders tools and a format to parse; `required` and a named function parse the constrained array.
 */
export function resolveToolParsing(tools: ToolRequest, support: TemplateToolSupport): ToolRequest {
  const maxCalls = tools.parallel ? Number.MAX_SAFE_INTEGER : 1;
  if (tools.choice === "none") return tools;
  if (tools.choice !== "auto") return { ...tools, parsing: { format: "json_array", maxCalls } };
  if (!support.usesTools)
    refuse(
      "tools",
      'tools with tool_choice "auto" are not supported by this model\'s chat template: it does not render tools (no tool support); start the server with --chat-template FILE naming a template that does, or send tool_choice "required" or a named function',
    );
  if (support.format === null)
    refuse(
      "tools",
      'tools with tool_choice "auto" are not supported here: the chat template names no known tool-call format; start the server with --tool-call-parser hermes, llama3_json or mistral',
    );
  return { ...tools, parsing: { format: support.format, maxCalls } };
}

/**
 * The output constraint of `required` or a named function (vLLM's): a JSON array of calls, each
 * `{"name": <one tool's name>, "parameters": <its schema>}`; null for `none` and `auto`.
 */
export function toolConstraint(tools: ToolRequest): OutputConstraint | null {
  const choice = tools.choice;
  if (choice === "none" || choice === "auto") return null;
  const chosen =
    typeof choice === "object" ? tools.tools.filter((t) => t.function.name === choice.name) : tools.tools;
  const item = (tool: ChatTool) => ({
    type: "object",
    properties: {
      name: { type: "string", enum: [tool.function.name] },
      parameters: tool.function.parameters ?? { type: "object", properties: {} },
    },
    required: ["name", "parameters"],
    additionalProperties: false,
  });
  const items = chosen.length === 1 ? item(chosen[0]!) : { anyOf: chosen.map(item) };
  const one = typeof choice === "object" || !tools.parallel;
  const schema = { type: "array", items, minItems: 1, ...(one ? { maxItems: 1 } : {}) };
  // Strict, as vLLM compiles it with xgrammar (strict mode): no properties beyond each schema's.
  return { kind: "json_schema", schema: JSON.stringify(schema), strict: true };
}

/**
 * The request's output constraint with its tools': `required` or a named function constrain the
 * output to the calls' array, which a structured-output format (`response_format`, `guided_*`,
 * `text.format`) cannot also constrain — the two together are refused.
 */
export function withToolConstraint(format: ConstraintFields, tools: ToolRequest | null): ConstraintFields {
  const calls = tools === null ? null : toolConstraint(tools);
  if (calls === null) return format;
  if (format.constraint !== undefined && JSON.stringify(format.constraint) !== JSON.stringify(calls))
    refuse(
      "tool_choice",
      'tool_choice "required" or a named function constrains the output to the calls, so it cannot be combined with a structured output format: send one of them',
    );
  return { constraint: calls, constraintParam: "tool_choice" };
}

/** A /v1/responses input item: an earlier call of the model. */
export const functionCallItem = z.object({
  type: z.literal("function_call"),
  call_id: z.string(),
  name: z.string(),
  arguments: z.string(),
  id: z.string().optional(),
  status: z.string().optional(),
});

/** A /v1/responses input item: a call's result. */
export const functionCallOutputItem = z.object({
  type: z.literal("function_call_output"),
  call_id: z.string(),
  output: z.string({ error: "expected the call's output as a string" }),
  id: z.string().optional(),
  status: z.string().optional(),
});

/** A /v1/responses request's function tools and tool choice, in chat's shapes (the same path from there). */
export function responsesToolFields(req: {
  readonly tools?: readonly z.infer<typeof responsesTool>[] | null | undefined;
  readonly tool_choice?: z.infer<typeof responsesToolChoice> | null | undefined;
  readonly parallel_tool_calls?: boolean | null | undefined;
}): Record<string, unknown> {
  const choice = req.tool_choice;
  return {
    tools: req.tools?.map(({ type, ...fn }) => ({ type, function: fn })) ?? null,
    tool_choice:
      choice == null || typeof choice === "string"
        ? (choice ?? null)
        : { type: "function", function: { name: choice.name } },
    parallel_tool_calls: req.parallel_tool_calls ?? null,
  };
}

/** OpenAI's deprecated `functions`: each a function's fields, as a tool's. */
export const legacyFunctions = z.array(z.object(functionFields));

/** OpenAI's deprecated `function_call`: `none`, `auto`, or `{"name": …}`. */
export const legacyFunctionCall = z.union([z.enum(["none", "auto"]), z.object({ name: z.string() })], {
  error: 'expected "none", "auto" or {"name": …}',
});

/** An assistant's call in the deprecated shape (`message.function_call`). */
export const legacyMessageCall = z.object({ name: z.string(), arguments: z.string() });

/**
 * The tool fields of a request that uses OpenAI's deprecated function calling (`functions`,
 * `function_call`): the same tools, one call at most, answered in the deprecated shape
 * (`message.function_call`, `finish_reason: "function_call"`); null when it does not use it.
 */
export function legacyToolRequest(
  functions: z.infer<typeof legacyFunctions> | null | undefined,
  functionCall: z.infer<typeof legacyFunctionCall> | null | undefined,
  hasTools: boolean,
): ToolRequest | null {
  if ((functions?.length ?? 0) === 0) {
    if (functionCall != null && functionCall !== "none" && functionCall !== "auto")
      refuse("function_call", "function_call names a function but there are no functions: send functions");
    return null;
  }
  if (hasTools) refuse("functions", "Send tools or the deprecated functions, not both: send tools");
  const tools = functions!.map((fn) => ({ type: "function" as const, function: fn }));
  const choice =
    functionCall == null || typeof functionCall === "string"
      ? functionCall
      : { type: "function" as const, function: { name: functionCall.name } };
  try {
    const request = toolRequest(tools, choice, false)!;
    return { ...request, legacy: true };
  } catch (err) {
    // The same checks, named by the deprecated fields.
    if (err instanceof KvfenceError && err.param !== undefined)
      throw new KvfenceError("invalid_request", err.message, {
        param: err.param
          .replace(/^tools/, "functions")
          .replace(".function.name", ".name")
          .replace(/^tool_choice/, "function_call"),
      });
    throw err;
  }
}

/**
 * A message of the deprecated function calling in today's shape: an assistant's `function_call`
 * becomes its one tool call (id `call_legacy_<i>`, answered by the next `function` message), a
 * `function` message a `tool` message naming the function.
 */
export function legacyMessage<
  M extends {
    role: string;
    name?: string | undefined;
    function_call?: z.infer<typeof legacyMessageCall> | null | undefined;
    tool_calls?: MessageToolCall[] | null | undefined;
    tool_call_id?: string | undefined;
  },
>(m: M, i: number, all: readonly M[]): M {
  if (m.role === "assistant" && m.function_call != null && m.tool_calls == null)
    return { ...m, tool_calls: [{ id: `call_legacy_${i}`, type: "function", function: m.function_call }] };
  if (m.role !== "function") return m;
  let call = i - 1;
  while (call >= 0 && all[call]!.function_call == null) call--;
  return { ...m, role: "tool", ...(call < 0 ? {} : { tool_call_id: `call_legacy_${call}` }) };
}
