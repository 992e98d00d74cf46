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
import { UNSAFE_OPT_IN_FLAG } from "../node/unsafe-switches.js";
import { BUNDLED_MODEL_DIR, parseServeConfig, type ServeConfig, serveTls } from "../server/serve-config.js";
import { type RunningServer, startNode, startServer } from "../server/start-server.js";

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

export function command(): Command {
  const cmd = new Command("serve")
    .description("Serve the OpenAI-compatible API (router + prefill + decode; or one role per process)")
    .option("--host <host>", "address to listen on", "127.0.0.1")
    .option("--port <port>", "port to listen on (0 = any free port)", "8000")
    .option("--model <dir>", "Hugging Face model folder", BUNDLED_MODEL_DIR)
    .option("--kv-memory <size>", "KV pool size, e.g. 256MiB (default 256MiB)")
    .option("--kv-pages <n>", "KV pool size in pages (instead of --kv-memory)")
    .option("--page-size <tokens>", "tokens per KV page", "16")
    .option("--max-model-len <tokens>", "longest request served (prompt + max_tokens)")
    .option("--max-prefill-tokens <tokens>", "prefill tokens per engine step")
    .option(
      "--api-keys <file>",
      'API keys: JSON {"sk-...": "tenant"} or lines "key tenant" (or env KVFENCE_API_KEYS)',
    );
  routerOptions(cmd)
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
      "forward-pass kernels: wasm (WebAssembly SIMD) or ts (TypeScript reference)",
      "wasm",
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
      "--max-body-bytes <size>",
      "request bodies over this get 413, before they are read (default 2 x --max-prompt-bytes + 1MiB)",
    )
    .option(
      "--max-prompt-bytes <size>",
      "prompts (a chat's message contents, summed) over this many UTF-8 bytes get 400 before tokenization (default 32 bytes per token of the context, at least 64KiB)",
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
    .option("--metrics-tenant-names", "label metrics with tenant names instead of opaque ids", false);
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
      "--ready-timeout <seconds>",
      "/ready: a node (or the engine) that does not answer a ping within this is not ready (default 0.5)",
    );
}

async function serve(raw: Record<string, unknown>): Promise<void> {
  const early = createLogger({ level: "info" });
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

/** `--role prefill|decode`: one node in this process, until a signal. */
async function serveNode(config: ServeConfig, log: Logger): Promise<void> {
  try {
    const node = await startNode(config, { logger: log });
    process.stdout.write(`kvfence ${config.role} node listening at ${node.url}\n`);
    const stop = () => void node.close().then(() => process.exit(0));
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
