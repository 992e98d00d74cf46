/**
 * Boots a server from a parsed `ServeConfig` (serve-config.ts): a router over a topology
 * (`startServer`), or one prefill or decode node process (`startNode`).
 *
 * Boot order: check the port can be bound → read the model's config → size the KV pool (by default
 * one request of the context, src/server/kv-sizing.ts) and run the capacity check shared with
 * `kvfence preflight` (a pool that cannot hold one full-context request stops the server with the
 * two fixes) → check the weights and every engine's pool fit the memory available → load the weights with a progress line → start the
 * topology's engines → start the HTTP server. A router process loads the tokenizer and chat
 * template, never the weights. Used by `kvfence serve` and the incident tool.
 */

import net from "node:net";
import {
  parseRegistryUrl,
  type RegistryOptions,
  registerNode,
  watchDrain,
  watchRole,
} from "../cluster/registry.js";
import type { Engine } from "../engine/engine.js";
import {
  type KernelMemory,
  loadEngineMemory,
  type MemoryRegion,
  regionBytesOf,
  weightMemoryBytes,
} from "../engine/engine-memory.js";
import { poolCapacityVerdict } from "../kvcache/kv-capacity.js";
import { type KvLayout, pageBytes } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import { isLoopback } from "../lib/loopback.js";
import { startTracing, tracing } from "../lib/tracing.js";
import { type GenerationDefaults, loadGenerationDefaults } from "../model/config-loader.js";
import {
  delayedProgress,
  loadModelWeights,
  type ModelHeader,
  openModelHeader,
  openModelMeta,
} from "../model/load-model.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";
import type { NodeServer } from "../node/node-server.js";
import { type PrestartedWorkers, prestartNodeWorkers } from "../node/prestart-workers.js";
import { waitUntil } from "../node/role-switch.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { TenantDirectory } from "../router/api-keys.js";
import { PreparePool, type PreparePoolOptions } from "../router/prepare-pool.js";
import { requestLimits } from "../router/request-limits.js";
import { RouterServer, type RouterServerOptions, type RouterTokenizer } from "../router/router-server.js";
import { clusterSecret, type ServeEngineOptions, startServeEngine } from "../topology/serve-topology.js";
import { takeEarlyThreads } from "./early-threads.js";
import { availableMemoryBytes, checkMemoryFits, poolPagesOf } from "./kv-sizing.js";
import {
  fairShareOf,
  kernelOptions,
  operatorListener,
  type ServeConfig,
  serveTls,
  withChosenKernels,
} from "./serve-config.js";
import { serveTokenizer } from "./serve-tokenizer.js";
import { unsafeWarning } from "./unsafe-switches.js";

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
  // The default topology's node threads start first and load their modules while this thread
  // loads the model; they get their options (the weights' memory) once it is there. So do the
  // router's preparation workers, which load the tokenizer meanwhile: they need only the model's
  // config (its window sizes the request limits).
  // Those `kvfence serve` started before its modules loaded are taken first (early-threads.ts).
  const early = takeEarlyThreads();
  const threaded = config.role === "all" && config.disaggregation;
  if (!threaded) await early.nodes?.terminate();
  const prestarted = threaded
    ? (early.nodes ??
      prestartNodeWorkers({ selfTest: config.kernels === "auto" || config.kernels === "native" }))
    : undefined;
  let preparing: Promise<PreparePool> | undefined;
  try {
    const header = await openModelHeader(config.model);
    const limits = limitsOf(config, contextLengthOf(config, header.config));
    preparing = startPreparer(config, header, limits, options.logger, early.preparer);
    return await bootServer(config, options, { header, limits, prestarted, preparing });
  } catch (err) {
    await prestarted?.terminate();
    if (preparing === undefined) await early.preparer?.worker.terminate();
    await preparing?.then(
      (p) => p.close(),
      () => {},
    );
    throw err;
  }
}

