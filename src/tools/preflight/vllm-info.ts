/**
 * Reads a vLLM server's KV capacity: `max_model_len` from `/v1/models`, and the pool from the
 * Prometheus gauge `vllm:cache_config_info`, whose labels carry the cache config as strings, e.g.
 * `vllm:cache_config_info{block_size="16",…,num_gpu_blocks="573",…} 1.0`. The pool is
 * `num_gpu_blocks × block_size` tokens; with several engines (label `engine`) the smallest counts,
 * since one request lives on one engine.
 */
import { KvfenceError } from "../../lib/errors.js";
import { httpGet } from "./http-get.js";
import { joinUrl } from "./kvfence-nodes.js";
import type { NodeCapacity } from "./node-capacity.js";
import { modelsMaxLen } from "./sglang-info.js";

/** One row for a vLLM server. */
export async function readVllmServer(
  baseUrl: string,
  options: { timeoutMs: number; apiKey?: string },
): Promise<NodeCapacity> {
  const contextLength = await modelsMaxLen(baseUrl, options);
  const url = joinUrl(baseUrl, "/metrics");
  const res = await httpGet(url, options);
  if (!res.ok) throw new KvfenceError("node_unavailable", `vLLM metrics answered HTTP ${res.status}: ${url}`);
  const cache = vllmPoolFromMetrics(res.text);
  const notes = ["/v1/models", "/metrics vllm:cache_config_info"];
  if (contextLength === null) notes.push("no max_model_len on /v1/models");
  if (cache.poolTokens === null) notes.push("num_gpu_blocks not reported");
  return {
    node: baseUrl,
    source: "vllm",
    role: "engine",
    poolTokens: cache.poolTokens,
    contextLength,
    pageSize: cache.blockSize ?? 1,
    note: notes.join("; "),
  };
}

/** Pool tokens (smallest engine) and block size from Prometheus text. */
export function vllmPoolFromMetrics(text: string): { poolTokens: number | null; blockSize: number | null } {
  let pool: number | null = null;
  let blockSize: number | null = null;
  for (const line of text.split("\n")) {
    if (!line.startsWith("vllm:cache_config_info{")) continue;
    const labels = parseLabels(line.slice(line.indexOf("{") + 1, line.lastIndexOf("}")));
    const blocks = Number(labels.get("num_gpu_blocks"));
    const size = Number(labels.get("block_size"));
    if (Number.isInteger(size) && size > 0) blockSize = size;
    if (Number.isInteger(blocks) && blocks >= 0 && Number.isInteger(size) && size > 0) {
      pool = pool === null ? blocks * size : Math.min(pool, blocks * size);
    }
  }
  return { poolTokens: pool, blockSize };
}

/** Parse Prometheus label pairs `a="x",b="y"` (values may hold escaped quotes). */
export function parseLabels(text: string): Map<string, string> {
  const out = new Map<string, string>();
  const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (let m = re.exec(text); m !== null; m = re.exec(text)) {
    out.set(m[1] ?? "", (m[2] ?? "").replace(/\\(.)/g, "$1"));
  }
  return out;
}
