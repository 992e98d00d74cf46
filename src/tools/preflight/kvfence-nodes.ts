/** Reads `GET URL/kvfence/nodes` from a kvfence router (shape in src/admin-api/admin-wire.ts). */

import { NODES_INFO_PATH, nodesInfoSchema } from "../../admin-api/admin-wire.js";
import { KvfenceError } from "../../lib/errors.js";
import { httpGet, parseJsonBody } from "./http-get.js";
import type { NodeCapacity } from "./node-capacity.js";

/**
 * Every node of a kvfence deployment, each compared with the router's effective context length
 * (the longest request the router admits), since any node may be handed such a request.
 */
export async function readKvfenceNodes(
  baseUrl: string,
  options: { timeoutMs: number; apiKey?: string },
): Promise<NodeCapacity[]> {
  const url = joinUrl(baseUrl, NODES_INFO_PATH);
  const res = await httpGet(url, options);
  if (!res.ok) {
    const hint =
      res.status === 401 || res.status === 403
        ? " (a kvfence router serves it with its operator key, --operator-key or env KVFENCE_OPERATOR_KEY, or without a key on its operator listener, --operator-url)"
        : "";
    throw new KvfenceError(
      "node_unavailable",
      `The router's node-info endpoint answered HTTP ${res.status}${hint}: ${url}`,
    );
  }
  const parsed = nodesInfoSchema.safeParse(parseJsonBody(res.text, url));
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    throw new KvfenceError(
      "invalid_request",
      `The node-info body does not match admin-wire.ts at ${issue?.path.join(".") ?? "?"}: ${issue?.message ?? ""}`,
    );
  }
  const info = parsed.data;
  return info.nodes.map((n) => ({
    node: n.id,
    source: "kvfence" as const,
    role: n.role,
    poolTokens: n.pool_tokens,
    contextLength: info.max_model_len,
    pageSize: n.page_size,
    note:
      (n.max_model_len === info.max_model_len
        ? `${NODES_INFO_PATH}`
        : `${NODES_INFO_PATH}; node's own max_model_len ${n.max_model_len}`) +
      (n.up === false ? "; DOWN: the router lost this node" : ""),
  }));
}

/** Join a base URL and an absolute path without doubling or dropping the slash. */
export function joinUrl(baseUrl: string, path: string): string {
  return baseUrl.replace(/\/+$/, "") + path;
}
