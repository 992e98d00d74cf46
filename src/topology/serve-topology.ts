/**
 * What `kvfence serve` runs behind its HTTP router, by topology:
 * - default: the threaded disaggregated topology (prefill and decode nodes in worker threads,
 *   shared-memory transfer);
 * - `--no-disaggregation`: one engine worker;
 * - `--role router --prefill URL… --decode URL…`: the multi-process topology (TCP).
 * `--role prefill|decode` runs a node process instead of a router (`startNodeServer`).
 */

import { registerClusterMetrics, type ScrapeTarget } from "../cluster/cluster-metrics.js";
import { connectCluster, connectClusterFromRegistry } from "../cluster/cluster-router.js";
import type { DisaggregatedEngine } from "../cluster/disaggregated-engine.js";
import type { RegistryOptions } from "../cluster/registry.js";
import { startRoleAutopilot } from "../cluster/role-autopilot.js";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import type { KernelMemory, MemoryRegion } from "../engine/engine-memory.js";
import type { FairShareConfig } from "../fair-share/fair-share.js";
import { KvfenceError } from "../lib/errors.js";
import type { Logger } from "../lib/logger.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";
import type { PrestartedWorkers } from "../node/prestart-workers.js";
import type { EngineHandle } from "../protocol/engine-api.js";
import { makeSafety } from "../protocol/safety.js";
import { clusterSecretBytes } from "../transfer/control-auth.js";
import type { LinkTls } from "../transfer/tls-config.js";
import { EngineClient } from "./engine-client.js";
import { startThreadedTopology } from "./threaded-topology.js";

export type ServeRole = "all" | "router" | "prefill" | "decode";

export interface ServeEngineOptions {
  readonly role: ServeRole;
  /** `--role-policy queue`: the router's role policy reads the roles' load this often (registry routers only). */
  readonly rolePolicyIntervalMs?: number;
  readonly disaggregation: boolean;
  /**
   * The model; with `memory`, its weights live in that shared WebAssembly memory and each engine
   * gets one of its regions (the one engine or prefill the first, decode the second).
   */
  readonly model: {
    readonly config: ModelConfig;
    readonly weights: ModelWeights;
    readonly memory?: { readonly memory: KernelMemory; readonly regions: readonly MemoryRegion[] };
  } | null;
  /** Engine options of each node (or of the one engine), without the model. */
  readonly engine: Omit<EngineBuildOptions, "model">;
  readonly maxModelLen: number;
  readonly prefill: readonly string[];
  readonly decode: readonly string[];
  readonly clusterSecret: string | undefined;
  /** `--registry`: the router watches etcd instead of static lists. */
  readonly registry?: RegistryOptions;
  /** `--insecure-plaintext-links`: dial registered nodes beyond loopback without TLS. */
  readonly insecurePlaintextLinks?: boolean;
  /** `--tls-cert/--tls-key/--tls-ca`, loaded: mutual TLS on the router's control links. */
  readonly linkTls?: LinkTls;
  readonly faults: readonly string[];
  /** `--unsafe-disable-guard` names (the router's machine; the nodes get them in `engine`). */
  readonly disabledGuards?: readonly string[];
  /** The prefill node's pool in pages, when it differs from `engine.numPages`. */
  readonly prefillNumPages?: number;
  /** Per-tenant caps, queue bounds and the queue timeout (`--tenant-max-*`, `--max-queue`, `--queue-timeout`). */
  readonly fairShare?: FairShareConfig;
  /** The default topology's node threads, started while the weights loaded (`prestartNodeWorkers`). */
  readonly prestarted?: PrestartedWorkers;
  /** `--ready-timeout`: a node (or the engine) whose readiness ping takes longer is not ready. */
  readonly pingTimeoutMs?: number;
  /** `--router-slot`: this router's slot among the routers over the same nodes (default 0). */
  readonly routerSlot?: number;
  /** `--max-migrations`: times a request may migrate mid-stream to another pair (default 2). */
  readonly maxMigrations?: number;
  /** The router process: lost nodes re-dialled, refused ones. */
  readonly log?: Logger;
}

export interface ServeEngine {
  readonly engine: EngineHandle;
  readonly topology: "single" | "threads" | "processes";
  /** Adds the disaggregated metrics to the router's registry (no-op for one engine). */
  registerMetrics(router: ScrapeTarget): void;
  close(): Promise<void>;
}

/**
 * The cluster secret from `--cluster-secret` or env `KVFENCE_CLUSTER_SECRET`, checked: required,
 * at least 16 bytes, not trivially guessable (`clusterSecretBytes`, docs/security.md).
 */
