/** What a preflight reader learns about one serving node, before the verdict. */
export interface NodeCapacity {
  /** Display name: a kvfence node id, or the URL of an SGLang/vLLM server (plus engine/rank). */
  readonly node: string;
  readonly source: "kvfence" | "sglang" | "vllm" | "offline";
  readonly role: string;
  /** KV pool tokens, or null when the server does not report it. */
  readonly poolTokens: number | null;
  /** The context length this node must serve, or null when unknown. */
  readonly contextLength: number | null;
  readonly pageSize: number;
  /** Where the numbers came from, or why one is missing. */
  readonly note: string;
}
