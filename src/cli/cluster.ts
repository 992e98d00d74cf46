/**
 * `kvfence cluster --prefill N --decode M`: a local multi-process cluster on 127.0.0.1 (N prefill
 * and M decode node processes and a router, TCP between them); prints the router's URL. Ctrl-C
 * stops every process. `--tls-cert/--tls-key/--tls-ca` go to every process (mutual TLS on every
 * cluster link), `--https-cert/--https-key` (docs/tls.md), the operator endpoints' flags
 * (`--operator-key`, `--metrics-port`, `--metrics-tenant-names`; docs/api.md), the request limits
 * and the tokenizer pool (`--max-body-bytes`, `--max-prompt-bytes`, `--max-response-bytes`,
 * `--max-messages`, `--max-json-depth`, `--tokenizer-threads`), the chat template and tool-call parser
 * (`--chat-template`, `--tool-call-parser`), and the fair-share and readiness flags
 * (`--tenant-max-*`, `--max-queue`, `--queue-timeout`, `--scheduling-policy`, `--ready-timeout`),
 * `--max-migrations` to the router; the
 * model and pool flags (`--quantize`, `--kv-cache-dtype`, `--kv-pages`, `--kernels`, ...) to every
 * node (`nodeArgsOf`).
 */
import { join } from "node:path";
import { Command } from "commander";
import { BUNDLED_MODEL_DIR } from "../server/serve-config.js";
import { UNSAFE_OPT_IN_FLAG, unsafeArgs, unsafeSwitchesProblem } from "../server/unsafe-switches.js";
import { startLocalCluster } from "../topology/local-cluster.js";

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

function count(flag: string, text: string): number {
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > 16) {
    process.stderr.write(
      `kvfence cluster: ${flag} must be an integer from 1 to 16: ${JSON.stringify(text)}\n`,
    );
    process.exit(2);
  }
  return n;
}

