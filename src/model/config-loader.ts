/**
 * Reads a Hugging Face `config.json` (plus the eos ids of `generation_config.json`) into the frozen
 * `ModelConfig` every other module uses, and `generation_config.json`'s sampling defaults.
 *
 * Supported: Llama (`LlamaForCausalLM`), Mistral (`MistralForCausalLM`) and Qwen2
 * (`Qwen2ForCausalLM`) with SiLU MLPs, plain RoPE and full attention. Everything this server does
 * not implement is refused with an `unsupported_model` error naming the field, never silently
 * ignored: any `rope_scaling` (linear, dynamic, yarn, llama3, ...), sliding-window attention,
 * `mlp_bias`, activations other than SiLU, and an `attention_bias` that would need an o_proj bias.
 */
import { join } from "node:path";
import { z } from "zod";
import { badModelFolder, readJsonFile, unsupportedModel } from "../tokenizer/model-files.js";
import type { ModelConfig } from "./model-config.js";

const ARCHITECTURES = {
  LlamaForCausalLM: "llama",
  MistralForCausalLM: "mistral",
  Qwen2ForCausalLM: "qwen2",
} as const satisfies Record<string, ModelConfig["architecture"]>;

const MODEL_TYPES: readonly string[] = ["llama", "mistral", "qwen2"];

const positiveInt = z.number().int().positive();
const tokenId = z.number().int().nonnegative();
const tokenIds = z.union([tokenId, z.array(tokenId)]).nullish();

const configSchema = z.object({
  architectures: z.array(z.string()).nullish(),
  model_type: z.string().nullish(),
  hidden_size: positiveInt,
  num_attention_heads: positiveInt,
  num_key_value_heads: positiveInt.nullish(),
  head_dim: positiveInt.nullish(),
  intermediate_size: positiveInt,
  num_hidden_layers: positiveInt,
  rms_norm_eps: z.number().positive().default(1e-6),
  rope_theta: z.number().positive().nullish(),
  rope_scaling: z.unknown().optional(),
  rope_parameters: z.record(z.string(), z.unknown()).nullish(),
  tie_word_embeddings: z.boolean().nullish(),
  attention_bias: z.boolean().nullish(),
  mlp_bias: z.boolean().nullish(),
  hidden_act: z.string().default("silu"),
  sliding_window: z.number().int().nullish(),
  use_sliding_window: z.boolean().nullish(),
  max_position_embeddings: positiveInt,
  vocab_size: positiveInt,
  bos_token_id: tokenId.nullish(),
  eos_token_id: tokenIds,
});

const generationConfigSchema = z.object({
  eos_token_id: tokenIds,
  temperature: z.number().nonnegative().nullish(),
  top_p: z.number().gt(0).max(1).nullish(),
  top_k: z.number().int().nonnegative().nullish(),
  max_new_tokens: positiveInt.nullish(),
  do_sample: z.boolean().nullish(),
});

export type GenerationConfigJson = z.infer<typeof generationConfigSchema>;

function describeIssues(error: z.ZodError): string {
  return error.issues
    .map((issue) => `${issue.path.length > 0 ? issue.path.join(".") : "(root)"}: ${issue.message}`)
    .join("; ");
}

function idList(value: number | readonly number[] | null | undefined): number[] {
  if (value === null || value === undefined) return [];
  return typeof value === "number" ? [value] : [...value];
}

/** Parses `generation_config.json` when present (undefined when absent). */
export function readGenerationConfig(dir: string): GenerationConfigJson | undefined {
  const path = join(dir, "generation_config.json");
  const raw = readJsonFile(path, { optional: true });
  if (raw === undefined) return undefined;
  const parsed = generationConfigSchema.safeParse(raw);
  if (!parsed.success) throw badModelFolder(path, describeIssues(parsed.error));
  return parsed.data;
}

/** Sampling defaults from generation_config.json (absent fields stay undefined). */
export interface GenerationDefaults {
  readonly temperature?: number;
  readonly topP?: number;
  readonly topK?: number;
  readonly maxNewTokens?: number;
  /** eos ids of generation_config.json (the config's merged list is in ModelConfig.eosTokenIds). */
  readonly eosTokenIds: readonly number[];
}

/**
 * Reads generation_config.json's defaults. `do_sample: false` means greedy in Hugging Face, so it
 * maps to temperature 0.
 */
