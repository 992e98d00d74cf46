/**
 * What the router's event loop needs of a request before it is prepared: the generation and
 * utility endpoints' names, the field each generation endpoint's prompt is in, and the check of
 * the model a body names. Apart from prepare-request.ts, whose request schemas (zod) load only in
 * the preparation workers (prepare-worker.ts), not on the main thread at start-up.
 */
import { KvfenceError } from "../lib/errors.js";

/** The generation endpoints: /v1/chat/completions, /v1/completions and /v1/responses (a chat, in OpenAI's newer shapes). */
export type GenerateEndpointName = "chat" | "completions" | "responses";

/** vLLM's /tokenize and /detokenize, answered by the same workers. */
export type UtilityEndpointName = "tokenize" | "detokenize";

/** The request field a generation endpoint's prompt is in (and its prompt errors name). */
export const PROMPT_PARAM: Readonly<Record<GenerateEndpointName, "messages" | "prompt" | "input">> = {
  chat: "messages",
  completions: "prompt",
  responses: "input",
};

/** Refuses a `model` other than the served one (any of its names). */
export function checkModel(model: string, served: string | readonly string[]): void {
  const names = typeof served === "string" ? [served] : served;
  if (!names.includes(model)) {
    throw new KvfenceError(
      "model_not_found",
      `The model does not exist: ${model.length > 64 ? `${model.slice(0, 64)}…` : model}; this server serves: ${names.join(", ")}`,
      { param: "model" },
    );
  }
}
