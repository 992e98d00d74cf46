/**
 * The incident of docs/design.md §1, reproduced on a real kvfence server and stopped by each guard.
 *
 * The shape: a threaded disaggregated server (router, prefill and decode worker threads, shared
 * memory between them) whose prefill KV pool (256 tokens) is smaller than the context window it
 * serves (1,024 tokens), while the decode pool holds the whole window — as in the incident, where
 * each node sized its own pool. `undersized-pool` skips the startup pre-flight and lets the router
 * admit by the model's window alone; `placeholder-reject` makes the prefill node swap a prompt too
 * long for its pool for a one-token placeholder and report the transfer complete. With every guard
 * off, decode then generates over leased pages it never received, which still hold earlier
 * requests' KV (pages are not zeroed), and the client gets HTTP 200.
 *
 * The canary probe (`runProbe`) is the detector, exactly as an operator would run it: tenant A
 * plants access codes, tenant B sends prompts at and around every limit. Its findings are the
 * incident's symptoms: a 200 to an over-limit prompt, an answer that is not B's own, and — when the
 * model copies from the stale KV — one of A's codes in B's answer.
 */
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createLogger } from "../../lib/logger.js";
import type { FaultName, GuardName } from "../../protocol/safety.js";
import { BUNDLED_MODEL_DIR, parseServeConfig } from "../../server/serve-config.js";
import { startServer } from "../../server/start-server.js";
import { unsafeArgs } from "../../server/unsafe-switches.js";
import { startLocalCluster } from "../../topology/local-cluster.js";
import { runProbe } from "../probe/probe.js";
import type { ProbeReport } from "../probe/probe-report.js";
import { parsePrometheusText } from "./prometheus-text.js";

/** The guards that stop the incident, each on its own (docs/design.md §5, `placeholder-reject`). */
export const INCIDENT_GUARDS = [
  "admission-doors",
  "coverage",
  "checksum",
  "page-tags",
] as const satisfies readonly GuardName[];

export const INCIDENT_FAULTS: readonly FaultName[] = ["undersized-pool", "placeholder-reject"];

/** The pool shape: prefill smaller than the window, decode the whole window. */
export const INCIDENT_SHAPE = Object.freeze({
  pageSize: 16,
  maxModelLen: 1024,
  decodeKvPages: 160,
  prefillKvPages: 16,
});

const KEY_A = "sk-incident-tenant-a";
const KEY_B = "sk-incident-tenant-b";

export interface IncidentServerOptions {
  readonly model?: string;
  readonly faults: readonly string[];
  readonly disabledGuards: readonly string[];
  /** Default: the incident's shape; false gives both nodes the decode pool (the safe shape). */
  readonly undersizedPrefill?: boolean;
  /** `kvfence serve`'s defaults (pool, window) instead of the incident's shape; no switches. */
  readonly defaults?: boolean;
  /**
   * Worker threads and shared memory (default), node processes and TCP (`kvfence cluster`), or one
   * engine (`--no-disaggregation`).
   */
  readonly topology?: "threads" | "tcp" | "single";
  /** The forward pass's kernels (default: `kvfence serve`'s, WebAssembly). */
  readonly kernels?: "ts" | "wasm";
  /** TCP only: `--tls-cert/--tls-key/--tls-ca` flags for every process (TLS links, docs/tls.md). */
  readonly linkTlsArgs?: readonly string[];
  /**
   * One engine only: a disk KV tier (`--cache-disk DIR`, 64 MiB, `--cache-disk-key FILE`) under a
   * 40-page pool and a 512-token window, and tenant B's keys-file `cache_epoch`.
   */
  readonly tiers?: { readonly dir: string; readonly keyFile: string; readonly cacheEpochB?: number };
}

export interface IncidentServer {
  readonly url: string;
  readonly keyA: string;
  readonly keyB: string;
  /** The server's operator key (/metrics, /kvfence/nodes), fresh for each server. */
  readonly operatorKey: string;
  /** The server's /metrics, parsed (`name{labels}` → value). */
  metrics(): Promise<Map<string, number>>;
  close(): Promise<void>;
}

