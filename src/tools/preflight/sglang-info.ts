/**
 * Reads an SGLang server's KV capacity. `GET /server_info` (older versions: `/get_server_info`)
 * returns the server args flattened at the top level (`context_length`, `page_size`,
 * `disaggregation_mode`, …) plus the scheduler's `max_total_num_tokens` (the KV pool in tokens) and
 * an `internal_states` array with one entry per DP rank (server args again, and in recent versions
 * `memory_usage.token_capacity`). Some builds nest the args under `server_args`. `context_length`
 * is the *argument*, so it is `null` when the model's default is used; the effective value is then
 * read from `/v1/models` (`max_model_len` on the model card).
 */
import { KvfenceError } from "../../lib/errors.js";
import { httpGet, parseJsonBody } from "./http-get.js";
import { joinUrl } from "./kvfence-nodes.js";
import type { NodeCapacity } from "./node-capacity.js";

type Json = Record<string, unknown>;

/** One row for an SGLang server (its pool is the smallest over its DP ranks). */
export async function readSglangServer(
  baseUrl: string,
  options: { timeoutMs: number; apiKey?: string },
): Promise<NodeCapacity> {
  let path = "/server_info";
  let res = await httpGet(joinUrl(baseUrl, path), options);
  if (res.status === 404) {
    path = "/get_server_info";
    res = await httpGet(joinUrl(baseUrl, path), options);
  }
  const url = joinUrl(baseUrl, path);
  if (!res.ok)
    throw new KvfenceError("node_unavailable", `SGLang server info answered HTTP ${res.status}: ${url}`);
  const body = parseJsonBody(res.text, url);
  if (!isObject(body))
    throw new KvfenceError("invalid_request", `SGLang server info is not a JSON object: ${url}`);
  const info = sglangCapacityFromInfo(body);
  const notes = [path];
  let contextLength = info.contextLength;
  if (contextLength === null) {
    contextLength = await modelsMaxLen(baseUrl, options);
    if (contextLength !== null) notes.push("context from /v1/models max_model_len");
  }
  if (info.poolTokens === null) notes.push("no max_total_num_tokens in server info");
  return {
    node: baseUrl,
    source: "sglang",
    role: info.role,
    poolTokens: info.poolTokens,
    contextLength,
    pageSize: info.pageSize,
    note: notes.join("; "),
  };
}

/** Extract pool tokens, context length, page size and role from a server-info body. */
export function sglangCapacityFromInfo(body: Json): {
  poolTokens: number | null;
  contextLength: number | null;
  pageSize: number;
  role: string;
} {
  const scopes: Json[] = [body];
  if (isObject(body.server_args)) scopes.push(body.server_args);
  if (isObject(body.scheduler_info)) scopes.push(body.scheduler_info);
  const ranks = Array.isArray(body.internal_states) ? body.internal_states.filter(isObject) : [];
  const top = firstNumber(scopes, "max_total_num_tokens");
  const perRank = ranks
    .map((r) => numberOrNull(r.max_total_num_tokens) ?? numberOrNull(objectOr(r.memory_usage).token_capacity))
    .filter((n): n is number => n !== null);
  const poolTokens = top ?? (perRank.length > 0 ? Math.min(...perRank) : null);
  const contextLength = firstNumber([...scopes, ...ranks], "context_length");
  const pageSize = firstNumber([...scopes, ...ranks], "page_size") ?? 1;
  const mode = [...scopes, ...ranks].map((s) => s.disaggregation_mode).find((m) => typeof m === "string");
  const role = mode === "prefill" || mode === "decode" ? mode : "engine";
  return { poolTokens, contextLength, pageSize, role };
}

/** `max_model_len` of the first model on `/v1/models` (SGLang and vLLM both put it there). */
export async function modelsMaxLen(
  baseUrl: string,
  options: { timeoutMs: number; apiKey?: string },
): Promise<number | null> {
  const url = joinUrl(baseUrl, "/v1/models");
  const res = await httpGet(url, options);
  if (!res.ok) return null;
  const body = parseJsonBody(res.text, url);
  const data = isObject(body) && Array.isArray(body.data) ? body.data : [];
  const first = data.find(isObject);
  return first === undefined ? null : numberOrNull(first.max_model_len);
}

function firstNumber(scopes: Json[], key: string): number | null {
  for (const s of scopes) {
    const n = numberOrNull(s[key]);
    if (n !== null) return n;
  }
  return null;
}

function numberOrNull(v: unknown): number | null {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function objectOr(v: unknown): Json {
  return isObject(v) ? v : {};
}

function isObject(v: unknown): v is Json {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}
