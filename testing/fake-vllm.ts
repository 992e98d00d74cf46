/**
 * A fake vLLM server for preflight tests: `/v1/models` with `max_model_len` on the model card, and
 * `/metrics` in Prometheus text with the `vllm:cache_config_info` info-gauge whose labels carry the
 * cache config as strings (`block_size`, `num_gpu_blocks`, …), one line per engine.
 */
import { startStaticServer } from "./fake-openai-server.js";

export interface FakeVllmOptions {
  readonly maxModelLen: number;
  readonly blockSize: number;
  /** num_gpu_blocks per engine (one entry per engine). */
  readonly numGpuBlocks: readonly number[];
}

export function vllmMetricsText(o: FakeVllmOptions): string {
  const lines = [
    "# HELP vllm:num_requests_running Number of requests in model execution batches.",
    "# TYPE vllm:num_requests_running gauge",
    'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0',
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
    "# TYPE vllm:cache_config_info gauge",
  ];
  o.numGpuBlocks.forEach((blocks, engine) => {
    lines.push(
      `vllm:cache_config_info{block_size="${o.blockSize}",cache_dtype="auto",calculate_kv_scales="False",` +
        `cpu_offload_gb="0",enable_prefix_caching="True",engine="${engine}",gpu_memory_utilization="0.9",` +
        `is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="${blocks}",` +
        `num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0`,
    );
  });
  lines.push(
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
    "# TYPE vllm:kv_cache_usage_perc gauge",
    'vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0',
  );
  return `${lines.join("\n")}\n`;
}

export function startFakeVllm(o: FakeVllmOptions) {
  return startStaticServer({
    "/v1/models": {
      json: {
        object: "list",
        data: [
          {
            id: "meta-llama/Llama-3.1-8B-Instruct",
            object: "model",
            created: 1764400000,
            owned_by: "vllm",
            root: "meta-llama/Llama-3.1-8B-Instruct",
            parent: null,
            max_model_len: o.maxModelLen,
            permission: [],
          },
        ],
      },
    },
    "/metrics": { text: vllmMetricsText(o), contentType: "text/plain; version=0.0.4; charset=utf-8" },
  });
}
