/**
 * Wire shape of kvfence's node-info endpoint, `GET /kvfence/nodes` on a router. The router reports
 * the effective context length it admits (`max_model_len`, already reduced to what every node's
 * pool can hold) and, per node, the KV pool size and the node's own configured context length.
 * `kvfence preflight --url` and `kvfence probe` read it; the server fills it. Types and a zod
 * schema, no I/O, in a folder of their own (it imports nothing of src/) so that the probe and the
 * pre-flight, which import these wire types and no server code, work against any server.
 */
import { z } from "zod";

export const NODE_ROLES = ["prefill", "decode", "engine"] as const;
export type NodeRole = (typeof NODE_ROLES)[number];

const positiveInt = z.number().int().nonnegative();

export const nodeInfoSchema = z.object({
  /** Stable node id, e.g. "prefill-0". */
  id: z.string().min(1),
  role: z.enum(NODE_ROLES),
  /** Where the node's control endpoint listens (informational). */
  url: z.string(),
  /** KV pool capacity of this node in tokens (pages × page_size). */
  pool_tokens: positiveInt,
  /** Tokens per KV page. */
  page_size: z.number().int().positive(),
  /** The node's own configured context length in tokens. */
  max_model_len: positiveInt,
  /** False once the router lost the node (its link closed); it takes no new requests. */
  up: z.boolean().optional(),
  /** False while the node is out of the registry's membership (gone or draining): no new requests. */
  member: z.boolean().optional(),
  /** Pages its prefix cache holds (shared, referenced or not); absent without a cache. */
  cached_pages: positiveInt.optional(),
  /** Chain keys of its caches this router's KV index holds (src/cluster/kv-index.ts); absent on one engine. */
  indexed_keys: positiveInt.optional(),
});

export const nodesInfoSchema = z.object({
  /** The router's effective context length: the longest request it admits. */
  max_model_len: positiveInt,
  nodes: z.array(nodeInfoSchema),
});

/** One node as reported by `GET /kvfence/nodes`. */
export type NodeInfo = z.infer<typeof nodeInfoSchema>;
/** Body of `GET /kvfence/nodes`. */
export type NodesInfo = z.infer<typeof nodesInfoSchema>;

/** Path of the node-info endpoint on a kvfence router. */
export const NODES_INFO_PATH = "/kvfence/nodes";
