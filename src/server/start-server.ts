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
import { loadModel, loadModelMeta, loadWeights } from "../model/load-model.js";
import { startNodeServer } from "../node/node-server.js";
import { unsafeWarning } from "../node/unsafe-switches.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { TenantDirectory } from "../router/api-keys.js";
import { routerTokenizer } from "../router/model-tokenizer.js";
import { RouterServer } from "../router/router-server.js";
import { clusterSecret, startServeEngine } from "../topology/serve-topology.js";
import { isLoopback } from "../transfer/tls-config.js";
import {
  DEFAULT_KV_MEMORY_BYTES,
  fairShareOf,
  kernelOptions,
  type ServeConfig,
  serveTls,
} from "./serve-config.js";

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

/** The loud startup warning of an unsafe server, on stderr (every role) and in the log. */
function warnUnsafe(config: ServeConfig, role: string, log: Logger): void {
  const text = unsafeWarning(role, config.unsafeFault, config.unsafeDisableGuard);
  if (text === null) return;
  process.stderr.write(text);
  log.warn({ faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard }, "UNSAFE switches on");
}
