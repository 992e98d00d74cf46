/**
 * `kvfence serve`: the OpenAI-compatible server on one engine (the `--no-disaggregation`
 * topology). With no arguments it serves the bundled model on http://127.0.0.1:8000.
 *
 * Boot order: parse the options once with zod into a frozen config (every problem with its path,
 * exit 2) → read the model's config → size the KV pool and run the capacity check shared with
 * `kvfence preflight` (a pool that cannot hold one full-context request stops the server with the
 * two fixes) → load the weights with a progress line → start the engine worker → start the HTTP
 * server and print its URL. TLS (docs/tls.md): `--tls-cert/--tls-key/--tls-ca` put mutual TLS on the
 * cluster links of every role, `--https-cert/--https-key` make the front door HTTPS; the files are
 * read and checked, and a node that would expose its links in plaintext beyond loopback is refused
 * (`linksExposure`), before anything loads. SIGINT/SIGTERM close the HTTP server (in-flight requests get a short
 * grace period), then the engine.
 */
import { existsSync } from "node:fs";
import net from "node:net";
import { fileURLToPath } from "node:url";
import { Command } from "commander";
import { z } from "zod";
import { parseNodeUrl } from "../cluster/cluster-router.js";
import { type KvLayout, pageBytes } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import { createLogger, type Logger, type LogLevel } from "../lib/logger.js";
import { loadModelConfig } from "../model/config-loader.js";
import { loadModel, loadModelMeta, loadWeights } from "../model/load-model.js";
import { startNodeServer } from "../node/node-server.js";
import { UNSAFE_OPT_IN_FLAG, unsafeSwitchesProblem, unsafeWarning } from "../node/unsafe-switches.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { TenantDirectory } from "../router/api-keys.js";
import { routerTokenizer } from "../router/model-tokenizer.js";
import { RouterServer } from "../router/router-server.js";
import { poolCapacityVerdict } from "../tools/preflight/capacity.js";
import { clusterSecret, startServeEngine } from "../topology/serve-topology.js";
import {
  type FrontDoorTls,
  isLoopback,
  type LinkTls,
  linksExposure,
  loadFrontDoorTls,
  loadLinkTls,
} from "../transfer/tls-config.js";

/** The bundled model, relative to this file in both src/ and dist/src/. */
export const BUNDLED_MODEL_DIR = (() => {
  for (const rel of ["../../models/kvfence-tiny", "../../../models/kvfence-tiny"]) {
    const path = fileURLToPath(new URL(rel, import.meta.url));
    if (existsSync(path)) return path;
  }
  return fileURLToPath(new URL("../../../models/kvfence-tiny", import.meta.url));
})();

export const DEFAULT_KV_MEMORY_BYTES = 256 * 1024 * 1024;

const UNITS: Record<string, number> = {
  "": 1,
  b: 1,
  k: 1024,
  kb: 1000,
  kib: 1024,
  m: 1024 ** 2,
  mb: 1000 ** 2,
  mib: 1024 ** 2,
  g: 1024 ** 3,
  gb: 1000 ** 3,
  gib: 1024 ** 3,
};

/** "256MiB" → bytes; null when the text is not a size. */
export function parseByteSize(text: string): number | null {
  const match = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/.exec(text);
  if (match === null) return null;
  const unit = UNITS[match[2]!.toLowerCase()];
  if (unit === undefined) return null;
  return Math.floor(Number(match[1]) * unit);
}

const intText = (min: number, max = Number.MAX_SAFE_INTEGER) =>
  z.union([z.string(), z.number()]).transform((v, ctx) => {
    const n = typeof v === "number" ? v : /^\s*\d+\s*$/.test(v) ? Number(v) : Number.NaN;
    if (!Number.isInteger(n) || n < min || n > max) {
      ctx.addIssue({
        code: "custom",
        message: `must be an integer from ${min} to ${max}: got ${JSON.stringify(v)}`,
      });
      return z.NEVER;
    }
    return n;
  });

const byteSizeText = z.string().transform((v, ctx) => {
  const n = parseByteSize(v);
  if (n === null || n <= 0) {
    ctx.addIssue({ code: "custom", message: `must be a size like 256MiB or 1GiB: got ${JSON.stringify(v)}` });
    return z.NEVER;
  }
  return n;
});

