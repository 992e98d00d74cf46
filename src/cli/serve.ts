/**
 * `kvfence serve`: the OpenAI-compatible server. With no arguments it serves the bundled model on
 * http://127.0.0.1:8000 (router + prefill + decode in threads); `--no-disaggregation` runs one
 * engine; `--role router|prefill|decode` one role per process. This file holds the flags and the
 * process's life (exit codes, the progress line, SIGINT/SIGTERM: the HTTP server closes with a short
 * grace period for in-flight requests, then the engine); the options are parsed in
 * src/server/serve-config.ts and the boot is src/server/start-server.ts.
 */
import { Command } from "commander";
import { KvfenceError } from "../lib/errors.js";
import { createLogger, type Logger, type LogLevel } from "../lib/logger.js";
import { BUNDLED_MODEL_DIR, parseServeConfig, type ServeConfig, serveTls } from "../server/serve-config.js";
import { type RunningServer, startNode, startServer } from "../server/start-server.js";
import { UNSAFE_OPT_IN_FLAG } from "../server/unsafe-switches.js";

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

export function command(): Command {
  const cmd = new Command("serve")
    .description("Serve the OpenAI-compatible API (router + prefill + decode; or one role per process)")
    .argument("[model]", "Hugging Face model folder (as --model; vLLM's and SGLang's positional form)")
    .option("--host <host>", "address to listen on", "127.0.0.1")
    .option("--port <port>", "port to listen on (0 = any free port)", "8000")
    .option("--model <dir|file.gguf>", "Hugging Face model folder or llama.cpp GGUF file", BUNDLED_MODEL_DIR)
    .option(
      "--kv-memory <size>",
      "KV pool size of each engine, e.g. 896MiB (default: one request of the context, at least 256MiB)",
    )
    .option("--kv-pages <n>", "KV pool size in pages (instead of --kv-memory)")
    .option("--page-size <tokens>", "tokens per KV page", "16")
    .option("--kv-cache-dtype <dtype>", "KV cache element type: f32, f16 (default) or bf16")
    .option("--max-model-len <tokens>", "longest request served (prompt + max_tokens)")
    .option("--max-prefill-tokens <tokens>", "prefill tokens per engine step")
    .option(
      "--api-keys <file>",
      'API keys: JSON {"sk-...": "tenant"} or lines "key tenant" (or env KVFENCE_API_KEYS)',
    )
    .option("--api-key <key>", 'an API key of tenant "default" (repeatable; besides --api-keys)', collect, [])
    .option(
      "--served-model-name <name...>",
      "the model names clients may send (the first is reported; default: the folder's name)",
    )
    .option("--max-num-seqs <n>", "requests one engine step batches (sequence slots; default 16)")
    .option("--max-queued-requests <n>", "as --max-queue (vLLM's name)")
    .option("--seed <n>", "seed of the requests that bring none (default: random at each start)")
    .option(
      "--generation-config <source>",
      "sampling defaults: auto (the model folder's generation_config.json), vllm (none), or a folder holding one",
      "auto",
    )
    .option("--chat-template <file>", "a Jinja chat template file in place of the model folder's");
  tierOptions(registryOptions(routerOptions(cmd)))
    .option("--scrub-on-free", "zero KV pages when they are freed", false)
    .option("--prefix-cache <on|off>", "keep a tenant-fenced prefix cache of full KV pages", "on")
    .option(
      "--prefix-cache-scope <tenant|key>",
      "prefix-cache namespace: per tenant, or narrower, per API key",
      "tenant",
    )
    .option("--no-disaggregation", "run prefill and decode on one engine")
    .option("--role <role>", "all (router + prefill + decode threads), router, prefill or decode", "all")
    .option("--prefill <url...>", "router: the prefill nodes' addresses (host:port)", [])
    .option("--decode <url...>", "router: the decode nodes' addresses (host:port)", [])
    .option(
      "--cluster-secret <secret>",
      "secret shared by the router and nodes (or env KVFENCE_CLUSTER_SECRET)",
    )
    .option("--unsafe-fault <name>", "UNSAFE, tests and demos only: inject a fault (repeatable)", collect, [])
    .option(
      "--unsafe-disable-guard <name>",
      "UNSAFE, tests and demos only: switch a guard off (repeatable)",
      collect,
      [],
    )
    .option(
      UNSAFE_OPT_IN_FLAG,
      "required with --unsafe-fault or --unsafe-disable-guard: this server may leak one tenant's data to another",
      false,
    )
    .option("--prefill-kv-pages <n>", "the prefill node's KV pool in pages, when it differs from --kv-pages")
    .option(
      "--kernels <kind>",
      "forward-pass kernels: auto (native where the addon is built and passes its start-up self-test, else wasm), native (C, docs/kernels.md), wasm (WebAssembly SIMD) or ts (TypeScript reference)",
      "auto",
    )
    .option(
      "--quantize <type>",
      "quantise the weight matrices at load into llama.cpp's q8_0 or q4_0 blocks (default: keep the folder's format)",
    )
    .option(
      "--kernel-threads <n>",
      "threads of the wasm kernels per engine: 1 or 2 (default 2 with --no-disaggregation, else 1)",
    )
    .option(
      "--tls-cert <file>",
      "cluster links: this process's TLS certificate (PEM; with --tls-key, --tls-ca)",
    )
    .option("--tls-key <file>", "cluster links: the private key of --tls-cert (PEM)")
    .option(
      "--tls-ca <file>",
      "cluster links: the CA (PEM) every peer's certificate must chain to; links are mutually authenticated",
    )
    .option("--https-cert <file>", "front door: serve HTTPS with this certificate (PEM; with --https-key)")
    .option("--https-key <file>", "front door: the private key of --https-cert (PEM)")
    .option(
      "--insecure-plaintext-links",
      "let a node listen (or a router dial nodes) beyond loopback without TLS: prompts and KV cross the network readable",
      false,
    );
  return fairShareOptions(cmd)
    .option(
      "--log-level <level>",
      "fatal, error, warn, info, debug, trace or silent",
      process.env.KVFENCE_LOG_LEVEL ?? "info",
    )
    .action(serve);
}

