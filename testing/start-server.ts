/**
 * Starts the real kvfence server (real engine worker, real model) in-process on 127.0.0.1 port 0,
 * for end-to-end tests, and checks the pool through /metrics (with the test operator key). Close it
 * in the test's cleanup.
 */
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { createLogger } from "../src/lib/logger.js";
import { parseServeConfig } from "../src/server/serve-config.js";
import { type RunningServer, startServer } from "../src/server/start-server.js";
import { parsePrometheusText } from "../src/tools/incident/prometheus-text.js";

const ROOT = fileURLToPath(new URL(import.meta.url.includes("/dist/") ? "../../" : "../", import.meta.url));

/** The operator key of the test servers (/metrics, /kvfence/nodes; docs/api.md). */
export const TEST_OPERATOR_KEY = "kvfence-test-operator-key-0001";

/** Headers that carry the test servers' operator key. */
export function operatorHeaders(): Record<string, string> {
  return { authorization: `Bearer ${TEST_OPERATOR_KEY}` };
}

/** GET an operator endpoint of a test server (with its operator key, the test one unless given). */
export function operatorGet(url: string, path: string, key = TEST_OPERATOR_KEY): Promise<Response> {
  return fetch(`${url}${path}`, { headers: { authorization: `Bearer ${key}` } });
}

/** A bundled model folder by name (`kvfence-tiny`, `tiny-qwen2`). */
export function modelDir(name: string): string {
  return join(ROOT, "models", name);
}

export interface TestServerOptions {
  readonly model: string;
  readonly kvPages?: number;
  readonly pageSize?: number;
  readonly maxModelLen?: number;
  readonly maxPrefillTokens?: number;
  /** `--kernel-threads` (default 2 on this one-engine topology; 1 leaves a core to the router). */
  readonly kernelThreads?: 1 | 2;
  /** `--max-prompt-bytes`. */
  readonly maxPromptBytes?: number;
  /** `--tokenizer-threads` (1: the one preparation worker also compiles constraints, at normal priority). */
  readonly tokenizerThreads?: number;
  /** `--max-response-bytes`. */
  readonly maxResponseBytes?: number;
  /** `--max-num-seqs`, `--tenant-max-concurrency` and `--tenant-max-pages` (0: no cap). */
  readonly maxNumSeqs?: number;
  readonly tenantMaxConcurrency?: number;
  readonly tenantMaxPages?: number;
  /** `--kernels` (default auto: native where it loads and passes its self-test, else wasm). */
  readonly kernels?: "ts" | "wasm" | "native" | "auto";
  /** true: the default topology (prefill and decode nodes in threads); default false (one engine). */
  readonly disaggregation?: boolean;
  /** `--cache-ram` (e.g. "64MiB"): the KV tier in host memory below the prefix cache. */
  readonly cacheRam?: string;
  /** `--operator-key` (default TEST_OPERATOR_KEY); null: none, so /metrics is on the operator listener. */
  readonly operatorKey?: string | null;
  /** `--metrics-tenant-names`. */
  readonly metricsTenantNames?: boolean;
  /** key → tenant name; written to a temp `--api-keys` file. */
  readonly apiKeys?: Readonly<Record<string, string>>;
  /** `--prefix-cache` (default on) and `--prefix-cache-scope` (default tenant). */
  readonly prefixCache?: "on" | "off";
  readonly prefixCacheScope?: "tenant" | "key";
  /** `--chat-template FILE` and `--tool-call-parser`. */
  readonly chatTemplate?: string;
  readonly toolCallParser?: string;
  /** `--reasoning-parser`. */
  readonly reasoningParser?: "deepseek_r1" | "qwen3";
}

export interface TestServer extends RunningServer {
  /** Base URL of the OpenAI API (`…/v1`). */
  readonly baseURL: string;
}

export async function startTestServer(options: TestServerOptions): Promise<TestServer> {
  let keysDir: string | null = null;
  let apiKeys: string | undefined;
  if (options.apiKeys !== undefined) {
    keysDir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
    apiKeys = join(keysDir, "keys.json");
    writeFileSync(apiKeys, JSON.stringify(options.apiKeys));
  }
  const config = parseServeConfig({
    host: "127.0.0.1",
    port: "0",
    model: options.model,
    pageSize: String(options.pageSize ?? 16),
    scrubOnFree: false,
    disaggregation: options.disaggregation ?? false,
    logLevel: "silent",
    ...(apiKeys === undefined ? {} : { apiKeys }),
    ...engineFlags(options),
    ...routerFlags(options),
  });
  try {
    const server = await startServer(config, { logger: createLogger({ level: "silent" }) });
    return {
      ...server,
      baseURL: `${server.url}/v1`,
      close: async (graceMs?: number) => {
        await server.close(graceMs);
        if (keysDir !== null) rmSync(keysDir, { recursive: true, force: true });
      },
    };
  } catch (err) {
    if (keysDir !== null) rmSync(keysDir, { recursive: true, force: true });
    throw err;
  }
}