export const serveConfigSchema = z
  .object({
    host: z.string().min(1),
    port: intText(0, 65535),
    model: z.string().min(1),
    kvMemory: byteSizeText.optional(),
    kvPages: intText(1).optional(),
    pageSize: intText(1, 1024),
    maxModelLen: intText(1).optional(),
    maxPrefillTokens: intText(1).optional(),
    apiKeys: z.string().min(1).optional(),
    scrubOnFree: z.boolean(),
    disaggregation: z.boolean(),
    role: z.enum(["all", "router", "prefill", "decode"]).default("all"),
    prefill: z.array(z.string().min(1)).default([]),
    decode: z.array(z.string().min(1)).default([]),
    clusterSecret: z.string().min(1).optional(),
    unsafeFault: z.array(z.string().min(1)).default([]),
    unsafeDisableGuard: z.array(z.string().min(1)).default([]),
    iUnderstandThisLeaksData: z.boolean().default(false),
    /** The prefill node's pool in pages when it differs from `--kv-pages` (the incident's shape). */
    prefillKvPages: intText(1).optional(),
    kernels: z.enum(["ts", "wasm"]).default("wasm"),
    kernelThreads: intText(1, 2).optional(),
    tlsCert: z.string().min(1).optional(),
    tlsKey: z.string().min(1).optional(),
    tlsCa: z.string().min(1).optional(),
    httpsCert: z.string().min(1).optional(),
    httpsKey: z.string().min(1).optional(),
    insecurePlaintextLinks: z.boolean().default(false),
    logLevel: z.enum(["fatal", "error", "warn", "info", "debug", "trace", "silent"]),
  })
  .refine((c) => c.kvMemory === undefined || c.kvPages === undefined, {
    message: "give either --kv-memory or --kv-pages, not both",
    path: ["kvPages"],
  })
  .refine(
    (c) =>
      [c.tlsCert, c.tlsKey, c.tlsCa].every((f) => f === undefined) ||
      [c.tlsCert, c.tlsKey, c.tlsCa].every((f) => f !== undefined),
    { message: "give --tls-cert, --tls-key and --tls-ca together (docs/tls.md)", path: ["tlsCert"] },
  )
  .refine((c) => (c.httpsCert === undefined) === (c.httpsKey === undefined), {
    message: "give --https-cert and --https-key together (docs/tls.md)",
    path: ["httpsCert"],
  });

export type ServeConfig = Readonly<z.infer<typeof serveConfigSchema>>;

const FLAG: Record<string, string> = {
  host: "--host",
  port: "--port",
  model: "--model",
  kvMemory: "--kv-memory",
  kvPages: "--kv-pages",
  pageSize: "--page-size",
  maxModelLen: "--max-model-len",
  maxPrefillTokens: "--max-prefill-tokens",
  apiKeys: "--api-keys",
  logLevel: "--log-level",
  role: "--role",
  prefill: "--prefill",
  decode: "--decode",
  clusterSecret: "--cluster-secret",
  unsafeFault: "--unsafe-fault",
  unsafeDisableGuard: "--unsafe-disable-guard",
  iUnderstandThisLeaksData: UNSAFE_OPT_IN_FLAG,
  prefillKvPages: "--prefill-kv-pages",
  kernels: "--kernels",
  kernelThreads: "--kernel-threads",
  tlsCert: "--tls-cert",
  tlsKey: "--tls-key",
  tlsCa: "--tls-ca",
  httpsCert: "--https-cert",
  httpsKey: "--https-key",
  insecurePlaintextLinks: "--insecure-plaintext-links",
};

/** Parse raw options once; every problem is reported with its flag. */
export function parseServeConfig(raw: Record<string, unknown>): ServeConfig {
  const result = serveConfigSchema.safeParse(raw);
  if (!result.success) {
    const lines = result.error.issues.map((issue) => {
      const key = String(issue.path[0] ?? "");
      return `  ${FLAG[key] ?? key}: ${issue.message}`;
    });
    throw new KvfenceError("config_invalid", `Invalid serve options:\n${lines.join("\n")}`);
  }
  const problem = unsafeSwitchesProblem(result.data);
  if (problem !== null) throw new KvfenceError("config_invalid", `Invalid serve options:\n  ${problem}`);
  const c = result.data;
  const exposure = linksExposure({
    role: c.role,
    host: c.host,
    nodeHosts: c.role === "router" ? [...c.prefill, ...c.decode].map((u) => parseNodeUrl(u).host) : [],
    tls: c.tlsCert !== undefined,
    insecurePlaintextLinks: c.insecurePlaintextLinks,
  });
  if (exposure !== null) throw new KvfenceError("config_invalid", exposure);
  return Object.freeze(c);
}

