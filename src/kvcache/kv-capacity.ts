/**
 * KV capacity arithmetic shared by the server's boot check and `kvfence preflight`. Pure functions,
 * no I/O: the question is always "does this node's KV pool hold one full-context request?".
 *
 * The pool size follows SGLang's formula (docs/prior-art.md §1): bytes per token = KV heads per rank ×
 * head_dim × layers × 2 (K and V) × element size, with KV heads per rank = max(1, kv_heads ÷ tp);
 * MLA models (DeepSeek-style, `kv_lora_rank` in the config) store one compressed latent per token,
 * replicated on every rank: (kv_lora_rank + qk_rope_head_dim) × layers × element size. Pool tokens
 * = (GPU memory × memory fraction − weights per rank) ÷ bytes per token.
 */
import { KvfenceError } from "../lib/errors.js";

/** Result of comparing one node's KV pool with the context length it must serve. */
export interface CapacityVerdict {
  readonly ok: boolean;
  readonly poolTokens: number;
  readonly contextLength: number;
  readonly pageSize: number;
  /** Whole pages the pool holds, times the page size. */
  readonly usableTokens: number;
  /** Tokens one full-context request needs, rounded up to whole pages. */
  readonly neededTokens: number;
  /** How many tokens short the pool is (0 when it fits). */
  readonly shortfallTokens: number;
  /** The longest context this pool can hold (whole pages). */
  readonly maxContextThatFits: number;
  /** One line telling the operator what to change; empty when it fits. */
  readonly fix: string;
}

/**
 * Does a pool of `poolTokens` hold one request of `contextLength` tokens? Both are rounded to whole
 * pages of `pageSize` (the pool down, the request up), as a paged allocator does.
 */
export function poolCapacityVerdict(input: {
  poolTokens: number;
  contextLength: number;
  pageSize?: number;
}): CapacityVerdict {
  const pageSize = input.pageSize ?? 1;
  assertCount("poolTokens", input.poolTokens);
  assertCount("contextLength", input.contextLength);
  if (!Number.isInteger(pageSize) || pageSize < 1) {
    throw new KvfenceError("invalid_request", `Page size must be a positive integer: ${pageSize}`, {
      param: "pageSize",
    });
  }
  const usableTokens = Math.floor(input.poolTokens / pageSize) * pageSize;
  const neededTokens = Math.ceil(input.contextLength / pageSize) * pageSize;
  const ok = usableTokens >= neededTokens;
  const shortfallTokens = ok ? 0 : neededTokens - usableTokens;
  const fix = ok
    ? ""
    : `lower the context length to ${fmt(usableTokens)} or grow the pool by ${fmt(shortfallTokens)} tokens ` +
      "(raise the memory fraction, add GPUs/tensor parallelism, or use a smaller KV dtype)";
  return {
    ok,
    poolTokens: input.poolTokens,
    contextLength: input.contextLength,
    pageSize,
    usableTokens,
    neededTokens,
    shortfallTokens,
    maxContextThatFits: usableTokens,
    fix,
  };
}

/** Pool tokens left for KV after weights: floor((memory × fraction − weights) ÷ bytes per token). */
export function poolTokensFromMemory(input: {
  gpuMemoryBytes: number;
  memFraction: number;
  weightsBytesPerRank: number;
  kvBytesPerToken: number;
}): number {
  const { gpuMemoryBytes, memFraction, weightsBytesPerRank, kvBytesPerToken } = input;
  if (!(gpuMemoryBytes > 0)) {
    throw new KvfenceError("invalid_request", `GPU memory must be positive: ${gpuMemoryBytes}`, {
      param: "gpuMemoryBytes",
    });
  }
  if (!(memFraction > 0 && memFraction <= 1)) {
    throw new KvfenceError("invalid_request", `Memory fraction must be in (0, 1]: ${memFraction}`, {
      param: "memFraction",
    });
  }
  if (!(weightsBytesPerRank >= 0)) {
    throw new KvfenceError("invalid_request", `Weights bytes must be zero or more: ${weightsBytesPerRank}`, {
      param: "weightsBytesPerRank",
    });
  }
  if (!(kvBytesPerToken > 0)) {
    throw new KvfenceError("invalid_request", `KV bytes per token must be positive: ${kvBytesPerToken}`, {
      param: "kvBytesPerToken",
    });
  }
  const free = gpuMemoryBytes * memFraction - weightsBytesPerRank;
  return free <= 0 ? 0 : Math.floor(free / kvBytesPerToken);
}

