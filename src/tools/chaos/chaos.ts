/**
 * `kvfence chaos`: a chaos campaign on network-namespace hosts (docs/topologies.md, "Chaos
 * campaign"). It starts etcd, the routers and the prefill and decode node processes each on a host
 * of its own (./chaos-cluster.ts), computes every prompt's greedy answer on one engine apart from
 * the cluster (`--no-disaggregation`, with no fault: the reference), then runs the
 * two tenants' canary workload (./workload.ts) for the duration while injecting the faults planned
 * from the seed (./faults.ts). Then the workload drains, every node must be back (up and a member
 * on every router), and the checks: no leak (no output of one tenant holds a code the other
 * planted), no wrong 200, no page lost (every node's pages FREE on every router: none reserved,
 * ready or quarantined), and at least `minCompleted` of the requests completed. The report lists
 * every injected fault with its time and target.
 */
import type { NodePages } from "./chaos-cluster.js";
import { ChaosCluster } from "./chaos-cluster.js";
import { type FaultKind, type InjectedFault, inject, type PlannedFault, planFaults } from "./faults.js";
import { buildWorkload, canariesRepeated, drive, type RequestRecord, reference } from "./workload.js";

export interface ChaosOptions {
  readonly seed: number;
  readonly durationS: number;
  readonly routers: number;
  readonly prefill: number;
  readonly decode: number;
  readonly model: string;
  readonly kvPages: number;
  /** More `kvfence serve` flags for every node and for every router. */
  readonly nodeArgs: readonly string[];
  readonly routerArgs: readonly string[];
  /** Requests in flight at once. */
  readonly concurrency: number;
  readonly maxTokens: number;
  /** max_tokens of the long requests (a sixth of all, `ignore_eos`). */
  readonly longTokens: number;
  /** The kinds of fault to inject. */
  readonly faultKinds: readonly FaultKind[];
  /** Mean gap between faults (s). */
  readonly faultGapS: number;
  /** Fraction of requests that must complete (default 0.99). */
  readonly minCompleted: number;
  readonly progress: (line: string) => void;
}

export interface ChaosCheck {
  readonly name: string;
  readonly ok: boolean;
  readonly detail: string;
}

export interface ChaosResult {
  readonly options: Omit<ChaosOptions, "progress">;
  readonly startupMs: number;
  readonly faults: InjectedFault[];
  readonly planned: PlannedFault[];
  readonly requests: {
    readonly sent: number;
    readonly completed: number;
    readonly wrong: number;
    readonly failed: number;
    readonly leaks: number;
    readonly byStatus: Record<string, number>;
  };
  /** Per router, each node's pages by state at the end. */
  readonly pages: NodePages[][];
  readonly recovered: boolean;
  /** Canary prompts whose fault-free answer restates the code asked for (the leak check can see). */
  readonly canaries: { readonly repeated: number; readonly canaries: number };
  readonly checks: ChaosCheck[];
  readonly ok: boolean;
  readonly records: RequestRecord[];
  /** Each prompt's fault-free greedy answer. */
  readonly references: Record<string, string>;
}

const KEYS = ["sk-chaos-tenant-alpha-0001", "sk-chaos-tenant-bravo-0002"] as const;

export async function runChaos(o: ChaosOptions): Promise<ChaosResult> {
  const t0 = Date.now();
  o.progress(`starting etcd, ${o.routers} routers, ${o.prefill} prefill and ${o.decode} decode nodes`);
  const cluster = await ChaosCluster.start({
    routers: o.routers,
    prefill: o.prefill,
    decode: o.decode,
    model: o.model,
    kvPages: o.kvPages,
    nodeArgs: o.nodeArgs,
    routerArgs: o.routerArgs,
    keys: { [KEYS[0]]: "alpha", [KEYS[1]]: "bravo" },
  });
  try {
    const startupMs = Date.now() - t0;
    o.progress(`cluster serving in ${(startupMs / 1000).toFixed(1)} s; reference answers from one engine`);
    const model = await cluster.modelId();
    const w = buildWorkload({
      seed: o.seed,
      keys: KEYS,
      canaries: 6,
      plain: 4,
      long: 2,
      longTokens: o.longTokens,
      maxTokens: o.maxTokens,
      model,
    });
    const engine = await cluster.startReferenceEngine();
    try {
      await reference(w, engine.url, o.concurrency);
    } finally {
      await engine.stop();
    }
    const durationMs = o.durationS * 1000;
    const planned = planFaults({
      seed: o.seed,
      durationMs,
      gapMs: o.faultGapS * 1000,
      kinds: o.faultKinds,
      targets: cluster.nodes,
    });
    o.progress(`${w.prompts.length} prompts; ${planned.length} faults over ${o.durationS} s`);
    const startMs = Date.now();
    const over = () => Date.now() - startMs >= durationMs;
    const [records, faults] = await Promise.all([
      drive(w, {
        urls: cluster.routerUrls,
        seed: o.seed,
        concurrency: o.concurrency,
        timeoutMs: 120_000,
        until: over,
        startMs,
      }),
      inject(cluster, planned, {
        startMs,
        stopped: over,
        log: (f) =>
          o.progress(
            `t=${(f.atMs / 1000).toFixed(1)}s ${f.kind} ${f.target} ${f.holdMs} ms${f.error ? ` (failed: ${f.error})` : ""}`,
          ),
      }),
    ]);
    o.progress(`workload drained: ${records.length} requests; waiting for every node on every router`);
    const recovered = await cluster.allServing(60_000);
    const pages = await pagesWhenIdle(cluster, 30_000);
    const references = Object.fromEntries(w.reference);
    const canaries = canariesRepeated(w);
    return judge(o, {
      startupMs,
      faults,
      planned,
      records,
      pages,
      recovered,
      references,
      canaries,
      nodes: cluster.nodes.length,
    });
  } finally {
    await cluster.stop();
  }
}

