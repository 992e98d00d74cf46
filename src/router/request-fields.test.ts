/**
 * The rule of docs/api.md, field by field (issue #17 item 8): every request field that OpenAI,
 * vLLM or SGLang define for chat and completions (testing/fixtures/request-fields.json, written
 * from their API reference and protocol sources) is either implemented — a value that would change
 * the answer changes the validated request — or refused with a 400 naming it, or neutral (it never
 * changes the answer: `NEUTRAL`, with the reason). A field accepted without effect fails, and so
 * does a field the table in docs/api.md classifies otherwise than the server behaves. A field is
 * refused only when the error names it as not supported (or not served); a probe value refused for
 * what it is (a wrong type, out of range, disagreeing with another field) is a wrong probe, and
 * fails, so that a field that works is never tabled as refused. The same for
 * OpenAI's `/v1/responses` fields (their own neutral list, `RESPONSES_NEUTRAL`: there `store: true`
 * is refused, since nothing is stored) and docs/api.md's table of them.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { KvfenceError } from "../lib/errors.js";
import { NEUTRAL, parseChatRequest, parseCompletionRequest } from "./openai-schemas.js";
import { parseResponsesRequest, RESPONSES_NEUTRAL } from "./responses-request.js";

/** The repository (the compiled test runs from dist/). */
const ROOT = fileURLToPath(
  new URL(import.meta.url.includes("/dist/") ? "../../../" : "../../", import.meta.url),
);
const FIELDS = JSON.parse(
  readFileSync(join(ROOT, "testing", "fixtures", "request-fields.json"), "utf8"),
) as Record<Endpoint, Record<"openai" | "vllm" | "sglang", string[]>>;

type Endpoint = "chat" | "completions" | "responses";
type Kind = "implemented" | "refused" | "neutral";

const BASE: Record<Endpoint, Record<string, unknown>> = {
  chat: { model: "m", messages: [{ role: "user", content: "hi" }], max_tokens: 8 },
  completions: { model: "m", prompt: "hi", max_tokens: 8 },
  responses: { model: "m", input: "hi", max_output_tokens: 8 },
};
const PARSE: Record<Endpoint, (body: unknown) => unknown> = {
  chat: parseChatRequest,
  completions: parseCompletionRequest,
  responses: parseResponsesRequest,
};
const NEUTRAL_OF: Record<Endpoint, Readonly<Record<string, string>>> = {
  chat: NEUTRAL,
  completions: NEUTRAL,
  responses: RESPONSES_NEUTRAL,
};

const tool = { type: "function", function: { name: "f", parameters: {} } };

/**
 * A value of each field that would change the answer, if the field were used (with fields it needs
 * alongside, in both the probe and its baseline).
 */
