/**
 * The operator's live dashboard (docs/api.md, "Dashboard"): `/kvfence/ui` serves the page built
 * from `ui/` at build time (`scripts/build-ui.mjs`: esbuild bundles `ui/dashboard.ts` with uPlot
 * into `dist/ui/`; no CDN, nothing fetched from elsewhere), and `/kvfence/state` the JSON it
 * polls: each node's KV pool page by page (state, and the page's tenant as an anonymous colour
 * index), its queue and guard counters, the transfer bytes so far (the page derives throughput),
 * and the per-phase latency percentiles by role. Both are operator endpoints, guarded like
 * /metrics: the operator key, or the loopback operator listener.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { packageRoot } from "../lib/package-root.js";
import { addSnapshots, PHASES, type PhaseSnapshot, phasePercentiles } from "../lib/phase-histograms.js";
import type { EngineHandle, EngineStats, NodeView } from "../protocol/engine-api.js";

/**
 * A /kvfence/state snapshot younger than this is served again (ms): several dashboards open, or a
 * page polling faster than its 1 s default, cost the nodes one poll per this interval.
 */
export const STATE_REUSE_MS = 250;

/** Colours the page offers tenants (index 1..TENANT_COLOURS; 0 is a free page). */
export const TENANT_COLOURS = 12;

export interface DashboardNode {
  readonly id: string;
  readonly role: string;
  readonly up: boolean;
  readonly pages: EngineStats["pages"] | null;
  readonly page_map: {
    readonly states: string;
    readonly state_names: readonly string[];
    readonly tenant_colours: number[];
  } | null;
  readonly queue: { readonly waiting: number; readonly running: number } | null;
  readonly transfer_bytes: number;
  readonly guards: Readonly<Record<string, number>>;
}

export interface DashboardPhase {
  readonly role: string;
  readonly phase: string;
  readonly count: number;
  readonly mean_s: number;
  readonly p50_s: number;
  readonly p90_s: number;
  readonly p99_s: number;
}

/** The body of `/kvfence/state`. */
export interface DashboardState {
  readonly time_ms: number;
  readonly router: { readonly waiting: number; readonly in_flight: number };
  readonly nodes: readonly DashboardNode[];
  readonly phases: readonly DashboardPhase[];
  /** Every guard counter summed over the nodes: a non-zero one is a guard that fired. */
  readonly guards: Readonly<Record<string, number>>;
}

/** A tenant's colour index (1..TENANT_COLOURS) from its opaque label: stable, and says nothing of its name. */
export function tenantColour(opaqueLabel: string): number {
  let h = 2166136261;
  for (let i = 0; i < opaqueLabel.length; i++) h = Math.imul(h ^ opaqueLabel.charCodeAt(i), 16777619);
  return ((h >>> 0) % TENANT_COLOURS) + 1;
}

/** The dashboard's state of `engine` now; `colourOf` maps an engine tenant index to its colour. */
export async function dashboardState(
  engine: EngineHandle,
  colourOf: (tenant: number) => number,
  inFlight: number,
): Promise<DashboardState> {
  let views: readonly NodeView[];
  let routerPhases: PhaseSnapshot | null = null;
  let waiting: number;
  if (engine.nodeViews !== undefined) {
    const all = await engine.nodeViews();
    views = all.nodes;
    routerPhases = all.routerPhases;
    waiting = all.waiting;
  } else {
    const stats = await engine.stats();
    views = [
      { id: "engine", role: "engine", up: true, stats, transferBytes: 0, guards: engineGuards(stats) },
    ];
    waiting = stats.queue.waiting;
  }
  const nodes = views.map((v) => nodeOf(v, colourOf));
  const byRole = new Map<string, PhaseSnapshot[]>();
  if (routerPhases !== null) byRole.set("router", [routerPhases]);
  for (const v of views) {
    if (v.stats?.phases === undefined) continue;
    byRole.set(v.role, [...(byRole.get(v.role) ?? []), v.stats.phases]);
  }
  const guards: Record<string, number> = {};
  for (const n of nodes) for (const [k, c] of Object.entries(n.guards)) guards[k] = (guards[k] ?? 0) + c;
  return {
    time_ms: Date.now(),
    router: { waiting, in_flight: inFlight },
    nodes,
    phases: phasesOf(byRole),
    guards,
  };
}

function engineGuards(stats: EngineStats): Record<string, number> {
  return { tag_check_failures: stats.counters.tagCheckFailures };
}

function nodeOf(v: NodeView, colourOf: (tenant: number) => number): DashboardNode {
  const s = v.stats;
  const map = s?.pageMap;
  return {
    id: v.id,
    role: v.role,
    up: v.up,
    pages: s?.pages ?? null,
    page_map:
      map === undefined
        ? null
        : {
            states: map.states,
            state_names: map.stateNames.map((n) => n.toLowerCase()),
            tenant_colours: map.tenants.map((t, i) => (map.states[i] === "0" ? 0 : colourOf(t))),
          },
    queue: s === null ? null : { waiting: s.queue.waiting, running: s.queue.running },
    transfer_bytes: v.transferBytes,
    guards: v.guards,
  };
}

function phasesOf(byRole: ReadonlyMap<string, PhaseSnapshot[]>): DashboardPhase[] {
  const out: DashboardPhase[] = [];
  for (const [role, snapshots] of byRole) {
    const sum = addSnapshots(snapshots);
    for (const phase of PHASES) {
      const { count, mean, quantiles } = phasePercentiles(sum, phase, [0.5, 0.9, 0.99]);
      if (count === 0) continue;
      out.push({
        role,
        phase,
        count,
        mean_s: mean,
        p50_s: quantiles[0]!,
        p90_s: quantiles[1]!,
        p99_s: quantiles[2]!,
      });
    }
  }
  return out;
}

/** The page's files in `dist/ui/`, by the name it is asked for under /kvfence/ui/. */
const ASSETS: Readonly<Record<string, { readonly file: string; readonly type: string }>> = {
  "": { file: "index.html", type: "text/html; charset=utf-8" },
  "dashboard.js": { file: "dashboard.js", type: "text/javascript; charset=utf-8" },
  "dashboard.css": { file: "dashboard.css", type: "text/css; charset=utf-8" },
};

const assetCache = new Map<string, Buffer>();

/** A file of the dashboard (`name`: "" for the page), or null when there is no such file or it was not built. */
export function dashboardAsset(name: string): { readonly body: Buffer; readonly type: string } | null {
  const asset = ASSETS[name];
  if (asset === undefined) return null;
  let body = assetCache.get(asset.file);
  if (body === undefined) {
    try {
      body = readFileSync(join(packageRoot(), "dist", "ui", asset.file));
    } catch {
      return null;
    }
    assetCache.set(asset.file, body);
  }
  return { body, type: asset.type };
}

/** The page's own headers: nothing loads from anywhere else, nothing is cached, no framing. */
export const DASHBOARD_HEADERS: Readonly<Record<string, string>> = {
  "Content-Security-Policy":
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
  "Cache-Control": "no-store",
  "X-Content-Type-Options": "nosniff",
};
