/**
 * `kvfence generate`: stream one completion to the terminal from a model folder, through the same
 * paged forward pass and sampler the server uses (a contiguous block table over a pool sized for
 * the prompt plus `--max-tokens`). The chat template is applied unless `--raw`.
 */
import { Command, InvalidArgumentError, Option } from "commander";
import { DEFAULT_KV_CACHE_DTYPE, isKvDtype, KV_DTYPES, type KvDtype } from "../kvcache/kv-layout.js";
import { PagePool } from "../kvcache/page-pool.js";
import { KvfenceError } from "../lib/errors.js";
import { bundledModelDir } from "../lib/package-root.js";
import { Prng } from "../lib/prng.js";
import { ForwardPass } from "../model/forward.js";
import { type LoadedModel, openModel, QUANTIZE_TYPES } from "../model/load-model.js";
import { Sampler, type SamplerSettings } from "../model/sampler.js";

const PAGE_SIZE = 16;
const PREFILL_CHUNK = 256;

export interface GenerateOptions extends SamplerSettings {
  readonly maxTokens: number;
  readonly seed: number;
  /** Token ids that end generation (not emitted). */
  readonly stopTokenIds: ReadonlySet<number>;
  /** The KV cache element type (`--kv-cache-dtype`). Default f16. */
  readonly kvCacheDtype?: KvDtype;
}

export interface GenerateResult {
  readonly tokens: number[];
  readonly finishReason: "stop" | "length";
  readonly prefillMs: number;
  readonly decodeMs: number;
}

/** Generates from `promptIds`, calling `onToken` with each new token id as it is sampled. */
export function generateTokens(
  model: Pick<LoadedModel, "config" | "weights">,
  promptIds: Int32Array,
  options: GenerateOptions,
  onToken: (id: number) => void,
): GenerateResult {
  const { config, weights } = model;
  Sampler.validate(options);
  if (promptIds.length === 0)
    throw new KvfenceError("invalid_request", "The prompt is empty: 0 tokens; pass some text");
  if (!Number.isInteger(options.maxTokens) || options.maxTokens < 1) {
    throw new KvfenceError("invalid_request", `Max tokens must be a positive integer: ${options.maxTokens}`, {
      param: "max_tokens",
    });
  }
  const total = promptIds.length + options.maxTokens;
  if (total > config.maxPositionEmbeddings) {
    throw new KvfenceError(
      "context_length_exceeded",
      `Prompt plus max tokens exceeds the model's context: ${promptIds.length} + ${options.maxTokens} > ${config.maxPositionEmbeddings}; shorten the prompt or lower --max-tokens`,
    );
  }
  const layout = {
    numLayers: config.numLayers,
    numKvHeads: config.numKvHeads,
    headDim: config.headDim,
    pageSize: PAGE_SIZE,
    dtype: options.kvCacheDtype ?? DEFAULT_KV_CACHE_DTYPE,
  };
  const numPages = Math.ceil(total / PAGE_SIZE);
  const pool = new PagePool(layout, numPages).data;
  const blockTable = Int32Array.from({ length: numPages }, (_, i) => i);
  const fp = new ForwardPass(config, weights, layout, {
    maxBatchTokens: Math.min(PREFILL_CHUNK, promptIds.length),
    maxSequences: 1,
  });
  const logits = new Float32Array(config.vocabSize);
  const sampler = new Sampler(config.vocabSize);
  const rng = new Prng(options.seed);

  const t0 = performance.now();
  for (let pos = 0; pos < promptIds.length; pos += PREFILL_CHUNK) {
    const end = Math.min(pos + PREFILL_CHUNK, promptIds.length);
    fp.step(pool, [
      {
        tokens: promptIds.subarray(pos, end),
        startPos: pos,
        blockTable,
        logits: end === promptIds.length ? logits : null,
      },
    ]);
  }
  const t1 = performance.now();
  const tokens: number[] = [];
  const one = new Int32Array(1);
  const seq = { tokens: one, startPos: promptIds.length, blockTable, logits };
  const batch = [seq];
  let finishReason: "stop" | "length" = "length";
  for (;;) {
    const id = sampler.sample(logits, options, rng);
    if (options.stopTokenIds.has(id)) {
      finishReason = "stop";
      break;
    }
    tokens.push(id);
    onToken(id);
    if (tokens.length >= options.maxTokens) break;
    one[0] = id;
    fp.step(pool, batch);
    seq.startPos++;
  }
  return { tokens, finishReason, prefillMs: t1 - t0, decodeMs: performance.now() - t1 };
}