/** The loaded TLS material of a config (files read and checked once, before the model loads). */
export function serveTls(config: ServeConfig): { links?: LinkTls; frontDoor?: FrontDoorTls } {
  return {
    ...(config.tlsCert === undefined
      ? {}
      : { links: loadLinkTls({ cert: config.tlsCert, key: config.tlsKey!, ca: config.tlsCa! }) }),
    ...(config.httpsCert === undefined
      ? {}
      : { frontDoor: loadFrontDoorTls({ cert: config.httpsCert, key: config.httpsKey! }) }),
  };
}

export interface RunningServer {
  readonly url: string;
  readonly router: RouterServer;
  readonly engine: EngineHandle;
  readonly contextLength: number;
  /** Close the HTTP server (with `graceMs` for in-flight requests), then the engine. */
  close(graceMs?: number): Promise<void>;
}

function formatBytes(bytes: number): string {
  if (bytes >= 1024 ** 3) return `${(bytes / 1024 ** 3).toFixed(2)} GiB`;
  if (bytes >= 1024 ** 2) return `${(bytes / 1024 ** 2).toFixed(1)} MiB`;
  return `${(bytes / 1024).toFixed(1)} KiB`;
}

function cannotListen(host: string, port: number, err: Error): KvfenceError {
  return new KvfenceError(
    "config_invalid",
    `Cannot listen on ${host}:${port}: ${err.message}; pick another --port or stop what holds it`,
  );
}

/** Binds `host:port` and lets it go again; throws `config_invalid` when it cannot. */
async function assertCanListen(host: string, port: number): Promise<void> {
  const probe = net.createServer();
  await new Promise<void>((resolve, reject) => {
    probe.once("error", (err) => reject(cannotListen(host, port, err)));
    probe.listen(port, host, () => probe.close(() => resolve()));
  });
}

