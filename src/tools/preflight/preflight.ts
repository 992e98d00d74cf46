/**
 * `kvfence preflight` as a library: gather each node's KV pool and context length (from a kvfence
 * router, live SGLang/vLLM servers, or offline from a model config), judge each with
 * `poolCapacityVerdict`, and render a verdict table. The CLI in src/cli/preflight.ts is a thin
 * wrapper; exit 1 when any node fails, 2 when a node could not be read.
 */

import {
  type CapacityVerdict,
  dtypeBytes,
  estimateParameterCount,
  type HfModelConfig,
  kvBytesPerToken,
  poolCapacityVerdict,
  poolTokensFromMemory,
} from "../../kvcache/kv-capacity.js";
import { KvfenceError } from "../../lib/errors.js";
import { readKvfenceNodes } from "./kvfence-nodes.js";
import type { NodeCapacity } from "./node-capacity.js";
import { readSglangServer } from "./sglang-info.js";
import { readVllmServer } from "./vllm-info.js";

/** Offline sizing inputs (one node, SGLang's formula). */
export interface OfflineInputs {
  readonly config?: HfModelConfig;
  readonly gpuMemoryBytes?: number;
  readonly dtype?: string;
  readonly kvDtype?: string;
  readonly tp?: number;
  readonly memFraction?: number;
  readonly weightsBytes?: number;
  readonly contextLength: number;
  readonly poolTokens?: number;
  readonly pageSize?: number;
}

export interface PreflightOptions {
  readonly kvfenceUrl?: string;
  readonly sglangUrls?: readonly string[];
  readonly vllmUrls?: readonly string[];
  readonly offline?: OfflineInputs;
  readonly apiKey?: string;
  /** The bearer token for a kvfence router's /kvfence/nodes (its operator key); default `apiKey`. */
  readonly operatorKey?: string;
  /**
   * Where the kvfence router's /kvfence/nodes is, when not on `kvfenceUrl`: its operator listener
   * (`--operator-port`). Enough on its own to check a kvfence deployment.
   */
  readonly operatorUrl?: string;
  readonly timeoutMs?: number;
}

export interface PreflightRow {
  readonly node: string;
  readonly source: NodeCapacity["source"];
  readonly role: string;
  readonly poolTokens: number | null;
  readonly contextLength: number | null;
  readonly pageSize: number;
  readonly verdict: "pass" | "fail" | "unknown" | "error";
  readonly fix: string;
  readonly note: string;
}

export interface PreflightReport {
  readonly rows: readonly PreflightRow[];
  /** 0 every node passes, 1 some node's pool is smaller than its context, 2 some node unreadable. */
  readonly exitCode: 0 | 1 | 2;
  /** Lines explaining offline estimates (formula, weights estimate). */
  readonly notes: readonly string[];
}

/** Run every requested check; reader failures become `error` rows, never exceptions. */
export async function runPreflight(options: PreflightOptions): Promise<PreflightReport> {
  const http = {
    timeoutMs: options.timeoutMs ?? 10_000,
    ...(options.apiKey === undefined ? {} : { apiKey: options.apiKey }),
  };
  const rows: PreflightRow[] = [];
  const notes: string[] = [];
  const jobs: Array<{ name: string; source: NodeCapacity["source"]; run: () => Promise<NodeCapacity[]> }> =
    [];
  if (options.kvfenceUrl !== undefined || options.operatorUrl !== undefined) {
    const url = (options.operatorUrl ?? options.kvfenceUrl)!;
    const key = options.operatorKey ?? options.apiKey;
    const operator = { timeoutMs: http.timeoutMs, ...(key === undefined ? {} : { apiKey: key }) };
    jobs.push({ name: url, source: "kvfence", run: () => readKvfenceNodes(url, operator) });
  }
  for (const url of options.sglangUrls ?? []) {
    jobs.push({ name: url, source: "sglang", run: async () => [await readSglangServer(url, http)] });
  }
  for (const url of options.vllmUrls ?? []) {
    jobs.push({ name: url, source: "vllm", run: async () => [await readVllmServer(url, http)] });
  }
  const results = await Promise.allSettled(jobs.map((j) => j.run()));
  results.forEach((r, i) => {
    const job = jobs[i]!;
    if (r.status === "fulfilled") {
      for (const n of r.value) rows.push(judge(n));
    } else {
      const message = r.reason instanceof Error ? r.reason.message : String(r.reason);
      rows.push({
        node: job.name,
        source: job.source,
        role: "?",
        poolTokens: null,
        contextLength: null,
        pageSize: 1,
        verdict: "error",
        fix: "",
        note: message,
      });
    }
  });
  if (options.offline !== undefined) {
    const offline = offlineCapacity(options.offline);
    notes.push(...offline.notes);
    rows.push(judge(offline.node));
  }
  if (rows.length === 0) {
    throw new KvfenceError(
      "invalid_request",
      "Nothing to check: give --url, --sglang, --vllm, or --context-length with --pool-tokens or a --config",
    );
  }
  const exitCode = rows.some((r) => r.verdict === "fail")
    ? 1
    : rows.some((r) => r.verdict === "error" || r.verdict === "unknown")
      ? 2
      : 0;
  return { rows, exitCode, notes };
}

