/**
 * Boots a server from a parsed `ServeConfig` (serve-config.ts): a router over a topology
 * (`startServer`), or one prefill or decode node process (`startNode`).
 *
 * Boot order: check the port can be bound → read the model's config → size the KV pool and run the
 * capacity check shared with `kvfence preflight` (a pool that cannot hold one full-context request
 * stops the server with the two fixes) → load the weights with a progress line → start the
 * topology's engines → start the HTTP server. A router process loads the tokenizer and chat
 * template, never the weights. Used by `kvfence serve` and the incident tool.
 */
import net from "node:net";
import { type KvLayout, pageBytes } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import { poolCapacityVerdict } from "../lib/kv-capacity.js";
import type { Logger } from "../lib/logger.js";
import { loadModelConfig } from "../model/config-loader.js";
import { loadModel, loadModelMeta, loadWeights, type ModelMeta } from "../model/load-model.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";
import { startNodeServer } from "../node/node-server.js";
import { unsafeWarning } from "../node/unsafe-switches.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { TenantDirectory } from "../router/api-keys.js";
import { routerTokenizer } from "../router/model-tokenizer.js";
import { PreparePool } from "../router/prepare-pool.js";
import { requestLimits } from "../router/request-limits.js";
import { RouterServer } from "../router/router-server.js";
import { clusterSecret, type ServeEngineOptions, startServeEngine } from "../topology/serve-topology.js";
import { isLoopback } from "../transfer/tls-config.js";
import {
  DEFAULT_KV_MEMORY_BYTES,
  fairShareOf,
  kernelOptions,
  operatorListener,
  type ServeConfig,
  serveTls,
} from "./serve-config.js";