/** The fields of a Hugging Face `config.json` that KV sizing reads. */
export interface HfModelConfig {
  readonly num_hidden_layers?: number;
  readonly num_attention_heads?: number;
  readonly num_key_value_heads?: number;
  readonly hidden_size?: number;
  readonly head_dim?: number;
  readonly intermediate_size?: number;
  readonly vocab_size?: number;
  readonly tie_word_embeddings?: boolean;
  readonly kv_lora_rank?: number;
  readonly qk_rope_head_dim?: number;
  readonly qk_nope_head_dim?: number;
  readonly v_head_dim?: number;
  readonly q_lora_rank?: number | null;
  readonly n_routed_experts?: number;
  readonly n_shared_experts?: number;
  readonly num_experts?: number;
  readonly moe_intermediate_size?: number;
  readonly first_k_dense_replace?: number;
  readonly text_config?: HfModelConfig;
}

/** How the KV bytes per token were derived, for the report. */
export interface KvSizing {
  readonly kvBytesPerToken: number;
  readonly layers: number;
  readonly mla: boolean;
  /** KV heads held by one rank (1 for MLA: the latent is replicated). */
  readonly kvHeadsPerRank: number;
  readonly headDim: number;
  readonly formula: string;
}

/** Element size in bytes of a dtype name (bf16, fp16/f16, fp8, fp32/f32, int8, …). */
export function dtypeBytes(dtype: string): number {
  const d = dtype.toLowerCase();
  if (["bf16", "bfloat16", "fp16", "f16", "float16", "half"].includes(d)) return 2;
  if (["fp8", "fp8_e4m3", "fp8_e5m2", "float8", "int8"].includes(d)) return 1;
  if (["fp32", "f32", "float32", "float"].includes(d)) return 4;
  if (["fp4", "int4", "nvfp4", "mxfp4"].includes(d)) return 0.5;
  throw new KvfenceError("invalid_request", `Unknown dtype, use bf16, fp16, fp8 or fp32: ${dtype}`, {
    param: "dtype",
  });
}

/** KV bytes per token on one rank, by SGLang's formula (see the module header). */
export function kvBytesPerToken(
  config: HfModelConfig,
  options: { tp: number; kvDtypeBytes: number },
): KvSizing {
  const c = config.text_config ?? config;
  const layers = requireField(c.num_hidden_layers, "num_hidden_layers");
  if (!Number.isInteger(options.tp) || options.tp < 1) {
    throw new KvfenceError(
      "invalid_request",
      `Tensor parallelism must be a positive integer: ${options.tp}`,
      {
        param: "tp",
      },
    );
  }
  const el = options.kvDtypeBytes;
  if (c.kv_lora_rank !== undefined && c.kv_lora_rank > 0) {
    const rope = c.qk_rope_head_dim ?? 0;
    const width = c.kv_lora_rank + rope;
    return {
      kvBytesPerToken: width * layers * el,
      layers,
      mla: true,
      kvHeadsPerRank: 1,
      headDim: width,
      formula: `(kv_lora_rank ${c.kv_lora_rank} + qk_rope_head_dim ${rope}) × layers ${layers} × ${el} B`,
    };
  }
  const heads = requireField(c.num_attention_heads, "num_attention_heads");
  const kvHeads = c.num_key_value_heads ?? heads;
  const headDim = c.head_dim ?? requireField(c.hidden_size, "hidden_size") / heads;
  const kvHeadsPerRank = Math.max(1, Math.floor(kvHeads / options.tp));
  return {
    kvBytesPerToken: kvHeadsPerRank * headDim * layers * 2 * el,
    layers,
    mla: false,
    kvHeadsPerRank,
    headDim,
    formula: `kv heads/rank ${kvHeadsPerRank} × head_dim ${headDim} × layers ${layers} × 2 × ${el} B`,
  };
}