const PROBES: Record<string, { value: unknown; with?: Record<string, unknown> }> = {
  messages: { value: [{ role: "user", content: "other" }] },
  prompt: { value: "other" },
  model: { value: "other-model" },
  max_tokens: { value: 3 },
  max_completion_tokens: { value: 3, with: { max_tokens: null } },
  temperature: { value: 0.5 },
  top_p: { value: 0.5 },
  top_k: { value: 5 },
  min_p: { value: 0.2 },
  seed: { value: 7 },
  stop: { value: ["x"] },
  stream: { value: true },
  stream_options: { value: { include_usage: true }, with: { stream: true } },
  n: { value: 2 },
  best_of: { value: 3 },
  frequency_penalty: { value: 1 },
  presence_penalty: { value: 1 },
  repetition_penalty: { value: 1.3 },
  length_penalty: { value: 0.5 },
  logit_bias: { value: { "5": 10 } },
  logprobs: { value: true },
  top_logprobs: { value: 2, with: { logprobs: true } },
  echo: { value: true },
  suffix: { value: "tail" },
  response_format: { value: { type: "json_object" } },
  tools: { value: [tool] },
  tool_choice: { value: "required", with: { tools: [tool] } },
  parallel_tool_calls: { value: false, with: { tools: [tool] } },
  functions: { value: [{ name: "f" }] },
  function_call: { value: { name: "f" }, with: { functions: [{ name: "f" }] } },
  min_tokens: { value: 2 },
  ignore_eos: { value: true },
  stop_token_ids: { value: [7] },
  include_stop_str_in_output: { value: true },
  no_stop_trim: { value: true },
  skip_special_tokens: { value: false },
  spaces_between_special_tokens: { value: false },
  prompt_logprobs: { value: 2 },
  add_generation_prompt: { value: false },
  continue_final_message: { value: true, with: { add_generation_prompt: false } },
  chat_template_kwargs: { value: { enable_thinking: false } },
  chat_template: { value: "{{ messages }}" },
  add_special_tokens: { value: false },
  use_beam_search: { value: true },
  truncate_prompt_tokens: { value: 4 },
  allowed_token_ids: { value: [1, 2] },
  bad_words: { value: ["x"] },
  documents: { value: [{ title: "t", text: "x" }] },
  mm_processor_kwargs: { value: { a: 1 } },
  guided_json: { value: { type: "object" } },
  guided_regex: { value: "[a-z]+" },
  guided_choice: { value: ["a", "b"] },
  guided_grammar: { value: "root ::= 'a'" },
  structural_tag: { value: "{}" },
  guided_decoding_backend: { value: "outlines" },
  guided_whitespace_pattern: { value: " " },
  logits_processors: { value: ["m.P"] },
  return_tokens_as_token_ids: { value: true },
  vllm_xargs: { value: { a: 1 } },
  kv_transfer_params: { value: { a: 1 } },
  prompt_embeds: { value: "AAAA" },
  regex: { value: "[a-z]+" },
  ebnf: { value: "root ::= 'a'" },
  json_schema: { value: "{}" },
  stop_regex: { value: "x+" },
  return_hidden_states: { value: true },
  return_routed_experts: { value: true },
  routed_experts_start_len: { value: 2 },
  return_cached_tokens_details: { value: true },
  return_prompt_token_ids: { value: true },
  return_token_ids: { value: true },
  return_meta_info: { value: true },
  task: { value: "title" },
  reasoning: { value: { effort: "high" } },
  reasoning_effort: { value: "high" },
  include_reasoning: { value: false },
  separate_reasoning: { value: false },
  stream_reasoning: { value: false },
  lora_path: { value: "adapter" },
  session_id: { value: "s" },
  session_params: { value: { id: "s" } },
  max_dynamic_patch: { value: 4 },
  min_dynamic_patch: { value: 1 },
  use_audio_in_video: { value: true },
  images_config: { value: { a: 1 } },
  custom_logit_processor: { value: "p" },
  custom_params: { value: { a: 1 } },
  input_ids: { value: [1, 2, 3] },
  audio: { value: { voice: "alloy", format: "wav" } },
  modalities: { value: ["text", "audio"] },
  prediction: { value: { type: "content", content: "x" } },
  web_search_options: { value: {} },
  verbosity: { value: "low" },
};

/** The /v1/completions values of fields whose shape differs there: its `logprobs` is a count. */
const COMPLETIONS_PROBES: Record<string, { value: unknown; with?: Record<string, unknown> }> = {
  logprobs: { value: 2 },
};

/** The /v1/responses values of its own fields (and of shared names whose shape differs there). */
const RESPONSES_PROBES: Record<string, { value: unknown; with?: Record<string, unknown> }> = {
  input: { value: [{ role: "user", content: [{ type: "input_text", text: "other" }] }] },
  instructions: { value: "Answer in French." },
  max_output_tokens: { value: 3 },
  stream_options: { value: { include_obfuscation: false }, with: { stream: true } },
  text: { value: { format: { type: "json_object" } } },
  tools: { value: [{ type: "function", name: "f", parameters: {}, strict: false }] },
  tool_choice: { value: "required", with: { tools: [{ type: "function", name: "f", parameters: {} }] } },
  parallel_tool_calls: { value: false, with: { tools: [{ type: "function", name: "f", parameters: {} }] } },
  top_logprobs: { value: 2 },
  store: { value: true },
  previous_response_id: { value: "resp_abc" },
  conversation: { value: "conv_abc" },
  background: { value: true },
  prompt: { value: { id: "pmpt_abc" } },
  include: { value: ["message.output_text.logprobs"] },
  truncation: { value: "auto" },
  context_management: { value: [{ type: "compaction" }] },
  moderation: { value: { model: "omni-moderation-latest" } },
};