/** /metrics parsed into `name{labels}` → value. */
export async function scrape(url: string, key = TEST_OPERATOR_KEY): Promise<Map<string, number>> {
  const res = await operatorGet(url, "/metrics", key);
  assert.equal(res.status, 200);
  return parsePrometheusText(await res.text());
}

/**
 * Wait until the engine is idle (nothing waiting or running), then assert that every page of the
 * pool is FREE or cached by the prefix cache with no reference (SHARED: the cache keeps them until
 * it evicts them). Returns the final metrics.
 */
export async function assertPoolIdle(
  url: string,
  options: { readonly timeoutMs?: number; readonly key?: string } = {},
): Promise<Map<string, number>> {
  const deadline = Date.now() + (options.timeoutMs ?? 20_000);
  for (;;) {
    const m = await scrape(url, options.key);
    const busy =
      (m.get('kvfence_engine_requests{state="waiting"}') ?? 0) +
      (m.get('kvfence_engine_requests{state="running"}') ?? 0) +
      (m.get('kvfence_engine_requests{state="preempted"}') ?? 0);
    const total = m.get("kvfence_kv_pool_pages_total") ?? -1;
    const free = m.get('kvfence_kv_pool_pages{state="free"}') ?? -2;
    const cached = m.get('kvfence_prefix_cache_pages{state="unreferenced"}') ?? 0;
    const referenced = m.get('kvfence_prefix_cache_pages{state="referenced"}') ?? 0;
    if ((busy === 0 && free + cached === total && referenced === 0) || Date.now() > deadline) {
      assert.equal(busy, 0, "the engine is idle");
      assert.equal(referenced, 0, "no cached page is referenced when idle");
      assert.equal(free + cached, total, "every page of the pool is FREE or cached when idle");
      for (const state of ["reserved", "ready", "quarantined"]) {
        assert.equal(m.get(`kvfence_kv_pool_pages{state="${state}"}`), 0, `no ${state} pages when idle`);
      }
      return m;
    }
    await new Promise((r) => setTimeout(r, 25));
  }
}

/** The serve flags of a test server's engines and their limits (pool, batch, kernels, tenant caps). */
function engineFlags(options: TestServerOptions): Record<string, unknown> {
  return {
    ...(options.kvPages === undefined ? {} : { kvPages: String(options.kvPages) }),
    ...(options.maxModelLen === undefined ? {} : { maxModelLen: String(options.maxModelLen) }),
    ...(options.maxPrefillTokens === undefined ? {} : { maxPrefillTokens: String(options.maxPrefillTokens) }),
    ...(options.kernelThreads === undefined ? {} : { kernelThreads: String(options.kernelThreads) }),
    ...(options.kernels === undefined ? {} : { kernels: options.kernels }),
    ...(options.maxNumSeqs === undefined ? {} : { maxNumSeqs: String(options.maxNumSeqs) }),
    ...(options.tenantMaxConcurrency === undefined
      ? {}
      : { tenantMaxConcurrency: String(options.tenantMaxConcurrency) }),
    ...(options.tenantMaxPages === undefined ? {} : { tenantMaxPages: String(options.tenantMaxPages) }),
    ...(options.cacheRam === undefined ? {} : { cacheRam: options.cacheRam }),
  };
}

/** The serve flags of a test server's router: request limits, operator, prefix cache, templates, parsers. */
function routerFlags(options: TestServerOptions): Record<string, unknown> {
  return {
    ...(options.maxPromptBytes === undefined ? {} : { maxPromptBytes: String(options.maxPromptBytes) }),
    ...(options.tokenizerThreads === undefined ? {} : { tokenizerThreads: String(options.tokenizerThreads) }),
    ...(options.maxResponseBytes === undefined ? {} : { maxResponseBytes: String(options.maxResponseBytes) }),
    ...(options.operatorKey === null ? {} : { operatorKey: options.operatorKey ?? TEST_OPERATOR_KEY }),
    ...(options.metricsTenantNames === true ? { metricsTenantNames: true } : {}),
    ...(options.prefixCache === undefined ? {} : { prefixCache: options.prefixCache }),
    ...(options.prefixCacheScope === undefined ? {} : { prefixCacheScope: options.prefixCacheScope }),
    ...(options.chatTemplate === undefined ? {} : { chatTemplate: options.chatTemplate }),
    ...(options.toolCallParser === undefined ? {} : { toolCallParser: options.toolCallParser }),
    ...(options.reasoningParser === undefined ? {} : { reasoningParser: options.reasoningParser }),
  };
}
