/**
 * `kvfence check` as a pure function: builds the bounded model (docs/design.md §7, docs/protocol.md),
 * picks the scenario of a fault variant, runs the breadth-first search and renders the result as
 * text, JSON or a Graphviz trace.
 *
 * A fault variant switches its fault on (with any fault it needs to be reachable, e.g. the
 * incident's `placeholder-reject` needs the `undersized-pool` router) and switches off the guards
 * that would otherwise catch it, so the search shows the bug the guard exists for. `keepGuards`
 * leaves every guard on instead, to show that the guards catch the fault.
 */
import { KvfenceError } from "../../lib/errors.js";
import {
  FAULT_NAMES,
  type FaultName,
  type GuardName,
  isFaultName,
  makeSafety,
} from "../../protocol/safety.js";
import { type Counterexample, type ExploreResult, explore } from "./explore.js";
import { ModelWorld } from "./model-world.js";
import { explorePrefixCache } from "./prefix-model.js";
import { type CheckRequest, FIRST_TOKEN, type ModelConfig } from "./world-state.js";

/** The request pool the bound draws from; `--requests N` takes the first N. */
export const CHECK_REQUESTS: readonly CheckRequest[] = [
  { rid: 1, tenant: 0, promptLen: 1, maxTokens: 2 },
  { rid: 2, tenant: 1, promptLen: 2, maxTokens: 1 },
  // Over the prefill pool (3 tokens), within the decode pool (4) and the model's window (8).
  { rid: 3, tenant: 1, promptLen: 3, maxTokens: 1 },
];

/**
 * The decode-side reuse bound's requests (`decodeCache`): a conversation's two turns of tenant 0
 * (turn 2's prompt is turn 1's prompt and its first generated token) and tenant 1's identical
 * second turn. Decode caches turn 1's computed pages when it ends; turn 2 holds two of them.
 */
export const DECODE_CACHE_REQUESTS: readonly CheckRequest[] = [
  { rid: 1, tenant: 0, promptLen: 2, maxTokens: 2, tokens: [1, 2] },
  { rid: 2, tenant: 0, promptLen: 3, maxTokens: 1, tokens: [1, 2, FIRST_TOKEN] },
  { rid: 3, tenant: 1, promptLen: 3, maxTokens: 1, tokens: [1, 2, FIRST_TOKEN] },
];

export interface CheckOptions {
  readonly fault?: FaultName;
  /** With `fault`: keep every guard on (expect no safety violation). */
  readonly keepGuards?: boolean;
  readonly disabledGuards?: readonly GuardName[];
  readonly requests?: number;
  /** n > 1: the first request's samples after its first, as one group (0: none). */
  readonly samples?: number;
  readonly pages?: number;
  readonly prefillPages?: number;
  readonly maxModelLen?: number;
  readonly maxAttempts?: number;
  readonly crashes?: number;
  readonly duplicates?: number;
  readonly losses?: number;
  readonly clientAborts?: boolean;
  readonly timeouts?: boolean;
  readonly transport?: "shm" | "tcp";
  readonly reorder?: boolean;
  /**
   * Routers over the one prefill/decode pair (1 or 2, default 1): with 2, the requests alternate
   * between router slot 0 and router slot 1 (docs/protocol.md §3, item 13).
   */
  readonly routers?: number;
  /**
   * Decode-side reuse: decode keeps a prefix cache, over `DECODE_CACHE_REQUESTS` (the bound's
   * `requests` take the first N of those instead).
   */
  readonly decodeCache?: boolean;
  readonly maxStates?: number;
  readonly maxDepth?: number;
  readonly timeLimitMs?: number;
}

/** The base bound; `kvfence check` with no bound options runs `DEFAULT_SUITE` over it. */
export const DEFAULT_BOUND = {
  requests: 2,
  samples: 0,
  pages: 4,
  prefillPages: 3,
  maxModelLen: 8,
  maxAttempts: 2,
  crashes: 0,
  duplicates: 1,
  losses: 0,
  clientAborts: true,
  timeouts: false,
  transport: "shm",
  reorder: false,
  routers: 1,
  decodeCache: false,
  maxStates: 3_000_000,
} as const;

/** The decode-side reuse bound of `DEFAULT_SUITE` (and of the `held-unpinned` variant). */
export const DECODE_CACHE_BOUND: Partial<CheckOptions> = {
  decodeCache: true,
  requests: 3,
  // Prompt + max_tokens is 4 tokens: a prefill pool of 4 pages admits every request.
  prefillPages: 4,
  maxAttempts: 1,
  duplicates: 0,
  clientAborts: false,
};

