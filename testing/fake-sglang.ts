/**
 * A fake SGLang server for preflight tests, shaped like SGLang's documented `/server_info` output
 * (docs "SGLang Native APIs"): server args flat at the top level — `context_length` is the *argument*
 * and is null when the model default is used — then `status`, `max_total_num_tokens`,
 * `max_req_input_len`, and `internal_states` (per DP rank: server args again plus `memory_usage`).
 * `/v1/models` carries the effective `max_model_len`. `legacy: true` serves only the older
 * `/get_server_info` with `context_length` set and no internal states.
 */
import { type StaticRoute, startStaticServer } from "./fake-openai-server.js";

export interface FakeSglangOptions {
  readonly contextLength: number;
  readonly maxTotalNumTokens: number;
  readonly pageSize?: number;
  readonly disaggregationMode?: "null" | "prefill" | "decode";
  /** Serve `/get_server_info` only (older SGLang), with `context_length` given as an argument. */
  readonly legacy?: boolean;
}

export function sglangServerInfo(o: FakeSglangOptions): Record<string, unknown> {
  const args = {
    model_path: "deepseek-ai/DeepSeek-V3",
    tokenizer_path: "deepseek-ai/DeepSeek-V3",
    context_length: o.legacy === true ? o.contextLength : null,
    dtype: "auto",
    kv_cache_dtype: "auto",
    mem_fraction_static: 0.88,
    max_running_requests: 128,
    max_total_tokens: null,
    chunked_prefill_size: 8192,
    page_size: o.pageSize ?? 1,
    tp_size: 8,
    dp_size: 1,
    served_model_name: "deepseek-ai/DeepSeek-V3",
    disaggregation_mode: o.disaggregationMode ?? "null",
    disaggregation_transfer_backend: "mooncake",
    disaggregation_bootstrap_port: 8998,
  };
  const reqInputLen = Math.min(o.contextLength - 1, o.maxTotalNumTokens - 1) - 5;
  if (o.legacy === true) {
    return {
      ...args,
      max_total_num_tokens: o.maxTotalNumTokens,
      max_req_input_len: reqInputLen,
      version: "0.4.1",
    };
  }
  return {
    ...args,
    status: "ready",
    max_total_num_tokens: o.maxTotalNumTokens,
    max_req_input_len: reqInputLen,
    internal_states: [
      {
        ...args,
        last_gen_throughput: 135.8,
        memory_usage: { weight: 83.4, kvcache: 44.9, token_capacity: o.maxTotalNumTokens, graph: 0 },
        effective_max_running_requests_per_dp: 128,
      },
    ],
    version: "0.5.9",
  };
}

export function startFakeSglang(o: FakeSglangOptions) {
  const routes: Record<string, StaticRoute> = {
    "/v1/models": {
      json: {
        object: "list",
        data: [
          {
            id: "deepseek-ai/DeepSeek-V3",
            object: "model",
            created: 1764400000,
            owned_by: "sglang",
            root: "deepseek-ai/DeepSeek-V3",
            max_model_len: o.contextLength,
          },
        ],
      },
    },
  };
  routes[o.legacy === true ? "/get_server_info" : "/server_info"] = { json: sglangServerInfo(o) };
  return startStaticServer(routes);
}