/** The front door's request limits, preparation threads and operator endpoints (docs/api.md). */
function routerOptions(cmd: Command): Command {
  return cmd
    .option(
      "--tool-call-parser <format>",
      "how tool calls are read from the output: hermes, llama3_json or mistral (default: the chat template's)",
    )
    .option(
      "--reasoning-parser <name>",
      "split the <think> block out of chat and /v1/responses answers: deepseek_r1 or qwen3 (vLLM's flag)",
    )
    .option(
      "--max-body-bytes <size>",
      "request bodies over this get 413, before they are read (default 2 x --max-prompt-bytes + 1MiB)",
    )
    .option(
      "--max-prompt-bytes <size>",
      "prompts (a chat's message contents, summed) over this many UTF-8 bytes get 400 before tokenization (default 32 bytes per token of the context, at least 64KiB)",
    )
    .option(
      "--max-response-bytes <size>",
      "requests whose answer could be larger (worst case from n, max_tokens, logprobs, echo and the prompt) get 400 before any work (default 1KiB per token of the context, at least 64MiB)",
    )
    .option("--max-messages <n>", "chat requests with more messages get 400 (default 2048)")
    .option(
      "--max-json-depth <n>",
      "bodies nesting objects and arrays deeper get 400 before parsing (default 64)",
    )
    .option(
      "--tokenizer-threads <n>",
      "worker threads that parse, template and tokenize requests off the router's event loop",
      "2",
    )
    .option(
      "--operator-key <key>",
      "/metrics and /kvfence/nodes need this as a Bearer token (or env KVFENCE_OPERATOR_KEY); without it they are served only on the loopback operator listener",
    )
    .option(
      "--metrics-host <host>",
      "address of the operator listener (/metrics, /kvfence/nodes)",
      "127.0.0.1",
    )
    .option(
      "--metrics-port <port>",
      "port of the operator listener (default: --port + 1 when no --operator-key is given, else none)",
    )
    .option("--metrics-tenant-names", "label metrics with tenant names instead of opaque ids", false)
    .option(
      "--allowed-origins <origin...>",
      'browser origins answered with CORS headers and preflights (repeatable or comma-separated; "*" for any; default none)',
    )
    .option(
      "--no-phase-metrics",
      "do not record the per-phase histograms (kvfence_phase_seconds; only for measuring what they cost)",
    )
    .option(
      "--otlp-endpoint <url>",
      "export OpenTelemetry spans of each request's phases over OTLP/HTTP (JSON) to this receiver, e.g. http://127.0.0.1:4318 (default: off, no SDK loaded)",
    );
}