/** Offline: a given pool, or one computed with SGLang's formula from a config and GPU memory. */
export function offlineCapacity(input: OfflineInputs): { node: NodeCapacity; notes: string[] } {
  const notes: string[] = [];
  let poolTokens: number;
  if (input.poolTokens !== undefined) {
    poolTokens = input.poolTokens;
    notes.push(`pool: ${poolTokens} tokens (given)`);
  } else {
    if (input.config === undefined || input.gpuMemoryBytes === undefined) {
      throw new KvfenceError(
        "invalid_request",
        "Offline sizing needs --config and --gpu-memory, or --pool-tokens: both missing or one missing",
      );
    }
    const tp = input.tp ?? 1;
    const dtype = input.dtype ?? "bf16";
    const sizing = kvBytesPerToken(input.config, { tp, kvDtypeBytes: dtypeBytes(input.kvDtype ?? dtype) });
    let weights: number;
    if (input.weightsBytes !== undefined) {
      weights = input.weightsBytes;
      notes.push(`weights per rank: ${weights} B (given)`);
    } else {
      const params = estimateParameterCount(input.config);
      weights = (params * dtypeBytes(dtype)) / tp;
      notes.push(
        `weights per rank: ${fmt(Math.round(weights))} B ESTIMATED from ~${fmt(Math.round(params))} parameters × ` +
          `${dtypeBytes(dtype)} B (${dtype}) ÷ tp ${tp}; pass --weights-bytes for the real size`,
      );
    }
    const memFraction = input.memFraction ?? 0.88;
    poolTokens = poolTokensFromMemory({
      gpuMemoryBytes: input.gpuMemoryBytes,
      memFraction,
      weightsBytesPerRank: weights,
      kvBytesPerToken: sizing.kvBytesPerToken,
    });
    notes.push(
      `KV bytes per token per rank: ${sizing.kvBytesPerToken} = ${sizing.formula}${sizing.mla ? " (MLA)" : ""}`,
    );
    notes.push(
      `pool: (${fmt(input.gpuMemoryBytes)} B × ${memFraction} − ${fmt(Math.round(weights))} B) ÷ ` +
        `${sizing.kvBytesPerToken} B = ${fmt(poolTokens)} tokens`,
    );
  }
  return {
    node: {
      node: "offline",
      source: "offline",
      role: "engine",
      poolTokens,
      contextLength: input.contextLength,
      pageSize: input.pageSize ?? 1,
      note: input.poolTokens === undefined ? "computed (SGLang formula)" : "given",
    },
    notes,
  };
}

function judge(n: NodeCapacity): PreflightRow {
  if (n.poolTokens === null || n.contextLength === null) {
    return {
      ...n,
      verdict: "unknown",
      fix: "the server does not report its pool or context; use --pool-tokens",
    };
  }
  const v: CapacityVerdict = poolCapacityVerdict({
    poolTokens: n.poolTokens,
    contextLength: n.contextLength,
    pageSize: n.pageSize,
  });
  return { ...n, verdict: v.ok ? "pass" : "fail", fix: v.fix };
}

/** The verdict table as fixed-width text. */
export function renderPreflightTable(report: PreflightReport): string {
  const header = ["node", "role", "pool tokens", "context length", "verdict", "fix"];
  const body = report.rows.map((r) => [
    r.node,
    r.role,
    r.poolTokens === null ? "?" : fmt(r.poolTokens),
    r.contextLength === null ? "?" : fmt(r.contextLength),
    r.verdict.toUpperCase(),
    r.verdict === "error" ? r.note : r.fix,
  ]);
  const widths = header.map((h, i) =>
    i === header.length - 1 ? h.length : Math.max(h.length, ...body.map((row) => (row[i] ?? "").length)),
  );
  const line = (cells: string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i] ?? 0)))
      .join("  ")
      .trimEnd();
  const out = [line(header), line(widths.map((w) => "-".repeat(w))), ...body.map(line)];
  for (const n of report.notes) out.push(`note: ${n}`);
  return out.join("\n");
}

function fmt(n: number): string {
  return n.toLocaleString("en-US");
}