function integer(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isSafeInteger(n))
    throw new InvalidArgumentError(`Expected an integer: ${value}`);
  return n;
}

function number(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n))
    throw new InvalidArgumentError(`Expected a number: ${value}`);
  return n;
}

interface CliOptions {
  model?: string;
  raw?: boolean;
  maxTokens?: number;
  temperature?: number;
  topP?: number;
  topK?: number;
  seed: number;
  kvCacheDtype: KvDtype;
  stats?: boolean;
  quantize?: "q8_0" | "q4_0";
}

function kvCacheDtype(value: string): KvDtype {
  if (!isKvDtype(value)) throw new InvalidArgumentError(`Expected one of ${KV_DTYPES.join(", ")}: ${value}`);
  return value;
}

export function command(): Command {
  return new Command("generate")
    .description("Stream a completion of a prompt to the terminal (chat template applied unless --raw)")
    .argument("<prompt>", "the user message (or the raw text with --raw)")
    .option(
      "--model <dir|file.gguf>",
      "Hugging Face model folder or GGUF file (default: the bundled models/kvfence-tiny)",
    )
    .option("--raw", "feed the prompt as plain text, without the chat template")
    .option(
      "--max-tokens <n>",
      "most tokens to generate (default: generation_config max_new_tokens, else 128)",
      integer,
    )
    .option(
      "--temperature <t>",
      "sampling temperature; 0 is greedy (default: generation_config, else 1)",
      number,
    )
    .option("--top-p <p>", "nucleus sampling mass in (0, 1] (default: generation_config, else 1)", number)
    .option(
      "--top-k <k>",
      "keep the k most likely tokens; 0 disables (default: generation_config, else 0)",
      integer,
    )
    .option("--seed <n>", "seed of the sampler", integer, 0)
    .option(
      "--kv-cache-dtype <dtype>",
      "KV cache element type: f32, f16 or bf16",
      kvCacheDtype,
      DEFAULT_KV_CACHE_DTYPE,
    )
    .option("--stats", "print token counts and speeds to stderr at the end")
    .addOption(
      new Option("--quantize <type>", "quantise the weight matrices at load into llama.cpp's blocks").choices(
        [...QUANTIZE_TYPES],
      ),
    )
    .action(async (prompt: string, opts: CliOptions) => {
      try {
        const model = await openModel(
          opts.model ?? bundledModelDir(),
          opts.quantize === undefined ? {} : { quantize: opts.quantize },
        );
        const { tokenizer, chatTemplate, generationDefaults: defaults, config } = model;
        const stop = new Set<number>([...config.eosTokenIds, ...defaults.eosTokenIds]);
        let text = prompt;
        if (opts.raw !== true) {
          if (chatTemplate === null) {
            throw new KvfenceError(
              "invalid_request",
              `Model has no chat template: ${model.dir}; pass --raw to feed plain text`,
            );
          }
          text = chatTemplate.render([{ role: "user", content: prompt }], { addGenerationPrompt: true });
          const imEnd = tokenizer.tokenId("<|im_end|>");
          if (imEnd !== undefined) stop.add(imEnd);
        }
        const ids = tokenizer.encode(text, { addSpecialTokens: opts.raw === true });
        const decoder = tokenizer.streamDecoder({ skipSpecialTokens: true });
        const result = generateTokens(
          model,
          ids,
          {
            maxTokens: opts.maxTokens ?? defaults.maxNewTokens ?? 128,
            temperature: opts.temperature ?? defaults.temperature ?? 1,
            topP: opts.topP ?? defaults.topP ?? 1,
            topK: opts.topK ?? defaults.topK ?? 0,
            seed: opts.seed,
            stopTokenIds: stop,
            kvCacheDtype: opts.kvCacheDtype,
          },
          (id) => process.stdout.write(decoder.push(id)),
        );
        process.stdout.write(`${decoder.flush()}\n`);
        if (opts.stats === true) {
          const n = result.tokens.length;
          process.stderr.write(
            `${ids.length} prompt tokens in ${result.prefillMs.toFixed(1)} ms; ${n} tokens (${result.finishReason}) in ${result.decodeMs.toFixed(1)} ms = ${((n / result.decodeMs) * 1000).toFixed(1)} tok/s\n`,
          );
        }
      } catch (err) {
        process.stderr.write(`kvfence generate: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 1;
      }
    });
}