/** The refusal of a request: the field its error names, and the message. */
interface Refusal {
  readonly param: string;
  readonly message: string;
}

function refusal(fn: () => unknown): Refusal | null {
  try {
    fn();
    return null;
  } catch (err) {
    assert.ok(err instanceof KvfenceError, String(err));
    assert.equal(err.code, "invalid_request");
    return { param: err.param ?? "", message: err.message };
  }
}

function refusedParam(fn: () => unknown): string | null {
  return refusal(fn)?.param ?? null;
}

/** Whether an error refuses `field` as a field the server does not serve, not for its value. */
function refusesAsUnsupported(field: string, { param, message }: Refusal): boolean {
  const names = param === field || param.startsWith(`${field}.`) || param.startsWith(`${field}[`);
  return names && message.includes(field) && /\bnot (?:supported|served)\b/.test(message);
}

const OWN_PROBES: Record<Endpoint, Record<string, { value: unknown; with?: Record<string, unknown> }>> = {
  chat: {},
  completions: COMPLETIONS_PROBES,
  responses: RESPONSES_PROBES,
};

/** How the server treats `field` on `endpoint`. Throws when it is accepted without effect. */
function classify(endpoint: Endpoint, field: string): Kind {
  const parse = PARSE[endpoint];
  if (NEUTRAL_OF[endpoint][field] !== undefined) {
    // Neutral fields are accepted as they come.
    assert.equal(
      refusedParam(() => parse({ ...BASE[endpoint], [field]: "x" })),
      null,
      `${field} is neutral`,
    );
    return "neutral";
  }
  const probe = OWN_PROBES[endpoint][field] ?? PROBES[field];
  assert.ok(
    probe !== undefined,
    `${endpoint}: no probe for ${field}: classify it (implement, refuse, or NEUTRAL)`,
  );
  const base = { ...BASE[endpoint], ...probe.with };
  const refused = refusal(() => parse({ ...base, [field]: probe.value }));
  if (refused !== null) {
    assert.ok(
      refusesAsUnsupported(field, refused),
      `${endpoint}: ${field} = ${JSON.stringify(probe.value)} is refused for its value, not as unsupported ` +
        `(param ${JSON.stringify(refused.param)}: ${refused.message}): probe it with a value the server accepts`,
    );
    return "refused";
  }
  const before = JSON.stringify(parse(base));
  const after = JSON.stringify(parse({ ...base, [field]: probe.value }));
  assert.notEqual(
    after,
    before,
    `${endpoint}: ${field} = ${JSON.stringify(probe.value)} is accepted without effect`,
  );
  return "implemented";
}

function fieldsOf(endpoint: Endpoint): string[] {
  const lists = FIELDS[endpoint];
  return [...new Set([...lists.openai, ...lists.vllm, ...lists.sglang])].sort();
}

/** docs/api.md's table: `| \`field\` | chat | completions | sources |`. */
function docsTable(): Map<string, [string, string]> {
  const text = readFileSync(join(ROOT, "docs", "api.md"), "utf8");
  const rows = new Map<string, [string, string]>();
  for (const line of text.split("\n")) {
    const m = /^\| `([a-z_]+)` \| (implemented|refused|neutral|—) \| (implemented|refused|neutral|—) \|/.exec(
      line,
    );
    if (m !== null) rows.set(m[1]!, [m[2]!, m[3]!]);
  }
  return rows;
}