async function bootServer(
  config: ServeConfig,
  options: { logger: Logger; progress?: (line: string, done: boolean) => void },
  early: {
    readonly header: ModelHeader;
    readonly limits: ReturnType<typeof limitsOf>;
    readonly prestarted: PrestartedWorkers | undefined;
    readonly preparing: Promise<PreparePool>;
  },
): Promise<RunningServer> {
  const { limits, prestarted, preparing } = early;
  const log = options.logger;
  warnUnsafe(config, config.role === "router" ? "router" : "serve", log);
  if (config.role !== "router") config = await withChosenKernels(config, log, prestarted?.selfTest);
  // Its report is in before the prefill thread gets its options (whatever --kernels asked).
  await prestarted?.selfTest;
  const tls = serveTls(config);
  if (tls.frontDoor === undefined) warnPlaintextFrontDoor(config.host, log);

  const { numPages, bytesPerPage, contextLength, engineOptions } = sizeServerPools(config, early.header);
  const poolTokens = numPages * config.pageSize;

  // Before the weights load (minutes for a big model): a port already taken fails now.
  if (config.port !== 0) await assertCanListen(config.host, config.port);
  const operator = operatorListener(config);
  if (operator !== null && operator.port !== 0)
    await assertCanListen(operator.host, operator.port, "--metrics-port");
  // So does a missing or weak cluster secret (the router connects only once the weights loaded).
  if (config.role === "router") clusterSecret(config.clusterSecret);

  const tenants = loadTenants(config, log);
  await startRouterTracing(config, log);
  const starting = startEnginesAndPreparer(config, {
    model: early.header,
    tenants,
    preparing,
    engineOptions,
    contextLength,
    tls,
    log,
    prestarted,
    ...(options.progress === undefined ? {} : { progress: options.progress }),
  });
  const tokenizer = await tokenizerMeanwhile(early.header, config, preparing, starting);
  const { served, preparer } = await starting;
  const engine = served.engine;
  log.info(
    {
      numPages,
      pageSize: config.pageSize,
      kvCacheDtype: config.kvCacheDtype,
      poolTokens,
      poolBytes: numPages * bytesPerPage,
      contextLength,
      topology: served.topology,
      ...(config.role === "router" ? {} : kernelOptions(config)),
    },
    "engine ready",
  );

  const router = new RouterServer(
    routerOptions(config, { engine, model: early.header, tokenizer, preparer, limits, tenants, tls, log }),
  );
  served.registerMetrics(router.metrics);
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
        await tracing()?.shutdown();
      })();
      return closing;
    },
  };
}

/** The router's options: the engine and the parts booted before it, and the config's flags. */
function routerOptions(
  config: ServeConfig,
  parts: {
    readonly engine: EngineHandle;
    readonly model: ModelHeader;
    readonly tokenizer: RouterTokenizer;
    readonly preparer: PreparePool;
    readonly limits: ReturnType<typeof limitsOf>;
    readonly tenants: TenantDirectory;
    readonly tls: ReturnType<typeof serveTls>;
    readonly log: Logger;
  },
): RouterServerOptions {
  const { model, tls } = parts;
  return {
    engine: parts.engine,
    tokenizer: parts.tokenizer,
    preparer: parts.preparer,
    limits: parts.limits,
    model: modelCard(model, config),
    tenants: parts.tenants,
    logger: parts.log,
    maxModelLen: config.maxModelLen,
    unsafe: { faults: config.unsafeFault, disabledGuards: config.unsafeDisableGuard },
    operatorKey: config.operatorKey,
    metricsTenantNames: config.metricsTenantNames,
    allowedOrigins: config.allowedOrigins,
    prefixCacheScope: config.prefixCacheScope,
    ...(tls.frontDoor === undefined ? {} : { https: tls.frontDoor }),
  };
}

/** `--otlp-endpoint`: the router's spans (the nodes start their own); without it no SDK is loaded. */
async function startRouterTracing(config: ServeConfig, log: Logger): Promise<void> {
  if (config.otlpEndpoint === undefined) return;
  await startTracing(config.otlpEndpoint, "kvfence-router");
  log.info({ endpoint: config.otlpEndpoint }, "exporting request spans over OTLP/HTTP");
}

/** The router's request limits: the flags given, defaults from the context length (request-limits.ts). */
function limitsOf(config: ServeConfig, contextLength: number) {
  return requestLimits(contextLength, {
    ...(config.maxBodyBytes === undefined ? {} : { maxBodyBytes: config.maxBodyBytes }),
    ...(config.maxPromptBytes === undefined ? {} : { maxPromptBytes: config.maxPromptBytes }),
    ...(config.maxResponseBytes === undefined ? {} : { maxResponseBytes: config.maxResponseBytes }),
    ...(config.maxMessages === undefined ? {} : { maxMessages: config.maxMessages }),
    ...(config.maxJsonDepth === undefined ? {} : { maxJsonDepth: config.maxJsonDepth }),
  });
}