/**
 * The default check: two bounds that together explore about 1,481,000 states in about 117 s of
 * one core — retries with a duplicated message (stale epochs), and a crash of either node (fences,
 * restarts, stale leases), each with the router's watermarks (docs/protocol.md §3, item 8); and
 * two routers over the one pair on a small bound (item 13; about 6,700 states).
 */
export const DEFAULT_SUITE: readonly { readonly name: string; readonly options: CheckOptions }[] = [
  { name: "retries and duplicates", options: {} },
  { name: "crashes", options: { maxAttempts: 1, crashes: 1, duplicates: 0 } },
  // Two routers over the pair (router slots 0 and 1): a small bound, under a second.
  { name: "two routers", options: { routers: 2, duplicates: 0, clientAborts: false } },
  // Decode-side reuse: a conversation's second turn holds decode's cached pages of its first.
  { name: "decode cache", options: DECODE_CACHE_BOUND },
];

interface Scenario {
  readonly faults: readonly FaultName[];
  readonly disabledGuards: readonly GuardName[];
  /** Bound changes the fault needs to be reachable (small, so the search stays fast). */
  readonly bound: Partial<CheckOptions>;
}

/** How each fault variant is set up to show its bug. */
export const FAULT_SCENARIOS: Readonly<Record<FaultName, Scenario>> = {
  "placeholder-reject": {
    faults: ["placeholder-reject", "undersized-pool"],
    disabledGuards: ["coverage", "checksum", "page-tags"],
    bound: { requests: 3, duplicates: 0, clientAborts: false },
  },
  "undersized-pool": {
    faults: ["undersized-pool"],
    disabledGuards: ["admission-doors"],
    bound: { requests: 3, duplicates: 0, clientAborts: false },
  },
  "early-free": { faults: ["early-free"], disabledGuards: [], bound: { duplicates: 0 } },
  "late-write": { faults: ["late-write"], disabledGuards: ["lease-check"], bound: { duplicates: 0 } },
  "corrupt-transfer": {
    faults: ["corrupt-transfer"],
    disabledGuards: ["checksum"],
    bound: { duplicates: 0 },
  },
  "misaddressed-write": {
    faults: ["misaddressed-write"],
    disabledGuards: ["lease-check", "checksum", "page-tags"],
    bound: { duplicates: 0 },
  },
  "drop-abort-ack": { faults: ["drop-abort-ack"], disabledGuards: ["quarantine"], bound: { duplicates: 0 } },
  "stale-commit": {
    faults: ["stale-commit"],
    disabledGuards: ["checksum", "page-tags"],
    bound: { requests: 1, duplicates: 0, clientAborts: false, timeouts: true },
  },
  "shared-prefix": { faults: ["shared-prefix"], disabledGuards: ["tenant-salt", "page-tags"], bound: {} },
  "prefix-collision": {
    faults: ["prefix-collision"],
    disabledGuards: ["prefix-tokens", "page-tags"],
    bound: {},
  },
  "held-unpinned": {
    faults: ["held-unpinned"],
    disabledGuards: ["held-pages", "page-tags"],
    bound: DECODE_CACHE_BOUND,
  },
  "tier-corrupt": { faults: ["tier-corrupt"], disabledGuards: ["tier-mac"], bound: {} },
  "tier-planted": { faults: ["tier-planted"], disabledGuards: ["tier-owner"], bound: {} },
  "stale-epoch": { faults: ["stale-epoch"], disabledGuards: ["tier-epoch"], bound: {} },
  "spill-race": { faults: ["spill-race"], disabledGuards: ["tier-spill-copy"], bound: {} },
};

/** The faults the KV tiers' model explores (the prefix cache's, with a tier: tier-model.ts). */
const TIER_FAULTS: readonly FaultName[] = ["tier-corrupt", "tier-planted", "stale-epoch", "spill-race"];

/** The faults the prefix cache's own model explores (src/tools/check/prefix-model.ts). */
const PREFIX_FAULTS: readonly FaultName[] = ["shared-prefix", "prefix-collision", ...TIER_FAULTS];

export interface CheckReport {
  readonly fault: FaultName | null;
  readonly faults: readonly FaultName[];
  readonly disabledGuards: readonly GuardName[];
  readonly bound: Required<
    Omit<CheckOptions, "fault" | "keepGuards" | "disabledGuards" | "maxDepth" | "timeLimitMs">
  >;
  readonly result: ExploreResult;
}