/** The KV tiers below the prefix cache (docs/api.md, "KV tiers"). */
function tierOptions(cmd: Command): Command {
  return cmd
    .option(
      "--cache-ram <size>",
      "KV tier in host memory below the prefix cache, e.g. 2GiB: evicted cached pages spill here and load back on a hit",
    )
    .option(
      "--cache-disk <dir>",
      "KV tier on disk below --cache-ram (with --cache-disk-size and --cache-disk-key); survives a restart",
    )
    .option("--cache-disk-size <size>", "bytes the --cache-disk tier may hold, e.g. 20GiB")
    .option(
      "--cache-disk-key <file>",
      "the secret the disk tier's pages are sealed under (HMAC); made (0600, 32 random bytes) if absent; not inside --cache-disk",
    );
}

/** Membership in etcd (docs/topologies.md, "Membership in etcd"). */
function registryOptions(cmd: Command): Command {
  return cmd
    .option(
      "--registry <url>",
      "membership in etcd, etcd://host:port[,host:port…]: nodes register, routers watch (instead of --prefill/--decode)",
    )
    .option("--registry-prefix <key>", "the cluster's key prefix in etcd", "/kvfence")
    .option("--registry-ca <file>", "TLS to etcd: the CA (PEM)")
    .option(
      "--registry-cert <file>",
      "TLS to etcd: this process's client certificate (PEM; with --registry-key)",
    )
    .option("--registry-key <file>", "TLS to etcd: the private key of --registry-cert (PEM)")
    .option("--registry-user <name>", "etcd user (its password from env KVFENCE_REGISTRY_PASSWORD)")
    .option(
      "--advertise <host:port>",
      "node: the host:port routers dial it at, when not --host:--port (NAT, a pod IP, a proxy); registered with --registry and bound by the link handshakes (default --host:--port)",
    );
}

/** The fair-share and readiness flags (docs/api.md, "Fair sharing"). */
function fairShareOptions(cmd: Command): Command {
  return cmd
    .option(
      "--tenant-max-concurrency <n>",
      "requests one tenant may have running at once (0: no cap; default: half the sequence slots with 2+ tenants, else no cap)",
    )
    .option(
      "--tenant-max-pages <n>",
      "KV pages one tenant's running requests may hold, each counted at prompt + max_tokens (0: no cap; default: half the KV pages with 2+ tenants)",
    )
    .option(
      "--tenant-max-queue <n>",
      "requests one tenant may have waiting; more get 429 (0: no cap; default: half of --max-queue with 2+ tenants)",
    )
    .option("--max-queue <n>", "requests waiting over all tenants; more get 503 (default 256)")
    .option("--queue-timeout <seconds>", "a request waiting longer gets 429 or 503 (default 30)")
    .option(
      "--scheduling-policy <policy>",
      "fair: waiting requests served by weighted fair queuing between tenants; fcfs: in arrival order across tenants (the caps and queue bounds still apply; default fair)",
    )
    .option(
      "--ready-timeout <seconds>",
      "/ready: a node (or the engine) that does not answer a ping within this is not ready (default 0.5)",
    )
    .option(
      "--max-migrations <n>",
      "router: times a request may migrate mid-stream to another prefill/decode pair when a node is lost (0: none, the stream ends with an error; default 2)",
    )
    .option(
      "--role-policy <policy>",
      "router with --registry: off, or queue (switch one node at a time to the role whose requests wait, from the roles' queue depth and wait; docs/topologies.md)",
      "off",
    )
    .option(
      "--role-policy-interval <seconds>",
      "router: how often --role-policy reads the roles' load (default 5)",
    )
    .option(
      "--router-slot <n>",
      "router: this router's slot, 0-15; each router over the same nodes needs its own (default: with --registry the lowest free slot in etcd, else 0; docs/topologies.md)",
    );
}