test("every chat and completions field of OpenAI, vLLM and SGLang is implemented, refused or neutral; none is ignored", () => {
  const problems: string[] = [];
  for (const endpoint of ["chat", "completions"] as const) {
    const fields = fieldsOf(endpoint);
    assert.ok(fields.length > 50, `${endpoint}: ${fields.length} fields`);
    for (const field of fields) {
      try {
        classify(endpoint, field);
      } catch (err) {
        problems.push((err as Error).message);
      }
    }
  }
  assert.deepEqual(problems, []);
});

test("refusesAsUnsupported() tells a field refused as unsupported from a value refused for what it is", () => {
  const chat = (extra: Record<string, unknown>) => () => parseChatRequest({ ...BASE.chat, ...extra });
  const completions = (extra: Record<string, unknown>) => () =>
    parseCompletionRequest({ ...BASE.completions, ...extra });
  const cases: [string, () => unknown, boolean][] = [
    ["chat_template", chat({ chat_template: "{{ messages }}" }), true],
    ["suffix", completions({ suffix: "tail" }), true],
    ["use_beam_search", completions({ use_beam_search: true }), true],
    ["logprobs", completions({ logprobs: true }), false], // a count, not a boolean
    ["logprobs", completions({ logprobs: 99 }), false], // out of range
    ["max_completion_tokens", chat({ max_completion_tokens: 3 }), false], // disagrees with max_tokens 8
  ];
  for (const [field, request, unsupported] of cases) {
    const refused = refusal(request);
    assert.ok(refused !== null, `${field}: refused`);
    assert.equal(refusesAsUnsupported(field, refused), unsupported, `${field}: ${refused.message}`);
  }
});

test("docs/api.md lists every field with what the server does with it", () => {
  const table = docsTable();
  const all = [...new Set([...fieldsOf("chat"), ...fieldsOf("completions")])].sort();
  const wrong: string[] = [];
  for (const field of all) {
    const want: [string, string] = [
      fieldsOf("chat").includes(field) ? classify("chat", field) : "—",
      fieldsOf("completions").includes(field) ? classify("completions", field) : "—",
    ];
    const got = table.get(field);
    if (got === undefined || got[0] !== want[0] || got[1] !== want[1]) {
      const sources = (["openai", "vllm", "sglang"] as const)
        .filter((s) => FIELDS.chat[s].includes(field) || FIELDS.completions[s].includes(field))
        .join(", ");
      wrong.push(`| \`${field}\` | ${want[0]} | ${want[1]} | ${sources} |`);
    }
  }
  assert.deepEqual(wrong, [], `docs/api.md's field table should have these rows:\n${wrong.join("\n")}`);
});

/** docs/api.md's table of /v1/responses fields: `| \`field\` | kind | why neutral |`, in its section. */
function responsesDocsTable(): Map<string, string> {
  const text = readFileSync(join(ROOT, "docs", "api.md"), "utf8");
  const start = text.indexOf("## Every /v1/responses field");
  assert.ok(start >= 0, "docs/api.md has a section: ## Every /v1/responses field");
  const section = text.slice(start, text.indexOf("\n## ", start + 1));
  const rows = new Map<string, string>();
  for (const line of section.split("\n")) {
    const m = /^\| `([a-z_]+)` \| (implemented|refused|neutral) \|/.exec(line);
    if (m !== null) rows.set(m[1]!, m[2]!);
  }
  return rows;
}

test("every /v1/responses field of OpenAI is implemented, refused or neutral, as docs/api.md's table says", () => {
  const fields = fieldsOf("responses");
  assert.ok(fields.length >= 30, `responses: ${fields.length} fields`);
  const table = responsesDocsTable();
  const problems: string[] = [];
  for (const field of fields) {
    try {
      const kind = classify("responses", field);
      if (table.get(field) !== kind)
        problems.push(
          `docs/api.md should have: | \`${field}\` | ${kind} | ${NEUTRAL_OF.responses[field] ?? ""} |`,
        );
    } catch (err) {
      problems.push((err as Error).message);
    }
  }
  assert.deepEqual(problems, []);
});