export function resolveOptions(options: CheckOptions): {
  config: ModelConfig;
  report: Omit<CheckReport, "result">;
} {
  const scenario = options.fault === undefined ? null : FAULT_SCENARIOS[options.fault];
  const merged = { ...DEFAULT_BOUND, ...(scenario?.bound ?? {}), ...stripUndefined(options) };
  const faults = scenario?.faults ?? [];
  const disabledGuards = disabledGuardsOf(options, scenario);
  const requests = merged.decodeCache ? DECODE_CACHE_REQUESTS : CHECK_REQUESTS;
  if (merged.requests < 1 || merged.requests > requests.length) {
    throw new KvfenceError(
      "invalid_request",
      `The checker models 1 to ${requests.length} requests: ${merged.requests}`,
      { param: "requests" },
    );
  }
  if (merged.pages < 2 || merged.pages > 8 || merged.prefillPages < 1 || merged.prefillPages > 8) {
    throw new KvfenceError(
      "invalid_request",
      `The checker models pools of 2 to 8 decode pages and 1 to 8 prefill pages: ${merged.pages} and ${merged.prefillPages}`,
      { param: "pages" },
    );
  }
  if (merged.routers !== 1 && merged.routers !== 2) {
    throw new KvfenceError("invalid_request", `The checker models 1 or 2 routers: ${merged.routers}`, {
      param: "routers",
    });
  }
  const bound = Object.fromEntries(
    Object.keys(DEFAULT_BOUND).map((k) => [k, merged[k as keyof typeof DEFAULT_BOUND]]),
  ) as CheckReport["bound"];
  const config: ModelConfig = {
    decodePages: bound.pages,
    prefillPages: bound.prefillPages,
    pageSize: 1,
    maxModelLen: bound.maxModelLen,
    requests: requests.slice(0, bound.requests).map((r, i) => ({
      ...r,
      ...(bound.routers === 1 ? {} : { router: i % 2 }),
      ...(i === 0 && bound.samples > 0 ? { samples: bound.samples } : {}),
    })),
    maxAttempts: bound.maxAttempts,
    crashes: bound.crashes,
    duplicates: bound.duplicates,
    losses: bound.losses,
    clientAborts: bound.clientAborts,
    timeouts: bound.timeouts,
    transport: bound.transport,
    reorder: bound.reorder,
    routers: bound.routers,
    decodeCache: bound.decodeCache,
    safety: makeSafety({ faults, disabledGuards }),
  };
  return { config, report: { fault: options.fault ?? null, faults, disabledGuards, bound } };
}

/** Runs the checker. Never throws for a violation: the report carries the counterexample. */
export function runCheck(options: CheckOptions = {}): CheckReport {
  if (options.fault !== undefined && !isFaultName(options.fault)) {
    throw new KvfenceError(
      "invalid_request",
      `Unknown fault name: ${options.fault}; use one of ${FAULT_NAMES.join(", ")}`,
      {
        param: "fault",
      },
    );
  }
  if (options.fault !== undefined && PREFIX_FAULTS.includes(options.fault))
    return prefixReport(options, options.fault);
  const { config, report } = resolveOptions(options);
  const model = new ModelWorld(config);
  const result = explore(model, {
    maxStates: report.bound.maxStates,
    ...(options.maxDepth === undefined ? {} : { maxDepth: options.maxDepth }),
    ...(options.timeLimitMs === undefined ? {} : { timeLimitMs: options.timeLimitMs }),
  });
  return { ...report, result };
}

function prefixReport(options: CheckOptions, fault: FaultName): CheckReport {
  // The prefix cache is checked by its own model (src/tools/check/prefix-model.ts).
  const { report } = resolveOptions({ ...options, fault: "early-free" });
  const disabledGuards = disabledGuardsOf(options, FAULT_SCENARIOS[fault]);
  return {
    ...report,
    fault,
    faults: [fault],
    disabledGuards,
    result: explorePrefixCache({
      faults: [fault],
      disabledGuards,
      tiers: TIER_FAULTS.includes(fault),
      ...(options.maxStates === undefined ? {} : { maxStates: options.maxStates }),
    }),
  };
}

/** The guards switched off: the scenario's (unless `keepGuards`), and those the options name. */
function disabledGuardsOf(options: CheckOptions, scenario: Scenario | null): GuardName[] {
  return [
    ...new Set([
      ...(options.keepGuards === true ? [] : (scenario?.disabledGuards ?? [])),
      ...(options.disabledGuards ?? []),
    ]),
  ];
}

function stripUndefined<T extends object>(o: T): Partial<T> {
  const out: Partial<T> = {};
  for (const k in o) if (o[k] !== undefined) out[k] = o[k];
  return out;
}