export function clusterSecret(flag: string | undefined): string {
  const secret = flag ?? process.env.KVFENCE_CLUSTER_SECRET;
  if (secret === undefined || secret.length === 0) {
    throw new KvfenceError(
      "config_invalid",
      "The multi-process topology needs a cluster secret: none given; pass --cluster-secret or set KVFENCE_CLUSTER_SECRET on every node",
    );
  }
  clusterSecretBytes(secret);
  return secret;
}

export async function startServeEngine(options: ServeEngineOptions): Promise<ServeEngine> {
  const safety = makeSafety({ faults: options.faults, disabledGuards: options.disabledGuards ?? [] });
  if (options.role === "router" && options.registry !== undefined) {
    const engine = await connectClusterFromRegistry({
      registry: options.registry,
      secret: clusterSecret(options.clusterSecret),
      ...(options.linkTls === undefined ? {} : { tls: options.linkTls }),
      plaintextBeyondLoopback: options.insecurePlaintextLinks === true,
      maxModelLen: options.maxModelLen,
      safety,
      ...shared(options),
      ...(options.log === undefined ? {} : { log: options.log }),
    });
    const policy =
      options.rolePolicyIntervalMs === undefined
        ? null
        : startRoleAutopilot(engine, options.registry, options.rolePolicyIntervalMs, options.log);
    return disaggregated(engine, "processes", async () => {
      policy?.close();
      await engine.close();
    });
  }
  if (options.rolePolicyIntervalMs !== undefined)
    throw new KvfenceError(
      "config_invalid",
      "--role-policy switches node roles through etcd: it needs a router with --registry: --role-policy",
    );
  if (options.role === "router") {
    if (options.prefill.length === 0 || options.decode.length === 0) {
      throw new KvfenceError(
        "config_invalid",
        `The router needs at least one --prefill URL and one --decode URL: got ${options.prefill.length} and ${options.decode.length}`,
      );
    }
    const engine = await connectCluster({
      prefill: options.prefill,
      decode: options.decode,
      secret: clusterSecret(options.clusterSecret),
      ...(options.linkTls === undefined ? {} : { tls: options.linkTls }),
      maxModelLen: options.maxModelLen,
      safety,
      ...shared(options),
      ...(options.log === undefined ? {} : { log: options.log }),
    });
    return disaggregated(engine, "processes", () => engine.close());
  }
  if (options.model === null)
    throw new KvfenceError("config_invalid", "The server needs a model: none loaded");
  const { memory, ...model } = options.model;
  const engineOptions: EngineBuildOptions = { ...options.engine, model };
  const region = (i: number): Pick<EngineBuildOptions, "memory"> => {
    const r = memory?.regions[i];
    return memory === undefined || r === undefined ? {} : { memory: { memory: memory.memory, region: r } };
  };
  if (!options.disaggregation) {
    const engine = await EngineClient.start({ ...engineOptions, ...region(0) }, shared(options));
    return { engine, topology: "single", registerMetrics: () => {}, close: () => engine.close() };
  }
  const topo = await startThreadedTopology({
    prefill: {
      ...engineOptions,
      ...region(0),
      ...(options.prefillNumPages === undefined ? {} : { numPages: options.prefillNumPages }),
    },
    decode: { ...engineOptions, ...region(1) },
    maxModelLen: options.maxModelLen,
    safety,
    faults: options.faults,
    ...shared(options),
    ...(options.log === undefined ? {} : { log: options.log }),
    ...(options.prestarted === undefined ? {} : { prestarted: options.prestarted }),
  });
  return disaggregated(topo.engine, "threads", () => topo.close());
}

/** The fair share and the readiness deadline, as every topology takes them. */
function shared(options: ServeEngineOptions): {
  fairShare?: FairShareConfig;
  pingTimeoutMs?: number;
  phaseMetrics?: boolean;
  routerSlot?: number;
  maxMigrations?: number;
} {
  return {
    ...(options.routerSlot === undefined ? {} : { routerSlot: options.routerSlot }),
    ...(options.maxMigrations === undefined ? {} : { maxMigrations: options.maxMigrations }),
    ...(options.fairShare === undefined ? {} : { fairShare: options.fairShare }),
    ...(options.pingTimeoutMs === undefined ? {} : { pingTimeoutMs: options.pingTimeoutMs }),
    ...(options.engine.phaseMetrics === undefined ? {} : { phaseMetrics: options.engine.phaseMetrics }),
  };
}

function disaggregated(
  engine: DisaggregatedEngine,
  topology: "threads" | "processes",
  close: () => Promise<void>,
): ServeEngine {
  return {
    engine,
    topology,
    registerMetrics: (router) => registerClusterMetrics(router, engine),
    close,
  };
}
