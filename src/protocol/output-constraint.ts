/**
 * What a request's output must match (structured output, issue #34): the one shape the router's
 * parser fills in from every vendor's request fields (OpenAI's `response_format`, vLLM's
 * `guided_*` and `structured_outputs`, SGLang's `json_schema` / `regex` / `ebnf`, llama.cpp's
 * `grammar` and `json_schema`, the Responses API's `text.format`) and from `tool_choice`
 * (`required` or a named function), carried on `SamplingParams.constraint` to every node that
 * samples, where the grammar engine (src/grammar/) compiles it and masks each draw. Plain data: it
 * crosses threads by structured clone and processes as JSON.
 */

export type OutputConstraint =
  /** Any JSON object (`response_format: {"type": "json_object"}`). */
  | { readonly kind: "json_object" }
  /** A JSON Schema, as JSON text. `strict`: OpenAI's `strict` (no properties beyond the schema's). */
  | { readonly kind: "json_schema"; readonly schema: string; readonly strict: boolean }
  /** A regular expression the whole output matches (ECMAScript syntax, no flags). */
  | { readonly kind: "regex"; readonly pattern: string }
  /** A grammar in GBNF / xgrammar's EBNF, its start rule `root`. */
  | { readonly kind: "grammar"; readonly ebnf: string }
  /** Exactly one of these strings. */
  | { readonly kind: "choice"; readonly choices: readonly string[] };