/** The report's line on what was explored: the prefix-cache model (with its tier) or the protocol's bound. */
function modelLine(report: CheckReport, prefixModel: boolean): string {
  const b = report.bound;
  if (prefixModel && TIER_FAULTS.includes(report.fault!))
    return "model: the prefix cache over a 4-page pool (page size 2) with a KV tier below it (evictions spill, verified loads promote back), two tenants, every order of three prompts' arrivals, finishes, aborts, evictions and loads, with the adversary's write to the tier (tier-corrupt, tier-planted) or a restart raising tenant 1's cache_epoch (stale-epoch)";
  if (prefixModel)
    return "model: the prefix cache over a 5-page pool (page size 2), two tenants, every order of three prompts' arrivals, finishes, aborts and evictions";
  return `bound: ${b.requests} requests${b.samples > 0 ? ` (the first with ${b.samples + 1} samples as one group)` : ""}${b.decodeCache ? " (a conversation's two turns and another tenant's copy of the second; decode keeps a prefix cache)" : ""}, decode pool ${b.pages} pages, prefill pool ${b.prefillPages} pages, page size 1, window ${b.maxModelLen}, ${b.maxAttempts} attempts, crashes ${b.crashes}, duplicates ${b.duplicates}, losses ${b.losses}, client aborts ${b.clientAborts ? "on" : "off"}, transfer timeouts ${b.timeouts ? "on" : "off"}, transport ${b.transport}, channels ${b.reorder ? "reordering" : "FIFO"}, routers ${b.routers}`;
}

/** The human-readable report. */
export function formatReport(report: CheckReport): string {
  const r = report.result;
  const lines: string[] = [];
  const prefixModel = report.fault !== null && PREFIX_FAULTS.includes(report.fault);
  lines.push(
    report.fault === null
      ? "kvfence check: the real protocol, every guard on"
      : `kvfence check: fault ${report.faults.join(" + ")}, guards off: ${report.disabledGuards.length === 0 ? "none" : report.disabledGuards.join(", ")}`,
  );
  lines.push(modelLine(report, prefixModel));
  lines.push(
    `explored ${r.states} states, ${r.transitions} transitions, depth ${r.depth}, in ${(r.elapsedMs / 1000).toFixed(1)} s${r.complete ? " (complete)" : r.counterexample === null ? " (stopped at the bound: incomplete)" : ""}`,
  );
  if (r.counterexample === null) {
    lines.push(
      r.complete
        ? prefixModel
          ? "all invariants hold (P1-P3 of docs/protocol.md §5a)"
          : "all invariants hold (1-5 of docs/design.md §7, and bounded liveness)"
        : "no violation found within the bound",
    );
    return lines.join("\n");
  }
  lines.push("", ...formatCounterexample(r.counterexample, !prefixModel));
  return lines.join("\n");
}

export function formatCounterexample(cex: Counterexample, legend = true): string[] {
  const v = cex.violation;
  const lines = [
    `VIOLATION of ${v.invariant === "liveness" ? "bounded liveness" : v.invariant === "bound" ? "bounded protocol state" : `invariant ${v.invariant}`}: ${v.message}`,
    `counterexample (${cex.steps.length} steps, shortest):`,
    `   0. initial state\n        ${cex.initialPools}`,
  ];
  cex.steps.forEach((s, i) => {
    lines.push(`  ${String(i + 1).padStart(2)}. ${s.event}\n        ${s.pools}`);
  });
  if (legend)
    lines.push(
      "   pages: F free, R reserved, Y ready, Q quarantined, S shared; :rR#E owner request R epoch E; (rR#E.I) the data held: page I of request R epoch E, - never written, ! corrupted",
    );
  return lines;
}

/** The counterexample as a Graphviz digraph: one node per state, one edge per event. */
export function counterexampleToDot(cex: Counterexample): string {
  const esc = (s: string) => s.replaceAll("\\", "\\\\").replaceAll('"', '\\"');
  const out = [
    "digraph counterexample {",
    '  rankdir=TB; node [shape=box, fontname="monospace", fontsize=10];',
  ];
  out.push(`  s0 [label="initial\\n${esc(cex.initialPools)}"];`);
  cex.steps.forEach((s, i) => {
    const last = i === cex.steps.length - 1;
    out.push(
      `  s${i + 1} [label="${esc(s.pools)}"${last ? `, color=red, xlabel="${esc(`violates ${cex.violation.invariant}`)}"` : ""}];`,
    );
    out.push(`  s${i} -> s${i + 1} [label="${esc(`${i + 1}. ${s.event}`)}"];`);
  });
  out.push(`  violation [shape=note, color=red, label="${esc(cex.violation.message)}"];`);
  out.push(`  s${cex.steps.length} -> violation [style=dashed, color=red];`);
  out.push("}");
  return out.join("\n");
}