async function serve(positional: string | undefined, rawOptions: Record<string, unknown>): Promise<void> {
  const early = createLogger({ level: "info" });
  const raw = positionalModel(positional, rawOptions);
  let config: ServeConfig;
  try {
    const envKey = process.env.KVFENCE_OPERATOR_KEY;
    config = parseServeConfig(
      raw.operatorKey === undefined && envKey !== undefined && envKey !== ""
        ? { ...raw, operatorKey: envKey }
        : raw,
    );
    serveTls(config); // unreadable or mismatched TLS files fail here, before the model loads
  } catch (err) {
    process.stderr.write(`kvfence serve: ${(err as Error).message}\n`);
    process.exitCode = 2;
    return;
  }
  const log = config.logLevel === "info" ? early : createLogger({ level: config.logLevel as LogLevel });
  if (config.role === "prefill" || config.role === "decode") await serveNode(config, log);
  else await serveRouter(config, log);
}

/**
 * `kvfence serve MODEL` is `--model MODEL`; both at once must agree. `--max-queued-requests` is
 * `--max-queue`. Throws (exit 2) on a conflict.
 */
function positionalModel(
  positional: string | undefined,
  raw: Record<string, unknown>,
): Record<string, unknown> {
  let out = raw;
  if (positional !== undefined) {
    if (raw.model !== BUNDLED_MODEL_DIR && raw.model !== positional) {
      process.stderr.write(
        `kvfence serve: the model is given twice: ${positional} and --model ${String(raw.model)}; give one\n`,
      );
      process.exit(2);
    }
    out = { ...out, model: positional };
  }
  if (raw.maxQueuedRequests !== undefined) {
    if (raw.maxQueue !== undefined && raw.maxQueue !== raw.maxQueuedRequests) {
      process.stderr.write("kvfence serve: --max-queue and --max-queued-requests disagree; give one\n");
      process.exit(2);
    }
    const { maxQueuedRequests, ...rest } = out;
    out = { ...rest, maxQueue: maxQueuedRequests };
  }
  return out;
}

/** `--role prefill|decode`: one node in this process, until a signal. */
async function serveNode(config: ServeConfig, log: Logger): Promise<void> {
  try {
    let stop = () => {};
    const node = await startNode(config, { logger: log, onDrained: () => stop() });
    process.stdout.write(`kvfence ${config.role} node listening at ${node.url}\n`);
    stop = () => void node.close().then(() => process.exit(0));
    process.on("SIGINT", stop);
    process.on("SIGTERM", stop);
  } catch (err) {
    process.stderr.write(`kvfence serve: ${(err as Error).message}\n`);
    process.exitCode = 1;
  }
}

/** The router over its topology: a progress line while the model loads, a graceful stop on a signal. */
async function serveRouter(config: ServeConfig, log: Logger): Promise<void> {
  const tty = process.stderr.isTTY === true;
  let server: RunningServer;
  try {
    server = await startServer(config, {
      logger: log,
      progress: (line, done) => {
        if (tty) process.stderr.write(`\r\x1b[K${line}${done ? "\n" : ""}`);
        else if (done || line.endsWith(" 0%") || /: (0|25|50|75|100)% /.test(line))
          process.stderr.write(`${line}\n`);
      },
    });
  } catch (err) {
    const message = err instanceof KvfenceError ? err.message : ((err as Error).stack ?? String(err));
    process.stderr.write(`kvfence serve: ${message}\n`);
    process.exitCode = 1;
    return;
  }
  process.stdout.write(
    `kvfence serving ${config.model.split(/[\\/]/).filter(Boolean).at(-1)} at ${server.url} ` +
      `(OpenAI API at ${server.url}/v1, max_model_len ${server.contextLength})\n`,
  );
  process.stdout.write(
    server.operatorUrl !== null
      ? `operator endpoints (/metrics, /kvfence/nodes) at ${server.operatorUrl}${config.operatorKey === undefined ? " (loopback, no key)" : " (operator key)"}\n`
      : "operator endpoints (/metrics, /kvfence/nodes) on the front door, with the operator key\n",
  );
  let signals = 0;
  const shutdown = (signal: NodeJS.Signals) => {
    signals++;
    if (signals > 1) {
      log.warn({ signal }, "second signal: exiting now");
      process.exit(1);
    }
    log.info({ signal, inFlight: server.router.activeRequests }, "shutting down");
    server.close(5000).then(
      () => {
        log.info("stopped");
        process.exit(0);
      },
      (err: unknown) => {
        log.error({ err }, "error during shutdown");
        process.exit(1);
      },
    );
  };
  process.on("SIGINT", shutdown);
  process.on("SIGTERM", shutdown);
}