export function command(): Command {
  return new Command("cluster")
    .description("Start a local multi-process cluster (router + prefill and decode node processes)")
    .option("--prefill <n>", "prefill node processes", "1")
    .option("--decode <n>", "decode node processes", "1")
    .option("--port <port>", "router port", "8000")
    .option("--model <dir|file.gguf>", "Hugging Face model folder or llama.cpp GGUF file", BUNDLED_MODEL_DIR)
    .option("--kv-pages <n>", "KV pool size of each node in pages")
    .option("--kv-cache-dtype <dtype>", "KV cache element type of every node: f32, f16 (default) or bf16")
    .option("--quantize <type>", "every node quantises the weight matrices at load: q8_0 or q4_0")
    .option("--api-keys <file>", "API keys file for the router")
    .option("--max-model-len <tokens>", "longest request served (prompt + max_tokens)")
    .option("--prefill-kv-pages <n>", "the prefill nodes' KV pool in pages, when it differs from --kv-pages")
    .option("--kernels <kind>", "forward-pass kernels of every node: auto (default), native, wasm or ts")
    .option("--kernel-threads <n>", "threads of the wasm kernels per node: 1 (default) or 2")
    .option("--tls-cert <file>", "cluster links: every process's TLS certificate (PEM, SANs 127.0.0.1)")
    .option("--tls-key <file>", "cluster links: the private key of --tls-cert (PEM)")
    .option("--tls-ca <file>", "cluster links: the CA (PEM) every peer's certificate must chain to")
    .option("--https-cert <file>", "front door: the router serves HTTPS with this certificate (PEM)")
    .option("--https-key <file>", "front door: the private key of --https-cert (PEM)")
    .option(
      "--max-body-bytes <size>",
      "router: request bodies over this get 413 (default 2 x --max-prompt-bytes + 1MiB)",
    )
    .option(
      "--max-prompt-bytes <size>",
      "router: prompts over this many UTF-8 bytes get 400 before tokenization",
    )
    .option(
      "--max-response-bytes <size>",
      "router: requests whose answer could be larger get 400 before any work (default 1KiB per token of the context, at least 64MiB)",
    )
    .option("--max-messages <n>", "router: chat requests with more messages get 400 (default 2048)")
    .option("--chat-template <file>", "router: a Jinja chat template file in place of the model folder's")
    .option("--tool-call-parser <format>", "router: tool-call format (hermes, llama3_json, mistral)")
    .option("--max-json-depth <n>", "router: bodies nesting deeper get 400 before parsing (default 64)")
    .option("--tokenizer-threads <n>", "router: worker threads that parse, template and tokenize (default 2)")
    .option(
      "--reasoning-parser <name>",
      "router: split the <think> block out of answers: deepseek_r1 or qwen3",
    )
    .option(
      "--tenant-max-concurrency <n>",
      "router: requests one tenant may have running at once (0: no cap)",
    )
    .option("--tenant-max-pages <n>", "router: KV pages one tenant's running requests may hold (0: no cap)")
    .option("--tenant-max-queue <n>", "router: requests one tenant may have waiting (0: no cap)")
    .option("--max-queue <n>", "router: requests waiting over all tenants (default 256)")
    .option("--queue-timeout <seconds>", "router: a request waiting longer gets 429 or 503 (default 30)")
    .option("--scheduling-policy <policy>", "router: fair (default) or fcfs, arrival order across tenants")
    .option(
      "--ready-timeout <seconds>",
      "router: a node that does not answer a ping within this is not ready (default 0.5)",
    )
    .option(
      "--max-migrations <n>",
      "router: times a request may migrate mid-stream to another pair when a node is lost (default 2)",
    )
    .option(
      "--operator-key <key>",
      "the router's operator key for /metrics and /kvfence/nodes (or env KVFENCE_OPERATOR_KEY)",
    )
    .option(
      "--metrics-port <port>",
      "the router's operator listener port (default: --port + 1 without an operator key)",
    )
    .option("--metrics-tenant-names", "label the router's metrics with tenant names, not opaque ids")
    .option(
      "--otlp-endpoint <url>",
      "every process exports its request spans over OTLP/HTTP (JSON) there (default: off)",
    )
    .option("--no-phase-metrics", "no per-phase histograms (only for measuring what they cost)")
    .option("--prefix-cache <on|off>", "the nodes' tenant-fenced prefix cache (default on)")
    .option("--prefix-cache-scope <tenant|key>", "the router's prefix-cache namespace (default tenant)")
    .option("--cache-ram <size>", "each prefill node's KV tier in host memory (e.g. 2GiB)")
    .option(
      "--cache-disk <dir>",
      "the prefill nodes' KV tier on disk: node i uses DIR/prefill-i (with --cache-disk-size, --cache-disk-key)",
    )
    .option("--cache-disk-size <size>", "bytes each prefill node's disk tier may hold")
    .option("--cache-disk-key <file>", "the disk tiers' secret (made if absent; outside --cache-disk)")
    .option("--unsafe-fault <name>", "UNSAFE, tests and demos only: inject a fault (repeatable)", collect, [])
    .option(
      "--unsafe-disable-guard <name>",
      "UNSAFE, tests and demos only: switch a guard off (repeatable)",
      collect,
      [],
    )
    .option(UNSAFE_OPT_IN_FLAG, "required with --unsafe-fault or --unsafe-disable-guard", false)
    .action(runCluster);
}

export type RawOptions = Record<string, string | undefined>;

/** `--flag value` for each of `flags` given (by its commander key), in that order. */
function passOn(raw: RawOptions, flags: ReadonlyArray<[flag: string, key: string]>): string[] {
  return flags.flatMap(([flag, key]) => {
    const value = raw[key];
    return value === undefined ? [] : [flag, value];
  });
}

/** The `kvfence serve --role router` flags `kvfence cluster` passes on from its own. */
export function routerArgsOf(raw: RawOptions): string[] {
  const args = passOn(raw, [
    ["--api-keys", "apiKeys"],
    ["--https-cert", "httpsCert"],
    ["--https-key", "httpsKey"],
    ["--operator-key", "operatorKey"],
    ["--metrics-port", "metricsPort"],
    ["--max-body-bytes", "maxBodyBytes"],
    ["--max-prompt-bytes", "maxPromptBytes"],
    ["--max-response-bytes", "maxResponseBytes"],
    ["--max-messages", "maxMessages"],
    ["--chat-template", "chatTemplate"],
    ["--tool-call-parser", "toolCallParser"],
    ["--max-json-depth", "maxJsonDepth"],
    ["--tokenizer-threads", "tokenizerThreads"],
    ["--reasoning-parser", "reasoningParser"],
    ["--tenant-max-concurrency", "tenantMaxConcurrency"],
    ["--tenant-max-pages", "tenantMaxPages"],
    ["--tenant-max-queue", "tenantMaxQueue"],
    ["--max-queue", "maxQueue"],
    ["--queue-timeout", "queueTimeout"],
    ["--scheduling-policy", "schedulingPolicy"],
    ["--ready-timeout", "readyTimeout"],
    ["--max-migrations", "maxMigrations"],
    ["--prefix-cache-scope", "prefixCacheScope"],
  ]);
  if (raw.metricsTenantNames !== undefined) args.push("--metrics-tenant-names");
  return args;
}