const LOST_STATES = ["reserved", "ready", "quarantined"];

function lostPages(p: NodePages): number {
  return LOST_STATES.reduce((n, s) => n + (p.pages[s] ?? 0), 0);
}

/** Each router's node pages, polled until none is held (or the deadline: then as they are). */
async function pagesWhenIdle(cluster: ChaosCluster, timeoutMs: number): Promise<NodePages[][]> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const pages = await Promise.all(cluster.routerUrls.map((u) => cluster.nodePages(u).catch(() => [])));
    const held = pages.flat().reduce((n, p) => n + lostPages(p), 0);
    if ((held === 0 && pages.every((l) => l.length > 0)) || Date.now() > deadline) return pages;
    await new Promise((r) => setTimeout(r, 250));
  }
}

function judge(
  o: ChaosOptions,
  run: {
    startupMs: number;
    faults: InjectedFault[];
    planned: PlannedFault[];
    records: RequestRecord[];
    pages: NodePages[][];
    recovered: boolean;
    references: Record<string, string>;
    canaries: { repeated: number; canaries: number };
    nodes: number;
  },
): ChaosResult {
  const { records, pages } = run;
  const count = (outcome: RequestRecord["outcome"]) => records.filter((r) => r.outcome === outcome).length;
  const byStatus: Record<string, number> = {};
  for (const r of records) {
    const key = r.status === 200 && r.outcome === "failed" ? "200+error event" : String(r.status);
    byStatus[key] = (byStatus[key] ?? 0) + 1;
  }
  const requests = {
    sent: records.length,
    completed: count("completed"),
    wrong: count("wrong"),
    failed: count("failed"),
    leaks: records.filter((r) => r.leaked.length > 0).length,
    byStatus,
  };
  const lost = pages.flat().reduce((n, p) => n + lostPages(p), 0);
  const fraction = requests.sent === 0 ? 0 : requests.completed / requests.sent;
  const failedFaults = run.faults.filter((f) => f.error !== undefined);
  const checks: ChaosCheck[] = [
    {
      name: "canaries visible",
      ok: run.canaries.repeated * 2 >= run.canaries.canaries,
      detail: `${run.canaries.repeated}/${run.canaries.canaries} canary answers restate their code (a leak would show)`,
    },
    {
      name: "no leak",
      ok: requests.leaks === 0,
      detail: `${requests.leaks} outputs with the other tenant's codes`,
    },
    {
      name: "no wrong 200",
      ok: requests.wrong === 0,
      detail: `${requests.wrong} answers unlike the fault-free one`,
    },
    {
      name: "no page lost",
      ok: lost === 0 && pages.every((l) => l.length === run.nodes),
      detail: `${lost} pages reserved, ready or quarantined at the end; ${pages.map((l) => l.length).join("/")} nodes reported per router`,
    },
    {
      name: "completed",
      ok: fraction >= o.minCompleted && requests.sent > 0,
      detail: `${requests.completed}/${requests.sent} = ${(100 * fraction).toFixed(2)}% (at least ${100 * o.minCompleted}%)`,
    },
    { name: "every node back", ok: run.recovered, detail: "every router lists every node up and a member" },
    {
      name: "every fault injected",
      ok: failedFaults.length === 0 && run.faults.length > 0,
      detail: `${run.faults.length} of ${run.planned.length} planned; ${failedFaults.length} failed to inject`,
    },
  ];
  const { progress: _, ...options } = o;
  const { nodes: _nodes, ...recorded } = run;
  return { options, ...recorded, requests, checks, ok: checks.every((c) => c.ok) };
}

/** The human report: the faults (time, kind, target, hold), the requests, the checks. */
export function formatChaos(r: ChaosResult): string {
  const lines = [
    `kvfence chaos --seed ${r.options.seed} --duration ${r.options.durationS}: ${r.options.routers} routers, ` +
      `${r.options.prefill} prefill + ${r.options.decode} decode nodes, etcd, each on its own netns host`,
    `faults injected (${r.faults.length}):`,
    ...r.faults.map(
      (f) =>
        `  t=${(f.atMs / 1000).toFixed(1).padStart(6)}s ${f.kind.padEnd(9)} ${f.target.padEnd(10)} ` +
        `held ${f.holdMs} ms, over at t=${(f.endMs / 1000).toFixed(1)}s${f.error ? ` FAILED: ${f.error}` : ""}`,
    ),
    `requests: ${r.requests.sent} sent, ${r.requests.completed} completed, ${r.requests.wrong} wrong, ` +
      `${r.requests.failed} failed (${Object.entries(r.requests.byStatus)
        .map(([s, n]) => `${s}: ${n}`)
        .join(", ")})`,
    ...r.checks.map((c) => `${c.ok ? "PASS" : "FAIL"} ${c.name}: ${c.detail}`),
    r.ok ? "chaos: every check passed" : "chaos: a check failed",
  ];
  return `${lines.join("\n")}\n`;
}