export function loadGenerationDefaults(dir: string): GenerationDefaults {
  const g = readGenerationConfig(dir);
  if (g === undefined) return Object.freeze({ eosTokenIds: Object.freeze([]) });
  const eos = g.eos_token_id;
  const out: { -readonly [K in keyof GenerationDefaults]: GenerationDefaults[K] } = {
    eosTokenIds: Object.freeze(
      eos === null || eos === undefined ? [] : typeof eos === "number" ? [eos] : [...eos],
    ),
  };
  if (g.do_sample === false) out.temperature = 0;
  else if (g.temperature !== null && g.temperature !== undefined) out.temperature = g.temperature;
  if (g.top_p !== null && g.top_p !== undefined) out.topP = g.top_p;
  if (g.top_k !== null && g.top_k !== undefined) out.topK = g.top_k;
  if (g.max_new_tokens !== null && g.max_new_tokens !== undefined) out.maxNewTokens = g.max_new_tokens;
  return Object.freeze(out);
}

/**
 * Loads `DIR/config.json` into a frozen `ModelConfig`; eos ids are the union of config.json's and
 * generation_config.json's. Throws `bad_model_folder` for missing or malformed files and
 * `unsupported_model` for features this server does not implement.
 */
export function loadModelConfig(dir: string): ModelConfig {
  const path = join(dir, "config.json");
  return parseModelConfig(readJsonFile(path), path, readGenerationConfig(dir));
}

/**
 * Checks a parsed config.json (`path` names it in errors; `generation` is generation_config.json,
 * whose eos ids join the config's) into a frozen `ModelConfig`. A GGUF file's metadata comes here
 * as the config.json it stands for (src/model/gguf.ts).
 */
export function parseModelConfig(
  raw: unknown,
  path: string,
  generation: GenerationConfigJson | undefined,
): ModelConfig {
  const parsed = configSchema.safeParse(raw);
  if (!parsed.success) throw badModelFolder(path, describeIssues(parsed.error));
  const c = parsed.data;

  const architecture = resolveArchitecture(path, c.architectures ?? undefined, c.model_type ?? undefined);
  // The checks in this order: the first problem found is the one reported.
  if (c.hidden_act !== "silu") {
    throw unsupportedModel(
      path,
      `hidden_act ${JSON.stringify(c.hidden_act)} is not implemented; only "silu" is supported`,
    );
  }
  const ropeTheta = ropeThetaOf(path, c);
  checkSlidingWindow(path, c, architecture);
  if (c.mlp_bias === true) throw unsupportedModel(path, "mlp_bias true is not implemented");
  const attentionBias = attentionBiasOf(path, c, architecture);
  const { numHeads, numKvHeads, headDim } = headsOf(path, c);
  const { eos, bosTokenId } = specialTokensOf(path, generation, c);

  const config: ModelConfig = {
    architecture,
    hiddenSize: c.hidden_size,
    numHeads,
    numKvHeads,
    headDim,
    intermediateSize: c.intermediate_size,
    numLayers: c.num_hidden_layers,
    rmsNormEps: c.rms_norm_eps,
    ropeTheta,
    tieWordEmbeddings: c.tie_word_embeddings ?? false,
    attentionBias,
    maxPositionEmbeddings: c.max_position_embeddings,
    vocabSize: c.vocab_size,
    bosTokenId,
    eosTokenIds: Object.freeze(eos),
  };
  return Object.freeze(config);
}

type ConfigJson = z.infer<typeof configSchema>;

/** Plain RoPE only: its theta (rope_theta, or rope_parameters' of type "default"; else 10000). */
function ropeThetaOf(path: string, c: ConfigJson): number {
  if (c.rope_scaling !== undefined && c.rope_scaling !== null) {
    throw unsupportedModel(
      path,
      `rope_scaling ${JSON.stringify(c.rope_scaling)} is not implemented; only plain RoPE (rope_scaling null) is supported`,
    );
  }
  const ropeTheta = c.rope_theta ?? 10000;
  const p = c.rope_parameters;
  if (p === null || p === undefined) return ropeTheta;
  const ropeType = p.rope_type ?? p.type ?? "default";
  if (ropeType !== "default") {
    throw unsupportedModel(
      path,
      `rope_parameters.rope_type ${JSON.stringify(ropeType)} is not implemented; only "default" is supported`,
    );
  }
  if (p.rope_theta === undefined) return ropeTheta;
  if (typeof p.rope_theta !== "number" || !(p.rope_theta > 0)) {
    throw badModelFolder(
      path,
      `rope_parameters.rope_theta must be a positive number: ${JSON.stringify(p.rope_theta)}`,
    );
  }
  return p.rope_theta;
}