/** Starts a threaded kvfence server in the incident's shape, with the given switches. */
export async function startIncidentServer(options: IncidentServerOptions): Promise<IncidentServer> {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-incident-"));
  const keys = join(dir, "keys.json");
  const epochB = options.tiers?.cacheEpochB ?? 0;
  writeFileSync(
    keys,
    JSON.stringify({
      [KEY_A]: "tenant-a",
      [KEY_B]: epochB === 0 ? "tenant-b" : { tenant: "tenant-b", cache_epoch: epochB },
    }),
  );
  const unsafe = options.faults.length > 0 || options.disabledGuards.length > 0;
  const operatorKey = randomBytes(24).toString("hex");
  if (options.topology === "tcp") {
    try {
      return await startIncidentCluster(options, keys, dir, operatorKey);
    } catch (err) {
      rmSync(dir, { recursive: true, force: true });
      throw err;
    }
  }
  try {
    const config = parseServeConfig({
      host: "127.0.0.1",
      port: "0",
      model: options.model ?? BUNDLED_MODEL_DIR,
      pageSize: String(INCIDENT_SHAPE.pageSize),
      ...(options.tiers === undefined
        ? {}
        : {
            cacheDisk: options.tiers.dir,
            cacheDiskSize: "64MiB",
            cacheDiskKey: options.tiers.keyFile,
          }),
      ...(options.defaults === true
        ? {}
        : options.tiers !== undefined
          ? { maxModelLen: "512", kvPages: "40" }
          : {
              maxModelLen: String(INCIDENT_SHAPE.maxModelLen),
              kvPages: String(INCIDENT_SHAPE.decodeKvPages),
              ...(options.undersizedPrefill === false
                ? {}
                : { prefillKvPages: String(INCIDENT_SHAPE.prefillKvPages) }),
            }),
      scrubOnFree: false,
      ...(options.kernels === undefined ? {} : { kernels: options.kernels }),
      disaggregation: options.topology !== "single",
      // See `DISAGGREGATED_CACHE`.
      ...(options.topology === "single" ? {} : { prefixCache: DISAGGREGATED_CACHE }),
      logLevel: "silent",
      apiKeys: keys,
      operatorKey,
      unsafeFault: [...options.faults],
      unsafeDisableGuard: [...options.disabledGuards],
      iUnderstandThisLeaksData: unsafe,
    });
    const server = await startServer(config, { logger: createLogger({ level: "silent" }) });
    return incidentServer(server.url, dir, operatorKey, () => server.close());
  } catch (err) {
    rmSync(dir, { recursive: true, force: true });
    throw err;
  }
}

/**
 * The disaggregated incident runs without the prefix cache, as the incident's deployment did: with
 * it, the decode node keeps a finished request's pages in its own cache (decode-side reuse) instead
 * of freeing them, so tenant A's planted KV would sit in cached pages rather than in the freed,
 * never-zeroed pages the incident's placeholder lease read. The prefix-cache rows run on one engine.
 */
const DISAGGREGATED_CACHE = "off";

async function startIncidentCluster(
  options: IncidentServerOptions,
  keys: string,
  dir: string,
  operatorKey: string,
): Promise<IncidentServer> {
  const nodeArgs = [
    "--page-size",
    String(INCIDENT_SHAPE.pageSize),
    ...(options.defaults === true
      ? []
      : [
          "--max-model-len",
          String(INCIDENT_SHAPE.maxModelLen),
          "--kv-pages",
          String(INCIDENT_SHAPE.decodeKvPages),
        ]),
    ...unsafeArgs(options.faults, options.disabledGuards),
    ...(options.linkTlsArgs ?? []),
    "--prefix-cache",
    DISAGGREGATED_CACHE,
  ];
  const cluster = await startLocalCluster({
    prefill: 1,
    decode: 1,
    model: options.model ?? BUNDLED_MODEL_DIR,
    nodeArgs,
    ...(options.defaults === true || options.undersizedPrefill === false
      ? {}
      : { prefillArgs: ["--prefill-kv-pages", String(INCIDENT_SHAPE.prefillKvPages)] }),
    routerArgs: ["--api-keys", keys, "--operator-key", operatorKey],
  });
  return incidentServer(cluster.url, dir, operatorKey, () => cluster.close());
}

