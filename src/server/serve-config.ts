/**
 * The `serve` options: parsed once with zod into a frozen config, every problem reported with its
 * flag (exit 2 in the CLI), before anything loads. Also checked here: the unsafe switches' opt-in,
 * and that a node would not expose its links in plaintext beyond loopback (`linksExposure`,
 * docs/tls.md). `serveTls` reads and checks the TLS files, also before the model loads. Shared by
 * `kvfence serve`, `kvfence cluster` and the incident tool.
 */
import { existsSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { z } from "zod";
import { parseNodeUrl } from "../cluster/cluster-router.js";
import type { KernelsName } from "../engine/forward-setup.js";
import { chooseKernels, type SelfTestResult } from "../engine/kernels-choice.js";
import { type FairShareConfig, SCHEDULING_POLICIES, type TenantOverrides } from "../fair-share/fair-share.js";
import { DEFAULT_KV_CACHE_DTYPE, KV_DTYPES } from "../kvcache/kv-layout.js";
import { KvfenceError } from "../lib/errors.js";
import { isLoopback } from "../lib/loopback.js";
import { ROUTER_SLOTS } from "../protocol/wire.js";
import { REASONING_PARSERS } from "../router/reasoning-parser.js";
import { TOOL_CALL_PARSERS } from "../router/tool-call-parser.js";
import { parseLinkAddress } from "../transfer/link-address.js";
import {
  type FrontDoorTls,
  type LinkTls,
  linksExposure,
  loadFrontDoorTls,
  loadLinkTls,
} from "../transfer/tls-config.js";
import { UNSAFE_OPT_IN_FLAG, unsafeSwitchesProblem } from "./unsafe-switches.js";

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

/** Seconds, decimals allowed ("30", "0.5"), above 0 and at most a day. */
const secondsText = z.union([z.string(), z.number()]).transform((v, ctx) => {
  const n = typeof v === "number" ? v : /^\s*\d+(?:\.\d+)?\s*$/.test(v) ? Number(v) : Number.NaN;
  if (!(n > 0 && n <= 86_400)) {
    ctx.addIssue({
      code: "custom",
      message: `must be seconds above 0, at most 86400: got ${JSON.stringify(v)}`,
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
    kvCacheDtype: z.enum(KV_DTYPES).default(DEFAULT_KV_CACHE_DTYPE),
    maxModelLen: intText(1).optional(),
    maxPrefillTokens: intText(1).optional(),
    apiKeys: z.string().min(1).optional(),
    apiKey: z
      .array(z.string().regex(/^\S{8,}$/, { error: "must be at least 8 characters, no spaces" }))
      .default([]),
    servedModelName: z.array(z.string().min(1).max(256)).default([]),
    maxNumSeqs: intText(1, 1024).optional(),
    seed: intText(0, 0xffff_ffff).optional(),
    generationConfig: z
      .string()
      .min(1)
      .default("auto")
      .refine((v) => v === "auto" || v === "vllm" || existsSync(join(v, "generation_config.json")), {
        error: "must be auto, vllm, or a folder holding a generation_config.json",
      }),
    chatTemplate: z
      .string()
      .min(1)
      .refine((f) => existsSync(f), { error: "no such file" })
      .optional(),
    /** vLLM's `--tool-call-parser`: the tool-call format of the output, in place of the one the template names. */
    toolCallParser: z.enum(TOOL_CALL_PARSERS).optional(),
    reasoningParser: z.enum(REASONING_PARSERS).optional(),
    maxBodyBytes: byteSizeText.optional(),
    maxPromptBytes: byteSizeText.optional(),
    maxResponseBytes: byteSizeText.optional(),
    maxMessages: intText(1, 1_000_000).optional(),
    maxJsonDepth: intText(2, 100_000).optional(),
    tokenizerThreads: intText(1, 16).default(2),
    operatorKey: z
      .string()
      .min(16, { error: "must be at least 16 characters (a random secret, e.g. openssl rand -hex 24)" })
      .regex(/^\S+$/, { error: "must not contain spaces" })
      .optional(),
    metricsHost: z.string().min(1).default("127.0.0.1"),
    metricsPort: intText(0, 65535).optional(),
    metricsTenantNames: z.boolean().default(false),
    /** `--allowed-origins`: each value may hold several, comma-separated (or a JSON list, as vLLM's). */
    allowedOrigins: z
      .union([z.string(), z.array(z.string())])
      .default([])
      .transform((v, ctx) => {
        const list = (Array.isArray(v) ? v : [v]).flatMap((item) => {
          const text = item.trim();
          if (text.startsWith("[")) {
            try {
              return (JSON.parse(text) as unknown[]).map(String);
            } catch {
              ctx.addIssue({ code: "custom", message: `is not a JSON list: ${JSON.stringify(item)}` });
              return [];
            }
          }
          return text.split(",");
        });
        const origins = list.map((o) => o.trim()).filter((o) => o !== "");
        for (const o of origins) {
          if (o !== "*" && !/^https?:\/\/[^/\s]+$/.test(o))
            ctx.addIssue({
              code: "custom",
              message: `must be "*" or an origin like https://app.example.com (scheme, host, optional port): got ${JSON.stringify(o)}`,
            });
        }
        return origins;
      }),
    phaseMetrics: z.boolean().default(true),
    otlpEndpoint: z
      .url({
        protocol: /^https?$/,
        error: "must be an http:// or https:// URL (an OTLP/HTTP receiver, e.g. http://127.0.0.1:4318)",
      })
      .optional(),
    prefixCache: z.enum(["on", "off"]).default("on"),
    prefixCacheScope: z.enum(["tenant", "key"]).default("tenant"),
    cacheRam: byteSizeText.optional(),
    cacheDisk: z.string().min(1).optional(),
    cacheDiskSize: byteSizeText.optional(),
    cacheDiskKey: z.string().min(1).optional(),
    scrubOnFree: z.boolean(),
    disaggregation: z.boolean(),
    role: z.enum(["all", "router", "prefill", "decode"]).default("all"),
    prefill: z.array(z.string().min(1)).default([]),
    decode: z.array(z.string().min(1)).default([]),
    clusterSecret: z.string().min(1).optional(),
    registry: z.string().min(1).optional(),
    registryPrefix: z
      .string()
      .regex(/^\/\S*[^/]$/, { error: "must start with / and not end with /" })
      .default("/kvfence"),
    registryCa: z.string().min(1).optional(),
    registryCert: z.string().min(1).optional(),
    registryKey: z.string().min(1).optional(),
    registryUser: z.string().min(1).optional(),
    advertise: z
      .string()
      .refine((a) => parseLinkAddress(a) !== null, "must be host:port, e.g. 10.0.0.11:9001")
      .optional(),
    unsafeFault: z.array(z.string().min(1)).default([]),
    unsafeDisableGuard: z.array(z.string().min(1)).default([]),
    iUnderstandThisLeaksData: z.boolean().default(false),
    /** The prefill node's pool in pages when it differs from `--kv-pages` (the incident's shape). */
    prefillKvPages: intText(1).optional(),
    kernels: z.enum(["ts", "wasm", "native", "auto"]).default("auto"),
    kernelThreads: intText(1, 2).optional(),
    quantize: z.enum(["q8_0", "q4_0"]).optional(),
    tlsCert: z.string().min(1).optional(),
    tlsKey: z.string().min(1).optional(),
    tlsCa: z.string().min(1).optional(),
    httpsCert: z.string().min(1).optional(),
    httpsKey: z.string().min(1).optional(),
    insecurePlaintextLinks: z.boolean().default(false),
    tenantMaxConcurrency: intText(0).optional(),
    tenantMaxPages: intText(0).optional(),
    tenantMaxQueue: intText(0).optional(),
    maxQueue: intText(0).optional(),
    queueTimeout: secondsText.optional(),
    schedulingPolicy: z.enum(SCHEDULING_POLICIES).default("fair"),
    readyTimeout: secondsText.optional(),
    routerSlot: intText(0, ROUTER_SLOTS - 1).optional(),
    maxMigrations: intText(0).optional(),
    rolePolicy: z.enum(["off", "queue"]).default("off"),
    rolePolicyInterval: secondsText.optional(),
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
  .refine((c) => (c.registryCert === undefined) === (c.registryKey === undefined), {
    message: "give --registry-cert and --registry-key together",
    path: ["registryCert"],
  })
  .refine(
    (c) =>
      c.role !== "router" || c.registry === undefined || (c.prefill.length === 0 && c.decode.length === 0),
    {
      message: "give either --registry or the --prefill/--decode lists, not both",
      path: ["registry"],
    },
  )
  .refine((c) => (c.httpsCert === undefined) === (c.httpsKey === undefined), {
    message: "give --https-cert and --https-key together (docs/tls.md)",
    path: ["httpsCert"],
  })
  .refine(
    (c) =>
      c.cacheDisk === undefined
        ? c.cacheDiskSize === undefined && c.cacheDiskKey === undefined
        : c.cacheDiskSize !== undefined && c.cacheDiskKey !== undefined,
    {
      message: "give --cache-disk, --cache-disk-size and --cache-disk-key together (docs/api.md, KV tiers)",
      path: ["cacheDisk"],
    },
  )
  .refine((c) => c.prefixCache === "on" || (c.cacheRam === undefined && c.cacheDisk === undefined), {
    message:
      "--cache-ram and --cache-disk hold the prefix cache's evicted pages: they need --prefix-cache on",
    path: ["cacheRam"],
  });

export type ServeConfig = Readonly<z.infer<typeof serveConfigSchema>>;

const FLAG: Record<string, string> = {
  host: "--host",
  port: "--port",
  model: "--model",
  kvMemory: "--kv-memory",
  kvPages: "--kv-pages",
  pageSize: "--page-size",
  kvCacheDtype: "--kv-cache-dtype",
  maxModelLen: "--max-model-len",
  maxPrefillTokens: "--max-prefill-tokens",
  apiKeys: "--api-keys",
  apiKey: "--api-key",
  servedModelName: "--served-model-name",
  maxNumSeqs: "--max-num-seqs",
  seed: "--seed",
  generationConfig: "--generation-config",
  chatTemplate: "--chat-template",
  toolCallParser: "--tool-call-parser",
  reasoningParser: "--reasoning-parser",
  maxBodyBytes: "--max-body-bytes",
  maxPromptBytes: "--max-prompt-bytes",
  maxResponseBytes: "--max-response-bytes",
  maxMessages: "--max-messages",
  maxJsonDepth: "--max-json-depth",
  tokenizerThreads: "--tokenizer-threads",
  operatorKey: "--operator-key",
  metricsHost: "--metrics-host",
  metricsPort: "--metrics-port",
  metricsTenantNames: "--metrics-tenant-names",
  allowedOrigins: "--allowed-origins",
  phaseMetrics: "--no-phase-metrics",
  otlpEndpoint: "--otlp-endpoint",
  prefixCache: "--prefix-cache",
  prefixCacheScope: "--prefix-cache-scope",
  cacheRam: "--cache-ram",
  cacheDisk: "--cache-disk",
  cacheDiskSize: "--cache-disk-size",
  cacheDiskKey: "--cache-disk-key",
  logLevel: "--log-level",
  role: "--role",
  prefill: "--prefill",
  decode: "--decode",
  clusterSecret: "--cluster-secret",
  registry: "--registry",
  registryPrefix: "--registry-prefix",
  registryCa: "--registry-ca",
  registryCert: "--registry-cert",
  registryKey: "--registry-key",
  registryUser: "--registry-user",
  advertise: "--advertise",
  unsafeFault: "--unsafe-fault",
  unsafeDisableGuard: "--unsafe-disable-guard",
  iUnderstandThisLeaksData: UNSAFE_OPT_IN_FLAG,
  prefillKvPages: "--prefill-kv-pages",
  kernels: "--kernels",
  kernelThreads: "--kernel-threads",
  quantize: "--quantize",
  tlsCert: "--tls-cert",
  tlsKey: "--tls-key",
  tlsCa: "--tls-ca",
  httpsCert: "--https-cert",
  httpsKey: "--https-key",
  insecurePlaintextLinks: "--insecure-plaintext-links",
  tenantMaxConcurrency: "--tenant-max-concurrency",
  tenantMaxPages: "--tenant-max-pages",
  tenantMaxQueue: "--tenant-max-queue",
  maxQueue: "--max-queue",
  queueTimeout: "--queue-timeout",
  schedulingPolicy: "--scheduling-policy",
  readyTimeout: "--ready-timeout",
  routerSlot: "--router-slot",
  maxMigrations: "--max-migrations",
  rolePolicy: "--role-policy",
  rolePolicyInterval: "--role-policy-interval",
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
  operatorListener(c); // throws on an operator listener that would serve beyond loopback unguarded
  return Object.freeze(c);
}

/**
 * Where the operator listener (/metrics, /kvfence/nodes, /health; docs/api.md) opens, or null for
 * none. With `--metrics-port`, there. Without it: none when an operator key guards the operator
 * endpoints on the front door; otherwise on `--metrics-host` (loopback by default) at the front
 * door's port + 1 (any free port when the front door's is 0), so that a server started without
 * options still lets a local operator read /metrics. Without an operator key the listener must be on
 * loopback. Nodes (`--role prefill|decode`) serve no HTTP.
 */
export function operatorListener(config: {
  readonly role: string;
  readonly port: number;
  readonly operatorKey?: string | undefined;
  readonly metricsHost: string;
  readonly metricsPort?: number | undefined;
}): { host: string; port: number } | null {
  if (config.role === "prefill" || config.role === "decode") return null;
  if (config.metricsPort === undefined && config.operatorKey !== undefined) return null;
  if (config.operatorKey === undefined && !isLoopback(config.metricsHost)) {
    throw new KvfenceError(
      "config_invalid",
      `Invalid serve options:\n  --metrics-host: the operator listener would serve /metrics and /kvfence/nodes on ${config.metricsHost} (beyond loopback) to anyone; give --operator-key, or keep --metrics-host on loopback`,
    );
  }
  if (config.metricsPort !== undefined) return { host: config.metricsHost, port: config.metricsPort };
  if (config.port === 65535) {
    throw new KvfenceError(
      "config_invalid",
      "Invalid serve options:\n  --metrics-port: the default (--port + 1) does not exist for --port 65535; give --metrics-port or --operator-key",
    );
  }
  return { host: config.metricsHost, port: config.port === 0 ? 0 : config.port + 1 };
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

/**
 * The forward pass's kernels and their threads. A kernel worker spins between matrices, so it only
 * pays where a core is free for it: 2 threads on the one engine of `--no-disaggregation`; 1 where
 * the prefill and decode nodes already take both cores (the threaded topology, node processes).
 */
export function kernelOptions(config: ServeConfig): { kernels: KernelsName; kernelThreads: 1 | 2 } {
  const single = config.role === "all" && !config.disaggregation;
  if (config.kernels === "auto")
    throw new Error("kernelOptions(): --kernels auto is resolved first (withChosenKernels)");
  return {
    kernels: config.kernels,
    kernelThreads: (config.kernelThreads ?? (single ? 2 : 1)) as 1 | 2,
  };
}

/**
 * The config with `--kernels auto` resolved (native where the addon loads and passes its
 * self-test, else wasm: src/kernels/choose-kernels.ts), after one log line saying which kernels
 * this process runs and why. `--kernels native` that cannot run stops the server with the reason.
 */
export async function withChosenKernels(
  config: ServeConfig,
  log: { info(obj: object, msg: string): void },
  /** The self-test as a prestarted node thread ran it (`PrestartedWorkers.selfTest`). */
  selfTest?: Promise<SelfTestResult | undefined>,
): Promise<ServeConfig> {
  let choice: Awaited<ReturnType<typeof chooseKernels>>;
  try {
    choice = await chooseKernels(config.kernels, selfTest);
  } catch (err) {
    throw new KvfenceError("config_invalid", `${(err as Error).message}; use --kernels wasm or auto`);
  }
  log.info({ kernels: choice.kernels, isa: choice.isa }, choice.message);
  return { ...config, kernels: choice.kernels };
}

/**
 * The fair share of a config (docs/api.md, "Fair sharing"): the flags, the number of tenants the
 * API keys define and each tenant's own limits from the keys file.
 */
export function fairShareOf(
  config: ServeConfig,
  tenants: { readonly count: number; readonly limits: ReadonlyMap<number, TenantOverrides> },
): FairShareConfig {
  return {
    tenants: Math.max(1, tenants.count),
    tenantMaxConcurrency: config.tenantMaxConcurrency,
    tenantMaxPages: config.tenantMaxPages,
    tenantMaxQueue: config.tenantMaxQueue,
    maxQueue: config.maxQueue,
    queueTimeoutMs: config.queueTimeout === undefined ? undefined : Math.round(config.queueTimeout * 1000),
    schedulingPolicy: config.schedulingPolicy,
    overrides: tenants.limits,
  };
}