/**
 * The router's preparation workers: parsing, the chat template and tokenization run in worker
 * threads, never on the event loop. Started before this thread parses the tokenizer (they load
 * their own meanwhile); resolves once the first is ready.
 */
function startPreparer(
  config: ServeConfig,
  header: ModelHeader,
  limits: ReturnType<typeof limitsOf>,
  log: Logger,
  first: PreparePoolOptions["first"],
): Promise<PreparePool> {
  const card = modelCard(header, config);
  const preparing = PreparePool.start({
    ...(first === undefined ? {} : { first }),
    modelDir: header.dir,
    modelId: [card.id, ...card.aliases],
    limits,
    ...(config.chatTemplate === undefined ? {} : { chatTemplateFile: config.chatTemplate }),
    ...(config.toolCallParser === undefined ? {} : { toolCallParser: config.toolCallParser }),
    threads: config.tokenizerThreads,
    policy: config.schedulingPolicy,
    onWorkerError: (detail) => log.error({ detail }, "a request preparation worker failed"),
  });
  preparing.catch(() => {}); // awaited after the engines (no unhandled rejection meanwhile)
  return preparing;
}

/**
 * The weights and the engines (none for a router process, which tokenizes and admits while the
 * nodes it connects to hold the weights), then the router's preparation workers (`preparing`),
 * which load the tokenizer while the weights load and the engines start. On a failure the caller
 * closes the workers.
 */
async function startEnginesAndPreparer(
  config: ServeConfig,
  parts: {
    readonly model: ModelHeader;
    readonly tenants: TenantDirectory;
    readonly preparing: Promise<PreparePool>;
    readonly engineOptions: ServeEngineOptions["engine"];
    readonly contextLength: number;
    readonly tls: ReturnType<typeof serveTls>;
    readonly log: Logger;
    readonly progress?: (line: string, done: boolean) => void;
    /** The default topology's node threads, started before the model loaded. */
    readonly prestarted: PrestartedWorkers | undefined;
  },
): Promise<{ served: Awaited<ReturnType<typeof startServeEngine>>; preparer: PreparePool }> {
  const { model, tenants, engineOptions, log, preparing } = parts;
  const prefillOptions = {
    ...engineOptions,
    ...(config.prefillKvPages === undefined ? {} : { numPages: config.prefillKvPages }),
  };
  const engines =
    config.role === "router" ? [] : config.disaggregation ? [prefillOptions, engineOptions] : [engineOptions];
  const { prestarted } = parts;
  const loaded =
    engines.length === 0 ? null : loadWeightsWithProgress(model, engines, parts.progress, config.quantize);
  parts.progress?.(
    `Loaded ${model.name}: ${model.config.numLayers} layers, vocab ${model.config.vocabSize}`,
    true,
  );
  const starting = startServeEngine({
    role: config.role,
    disaggregation: config.disaggregation,
    model: loaded === null ? null : { config: model.config, ...loaded },
    engine: engineOptions,
    ...(config.prefillKvPages === undefined ? {} : { prefillNumPages: config.prefillKvPages }),
    disabledGuards: config.unsafeDisableGuard,
    maxModelLen: parts.contextLength,
    prefill: config.prefill,
    decode: config.decode,
    clusterSecret: config.clusterSecret,
    ...(config.registry === undefined ? {} : { registry: registryOf(config) }),
    insecurePlaintextLinks: config.insecurePlaintextLinks,
    ...(parts.tls.links === undefined ? {} : { linkTls: parts.tls.links }),
    faults: config.unsafeFault,
    fairShare: fairShareOf(config, { count: tenants.tenants.length, limits: tenants.limits }),
    ...(config.readyTimeout === undefined ? {} : { pingTimeoutMs: Math.round(config.readyTimeout * 1000) }),
    ...(config.routerSlot === undefined ? {} : { routerSlot: config.routerSlot }),
    ...(config.maxMigrations === undefined ? {} : { maxMigrations: config.maxMigrations }),
    ...(config.rolePolicy === "off"
      ? {}
      : { rolePolicyIntervalMs: Math.round((config.rolePolicyInterval ?? 5) * 1000) }),
    ...(prestarted === undefined ? {} : { prestarted }),
    log,
  });
  const served = await starting;
  try {
    return { served, preparer: await preparing };
  } catch (err) {
    await served.close();
    throw err;
  }
}

