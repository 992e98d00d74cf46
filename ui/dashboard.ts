/**
 * The kvfence operator dashboard (served at /kvfence/ui, bundled by scripts/build-ui.mjs): polls
 * the router's `/kvfence/state` and draws each node's KV pool page by page (coloured by state,
 * each held page marked with its tenant's anonymous colour), the guard counters (a non-zero one
 * stands out), the queues, the per-phase latency percentiles, and charts of the KV transfer
 * throughput and the queue lengths. With an operator key, open the page as
 * `/kvfence/ui#key=OPERATOR_KEY` (the fragment never leaves the browser) or send the key as a
 * Bearer header; on the loopback operator listener no key is needed.
 */
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import "./dashboard.css";

interface Node {
  id: string;
  role: string;
  up: boolean;
  pages: { free: number; reserved: number; ready: number; quarantined: number; total: number } | null;
  page_map: { states: string; state_names: string[]; tenant_colours: number[] } | null;
  queue: { waiting: number; running: number } | null;
  transfer_bytes: number;
  guards: Record<string, number>;
}

interface State {
  time_ms: number;
  router: { waiting: number; in_flight: number };
  nodes: Node[];
  phases: { role: string; phase: string; count: number; p50_s: number; p90_s: number; p99_s: number }[];
  guards: Record<string, number>;
}

const STATE_COLOURS: Record<string, string> = {
  free: "#e8ecef",
  reserved: "#f2c14e",
  ready: "#3c8dbc",
  shared: "#7e57c2",
  quarantined: "#d9534f",
};
const TENANT_COLOURS = [
  "#1b9e77",
  "#d95f02",
  "#7570b3",
  "#e7298a",
  "#66a61e",
  "#e6ab02",
  "#a6761d",
  "#666666",
  "#17becf",
  "#8c564b",
  "#bcbd22",
  "#393b79",
];
const HISTORY = 120;