/**
 * Rough parameter count from a config (embeddings, attention, dense or MoE MLP; norms and biases
 * ignored). An estimate for sizing only: pass the real weight size when you know it.
 */
export function estimateParameterCount(config: HfModelConfig): number {
  const c = config.text_config ?? config;
  const hidden = requireField(c.hidden_size, "hidden_size");
  const layers = requireField(c.num_hidden_layers, "num_hidden_layers");
  const heads = requireField(c.num_attention_heads, "num_attention_heads");
  const vocab = c.vocab_size ?? 0;
  const embeddings = vocab * hidden * (c.tie_word_embeddings === true ? 1 : 2);
  let attention: number;
  if (c.kv_lora_rank !== undefined && c.kv_lora_rank > 0) {
    const nope = c.qk_nope_head_dim ?? 128;
    const rope = c.qk_rope_head_dim ?? 64;
    const vDim = c.v_head_dim ?? nope;
    const qDim = heads * (nope + rope);
    const q = c.q_lora_rank ? hidden * c.q_lora_rank + c.q_lora_rank * qDim : hidden * qDim;
    const kvA = hidden * (c.kv_lora_rank + rope);
    const kvB = c.kv_lora_rank * heads * (nope + vDim);
    attention = q + kvA + kvB + heads * vDim * hidden;
  } else {
    const headDim = c.head_dim ?? hidden / heads;
    const kvHeads = c.num_key_value_heads ?? heads;
    attention = hidden * heads * headDim * 2 + hidden * kvHeads * headDim * 2;
  }
  const dense = 3 * hidden * (c.intermediate_size ?? 4 * hidden);
  const experts = c.n_routed_experts ?? c.num_experts ?? 0;
  let mlpTotal: number;
  if (experts > 0) {
    const moeInter = c.moe_intermediate_size ?? c.intermediate_size ?? 4 * hidden;
    const denseLayers = Math.min(layers, c.first_k_dense_replace ?? 0);
    const moeLayer = 3 * hidden * moeInter * (experts + (c.n_shared_experts ?? 0)) + hidden * experts;
    mlpTotal = denseLayers * dense + (layers - denseLayers) * moeLayer;
  } else {
    mlpTotal = layers * dense;
  }
  return embeddings + layers * attention + mlpTotal;
}

const BYTE_UNITS: Record<string, number> = {
  b: 1,
  kb: 1e3,
  mb: 1e6,
  gb: 1e9,
  tb: 1e12,
  kib: 2 ** 10,
  mib: 2 ** 20,
  gib: 2 ** 30,
  tib: 2 ** 40,
};

/** Parse a byte size such as "141GiB", "80GB", "1.5TiB" or "1048576". */
export function parseBytes(text: string): number {
  const m = /^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$/.exec(text);
  const unit = (m?.[2] ?? "").toLowerCase() || "b";
  const scale = BYTE_UNITS[unit];
  if (m === null || scale === undefined) {
    throw new KvfenceError(
      "invalid_request",
      `Size must be a number with an optional unit like 141GiB: ${text}`,
    );
  }
  return Math.round(Number(m[1]) * scale);
}

function fmt(n: number): string {
  return n.toLocaleString("en-US");
}

function assertCount(name: string, value: number): void {
  if (!Number.isInteger(value) || value < 0) {
    throw new KvfenceError("invalid_request", `${name} must be a whole number of tokens: ${value}`, {
      param: name,
    });
  }
}

function requireField(value: number | undefined, name: string): number {
  if (value === undefined || !Number.isFinite(value) || value <= 0) {
    throw new KvfenceError(
      "invalid_request",
      `Model config lacks a positive ${name}, add it to config.json: ${value}`,
      {
        param: name,
      },
    );
  }
  return value;
}