/**
 * The router's tokenizer (serve-tokenizer.ts), made while the engine threads build their engines
 * over the weights (`starting`); their engines are closed on a throw (and the preparation workers
 * by `startServer`).
 */
async function tokenizerMeanwhile(
  header: ModelHeader,
  config: ServeConfig,
  preparing: Promise<PreparePool>,
  starting: ReturnType<typeof startEnginesAndPreparer>,
): Promise<RouterTokenizer> {
  try {
    return await serveTokenizer(header, config, preparing);
  } catch (err) {
    await starting.then(
      ({ served }) => served.close(),
      () => {},
    );
    throw err;
  }
}

/** The served model as the router shows it: its names, window, EOS ids and sampling defaults. */
function modelCard(model: ModelHeader, config: ServeConfig) {
  // --generation-config: auto (the folder's), vllm (none, as vLLM's), or another folder's.
  const source = config.generationConfig;
  const d: Partial<GenerationDefaults> =
    source === "auto" ? model.generationDefaults : source === "vllm" ? {} : loadGenerationDefaults(source);
  const [id = model.name, ...aliases] = config.servedModelName;
  return {
    id,
    aliases,
    maxPositionEmbeddings: model.config.maxPositionEmbeddings,
    eosTokenIds: model.config.eosTokenIds,
    ...(config.reasoningParser === undefined ? {} : { reasoningParser: config.reasoningParser }),
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
  options: { logger: Logger; onDrained?: () => void; onScrubbed?: (engine: Engine) => void },
): Promise<{ url: string; node: NodeServer; close(): Promise<void> }> {
  const role = config.role === "prefill" ? "prefill" : "decode";
  warnUnsafe(config, role, options.logger);
  config = await withChosenKernels(config, options.logger);
  const tls = serveTls(config);
  // Before the weights load: a missing or weak cluster secret fails now.
  const secret = clusterSecret(config.clusterSecret);
  const meta = await openModelMeta(config.model);
  const modelConfig = meta.config;
  const layout = layoutOf(config, modelConfig);
  const contextLength = contextLengthOf(config, modelConfig);
  const numPages =
    (role === "prefill" ? config.prefillKvPages : undefined) ?? poolPagesOf(config, layout, contextLength);
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
  const engine = engineOptionsOf(config, { numPages, contextLength });
  checkEnginesFit(meta, config, layout, contextLength, [engine]);
  const loaded = loadWeightsWithProgress(meta, [engine], undefined, config.quantize);
  // The node's server and engine load here: the default topology's main thread never runs an
  // engine (its node threads do), so `kvfence serve` does not load them at start-up.
  const { startNodeServer } = await import("../node/node-server.js");
  const node = await startNodeServer({
    role,
    host: config.host,
    port: config.port,
    ...(config.advertise === undefined ? {} : { advertise: config.advertise }),
    secret,
    ...(tls.links === undefined ? {} : { tls: tls.links }),
    engine: {
      ...engine,
      model: { config: meta.config, weights: loaded.weights },
      ...(loaded.memory === undefined
        ? {}
        : { memory: { memory: loaded.memory.memory, region: loaded.memory.regions[0]! } }),
    },
    faults: config.unsafeFault,
    log: (line) => options.logger.info(line),
    warn: (line) => options.logger.warn(line),
    ...(options.onScrubbed === undefined ? {} : { onScrubbed: options.onScrubbed }),
  });
  if (config.registry === undefined)
    return { url: `http://${config.host}:${node.port}`, node, close: () => node.close() };
  // --registry: the node's entry (its lease kept alive) names where routers dial it: the address
  // its handshakes bind (--advertise, or --host:--port).
  const address = node.advertised;
  const registry = registryOf(config);
  const register = () =>
    registerNode(registry, { ...node.registration, address }, (line) => options.logger.warn(line));
  let registration = await register().catch(async (err: unknown) => {
    await node.close();
    throw err;
  });
  // `kvfence drain`: draining in the registry (no new requests), then, once nothing is in flight,
  // out of it; the process ends by `onDrained`.
  const watchDrainOfRole = () =>
    watchDrain(registry, { role: node.role, address }, () => {
      options.logger.warn("draining: no new requests; leaving once the requests in flight finished");
      void registration.drain().then(async () => {
        while (!node.idle()) await new Promise((r) => setTimeout(r, 100));
        await registration.close();
        options.logger.warn("drained: left the registry");
        options.onDrained?.();
      });
    });
  let drain = await watchDrainOfRole();
  // `kvfence role`: drained of the old role's work, scrubbed, registered under the new role.
  const roles = await watchRole(
    registry,
    address,
    async ({ role: next, drainTimeoutMs }) => {
      if (next === node.role) return;
      const was = node.role;
      options.logger.warn(`role switch ${was} → ${next}: draining (no new requests)`);
      await registration.drain();
      if (!(await waitUntil(() => node.inFlight() === 0, drainTimeoutMs, 100)))
        options.logger.warn(
          `role switch: ${node.inFlight()} attempts still in flight after ${drainTimeoutMs} ms; ending them (their routers migrate them)`,
        );
      drain.close();
      await node.switchRole(next);
      await registration.close();
      registration = await register();
      drain = await watchDrainOfRole();
      options.logger.warn(`role switch ${was} → ${next}: registered as ${node.role}@${address}`);
    },
    (line) => options.logger.warn(line),
  );
  return {
    url: `http://${config.host}:${node.port}`,
    node,
    close: async () => {
      roles.close();
      drain.close();
      await registration.close();
      await node.close();
    },
  };
}

/** `--registry` and its TLS files and credentials (the password from env KVFENCE_REGISTRY_PASSWORD). */
export function registryOf(
  config: Pick<
    ServeConfig,
    "registry" | "registryPrefix" | "registryCa" | "registryCert" | "registryKey" | "registryUser"
  >,
): RegistryOptions {
  const tls = config.registryCa !== undefined;
  const password = process.env.KVFENCE_REGISTRY_PASSWORD;
  return {
    endpoints: parseRegistryUrl(config.registry!, tls),
    prefix: config.registryPrefix,
    ...(config.registryCa === undefined ? {} : { ca: config.registryCa }),
    ...(config.registryCert === undefined ? {} : { cert: config.registryCert, key: config.registryKey! }),
    ...(config.registryUser === undefined ? {} : { user: config.registryUser }),
    ...(password === undefined ? {} : { password }),
  };
}

function layoutOf(config: ServeConfig, modelConfig: ModelConfig): KvLayout {
  return {
    numLayers: modelConfig.numLayers,
    numKvHeads: modelConfig.numKvHeads,
    headDim: modelConfig.headDim,
    pageSize: config.pageSize,
    dtype: config.kvCacheDtype,
  };
}

/** `--max-model-len`, or the model's window; above the window it is an error, never a silent clamp. */
function contextLengthOf(config: ServeConfig, modelConfig: ModelConfig): number {
  const window = modelConfig.maxPositionEmbeddings;
  if (config.maxModelLen !== undefined && config.maxModelLen > window) {
    throw new KvfenceError(
      "config_invalid",
      `--max-model-len ${config.maxModelLen} is above the model's window of ${window} tokens (max_position_embeddings in config.json): give at most ${window}, or leave it out`,
    );
  }
  return Math.min(window, config.maxModelLen ?? Number.POSITIVE_INFINITY);
}

/** What every engine of this process is built with, the model aside (pool, context, guards, kernels). */
function engineOptionsOf(
  config: ServeConfig,
  pool: { readonly numPages: number; readonly contextLength: number },
): ServeEngineOptions["engine"] {
  return {
    numPages: pool.numPages,
    pageSize: config.pageSize,
    kvCacheDtype: config.kvCacheDtype,
    maxModelLen: pool.contextLength,
    scrubOnFree: config.scrubOnFree,
    // Structured output masks by the model's tokenizer (the engine gets the weights in memory).
    tokenizer: config.model,
    ...(config.phaseMetrics ? {} : { phaseMetrics: false }),
    ...(config.otlpEndpoint === undefined ? {} : { otlpEndpoint: config.otlpEndpoint }),
    prefixCache: config.prefixCache === "on",
    ...tierOptionsOf(config),
    ...(config.unsafeFault.length === 0 ? {} : { faults: config.unsafeFault }),
    ...(config.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: config.maxPrefillTokens }),
    ...(config.maxNumSeqs === undefined ? {} : { maxSequences: config.maxNumSeqs }),
    ...(config.seed === undefined ? {} : { seed: config.seed }),
    ...(config.unsafeDisableGuard.length === 0 ? {} : { disabledGuards: config.unsafeDisableGuard }),
    // A router runs no engine: its --kernels (auto unresolved) is its nodes' business.
    ...(config.role === "router" ? {} : kernelOptions(config)),
  };
}