/** Boot the server from a parsed config; `progress` receives the weight-loading line. */
export async function startServer(
  config: ServeConfig,
  options: { logger: Logger; progress?: (line: string, done: boolean) => void },
): Promise<RunningServer> {
  const log = options.logger;
  warnUnsafe(config, config.role === "router" ? "router" : "serve", log);
  const tls = serveTls(config);
  if (tls.frontDoor === undefined && !isLoopback(config.host)) {
    log.warn(
      { host: config.host },
      "the HTTP front door listens beyond loopback without TLS: prompts, answers and API keys cross the network in plaintext; give --https-cert and --https-key or put a TLS proxy in front (docs/tls.md)",
    );
  }

  const modelConfig = loadModelConfig(config.model);
  const layout: KvLayout = {
    numLayers: modelConfig.numLayers,
    numKvHeads: modelConfig.numKvHeads,
    headDim: modelConfig.headDim,
    pageSize: config.pageSize,
  };
  const bytesPerPage = pageBytes(layout);
  const numPages = config.kvPages ?? Math.floor((config.kvMemory ?? DEFAULT_KV_MEMORY_BYTES) / bytesPerPage);
  const poolTokens = numPages * config.pageSize;
  const contextLength = Math.min(
    modelConfig.maxPositionEmbeddings,
    config.maxModelLen ?? Number.POSITIVE_INFINITY,
  );
  // With --prefill-kv-pages the prefill pool is checked too (the smaller of the two).
  const prefillSmaller = config.prefillKvPages !== undefined && config.prefillKvPages < numPages;
  const checkedPages = prefillSmaller ? config.prefillKvPages! : numPages;
  const verdict = poolCapacityVerdict({
    poolTokens: checkedPages * config.pageSize,
    contextLength,
    pageSize: config.pageSize,
  });
  // The undersized-pool fault skips this pre-flight, as the incident's deployment had none.
  if (!verdict.ok && !config.unsafeFault.includes("undersized-pool")) {
    const neededPages = verdict.neededTokens / config.pageSize;
    const fix = prefillSmaller
      ? `--prefill-kv-pages ${neededPages}`
      : `--kv-pages ${neededPages} or --kv-memory ${Math.ceil((neededPages * bytesPerPage) / 1024 ** 2)}MiB`;
    throw new KvfenceError(
      "config_invalid",
      `The ${prefillSmaller ? "prefill node's " : ""}KV pool cannot hold one full-context request: the pool holds ${checkedPages * config.pageSize} tokens ` +
        `(${checkedPages} pages of ${config.pageSize}, ${formatBytes(checkedPages * bytesPerPage)}) but the context length is ` +
        `${contextLength} tokens; fix: a bigger pool (${fix}), or a smaller context (--max-model-len ${verdict.maxContextThatFits})`,
    );
  }

  // Before the weights load (minutes for a big model): a port already taken fails now.
  if (config.port !== 0) await assertCanListen(config.host, config.port);
  // So does a missing or weak cluster secret (the router connects only once the weights loaded).
  if (config.role === "router") clusterSecret(config.clusterSecret);

  let lastPercent = -1;
  // A router process tokenizes and admits; the nodes it connects to hold the weights.
  const model = loadModelMeta(config.model);
  const weights =
    config.role === "router"
      ? null
      : loadWeights(model.dir, model.config, {
          shared: true,
          onProgress: (p) => {
            const percent = p.totalBytes === 0 ? 100 : Math.floor((100 * p.bytesRead) / p.totalBytes);
            if (percent === lastPercent) return;
            lastPercent = percent;
            options.progress?.(
              `Loading weights: ${percent}% (${formatBytes(p.bytesRead)} of ${formatBytes(p.totalBytes)}, ${p.tensorsLoaded}/${p.tensorsTotal} tensors)`,
              false,
            );
          },
        });
  options.progress?.(
    `Loaded ${model.name}: ${model.config.numLayers} layers, vocab ${model.config.vocabSize}`,
    true,
  );

  const tenants = TenantDirectory.load({ file: config.apiKeys, env: process.env.KVFENCE_API_KEYS });
  if (tenants.anonymous) {
    log.warn(
      "no API keys configured (--api-keys FILE or KVFENCE_API_KEYS): serving one anonymous tenant without authentication",
    );
  } else {
    log.info({ tenants: tenants.tenants.map((t) => t.name) }, "API keys loaded");
  }

  const served = await startServeEngine({
    role: config.role,
    disaggregation: config.disaggregation,
    model: weights === null ? null : { config: model.config, weights },
    engine: {
      numPages,
      pageSize: config.pageSize,
      maxModelLen: contextLength,
      scrubOnFree: config.scrubOnFree,
      ...(config.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: config.maxPrefillTokens }),
      ...(config.unsafeDisableGuard.length === 0 ? {} : { disabledGuards: config.unsafeDisableGuard }),
      ...kernelOptions(config),
    },
    ...(config.prefillKvPages === undefined ? {} : { prefillNumPages: config.prefillKvPages }),
    disabledGuards: config.unsafeDisableGuard,
    maxModelLen: contextLength,
    prefill: config.prefill,
    decode: config.decode,
    clusterSecret: config.clusterSecret,
    ...(tls.links === undefined ? {} : { linkTls: tls.links }),
    faults: config.unsafeFault,
  });
  const engine = served.engine;
  log.info(
    {
      numPages,
      pageSize: config.pageSize,
      poolTokens,
      poolBytes: numPages * bytesPerPage,
      contextLength,
      topology: served.topology,
      ...(config.role === "router" ? {} : kernelOptions(config)),
    },
    "engine ready",
  );

  const router = new RouterServer({
    engine,
    tokenizer: routerTokenizer(model.tokenizer, model.chatTemplate),
    model: {
      id: model.name,
      maxPositionEmbeddings: model.config.maxPositionEmbeddings,
      eosTokenIds: model.config.eosTokenIds,
      defaults: {
        ...(model.generationDefaults.temperature === undefined
          ? {}
          : { temperature: model.generationDefaults.temperature }),
        ...(model.generationDefaults.topP === undefined ? {} : { topP: model.generationDefaults.topP }),
        ...(model.generationDefaults.topK === undefined ? {} : { topK: model.generationDefaults.topK }),
      },
    },
    tenants,
    logger: log,
    maxModelLen: config.maxModelLen,
    unsafe: { faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard },
    ...(tls.frontDoor === undefined ? {} : { https: tls.frontDoor }),
  });
  served.registerMetrics(router.metrics.registry);
  let url: string;
  try {
    url = await router.listen(config.port, config.host);
  } catch (err) {
    await served.close();
    throw cannotListen(config.host, config.port, err as Error);
  }
  let closing: Promise<void> | null = null;
  return {
    url,
    router,
    engine,
    contextLength: router.contextLength,
    close(graceMs = 0) {
      closing ??= (async () => {
        await router.close(graceMs);
        await served.close();
      })();
      return closing;
    },
  };
}

/**
 * `--role prefill|decode`: one node process (no HTTP router); the router connects to `--port` with
 * the cluster secret. Same pool sizing and capacity check as the server.
 */
