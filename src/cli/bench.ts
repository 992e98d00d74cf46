/**
 * `kvfence bench`: the benchmark command group. Each subcommand is a thin wrapper over a pure
 * function in `src/tools/bench/` that returns a result object; the wrapper prints it (or its JSON).
 *
 * To add a subcommand: write `function xyzCommand(): Command` (here or in its own module, imported
 * at the top) and add ONE `group.addCommand(xyzCommand());` line between the
 * `bench-commands:begin/end` markers.
 */
import { writeFileSync } from "node:fs";
import { Command, InvalidArgumentError, Option } from "commander";
import { WEIGHT_DTYPES, type WeightDType } from "../kernels/weight-format.js";
import { DEFAULT_KV_CACHE_DTYPE, isKvDtype, KV_DTYPES, type KvDtype } from "../kvcache/kv-layout.js";
import { bundledModelDir } from "../lib/package-root.js";
import { positiveInteger } from "../tools/bench/bench-cli.js";
import { clusterCommand } from "../tools/bench/cluster.js";
import { combineCommand } from "../tools/bench/combine.js";
import { fairShareCommand } from "../tools/bench/fair-share.js";
import { linkFloodCommand } from "../tools/bench/link-flood.js";
import {
  type BenchKernels,
  formatModelBench,
  MODEL_BENCH_DEFAULTS,
  runModelBench,
} from "../tools/bench/model.js";
import { observabilityCommand } from "../tools/bench/observability.js";
import { prefixCacheCommand } from "../tools/bench/prefix-cache.js";
import { serveCommand } from "../tools/bench/serve.js";
import { soakCommand } from "../tools/bench/soak.js";
import { startupCommand } from "../tools/bench/startup.js";
import { tagCheckCommand } from "../tools/bench/tag-check.js";
import { transferCommand } from "../tools/bench/transfer.js";

function integerList(value: string): number[] {
  return value.split(",").map((v) => positiveInteger(v.trim()));
}

const BENCH_KERNELS: readonly BenchKernels[] = ["ts", "wasm", "native", "auto", "wasm-mul-add", "wasm-i16"];

function kernelsChoice(value: string): BenchKernels[] {
  if (value === "both") return ["ts", "wasm"];
  const names = value.split(",").map((v) => v.trim());
  const bad = names.filter((n) => !(BENCH_KERNELS as readonly string[]).includes(n));
  if (names.length === 0 || bad.length > 0) {
    throw new InvalidArgumentError(
      `Expected both, or a comma-separated list of ${BENCH_KERNELS.join(", ")}: ${value}`,
    );
  }
  return names as BenchKernels[];
}

function kvCacheDtypeList(value: string): KvDtype[] {
  const names = value.split(",").map((v) => v.trim());
  const bad = names.filter((n) => !isKvDtype(n));
  if (bad.length > 0) {
    throw new InvalidArgumentError(`Expected a comma-separated list of ${KV_DTYPES.join(", ")}: ${value}`);
  }
  return names as KvDtype[];
}

function dtypeList(value: string): WeightDType[] {
  const names = value.split(",").map((v) => v.trim());
  const bad = names.filter((n) => !(WEIGHT_DTYPES as readonly string[]).includes(n));
  if (names.length === 0 || bad.length > 0) {
    throw new InvalidArgumentError(
      `Expected a comma-separated list of weight formats (${WEIGHT_DTYPES.join(", ")}): ${value}`,
    );
  }
  return names as WeightDType[];
}

function threadCount(value: string): 1 | 2 {
  if (value === "1" || value === "2") return Number(value) as 1 | 2;
  throw new InvalidArgumentError(`Expected 1 or 2 threads: ${value}`);
}

function nonNegativeInteger(value: string): number {
  return value.trim() === "0" ? 0 : positiveInteger(value);
}

interface ModelCliOptions {
  model?: string;
  dtype?: WeightDType[];
  kernels: BenchKernels[];
  threads: 1 | 2;
  longContext: number;
  promptTokens: number;
  contextTokens: number;
  decodeSteps: number;
  pageSize: number;
  batch: number[];
  kvCacheDtype: KvDtype[];
  repeats: number;
  bandwidthMib: number;
  seed: number;
  baseline?: string;
  profile?: boolean;
  json?: string;
}