export interface RunningServer {
  readonly url: string;
  /** The operator listener's base URL (/metrics, /kvfence/nodes), or null when there is none. */
  readonly operatorUrl: string | null;
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

function cannotListen(host: string, port: number, err: Error, flag = "--port"): KvfenceError {
  const what = flag === "--port" ? "" : " (the operator listener for /metrics)";
  const fix =
    flag === "--port"
      ? "pick another --port"
      : "pick another --metrics-port, or give --operator-key to serve /metrics on the front door";
  return new KvfenceError(
    "config_invalid",
    `Cannot listen on ${host}:${port}${what}: ${err.message}; ${fix} or stop what holds it`,
  );
}

/** Binds `host:port` and lets it go again; throws `config_invalid` when it cannot. */
async function assertCanListen(host: string, port: number, flag = "--port"): Promise<void> {
  const probe = net.createServer();
  await new Promise<void>((resolve, reject) => {
    probe.once("error", (err) => reject(cannotListen(host, port, err, flag)));
    probe.listen(port, host, () => probe.close(() => resolve()));
  });
}

/** A front door without TLS beyond loopback: prompts, answers and API keys cross the network readable. */
function warnPlaintextFrontDoor(host: string, log: Logger): void {
  if (isLoopback(host)) return;
  log.warn(
    { host },
    "the HTTP front door listens beyond loopback without TLS: prompts, answers and API keys cross the network in plaintext; give --https-cert and --https-key or put a TLS proxy in front (docs/tls.md)",
  );
}

/** Boot the server from a parsed config; `progress` receives the weight-loading line. */
export async function startServer(
  config: ServeConfig,
  options: { logger: Logger; progress?: (line: string, done: boolean) => void },
): Promise<RunningServer> {
  const log = options.logger;
  warnUnsafe(config, config.role === "router" ? "router" : "serve", log);
  const tls = serveTls(config);
  if (tls.frontDoor === undefined) warnPlaintextFrontDoor(config.host, log);

  const modelConfig = loadModelConfig(config.model);
  const bytesPerPage = pageBytes(layoutOf(config, modelConfig));
  const numPages = config.kvPages ?? Math.floor((config.kvMemory ?? DEFAULT_KV_MEMORY_BYTES) / bytesPerPage);
  const poolTokens = numPages * config.pageSize;
  const contextLength = contextLengthOf(config, modelConfig);
  checkServerPool(config, { numPages, bytesPerPage, contextLength });

  // Before the weights load (minutes for a big model): a port already taken fails now.
  if (config.port !== 0) await assertCanListen(config.host, config.port);
  const operator = operatorListener(config);
  if (operator !== null && operator.port !== 0)
    await assertCanListen(operator.host, operator.port, "--metrics-port");
  // So does a missing or weak cluster secret (the router connects only once the weights loaded).
  if (config.role === "router") clusterSecret(config.clusterSecret);

  // A router process tokenizes and admits; the nodes it connects to hold the weights.
  const model = loadModelMeta(config.model);
  const weights = config.role === "router" ? null : loadWeightsWithProgress(model, options.progress);
  options.progress?.(
    `Loaded ${model.name}: ${model.config.numLayers} layers, vocab ${model.config.vocabSize}`,
    true,
  );
  const tenants = loadTenants(config, log);

  const served = await startServeEngine({
    role: config.role,
    disaggregation: config.disaggregation,
    model: weights === null ? null : { config: model.config, weights },
    engine: engineOptionsOf(config, { numPages, contextLength }),
    ...(config.prefillKvPages === undefined ? {} : { prefillNumPages: config.prefillKvPages }),
    disabledGuards: config.unsafeDisableGuard,
    maxModelLen: contextLength,
    prefill: config.prefill,
    decode: config.decode,
    clusterSecret: config.clusterSecret,
    ...(tls.links === undefined ? {} : { linkTls: tls.links }),
    faults: config.unsafeFault,
    fairShare: fairShareOf(config, { count: tenants.tenants.length, limits: tenants.limits }),
    ...(config.readyTimeout === undefined ? {} : { pingTimeoutMs: Math.round(config.readyTimeout * 1000) }),
    log,
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

  // Parsing, the chat template and tokenization run in worker threads, never on the event loop.
  const limits = limitsOf(config, contextLength);
  const preparer = await PreparePool.start({
    modelDir: model.dir,
    modelId: model.name,
    limits,
    threads: config.tokenizerThreads,
    onWorkerError: (detail) => log.error({ detail }, "a request preparation worker failed"),
  }).catch(async (err: unknown) => {
    await served.close();
    throw err;
  });
  const router = new RouterServer({
    engine,
    tokenizer: routerTokenizer(model.tokenizer, model.chatTemplate),
    preparer,
    limits,
    model: modelCard(model),
    tenants,
    logger: log,
    maxModelLen: config.maxModelLen,
    unsafe: { faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard },
    operatorKey: config.operatorKey,
    metricsTenantNames: config.metricsTenantNames,
    prefixCacheScope: config.prefixCacheScope,
    ...(tls.frontDoor === undefined ? {} : { https: tls.frontDoor }),
  });
  served.registerMetrics(router.metrics.registry);
  const closeAll = async (): Promise<void> => {
    await router.close();
    await preparer.close();
    await served.close();
  };
  const url = await router.listen(config.port, config.host).catch(async (err: Error) => {
    await closeAll();
    throw cannotListen(config.host, config.port, err);
  });
  const operatorUrl =
    operator === null
      ? null
      : await router.listenOperator(operator.port, operator.host).catch(async (err: Error) => {
          await closeAll();
          throw cannotListen(operator.host, operator.port, err, "--metrics-port");
        });
  let closing: Promise<void> | null = null;
  return {
    url,
    operatorUrl,
    router,
    engine,
    contextLength: router.contextLength,
    close(graceMs = 0) {
      closing ??= (async () => {
        await router.close(graceMs);
        await preparer.close();
        await served.close();
      })();
      return closing;
    },
  };
}

/** The router's request limits: the flags given, defaults from the context length (request-limits.ts). */
function limitsOf(config: ServeConfig, contextLength: number) {
  return requestLimits(contextLength, {
    ...(config.maxBodyBytes === undefined ? {} : { maxBodyBytes: config.maxBodyBytes }),
    ...(config.maxPromptBytes === undefined ? {} : { maxPromptBytes: config.maxPromptBytes }),
    ...(config.maxMessages === undefined ? {} : { maxMessages: config.maxMessages }),
    ...(config.maxJsonDepth === undefined ? {} : { maxJsonDepth: config.maxJsonDepth }),
  });
}

/** What the router knows of the model: its id, window, end-of-sequence ids and sampling defaults. */
function modelCard(model: ReturnType<typeof loadModelMeta>) {
  const d = model.generationDefaults;
  return {
    id: model.name,
    maxPositionEmbeddings: model.config.maxPositionEmbeddings,
    eosTokenIds: model.config.eosTokenIds,
    defaults: {
      ...(d.temperature === undefined ? {} : { temperature: d.temperature }),
      ...(d.topP === undefined ? {} : { topP: d.topP }),
      ...(d.topK === undefined ? {} : { topK: d.topK }),
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
  const numPages =
    (role === "prefill" ? config.prefillKvPages : undefined) ??
    config.kvPages ??
    Math.floor((config.kvMemory ?? DEFAULT_KV_MEMORY_BYTES) / pageBytes(layoutOf(config, modelConfig)));
  const contextLength = contextLengthOf(config, modelConfig);
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
      ...engineOptionsOf(config, { numPages, contextLength }),
    },
    faults: config.unsafeFault,
    log: (line) => options.logger.info(line),
    warn: (line) => options.logger.warn(line),
  });
  return { url: `http://${config.host}:${node.port}`, close: () => node.close() };
}

function layoutOf(config: ServeConfig, modelConfig: ModelConfig): KvLayout {
  return {
    numLayers: modelConfig.numLayers,
    numKvHeads: modelConfig.numKvHeads,
    headDim: modelConfig.headDim,
    pageSize: config.pageSize,
  };
}

/** The longest request served: the model's window, or less with --max-model-len. */
function contextLengthOf(config: ServeConfig, modelConfig: ModelConfig): number {
  return Math.min(modelConfig.maxPositionEmbeddings, config.maxModelLen ?? Number.POSITIVE_INFINITY);
}

/** What every engine of this process is built with, the model aside (pool, context, guards, kernels). */
function engineOptionsOf(
  config: ServeConfig,
  pool: { readonly numPages: number; readonly contextLength: number },
): ServeEngineOptions["engine"] {
  return {
    numPages: pool.numPages,
    pageSize: config.pageSize,
    maxModelLen: pool.contextLength,
    scrubOnFree: config.scrubOnFree,
    prefixCache: config.prefixCache === "on",
    ...(config.unsafeFault.length === 0 ? {} : { faults: config.unsafeFault }),
    ...(config.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: config.maxPrefillTokens }),
    ...(config.unsafeDisableGuard.length === 0 ? {} : { disabledGuards: config.unsafeDisableGuard }),
    ...kernelOptions(config),
  };
}

/**
 * The capacity check of the router's process, shared with `kvfence preflight`: the pool (with
 * --prefill-kv-pages, the smaller of the two) must hold one full-context request, or the server
 * stops with the two fixes. The undersized-pool fault skips it, as the incident's deployment had none.
 */
function checkServerPool(
  config: ServeConfig,
  pool: { readonly numPages: number; readonly bytesPerPage: number; readonly contextLength: number },
): void {
  const { numPages, bytesPerPage, contextLength } = pool;
  const prefillSmaller = config.prefillKvPages !== undefined && config.prefillKvPages < numPages;
  const checkedPages = prefillSmaller ? config.prefillKvPages! : numPages;
  const verdict = poolCapacityVerdict({
    poolTokens: checkedPages * config.pageSize,
    contextLength,
    pageSize: config.pageSize,
  });
  if (verdict.ok || config.unsafeFault.includes("undersized-pool")) return;
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

/** The weights, with a progress line each time the loaded share moves by a percent. */
function loadWeightsWithProgress(
  model: ModelMeta,
  progress: ((line: string, done: boolean) => void) | undefined,
): ModelWeights {
  let lastPercent = -1;
  return loadWeights(model.dir, model.config, {
    shared: true,
    onProgress: (p) => {
      const percent = p.totalBytes === 0 ? 100 : Math.floor((100 * p.bytesRead) / p.totalBytes);
      if (percent === lastPercent) return;
      lastPercent = percent;
      progress?.(
        `Loading weights: ${percent}% (${formatBytes(p.bytesRead)} of ${formatBytes(p.totalBytes)}, ${p.tensorsLoaded}/${p.tensorsTotal} tensors)`,
        false,
      );
    },
  });
}

/** The API keys (--api-keys or KVFENCE_API_KEYS); none is one anonymous tenant, said loudly. */
function loadTenants(config: ServeConfig, log: Logger): TenantDirectory {
  const tenants = TenantDirectory.load({ file: config.apiKeys, env: process.env.KVFENCE_API_KEYS });
  if (tenants.anonymous) {
    log.warn(
      "no API keys configured (--api-keys FILE or KVFENCE_API_KEYS): serving one anonymous tenant without authentication",
    );
  } else {
    log.info({ tenants: tenants.tenants.map((t) => t.name) }, "API keys loaded");
  }
  return tenants;
}

/** The loud startup warning of an unsafe server, on stderr (every role) and in the log. */
function warnUnsafe(config: ServeConfig, role: string, log: Logger): void {
  const text = unsafeWarning(role, config.unsafeFault, config.unsafeDisableGuard);
  if (text === null) return;
  process.stderr.write(text);
  log.warn({ faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard }, "UNSAFE switches on");
}
