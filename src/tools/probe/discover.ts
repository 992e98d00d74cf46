/**
 * What the probe learns of a server before it sends a prompt: that both tenants' keys are accepted,
 * the model, its context length and the KV pool's size — from the options first, else the model
 * card on /v1/models, kvfence's /kvfence/nodes (the smallest node pool), or SGLang's server info —
 * and the limit over-limit prompts are judged against, min(context length, pool).
 */

import { NODES_INFO_PATH, nodesInfoSchema } from "../../admin-api/admin-wire.js";
import { KvfenceError } from "../../lib/errors.js";
import { getJson, type ProbeOptions, type ProbeRun } from "./probe-run.js";

export interface Discovery {
  model: string;
  maxModelLen: number | null;
  maxModelLenSource: string;
  poolTokens: number | null;
  poolTokensSource: string;
}

export function effectiveLimit(maxModelLen: number | null, poolTokens: number | null): number | null {
  if (maxModelLen === null) return poolTokens;
  return poolTokens === null ? maxModelLen : Math.min(maxModelLen, poolTokens);
}

export async function discover(
  ctx: ProbeRun,
  options: Pick<ProbeOptions, "model" | "maxModelLen" | "poolTokens">,
): Promise<Discovery> {
  const data = await modelCards(ctx);
  if (options.model === undefined && data.models.length === 0) {
    throw new KvfenceError(
      "model_not_found",
      `The server lists no models on /v1/models, pass --model: HTTP ${data.status}`,
    );
  }
  const model = options.model ?? String(data.models[0]?.id);
  const card = data.models.find((m) => m.id === model) ?? data.models[0];
  const found: Discovery = {
    model,
    maxModelLen: options.maxModelLen ?? null,
    maxModelLenSource: options.maxModelLen === undefined ? "unknown" : "--max-model-len",
    poolTokens: options.poolTokens ?? null,
    poolTokensSource: options.poolTokens === undefined ? "unknown" : "--pool-tokens",
  };
  const fromCard = num(card?.max_model_len);
  if (found.maxModelLen === null && fromCard !== null) {
    found.maxModelLen = fromCard;
    found.maxModelLenSource = "/v1/models max_model_len";
  }
  if (found.poolTokens === null) await poolFromNodes(ctx, found);
  if (found.maxModelLen === null || found.poolTokens === null) await fromServerInfo(ctx, found);
  ctx.progress(
    `probe: model ${model}, max_model_len ${found.maxModelLen ?? "unknown"} (${found.maxModelLenSource}), ` +
      `pool ${found.poolTokens ?? "unknown"} (${found.poolTokensSource})`,
  );
  return found;
}

/** The model cards of /v1/models, once both tenants' keys were accepted there. */
async function modelCards(ctx: ProbeRun): Promise<{ status: number; models: Record<string, unknown>[] }> {
  const modelsA = await getJson(ctx, "/v1/models", ctx.keyA);
  if (modelsA.status === 0) {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the server (${modelsA.error}): ${ctx.client.baseUrl}`,
    );
  }
  checkAuth(modelsA.status, "A (--api-key)");
  if (ctx.keyB !== ctx.keyA) {
    const modelsB = await getJson(ctx, "/v1/models", ctx.keyB);
    checkAuth(modelsB.status, "B (--api-key-b)");
  }
  return { status: modelsA.status, models: arrayField(modelsA.json, "data").filter(isObject) };
}

/** What a kvfence router's refusal of /kvfence/nodes asks for. */
const OPERATOR_HINT =
  "a kvfence router serves it with its operator key, --operator-key or env KVFENCE_OPERATOR_KEY, or without a key on its operator listener, --operator-url";

/**
 * kvfence: the smallest node pool of /kvfence/nodes (on the operator listener with
 * `--operator-url`). A kvfence router that refuses it gets a note saying which flags read it.
 */
async function poolFromNodes(ctx: ProbeRun, found: Discovery): Promise<void> {
  const nodes = await getJson(ctx, NODES_INFO_PATH, ctx.operatorKey, ctx.operatorUrl);
  const parsed = nodes.status === 200 ? nodesInfoSchema.safeParse(nodes.json) : null;
  if (parsed?.success === true && parsed.data.nodes.length > 0) {
    found.poolTokens = Math.min(...parsed.data.nodes.map((n) => n.pool_tokens));
    found.poolTokensSource = `${NODES_INFO_PATH} (smallest node pool)`;
  } else if (nodes.status === 401 || nodes.status === 403) {
    found.poolTokensSource = `unknown: ${NODES_INFO_PATH} answered HTTP ${nodes.status} (${OPERATOR_HINT})`;
  }
}

/** SGLang: what is still unknown, from the first server-info path that answers. */
async function fromServerInfo(ctx: ProbeRun, found: Discovery): Promise<void> {
  for (const path of ["/server_info", "/get_server_info"]) {
    const info = await getJson(ctx, path, ctx.keyA);
    if (info.status !== 200 || !isObject(info.json)) continue;
    const ctxLen = num(info.json.context_length);
    if (found.maxModelLen === null && ctxLen !== null) {
      found.maxModelLen = ctxLen;
      found.maxModelLenSource = `${path} context_length`;
    }
    const pool = num(info.json.max_total_num_tokens);
    if (found.poolTokens === null && pool !== null) {
      found.poolTokens = pool;
      found.poolTokensSource = `${path} max_total_num_tokens`;
    }
    return;
  }
}

function checkAuth(status: number, who: string): void {
  if (status === 401 || status === 403) {
    throw new KvfenceError(
      "invalid_api_key",
      `The server refused tenant ${who}'s key on /v1/models: HTTP ${status}`,
    );
  }
}

function num(v: unknown): number | null {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function arrayField(v: unknown, key: string): unknown[] {
  const a = isObject(v) ? v[key] : undefined;
  return Array.isArray(a) ? a : [];
}