function modelCommand(): Command {
  const d = MODEL_BENCH_DEFAULTS;
  return new Command("model")
    .description(
      "Prefill and decode tokens/s of a model folder on the TypeScript and WebAssembly kernels side by side (batch 1 and 8 by default), beside the memory-bandwidth roofline measured in the same run",
    )
    .option(
      "--model <dir>",
      "Hugging Face model folder, e.g. from `kvfence gen-model --like smollm2-135m DIR` (default: bundled kvfence-tiny)",
    )
    .addOption(
      new Option(
        "--kernels <which>",
        "ts, wasm, native (the C kernels, docs/kernels.md), auto (what the server picks: native where it passes its self-test, else wasm), wasm-mul-add (the WebAssembly build without fused multiply-add), wasm-i16 (the i16 tile for Q8_0/Q4_0 batches, not the int8 dot with accumulate), a comma-separated list of them, or both (ts,wasm); side by side",
      )
        .argParser(kernelsChoice)
        .default([...d.kernels], "both"),
    )
    .option(
      "--dtype <list>",
      `weight formats to compare in the same interleaved run, comma-separated (${WEIGHT_DTYPES.join(", ")}); the folder's weights are converted in memory to each (default: as stored)`,
      dtypeList,
    )
    .option(
      "--threads <n>",
      "threads of the wasm kernels: 1 or 2 (the ts reference runs on 1)",
      threadCount,
      d.threads,
    )
    .option("--prompt-tokens <n>", "prefill prompt length", positiveInteger, d.promptTokens)
    .option(
      "--context-tokens <n>",
      "context each decoding sequence already holds",
      positiveInteger,
      d.contextTokens,
    )
    .option(
      "--long-context <n>",
      "context of a batch-1 long-context decode arm, e.g. 4096 (0 skips it)",
      nonNegativeInteger,
      d.longContextTokens,
    )
    .option(
      "--decode-steps <n>",
      "decode steps timed per repeat and batch size",
      positiveInteger,
      d.decodeSteps,
    )
    .option(
      "--page-size <n>",
      "tokens per KV page, as kvfence serve --page-size",
      positiveInteger,
      d.pageSize,
    )
    .option("--batch <list>", "decode batch sizes, comma-separated", integerList, [...d.batchSizes])
    .option(
      "--kv-cache-dtype <list>",
      "KV cache element types to run, comma-separated: f32, f16, bf16 (side by side)",
      kvCacheDtypeList,
      [DEFAULT_KV_CACHE_DTYPE],
    )
    .option("--repeats <n>", "interleaved repeats (median, range, bootstrap CI)", positiveInteger, d.repeats)
    .option(
      "--bandwidth-mib <n>",
      "size of the read-bandwidth probe buffer in MiB",
      positiveInteger,
      d.bandwidthBytes / 2 ** 20,
    )
    .option("--seed <n>", "seed of the random prompts", positiveInteger, d.seed)
    .option(
      "--baseline <dir>",
      "a kvfence checkout built at another commit: each arm also runs on its forward pass in the same repeats, and the report gives this build / baseline with 95% CIs",
    )
    .option(
      "--profile",
      "after the timed repeats, show where each phase's step time goes, kernel by kernel (and matmul shape)",
    )
    .option("--json <file>", "also write the full result as JSON")
    .action(runModelCli);
}

/** The action of `kvfence bench model`: runs the bench, prints its report, writes the JSON if asked. */
async function runModelCli(opts: ModelCliOptions): Promise<void> {
  try {
    const result = await runModelBench({
      modelDir: opts.model ?? bundledModelDir(),
      ...(opts.dtype === undefined ? {} : { dtypes: opts.dtype }),
      kernels: opts.kernels,
      threads: opts.threads,
      longContextTokens: opts.longContext,
      promptTokens: opts.promptTokens,
      contextTokens: opts.contextTokens,
      decodeSteps: opts.decodeSteps,
      pageSize: opts.pageSize,
      kvCacheDtypes: opts.kvCacheDtype,
      batchSizes: opts.batch,
      repeats: opts.repeats,
      bandwidthBytes: opts.bandwidthMib * 2 ** 20,
      seed: opts.seed,
      ...(opts.baseline === undefined ? {} : { baseline: opts.baseline }),
      ...(opts.profile === true ? { profile: true } : {}),
      log: (line) => process.stderr.write(`${line}\n`),
    });
    process.stdout.write(`${formatModelBench(result)}\n`);
    if (opts.json !== undefined) writeFileSync(opts.json, `${JSON.stringify(result, null, 2)}\n`);
  } catch (err) {
    process.stderr.write(`kvfence bench model: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 1;
  }
}

export function command(): Command {
  const group = new Command("bench").description(
    "Benchmarks: the forward pass against the machine's limits, and more",
  );
  // bench-commands:begin
  group.addCommand(modelCommand());
  group.addCommand(transferCommand());
  group.addCommand(tagCheckCommand());
  group.addCommand(clusterCommand());
  group.addCommand(linkFloodCommand());
  group.addCommand(serveCommand());
  group.addCommand(fairShareCommand());
  group.addCommand(observabilityCommand());
  group.addCommand(soakCommand());
  group.addCommand(prefixCacheCommand());
  group.addCommand(combineCommand());
  group.addCommand(startupCommand());
  // bench-commands:end
  return group;
}
