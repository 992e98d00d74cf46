/**
 * Starts kvfence in each topology for the acceptance tests of `src/node/`: one engine
 * (`--no-disaggregation`) and the threaded default in-process on port 0, and a TCP cluster of
 * child processes (`startLocalCluster`), its links in plaintext or over TLS. Every server gets the
 * same API keys file and the test operator key (testing/start-server.ts); `close()` stops
 * everything and removes the file.
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createLogger } from "../src/lib/logger.js";
import { parseServeConfig } from "../src/server/serve-config.js";
import { startServer } from "../src/server/start-server.js";
import { type LocalCluster, startLocalCluster } from "../src/topology/local-cluster.js";
import { TEST_OPERATOR_KEY } from "./start-server.js";
import { linkTlsArgs } from "./tls-fixtures.js";

export interface TopologyServer {
  readonly url: string;
  readonly baseURL: string;
  readonly cluster: LocalCluster | null;
  close(): Promise<void>;
}

export interface TopologyOptions {
  readonly model: string;
  readonly kvPages: number;
  readonly maxModelLen?: number;
  readonly maxPrefillTokens?: number;
  readonly apiKeys: Readonly<Record<string, string>>;
  /** Cluster only: `--unsafe-fault` names for every process. */
  readonly faults?: readonly string[];
  /** Cluster only: mutual TLS on every link, with testing/fixtures/tls (docs/tls.md). */
  readonly linkTls?: boolean;
  /** `--otlp-endpoint` for the router and every node. */
  readonly otlpEndpoint?: string;
  /** In-process only: `--prefix-cache` (default on, as `kvfence serve`). */
  readonly prefixCache?: "on" | "off";
  /** `--kv-cache-dtype` (default f16, as `kvfence serve`). */
  readonly kvCacheDtype?: "f32" | "f16" | "bf16";
  /** Cluster only: more flags for the router process (e.g. `--max-migrations 0`). */
  readonly routerArgs?: readonly string[];
  /** Cluster only: more flags for prefill node `index` (e.g. a node fault on one of them). */
  readonly prefillArgsAt?: (index: number) => readonly string[];
}

function keysFile(keys: Readonly<Record<string, string>>): { path: string; dir: string } {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
  const path = join(dir, "keys.json");
  writeFileSync(path, JSON.stringify(keys));
  return { path, dir };
}

/** `single` (one engine) or `threads` (router + prefill + decode worker threads), in-process. */
export async function startInProcess(
  kind: "single" | "threads",
  options: TopologyOptions,
): Promise<TopologyServer> {
  const keys = keysFile(options.apiKeys);
  try {
    const config = parseServeConfig({
      host: "127.0.0.1",
      port: "0",
      model: options.model,
      pageSize: "16",
      scrubOnFree: false,
      disaggregation: kind === "threads",
      logLevel: "silent",
      kvPages: String(options.kvPages),
      apiKeys: keys.path,
      operatorKey: TEST_OPERATOR_KEY,
      unsafeFault: [...(options.faults ?? [])],
      iUnderstandThisLeaksData: (options.faults ?? []).length > 0,
      ...(options.maxModelLen === undefined ? {} : { maxModelLen: String(options.maxModelLen) }),
      ...(options.otlpEndpoint === undefined ? {} : { otlpEndpoint: options.otlpEndpoint }),
      ...(options.prefixCache === undefined ? {} : { prefixCache: options.prefixCache }),
      ...(options.kvCacheDtype === undefined ? {} : { kvCacheDtype: options.kvCacheDtype }),
      ...(options.maxPrefillTokens === undefined
        ? {}
        : { maxPrefillTokens: String(options.maxPrefillTokens) }),
    });
    const server = await startServer(config, { logger: createLogger({ level: "silent" }) });
    return {
      url: server.url,
      baseURL: `${server.url}/v1`,
      cluster: null,
      async close() {
        await server.close();
        rmSync(keys.dir, { recursive: true, force: true });
      },
    };
  } catch (err) {
    rmSync(keys.dir, { recursive: true, force: true });
    throw err;
  }
}

/** A TCP cluster of `prefill` + `decode` node processes and a router process on 127.0.0.1. */
export async function startCluster(
  prefill: number,
  decode: number,
  options: TopologyOptions,
): Promise<TopologyServer> {
  const keys = keysFile(options.apiKeys);
  const nodeArgs = ["--kv-pages", String(options.kvPages)];
  if (options.kvCacheDtype !== undefined) nodeArgs.push("--kv-cache-dtype", options.kvCacheDtype);
  if (options.maxModelLen !== undefined) nodeArgs.push("--max-model-len", String(options.maxModelLen));
  if (options.maxPrefillTokens !== undefined)
    nodeArgs.push("--max-prefill-tokens", String(options.maxPrefillTokens));
  for (const f of options.faults ?? []) nodeArgs.push("--unsafe-fault", f);
  if ((options.faults ?? []).length > 0) nodeArgs.push("--i-understand-this-leaks-data");
  nodeArgs.push(...linkTlsArgs(options.linkTls === true));
  const otlp = options.otlpEndpoint === undefined ? [] : ["--otlp-endpoint", options.otlpEndpoint];
  nodeArgs.push(...otlp); // the router process gets nodeArgs too
  try {
    const cluster = await startLocalCluster({
      prefill,
      decode,
      model: options.model,
      nodeArgs,
      routerArgs: [
        "--api-keys",
        keys.path,
        "--operator-key",
        TEST_OPERATOR_KEY,
        ...(options.routerArgs ?? []),
      ],
      ...(options.prefillArgsAt === undefined ? {} : { prefillArgsAt: options.prefillArgsAt }),
    });
    return {
      url: cluster.url,
      baseURL: `${cluster.url}/v1`,
      cluster,
      async close() {
        await cluster.close();
        rmSync(keys.dir, { recursive: true, force: true });
      },
    };
  } catch (err) {
    rmSync(keys.dir, { recursive: true, force: true });
    throw err;
  }
}