/** The handle of a started server at `url`; `close` stops it, then `dir` is removed. */
function incidentServer(
  url: string,
  dir: string,
  operatorKey: string,
  stop: () => Promise<void>,
): IncidentServer {
  return {
    url,
    keyA: KEY_A,
    keyB: KEY_B,
    operatorKey,
    async metrics() {
      const res = await fetch(`${url}/metrics`, { headers: { authorization: `Bearer ${operatorKey}` } });
      const text = await res.text();
      // A failed scrape must not read as zeros (a guard counter of 0, no pages quarantined).
      if (res.status !== 200) throw new Error(`/metrics answered ${res.status}: ${text.slice(0, 300)}`);
      return parsePrometheusText(text);
    },
    async close() {
      await stop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

export interface IncidentRun {
  readonly faults: readonly string[];
  readonly disabledGuards: readonly string[];
  readonly report: ProbeReport;
  /** Findings by kind. */
  readonly findingKinds: Readonly<Record<string, number>>;
  /** Guard counters from /metrics after the run (checksum/coverage/tag failures, admission rejections). */
  readonly guardCounters: Readonly<Record<string, number>>;
  readonly durationMs: number;
}

/** Sum of every series of `name` (all label sets). */
export function metricSum(metrics: Map<string, number>, name: string): number {
  let sum = 0;
  for (const [key, value] of metrics) if (key === name || key.startsWith(`${name}{`)) sum += value;
  return sum;
}

/** The /metrics series that count a guard catching something, summed over labels. */
export const GUARD_COUNTERS = [
  "kvfence_admission_rejections_total",
  "kvfence_transfer_checksum_failures_total",
  "kvfence_transfer_coverage_failures_total",
  "kvfence_tag_check_failures_total",
  "kvfence_transfer_dropped_misaddressed_writes_total",
  "kvfence_transfer_dropped_stale_writes_total",
  "kvfence_prefix_cache_collisions_total",
] as const;

/** Starts a server with the switches, runs the canary probe against it, and stops it. */
export async function runIncident(
  options: Omit<IncidentServerOptions, "kernels"> & {
    readonly seed?: number;
    readonly requests?: number;
    readonly onProgress?: (line: string) => void;
  },
): Promise<IncidentRun> {
  const started = Date.now();
  const server = await startIncidentServer(options);
  try {
    const report = await runProbe({
      baseUrl: server.url,
      apiKeyA: server.keyA,
      apiKeyB: server.keyB,
      operatorKey: server.operatorKey,
      seed: options.seed ?? 4821,
      requests: options.requests ?? 12,
      // One request at a time: the plants (each most of the prefill pool) must not crowd each other out.
      concurrency: 1,
      maxTokens: 48,
      // Plants that nearly fill the incident's prefill pool: B's over-pool prompts then lease pages
      // that held a whole planted prompt.
      ...(options.defaults === true ? {} : { plantChars: 220 }),
      overallTimeoutMs: 120_000,
      timeoutMs: 60_000,
      ...(options.onProgress === undefined ? {} : { onProgress: options.onProgress }),
    });
    const metrics = await server.metrics();
    const findingKinds: Record<string, number> = {};
    for (const f of report.findings) findingKinds[f.kind] = (findingKinds[f.kind] ?? 0) + 1;
    const guardCounters: Record<string, number> = {};
    for (const name of GUARD_COUNTERS) guardCounters[name] = metricSum(metrics, name);
    return {
      faults: options.faults,
      disabledGuards: options.disabledGuards,
      report,
      findingKinds,
      guardCounters,
      durationMs: Date.now() - started,
    };
  } finally {
    await server.close();
  }
}
