/**
 * The request of the second adversarial run's finding 1 (issue #31): a 1.9 KB completions body
 * whose answer, on kvfence-tiny (whose tokens are bytes), is 215 MB — a 1,800-token prompt echoed
 * with 20 log-probabilities per token and vLLM's `prompt_logprobs` in each of 64 choices of 100
 * tokens. Used by src/router/response-size-attack.solo.test.ts (admitted under a raised
 * `--max-response-bytes`) and src/router/response-size.e2e.test.ts (refused under the default).
 */
export const ISSUE_31_REQUEST = {
  model: "kvfence-tiny",
  prompt: "The quick brown fox jumps over the lazy dog. ".repeat(40),
  n: 64,
  echo: true,
  logprobs: 20,
  prompt_logprobs: 20,
  max_tokens: 100,
  ignore_eos: true,
} as const;