export async function startNode(
  config: ServeConfig,
  options: { logger: Logger },
): Promise<{ url: string; close(): Promise<void> }> {
  const role = config.role === "prefill" ? "prefill" : "decode";
  warnUnsafe(config, role, options.logger);
  const tls = serveTls(config);
  // Before the weights load: a missing or weak cluster secret fails now.
  const secret = clusterSecret(config.clusterSecret);
  const modelConfig = loadModelConfig(config.model);
  const layout: KvLayout = {
    numLayers: modelConfig.numLayers,
    numKvHeads: modelConfig.numKvHeads,
    headDim: modelConfig.headDim,
    pageSize: config.pageSize,
  };
  const numPages =
    (role === "prefill" ? config.prefillKvPages : undefined) ??
    config.kvPages ??
    Math.floor((config.kvMemory ?? DEFAULT_KV_MEMORY_BYTES) / pageBytes(layout));
  const contextLength = Math.min(
    modelConfig.maxPositionEmbeddings,
    config.maxModelLen ?? Number.POSITIVE_INFINITY,
  );
  const verdict = poolCapacityVerdict({
    poolTokens: numPages * config.pageSize,
    contextLength,
    pageSize: config.pageSize,
  });
  if (!verdict.ok && !config.unsafeFault.includes("undersized-pool")) {
    throw new KvfenceError(
      "config_invalid",
      `The ${role} node's KV pool cannot hold one full-context request: ${numPages * config.pageSize} tokens for a context of ${contextLength}; fix: --kv-pages ${verdict.neededTokens / config.pageSize} or --max-model-len ${verdict.maxContextThatFits}`,
    );
  }
  const model = loadModel(config.model, { shared: true });
  const node = await startNodeServer({
    role,
    host: config.host,
    port: config.port,
    secret,
    ...(tls.links === undefined ? {} : { tls: tls.links }),
    engine: {
      model: { config: model.config, weights: model.weights },
      numPages,
      pageSize: config.pageSize,
      maxModelLen: contextLength,
      scrubOnFree: config.scrubOnFree,
      ...(config.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: config.maxPrefillTokens }),
      ...(config.unsafeDisableGuard.length === 0 ? {} : { disabledGuards: config.unsafeDisableGuard }),
      ...kernelOptions(config),
    },
    faults: config.unsafeFault,
    log: (line) => options.logger.info(line),
    warn: (line) => options.logger.warn(line),
  });
  return { url: `http://${config.host}:${node.port}`, close: () => node.close() };
}

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

/**
 * The forward pass's kernels and their threads. A kernel worker spins between matrices, so it only
 * pays where a core is free for it: 2 threads on the one engine of `--no-disaggregation`; 1 where
 * the prefill and decode nodes already take both cores (the threaded topology, node processes).
 */
export function kernelOptions(config: ServeConfig): { kernels: "ts" | "wasm"; kernelThreads: 1 | 2 } {
  const single = config.role === "all" && !config.disaggregation;
  return {
    kernels: config.kernels,
    kernelThreads: (config.kernelThreads ?? (single ? 2 : 1)) as 1 | 2,
  };
}

/** The loud startup warning of an unsafe server, on stderr (every role) and in the log. */
function warnUnsafe(config: ServeConfig, role: string, log: Logger): void {
  const text = unsafeWarning(role, config.unsafeFault, config.unsafeDisableGuard);
  if (text === null) return;
  process.stderr.write(text);
  log.warn({ faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard }, "UNSAFE switches on");
}

export function command(): Command {
  return new Command("serve")
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
    )
    .option("--scrub-on-free", "zero KV pages when they are freed", false)
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
    )
    .option(
      "--log-level <level>",
      "fatal, error, warn, info, debug, trace or silent",
      process.env.KVFENCE_LOG_LEVEL ?? "info",
    )
    .action(async (raw: Record<string, unknown>) => {
      const early = createLogger({ level: "info" });
      let config: ServeConfig;
      try {
        config = parseServeConfig(raw);
        serveTls(config); // unreadable or mismatched TLS files fail here, before the model loads
      } catch (err) {
        process.stderr.write(`kvfence serve: ${(err as Error).message}\n`);
        process.exitCode = 2;
        return;
      }
      const log = config.logLevel === "info" ? early : createLogger({ level: config.logLevel as LogLevel });
      const tty = process.stderr.isTTY === true;
      if (config.role === "prefill" || config.role === "decode") {
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
        return;
      }
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
    });
}