/** `--cache-ram`, `--cache-disk …`: the KV tiers of the engine (or the prefill node) of this process. */
function tierOptionsOf(config: ServeConfig): Pick<ServeEngineOptions["engine"], "tiers"> {
  if (config.cacheRam === undefined && config.cacheDisk === undefined) return {};
  return {
    tiers: {
      ramBytes: config.cacheRam ?? 0,
      ...(config.cacheDisk === undefined
        ? {}
        : {
            disk: { dir: config.cacheDisk, maxBytes: config.cacheDiskSize!, keyFile: config.cacheDiskKey! },
          }),
    },
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

/**
 * The context and each engine's pool (src/server/kv-sizing.ts), checked before anything loads:
 * the pool holds one full-context request, and the weights and the engines fit the memory.
 */
function sizeServerPools(config: ServeConfig, model: ModelHeader) {
  const layout = layoutOf(config, model.config);
  const bytesPerPage = pageBytes(layout);
  const contextLength = contextLengthOf(config, model.config);
  const numPages = poolPagesOf(config, layout, contextLength);
  checkServerPool(config, { numPages, bytesPerPage, contextLength });
  const engineOptions = engineOptionsOf(config, { numPages, contextLength });
  if (config.role !== "router") {
    const prefill = { ...engineOptions, numPages: config.prefillKvPages ?? numPages };
    const engines = config.disaggregation ? [prefill, engineOptions] : [engineOptions];
    checkEnginesFit(model, config, layout, contextLength, engines);
  }
  return { numPages, bytesPerPage, contextLength, engineOptions };
}

/**
 * `checkMemoryFits` for the engines of this process, before the weights load (src/server/kv-sizing.ts):
 * at another context, a context-sized pool follows it.
 */
function checkEnginesFit(
  model: ModelHeader,
  config: ServeConfig,
  layout: KvLayout,
  contextLength: number,
  engines: readonly ServeEngineOptions["engine"][],
): void {
  const contextSized = config.kvPages === undefined && config.kvMemory === undefined;
  checkMemoryFits({
    weightBytes: weightMemoryBytes(model, config.quantize),
    engines: (context) =>
      engines.map((e) => {
        // A pool the flags sized (--prefill-kv-pages too) stays; a default one follows the context.
        const sized = !contextSized || e.numPages !== poolPagesOf(config, layout, contextLength);
        const numPages = sized ? e.numPages : poolPagesOf(config, layout, context);
        return {
          numPages,
          regionBytes: regionBytesOf(model.config, { ...e, numPages, maxModelLen: context }),
        };
      }),
    layout,
    contextLength,
    contextSized,
    availableBytes: availableMemoryBytes(),
  });
}

/**
 * The weights, with a progress line each time the loaded share moves by a percent. On the
 * WebAssembly kernels they are read straight into one shared memory laid out for them and one
 * region per engine of `engines` (src/engine/engine-memory.ts): one copy for the whole process.
 */
function loadWeightsWithProgress(
  model: ModelHeader,
  engines: readonly ServeEngineOptions["engine"][],
  progress: ((line: string, done: boolean) => void) | undefined,
  quantize: "q8_0" | "q4_0" | undefined,
): {
  weights: ModelWeights;
  memory?: { readonly memory: KernelMemory; readonly regions: readonly MemoryRegion[] };
} {
  const onProgress = delayedProgress((line) => progress?.(line, false));
  const options = { onProgress, ...(quantize === undefined ? {} : { quantize }) };
  if (engines.some((e) => e.kernels === "ts"))
    return { weights: loadModelWeights(model, { shared: true, ...options }) };
  const regions = engines.map((e) => regionBytesOf(model.config, e));
  const kernels = engines[0]?.kernels === "native" ? "native" : "wasm";
  const loaded = loadEngineMemory(model, regions, { ...options, kernels });
  return { weights: loaded.weights, memory: { memory: loaded.memory, regions: loaded.regions } };
}

/** The API keys (--api-keys or KVFENCE_API_KEYS); none is one anonymous tenant, said loudly. */
function loadTenants(config: ServeConfig, log: Logger): TenantDirectory {
  const tenants = TenantDirectory.load({
    file: config.apiKeys,
    env: process.env.KVFENCE_API_KEYS,
    keys: config.apiKey,
  });
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