/** The `kvfence serve --role prefill|decode` flags `kvfence cluster` passes on to every node. */
export function nodeArgsOf(
  raw: RawOptions,
  opts: { readonly unsafeFault: string[]; readonly unsafeDisableGuard: string[] },
): string[] {
  return [
    ...passOn(raw, [
      ["--kv-pages", "kvPages"],
      ["--kv-cache-dtype", "kvCacheDtype"],
      ["--quantize", "quantize"],
      ["--max-model-len", "maxModelLen"],
      ["--kernels", "kernels"],
      ["--kernel-threads", "kernelThreads"],
      ["--prefix-cache", "prefixCache"],
    ]),
    ...unsafeArgs(opts.unsafeFault, opts.unsafeDisableGuard),
    ...passOn(raw, [
      ["--tls-cert", "tlsCert"],
      ["--tls-key", "tlsKey"],
      ["--tls-ca", "tlsCa"],
      ["--otlp-endpoint", "otlpEndpoint"],
    ]),
    ...((raw.phaseMetrics as unknown) === false ? ["--no-phase-metrics"] : []),
  ];
}

/**
 * The KV tier flags of prefill node `index`: `--cache-ram` as given, and its own directory
 * `DIR/prefill-<index>` of `--cache-disk` (a tier directory belongs to one node).
 */
export function tierArgsOf(raw: RawOptions, index: number): string[] {
  return [
    ...passOn(raw, [["--cache-ram", "cacheRam"]]),
    ...(raw.cacheDisk === undefined ? [] : ["--cache-disk", join(raw.cacheDisk, `prefill-${index}`)]),
    ...passOn(raw, [
      ["--cache-disk-size", "cacheDiskSize"],
      ["--cache-disk-key", "cacheDiskKey"],
    ]),
  ];
}

async function runCluster(raw: RawOptions): Promise<void> {
  const opts = raw as unknown as {
    unsafeFault: string[];
    unsafeDisableGuard: string[];
    iUnderstandThisLeaksData: boolean;
  };
  const problem = unsafeSwitchesProblem(opts);
  if (problem !== null) {
    process.stderr.write(`kvfence cluster: ${problem}\n`);
    process.exit(2);
  }
  const nodeArgs = nodeArgsOf(raw, opts);
  const routerArgs = routerArgsOf(raw);
  const cluster = await startLocalCluster({
    prefill: count("--prefill", raw.prefill ?? "1"),
    decode: count("--decode", raw.decode ?? "1"),
    model: raw.model ?? BUNDLED_MODEL_DIR,
    port: Number(raw.port ?? 8000),
    nodeArgs,
    ...(raw.prefillKvPages === undefined ? {} : { prefillArgs: ["--prefill-kv-pages", raw.prefillKvPages] }),
    prefillArgsAt: (index) => tierArgsOf(raw, index),
    routerArgs,
    stderr: (line) => process.stderr.write(`${line}\n`),
  }).catch((err: Error) => {
    process.stderr.write(`kvfence cluster: ${err.message}\n`);
    process.exit(1);
  });
  process.stdout.write(
    `kvfence cluster at ${cluster.url} (OpenAI API at ${cluster.url}/v1): ` +
      `${cluster.prefill.length} prefill, ${cluster.decode.length} decode processes; Ctrl-C stops them all\n`,
  );
  process.stdout.write(`${operatorEndpointsLine(raw)}\n`);
  let stopping = false;
  const shutdown = (): void => {
    if (stopping) process.exit(1);
    stopping = true;
    void cluster.close().then(() => process.exit(0));
  };
  process.on("SIGINT", shutdown);
  process.on("SIGTERM", shutdown);
}

/** Where the router's operator endpoints are (docs/api.md, "Operator endpoints"). */
function operatorEndpointsLine(raw: RawOptions): string {
  const what = "operator endpoints (/metrics, /kvfence/nodes)";
  if (raw.metricsPort !== undefined) return `${what} at http://127.0.0.1:${raw.metricsPort}`;
  if ((raw.operatorKey ?? process.env.KVFENCE_OPERATOR_KEY ?? "") !== "")
    return `${what} on the front door, with the operator key`;
  const asked = Number(raw.port ?? 8000);
  return asked === 0
    ? `${what} on a free loopback port: give --metrics-port to choose it`
    : `${what} at http://127.0.0.1:${asked + 1}`;
}
