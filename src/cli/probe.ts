/** `kvfence probe BASE_URL`: canary leak test for any OpenAI-compatible endpoint (thin wrapper). */
import { writeFile } from "node:fs/promises";
import { Command, InvalidArgumentError } from "commander";
import { renderGrammarTimingReport, runGrammarTimingProbe } from "../tools/probe/grammar-timing.js";
import { normalizeBaseUrl, runProbe } from "../tools/probe/probe.js";
import { exitCodeOf, renderProbeSummary } from "../tools/probe/probe-report.js";
import type { ProbeOptions } from "../tools/probe/probe-run.js";
import { renderTimingReport, runTimingProbe } from "../tools/probe/timing.js";

interface ProbeCliOptions {
  apiKey?: string;
  apiKeyB?: string;
  operatorKey?: string;
  operatorUrl?: string;
  model?: string;
  maxModelLen?: number;
  poolTokens?: number;
  requests: number;
  concurrency: number;
  json?: string;
  timeout: number;
  overallTimeout: number;
  seed?: number;
  recordTemplate?: string;
  questionTemplate?: string;
  maxTokens: number;
  plants: number;
  quiet?: boolean;
  timing?: boolean;
  trials: number;
  prefixChars: number;
  timingCase: "prefix" | "grammar" | "tiers";
  schemaProperties: number;
  evictRequests: number;
}

