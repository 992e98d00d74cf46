/** `kvfence preflight`: does every node's KV pool hold one full-context request? */
import { readFile } from "node:fs/promises";
import { Command, InvalidArgumentError } from "commander";
import { type HfModelConfig, parseBytes } from "../kvcache/kv-capacity.js";
import { KvfenceError } from "../lib/errors.js";
import { type OfflineInputs, renderPreflightTable, runPreflight } from "../tools/preflight/preflight.js";

interface PreflightCliOptions {
  url?: string;
  sglang?: string[];
  vllm?: string[];
  apiKey?: string;
  operatorKey?: string;
  operatorUrl?: string;
  config?: string;
  gpuMemory?: string;
  dtype?: string;
  kvCacheDtype?: string;
  tp?: number;
  memFraction?: number;
  contextLength?: number;
  weightsBytes?: string;
  poolTokens?: number;
  pageSize?: number;
  timeout: number;
  json?: boolean;
}

export function command(): Command {
  return new Command("preflight")
    .description("Check that every node's KV pool holds one full-context request (exit 1 when one does not)")
    .option("--url <url>", "a kvfence router (reads GET /kvfence/nodes)")
    .option("--sglang <urls...>", "SGLang servers (reads /server_info or /get_server_info)")
    .option("--vllm <urls...>", "vLLM servers (reads /v1/models and /metrics)")
    .option("--api-key <key>", "bearer token for the servers")
    .option(
      "--operator-key <key>",
      "bearer token for the kvfence router's /kvfence/nodes, its operator key (or env KVFENCE_OPERATOR_KEY)",
    )
    .option(
      "--operator-url <url>",
      "the kvfence router's operator listener, where /kvfence/nodes is when not on --url (e.g. http://127.0.0.1:8001)",
    )
    .option("--config <file>", "offline: the model's config.json")
    .option("--gpu-memory <size>", "offline: memory per GPU, e.g. 141GiB")
    .option("--dtype <dtype>", "offline: weight dtype (bf16, fp16, fp8, fp32)", "bf16")
    .option(
      "--kv-cache-dtype <dtype>",
      "offline: KV cache dtype, as kvfence serve --kv-cache-dtype (f32, f16, bf16, fp8; default: --dtype)",
    )
    .option("--tp <n>", "offline: tensor-parallel size", positiveInt, 1)
    .option(
      "--mem-fraction <f>",
      "offline: static memory fraction (SGLang --mem-fraction-static)",
      fraction,
      0.88,
    )
    .option("--context-length <n>", "offline: context length to serve", positiveInt)
    .option("--weights-bytes <size>", "offline: weight bytes per rank (default: estimated from the config)")
    .option("--pool-tokens <n>", "offline: the pool size in tokens, to compare directly", positiveInt)
    .option("--page-size <n>", "offline: tokens per KV page", positiveInt, 1)
    .option("--timeout <seconds>", "per-request timeout", positiveInt, 10)
    .option("--json", "print the report as JSON instead of a table")
    .action(async (opts: PreflightCliOptions) => {
      try {
        const offline = await offlineFrom(opts);
        const report = await runPreflight({
          ...(opts.url === undefined ? {} : { kvfenceUrl: opts.url }),
          ...(opts.sglang === undefined ? {} : { sglangUrls: opts.sglang }),
          ...(opts.vllm === undefined ? {} : { vllmUrls: opts.vllm }),
          ...(offline === undefined ? {} : { offline }),
          ...(opts.apiKey === undefined ? {} : { apiKey: opts.apiKey }),
          ...operatorKeyOption(opts.operatorKey),
          ...(opts.operatorUrl === undefined ? {} : { operatorUrl: opts.operatorUrl }),
          timeoutMs: opts.timeout * 1000,
        });
        process.stdout.write(
          `${opts.json === true ? JSON.stringify(report, null, 2) : renderPreflightTable(report)}\n`,
        );
        process.exitCode = report.exitCode;
      } catch (err) {
        process.stderr.write(`kvfence preflight: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 2;
      }
    });
}

/** `--operator-key`, else env KVFENCE_OPERATOR_KEY, as an option object. */
function operatorKeyOption(flag: string | undefined): { operatorKey?: string } {
  const key = flag ?? process.env.KVFENCE_OPERATOR_KEY;
  return key === undefined || key === "" ? {} : { operatorKey: key };
}

async function offlineFrom(opts: PreflightCliOptions): Promise<OfflineInputs | undefined> {
  const wantsOffline =
    opts.config !== undefined || opts.gpuMemory !== undefined || opts.poolTokens !== undefined;
  if (!wantsOffline) return undefined;
  if (opts.contextLength === undefined) {
    throw new KvfenceError("invalid_request", "Offline checks need --context-length: missing");
  }
  let config: HfModelConfig | undefined;
  if (opts.config !== undefined) {
    try {
      config = JSON.parse(await readFile(opts.config, "utf8")) as HfModelConfig;
    } catch (err) {
      throw new KvfenceError(
        "config_invalid",
        `Cannot read the model config as JSON, check the path: ${opts.config}`,
        {
          cause: err,
        },
      );
    }
  }
  return {
    contextLength: opts.contextLength,
    ...(config === undefined ? {} : { config }),
    ...(opts.gpuMemory === undefined ? {} : { gpuMemoryBytes: parseBytes(opts.gpuMemory) }),
    ...(opts.dtype === undefined ? {} : { dtype: opts.dtype }),
    ...(opts.kvCacheDtype === undefined ? {} : { kvDtype: opts.kvCacheDtype }),
    ...(opts.tp === undefined ? {} : { tp: opts.tp }),
    ...(opts.memFraction === undefined ? {} : { memFraction: opts.memFraction }),
    ...(opts.weightsBytes === undefined ? {} : { weightsBytes: parseBytes(opts.weightsBytes) }),
    ...(opts.poolTokens === undefined ? {} : { poolTokens: opts.poolTokens }),
    ...(opts.pageSize === undefined ? {} : { pageSize: opts.pageSize }),
  };
}

function positiveInt(value: string): number {
  const n = Number(value.replaceAll("_", "").replaceAll(",", ""));
  if (!Number.isInteger(n) || n < 1) throw new InvalidArgumentError(`Expected a positive integer: ${value}`);
  return n;
}

function fraction(value: string): number {
  const n = Number(value);
  if (!(n > 0 && n <= 1)) throw new InvalidArgumentError(`Expected a fraction in (0, 1]: ${value}`);
  return n;
}