const params = new URLSearchParams(location.search);
const intervalMs = Math.max(100, Number(params.get("interval") ?? 1000));
const keyFromHash = /(?:^#|&)key=([^&]+)/.exec(location.hash)?.[1];
if (keyFromHash !== undefined) {
  sessionStorage.setItem("kvfence-operator-key", decodeURIComponent(keyFromHash));
  history.replaceState(null, "", location.pathname + location.search);
}
const operatorKey = sessionStorage.getItem("kvfence-operator-key");

const el = (id: string): HTMLElement => document.getElementById(id)!;

function seconds(s: number): string {
  if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(1)} ms`;
  return `${s.toFixed(2)} s`;
}

function renderGuards(guards: Record<string, number>): void {
  const box = el("guards");
  box.replaceChildren(
    ...Object.entries(guards).map(([name, count]) => {
      const div = document.createElement("div");
      div.className = count > 0 ? "guard fired" : "guard";
      div.dataset.guard = name;
      div.dataset.count = String(count);
      div.textContent = name.replace(/_/g, " ");
      const b = document.createElement("b");
      b.textContent = String(count);
      div.append(b);
      return div;
    }),
  );
}

function renderQueues(state: State): void {
  let waiting = state.router.waiting;
  let running = 0;
  for (const n of state.nodes) {
    waiting += n.queue?.waiting ?? 0;
    running += n.queue?.running ?? 0;
  }
  const items: [string, number][] = [
    ["in flight", state.router.in_flight],
    ["waiting at the router", state.router.waiting],
    ["waiting in the nodes", waiting - state.router.waiting],
    ["running", running],
  ];
  el("queues").replaceChildren(
    ...items.map(([label, value]) => {
      const span = document.createElement("span");
      span.dataset.queue = label;
      span.textContent = `${label}: ${value}`;
      return span;
    }),
  );
}

/** One node's card: the summary and a canvas with one square per page. */
function nodeCard(n: Node): HTMLElement {
  const card = document.createElement("section");
  card.className = n.up ? "node" : "node down";
  card.dataset.node = n.id;
  const h = document.createElement("h3");
  h.textContent = `${n.id} (${n.role})${n.up ? "" : " — not answering"}`;
  const summary = document.createElement("div");
  summary.className = "summary";
  card.append(h, summary);
  const pages = n.pages;
  if (pages !== null) {
    for (const [k, v] of Object.entries(pages)) card.dataset[k] = String(v);
    card.dataset.busy = String(pages.total - pages.free);
    summary.textContent = `${pages.total} pages: ${pages.free} free · ${pages.reserved} reserved · ${pages.ready} ready · ${pages.quarantined} quarantined`;
  }
  if (n.page_map !== null) card.append(pageCanvas(n.page_map));
  return card;
}

function pageCanvas(map: NonNullable<Node["page_map"]>): HTMLCanvasElement {
  const count = map.states.length;
  const columns = Math.min(64, Math.max(16, Math.ceil(Math.sqrt(count * 4))));
  const rows = Math.ceil(count / columns);
  const cell = 8;
  const canvas = document.createElement("canvas");
  canvas.width = columns * cell;
  canvas.height = rows * cell;
  const g = canvas.getContext("2d")!;
  for (let i = 0; i < count; i++) {
    const x = (i % columns) * cell;
    const y = Math.floor(i / columns) * cell;
    const state = map.state_names[Number(map.states[i])] ?? "free";
    g.fillStyle = STATE_COLOURS[state] ?? "#000";
    g.fillRect(x, y, cell - 1, cell - 1);
    const tenant = map.tenant_colours[i] ?? 0;
    if (tenant > 0) {
      g.fillStyle = TENANT_COLOURS[(tenant - 1) % TENANT_COLOURS.length]!;
      g.fillRect(x + 2, y + 2, cell - 5, cell - 5);
    }
  }
  return canvas;
}

function renderPhases(phases: State["phases"]): void {
  const body = el("phases").querySelector("tbody")!;
  body.replaceChildren(
    ...phases.map((p) => {
      const tr = document.createElement("tr");
      tr.dataset.phase = `${p.role}/${p.phase}`;
      for (const text of [p.role, p.phase, String(p.count), seconds(p.p50_s), seconds(p.p90_s), seconds(p.p99_s)]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.append(td);
      }
      return tr;
    }),
  );
}

function legend(): void {
  el("legend").replaceChildren(
    ...Object.entries(STATE_COLOURS).map(([name, colour]) => {
      const span = document.createElement("span");
      const i = document.createElement("i");
      i.style.background = colour;
      span.append(i, name);
      return span;
    }),
  );
}

/** The two charts over the last HISTORY polls. */
class Charts {
  readonly #times: number[] = [];
  readonly #mbps: number[] = [];
  readonly #waiting: number[] = [];
  readonly #running: number[] = [];
  #last: { time: number; bytes: number } | null = null;
  readonly #transfer: uPlot;
  readonly #queue: uPlot;

  constructor() {
    const width = Math.max(320, el("charts-panel").clientWidth - 40);
    const opts = (title: string, series: uPlot.Series[]): uPlot.Options => ({
      title,
      width,
      height: 160,
      series: [{}, ...series],
      axes: [{}, { size: 60 }],
    });
    this.#transfer = new uPlot(
      opts("KV transfer (MB/s)", [{ label: "MB/s", stroke: "#3c8dbc", fill: "rgba(60,141,188,0.15)" }]),
      [[], []],
      el("chart-transfer"),
    );
    this.#queue = new uPlot(
      opts("Requests", [
        { label: "waiting", stroke: "#f2c14e" },
        { label: "running", stroke: "#1b9e77" },
      ]),
      [[], [], []],
      el("chart-queue"),
    );
  }

  add(state: State): void {
    const time = state.time_ms / 1000;
    let bytes = 0;
    let waiting = state.router.waiting;
    let running = 0;
    for (const n of state.nodes) {
      if (n.role === "decode") bytes += n.transfer_bytes;
      waiting += n.queue?.waiting ?? 0;
      running += n.queue?.running ?? 0;
    }
    const last = this.#last;
    this.#last = { time, bytes };
    if (last === null || time <= last.time) return;
    this.#times.push(time);
    this.#mbps.push(Math.max(0, bytes - last.bytes) / (time - last.time) / 1e6);
    this.#waiting.push(waiting);
    this.#running.push(running);
    for (const a of [this.#times, this.#mbps, this.#waiting, this.#running]) if (a.length > HISTORY) a.shift();
    this.#transfer.setData([this.#times, this.#mbps]);
    this.#queue.setData([this.#times, this.#waiting, this.#running]);
  }
}

async function poll(charts: Charts): Promise<void> {
  const status = el("status");
  try {
    const res = await fetch("/kvfence/state", {
      headers: operatorKey === null ? {} : { authorization: `Bearer ${operatorKey}` },
      cache: "no-store",
    });
    if (!res.ok) throw new Error(`/kvfence/state answered ${res.status}`);
    const state = (await res.json()) as State;
    renderGuards(state.guards);
    renderQueues(state);
    el("nodes").replaceChildren(...state.nodes.map(nodeCard));
    renderPhases(state.phases);
    charts.add(state);
    status.className = "status";
    status.textContent = `updated ${new Date(state.time_ms).toLocaleTimeString()}`;
    document.body.dataset.updates = String(Number(document.body.dataset.updates ?? 0) + 1);
  } catch (err) {
    status.className = "status error";
    status.textContent = err instanceof Error ? err.message : String(err);
  }
}

function start(): void {
  legend();
  const charts = new Charts();
  let running = false;
  const tick = async () => {
    if (running) return;
    running = true;
    await poll(charts);
    running = false;
  };
  void tick();
  setInterval(() => void tick(), intervalMs);
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