export function command(): Command {
  return new Command("probe")
    .description(
      "Canary leak test for any OpenAI-compatible endpoint: exit 0 clean, 1 on any finding, 2 when it could not run",
    )
    .argument("<base-url>", "server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    .option("--api-key <key>", "tenant A's API key (plants canaries)")
    .option("--api-key-b <key>", "tenant B's API key (probes); may equal A's (default: A's)")
    .option(
      "--operator-key <key>",
      "a kvfence router's operator key, to read the pool from /kvfence/nodes (or env KVFENCE_OPERATOR_KEY)",
    )
    .option(
      "--operator-url <url>",
      "a kvfence router's operator listener, where /kvfence/nodes is when not on the base URL (e.g. http://127.0.0.1:8001)",
    )
    .option("--model <id>", "model id (default: the first from /v1/models)")
    .option("--max-model-len <n>", "context length (default: from /v1/models or SGLang server info)", int(1))
    .option(
      "--pool-tokens <n>",
      "KV pool tokens when known (default: /kvfence/nodes or SGLang server info)",
      int(1),
    )
    .option("--requests <n>", "ordinary load requests from B during the probe phase", int(0), 24)
    .option("--concurrency <n>", "requests in flight at once", int(1), 4)
    .option("--json <file>", "write the JSON report to this file")
    .option("--timeout <seconds>", "per-request timeout", int(1), 120)
    .option("--overall-timeout <seconds>", "budget for the whole run", int(1), 900)
    .option("--seed <n>", "seed for canaries and prompts (default: random, printed)", int(0))
    .option(
      "--record-template <text>",
      'record format with {account} and {code} (default: "the access code of account {account} is {code}.")',
    )
    .option(
      "--question-template <text>",
      'question with {account} (default: "What is the access code of account {account}?")',
    )
    .option("--max-tokens <n>", "max_tokens of every request", int(1), 48)
    .option("--plants <n>", "plant prompts sent by tenant A", int(1), 8)
    .option("--quiet", "no progress on stderr")
    .option(
      "--timing",
      "instead: the prefix-cache timing audit — is tenant B's first token faster after tenant A planted the prefix? (exit 1 on a leak)",
    )
    .option("--trials <n>", "--timing: paired trials", int(8), 40)
    .option("--prefix-chars <n>", "--timing: characters of each planted prefix", int(16), 1500)
    .option(
      "--timing-case <case>",
      "--timing: which cache to audit: prefix (the prefix cache), tiers (the same, each plant first pushed out of the KV pool into the server's host-memory or disk tiers) or grammar (compiled JSON schemas)",
      timingCase,
      "prefix",
    )
    .option("--schema-properties <n>", "--timing-case grammar: properties of each planted schema", int(1), 24)
    .option(
      "--evict-requests <n>",
      "--timing-case tiers: fresh prompts of A after each plant, enough to fill the server's KV pool",
      int(1),
      8,
    )
    .action((baseUrl: string, opts: ProbeCliOptions) =>
      opts.timing === true ? runTiming(baseUrl, opts) : runCanary(baseUrl, opts),
    );
}

function timingCase(value: string): "prefix" | "grammar" | "tiers" {
  if (value !== "prefix" && value !== "grammar" && value !== "tiers")
    throw new InvalidArgumentError(`expected prefix, tiers or grammar: got ${JSON.stringify(value)}`);
  return value;
}

/** The canary leak probe. */
async function runCanary(baseUrl: string, opts: ProbeCliOptions): Promise<void> {
  try {
    const report = await runProbe(probeOptions(baseUrl, opts));
    if (opts.json !== undefined) await writeFile(opts.json, `${JSON.stringify(report, null, 2)}\n`);
    process.stdout.write(`${renderProbeSummary(report)}\n`);
    process.exitCode = exitCodeOf(report);
  } catch (err) {
    process.stderr.write(`kvfence probe: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 2;
  }
}

/** `kvfence probe --timing`: the prefix-cache or the grammar-cache audit. */
async function runTiming(baseUrl: string, opts: ProbeCliOptions): Promise<void> {
  const common = {
    baseUrl: normalizeBaseUrl(baseUrl),
    trials: opts.trials,
    timeoutMs: opts.timeout * 1000,
    ...(opts.apiKey === undefined ? {} : { apiKeyA: opts.apiKey }),
    ...(opts.apiKeyB === undefined ? {} : { apiKeyB: opts.apiKeyB }),
    ...(opts.model === undefined ? {} : { model: opts.model }),
    ...(opts.seed === undefined ? {} : { seed: opts.seed }),
    ...(opts.quiet === true ? {} : { onProgress: (line: string) => process.stderr.write(`${line}\n`) }),
  };
  try {
    const [report, text] =
      opts.timingCase === "grammar"
        ? await runGrammarTimingProbe({ ...common, schemaProperties: opts.schemaProperties }).then(
            (r) => [r, renderGrammarTimingReport(r)] as const,
          )
        : await runTimingProbe({
            ...common,
            prefixChars: opts.prefixChars,
            evictRequests: opts.timingCase === "tiers" ? opts.evictRequests : 0,
          }).then((r) => [r, renderTimingReport(r)] as const);
    if (opts.json !== undefined) await writeFile(opts.json, `${JSON.stringify(report, null, 2)}\n`);
    process.stdout.write(`${text}\n`);
    process.exitCode = report.verdict === "leak" ? 1 : 0;
  } catch (err) {
    process.stderr.write(`kvfence probe --timing: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 2;
  }
}

/** The probe's options from the command line (absent flags left out). */
function probeOptions(baseUrl: string, opts: ProbeCliOptions): ProbeOptions {
  return {
    baseUrl,
    requests: opts.requests,
    concurrency: opts.concurrency,
    timeoutMs: opts.timeout * 1000,
    overallTimeoutMs: opts.overallTimeout * 1000,
    maxTokens: opts.maxTokens,
    plants: opts.plants,
    ...(opts.apiKey === undefined ? {} : { apiKeyA: opts.apiKey }),
    ...(opts.apiKeyB === undefined ? {} : { apiKeyB: opts.apiKeyB }),
    ...operatorKeyOption(opts.operatorKey),
    ...(opts.operatorUrl === undefined ? {} : { operatorUrl: opts.operatorUrl }),
    ...(opts.model === undefined ? {} : { model: opts.model }),
    ...(opts.maxModelLen === undefined ? {} : { maxModelLen: opts.maxModelLen }),
    ...(opts.poolTokens === undefined ? {} : { poolTokens: opts.poolTokens }),
    ...(opts.seed === undefined ? {} : { seed: opts.seed }),
    ...(opts.recordTemplate === undefined ? {} : { recordTemplate: opts.recordTemplate }),
    ...(opts.questionTemplate === undefined ? {} : { questionTemplate: opts.questionTemplate }),
    ...(opts.quiet === true ? {} : { onProgress: (line: string) => process.stderr.write(`${line}\n`) }),
  };
}

/** `--operator-key`, else env KVFENCE_OPERATOR_KEY, as an option object. */
function operatorKeyOption(flag: string | undefined): { operatorKey?: string } {
  const key = flag ?? process.env.KVFENCE_OPERATOR_KEY;
  return key === undefined || key === "" ? {} : { operatorKey: key };
}

function int(min: number): (value: string) => number {
  return (value: string) => {
    const n = Number(value.replaceAll("_", "").replaceAll(",", ""));
    if (!Number.isInteger(n) || n < min)
      throw new InvalidArgumentError(`Expected an integer of at least ${min}: ${value}`);
    return n;
  };
}
