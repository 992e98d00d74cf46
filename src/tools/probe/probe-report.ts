/** The probe's report: JSON-serialisable data plus a fixed-width summary table. */

export const PROBE_PHASES = ["plant", "probe", "status", "determinism"] as const;
export type ProbePhase = (typeof PROBE_PHASES)[number];

export type FindingKind =
  /** A B output contains one of A's planted codes. */
  | "leak"
  /** An over-limit prompt got HTTP 200. */
  | "over-limit-accepted"
  /** An over-limit or malformed request got a status other than 4xx (and not 200). */
  | "not-4xx"
  /** A malformed request (bad JSON, wrong types, no messages) got HTTP 200. */
  | "malformed-accepted"
  /** A 200 whose answer is not the code from its own context (placeholder, truncation, stale KV). */
  | "wrong-answer"
  /** A 200 whose usage.prompt_tokens is far below the prompt sent (a placeholder prompt). */
  | "usage-mismatch"
  /** Greedy output differs between the isolated run and the run under load. */
  | "nondeterminism";

export interface Finding {
  readonly phase: ProbePhase;
  readonly kind: FindingKind;
  /** The probe case, e.g. "over-context/stream" or "load#12". */
  readonly case: string;
  readonly message: string;
  readonly status?: number;
  /** Start of the offending output. */
  readonly excerpt?: string;
}

export interface PhaseSummary {
  readonly phase: ProbePhase;
  /** Number of individual checks made. */
  checks: number;
  findings: number;
  warnings: number;
  /** Why the phase (or part of it) did not run. */
  skipped: string | null;
}

export interface ProbeReport {
  readonly version: 1;
  readonly baseUrl: string;
  readonly model: string | null;
  readonly maxModelLen: number | null;
  readonly maxModelLenSource: string;
  readonly poolTokens: number | null;
  readonly poolTokensSource: string;
  /** The limit over-limit prompts are judged against: min(max_model_len, pool tokens). */
  readonly effectiveLimit: number | null;
  /** Calibrated from the plant phase's usage: prompt tokens per character. */
  readonly tokensPerChar: number;
  readonly seed: number;
  /** The run's bounds, so a report says how hard the server was pushed. */
  readonly settings: {
    readonly requests: number;
    readonly concurrency: number;
    readonly maxTokens: number;
    readonly timeoutMs: number;
    readonly overallTimeoutMs: number;
  };
  readonly startedAt: string;
  readonly durationMs: number;
  /** clean: no finding (exit 0); findings: exit 1; error: the probe could not run (exit 2). */
  readonly outcome: "clean" | "findings" | "error";
  readonly error: { code: string; message: string } | null;
  readonly requestsSent: number;
  readonly planted: { codes: number; asked: number; repeated: number };
  readonly phases: readonly PhaseSummary[];
  readonly findings: readonly Finding[];
  readonly warnings: readonly string[];
}

/** Exit code for a report: 0 clean, 1 findings, 2 could not run. */
export function exitCodeOf(report: ProbeReport): 0 | 1 | 2 {
  return report.outcome === "clean" ? 0 : report.outcome === "findings" ? 1 : 2;
}

/** A readable summary: header lines, the phase table, then findings and warnings. */
export function renderProbeSummary(report: ProbeReport): string {
  const out: string[] = [];
  out.push(`kvfence probe ${report.baseUrl}  model=${report.model ?? "?"}  seed=${report.seed}`);
  out.push(
    `max_model_len=${report.maxModelLen ?? "?"} (${report.maxModelLenSource})  pool_tokens=${report.poolTokens ?? "?"} ` +
      `(${report.poolTokensSource})  requests=${report.requestsSent}  ${(report.durationMs / 1000).toFixed(1)} s`,
  );
  const rows = report.phases.map((p) => [
    p.phase,
    String(p.checks),
    String(p.findings),
    String(p.warnings),
    p.skipped !== null
      ? `skipped: ${p.skipped}`
      : p.findings > 0
        ? "FAIL"
        : p.checks === 0
          ? "not run"
          : "ok",
  ]);
  const header = ["phase", "checks", "findings", "warnings", "result"];
  const widths = header.map((h, i) =>
    i === header.length - 1 ? h.length : Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)),
  );
  const line = (cells: string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i] ?? 0)))
      .join("  ")
      .trimEnd();
  out.push("", line(header), line(widths.map((w) => "-".repeat(w))), ...rows.map(line), "");
  for (const f of report.findings.slice(0, 50)) {
    out.push(`FINDING [${f.phase}/${f.kind}] ${f.case}: ${f.message}`);
  }
  if (report.findings.length > 50)
    out.push(`… and ${report.findings.length - 50} more findings (see --json)`);
  for (const w of report.warnings.slice(0, 20)) out.push(`warning: ${w}`);
  if (report.error !== null) out.push(`ERROR (${report.error.code}): ${report.error.message}`);
  out.push(
    report.outcome === "clean"
      ? "RESULT: clean"
      : report.outcome === "findings"
        ? `RESULT: ${report.findings.length} finding(s)`
        : "RESULT: the probe could not run",
  );
  return out.join("\n");
}