/** Full attention only: a sliding window that is in use is refused. */
function checkSlidingWindow(path: string, c: ConfigJson, architecture: ModelConfig["architecture"]): void {
  const window = c.sliding_window ?? null;
  if (window === null) return;
  if (c.use_sliding_window === true) {
    throw unsupportedModel(
      path,
      `sliding-window attention (use_sliding_window true, sliding_window ${window}) is not implemented`,
    );
  }
  if (architecture === "mistral" && c.use_sliding_window !== false && window < c.max_position_embeddings) {
    throw unsupportedModel(
      path,
      `sliding-window attention (sliding_window ${window} < max_position_embeddings ${c.max_position_embeddings}) is not implemented; set sliding_window to null`,
    );
  }
}

/** Qwen2's q/k/v projections always carry biases; Llama's and Mistral's never (no o_proj bias). */
function attentionBiasOf(path: string, c: ConfigJson, architecture: ModelConfig["architecture"]): boolean {
  if (architecture === "qwen2") {
    if (c.attention_bias === false) {
      throw unsupportedModel(
        path,
        "attention_bias false is not supported for Qwen2 (its q/k/v projections always carry biases)",
      );
    }
    return true;
  }
  if (c.attention_bias === true) {
    throw unsupportedModel(
      path,
      `attention_bias true is not implemented for ${architecture} (it adds an o_proj bias)`,
    );
  }
  return false;
}

function headsOf(path: string, c: ConfigJson): { numHeads: number; numKvHeads: number; headDim: number } {
  const numHeads = c.num_attention_heads;
  const numKvHeads = c.num_key_value_heads ?? numHeads;
  if (numHeads % numKvHeads !== 0) {
    throw badModelFolder(
      path,
      `num_attention_heads ${numHeads} is not a multiple of num_key_value_heads ${numKvHeads}`,
    );
  }
  let headDim: number;
  if (c.head_dim !== null && c.head_dim !== undefined) {
    headDim = c.head_dim;
  } else {
    if (c.hidden_size % numHeads !== 0) {
      throw badModelFolder(
        path,
        `hidden_size ${c.hidden_size} is not a multiple of num_attention_heads ${numHeads} and head_dim is not set`,
      );
    }
    headDim = c.hidden_size / numHeads;
  }
  if (headDim % 2 !== 0) throw badModelFolder(path, `head_dim must be even for RoPE: ${headDim}`);
  return { numHeads, numKvHeads, headDim };
}

/** The eos ids of config.json and generation_config.json, and the bos id, all inside the vocabulary. */
function specialTokensOf(
  path: string,
  generation: GenerationConfigJson | undefined,
  c: ConfigJson,
): { eos: number[]; bosTokenId: number | null } {
  const eos = idList(c.eos_token_id);
  for (const id of idList(generation?.eos_token_id)) if (!eos.includes(id)) eos.push(id);
  const bosTokenId = c.bos_token_id ?? null;
  for (const id of [...eos, ...(bosTokenId === null ? [] : [bosTokenId])]) {
    if (id >= c.vocab_size)
      throw badModelFolder(path, `token id ${id} is outside the vocabulary of ${c.vocab_size}`);
  }
  return { eos, bosTokenId };
}

function resolveArchitecture(
  path: string,
  architectures: readonly string[] | undefined,
  modelType: string | undefined,
): ModelConfig["architecture"] {
  const supported = `supported: ${Object.keys(ARCHITECTURES).join(", ")}`;
  if (architectures !== undefined && architectures.length > 0) {
    if (architectures.length !== 1)
      throw unsupportedModel(path, `architectures must name one class: ${JSON.stringify(architectures)}`);
    const name = architectures[0] as string;
    const arch = (ARCHITECTURES as Record<string, ModelConfig["architecture"]>)[name];
    if (arch === undefined)
      throw unsupportedModel(path, `architecture ${JSON.stringify(name)} is not implemented (${supported})`);
    if (modelType !== undefined && modelType !== arch) {
      throw unsupportedModel(
        path,
        `model_type ${JSON.stringify(modelType)} does not match architecture ${name}`,
      );
    }
    return arch;
  }
  if (modelType !== undefined && MODEL_TYPES.includes(modelType))
    return modelType as ModelConfig["architecture"];
  throw unsupportedModel(
    path,
    `model_type ${JSON.stringify(modelType ?? null)} is not implemented and architectures is missing (${supported})`,
  );
}
