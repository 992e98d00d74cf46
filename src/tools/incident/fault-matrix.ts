/**
 * The fault × guard matrix (docs/design.md §5): each fault, run on a real server (threaded topology,
 * real model, real HTTP), first with the guards that catch it switched off — the bug must show: a
 * wrong HTTP 200 (to an over-limit prompt, or over a transfer that was corrupted or misaddressed)
 * or one tenant's code in another's answer — and then with each of those guards alone switched on,
 * where the fault must be caught: the client gets a 4xx or 5xx, never a 200, and a guard counter
 * in /metrics goes up.
 *
 * Each cell plants tenant A's access codes first (their KV lands in the decode pool, whose pages
 * are not zeroed on free), then sends tenant B's request and classifies the answer. The prefix-cache
 * rows (`victim: "prefix"`) plant A's prompts in the cache and show the bug as B's request served
 * from A's cached pages (`usage.prompt_tokens_details.cached_tokens` > 0); the key guards catch it
 * as a miss (`tenant-salt`: B's keys differ; `prefix-tokens`: the stored tokens differ, counted in
 * `kvfence_prefix_cache_collisions_total`), the page tags as a 500. `renderMatrix` turns the
 * outcomes into `docs/fault-matrix.md`.
 */
import { randomBytes } from "node:crypto";
import { FAULT_TABLE, type FaultName, type GuardName } from "../../protocol/safety.js";
import { GUARD_COUNTERS, metricSum, startIncidentServer } from "./incident.js";
import {
  A_ACCOUNTS,
  A_CODES,
  type CellOutcome,
  type ChatResult,
  chat,
  plantPrompt,
  recordText,
  victimPrompt,
} from "./matrix-chat.js";
import { tierCell } from "./tier-cells.js";

export type { CellOutcome } from "./matrix-chat.js";

export interface MatrixScenario {
  /** The fault the row is about. */
  readonly fault: FaultName;
  /** Every fault switched on for it (the incident's placeholder needs the undersized-pool router). */
  readonly faults: readonly FaultName[];
  /** The guards that catch it in this topology, each tried alone. */
  readonly guards: readonly GuardName[];
  /** Prefill pool smaller than the window (the incident's shape). */
  readonly undersizedPrefill: boolean;
  /**
   * B's prompt: over the prefill pool (under the window), an ordinary one, one aborted, or (the
   * prefix cache) A's own prompt (`shared-prefix`) or B's own after A's plants (`prefix-collision`).
   */
  readonly victim: "over-pool" | "ordinary" | "aborted" | "prefix" | "tier";
  /** Worker threads + shared memory, node processes + TCP (where the guard is TCP-only), or one engine. */
  readonly topology: "threads" | "tcp" | "single";
}

/** The incident's row, run over worker threads and again over node processes and TCP. */
const INCIDENT: Omit<MatrixScenario, "topology"> = {
  fault: "placeholder-reject",
  faults: ["undersized-pool", "placeholder-reject"],
  guards: ["admission-doors", "coverage", "checksum", "page-tags"],
  undersizedPrefill: true,
  victim: "over-pool",
};

export const MATRIX_SCENARIOS: readonly MatrixScenario[] = [
  { ...INCIDENT, topology: "threads" },
  { ...INCIDENT, topology: "tcp" },
  {
    fault: "undersized-pool",
    faults: ["undersized-pool"],
    guards: ["admission-doors"],
    undersizedPrefill: true,
    victim: "over-pool",
    topology: "threads",
  },
  {
    fault: "corrupt-transfer",
    faults: ["corrupt-transfer"],
    guards: ["checksum"],
    undersizedPrefill: false,
    victim: "ordinary",
    topology: "threads",
  },
  {
    fault: "misaddressed-write",
    faults: ["misaddressed-write"],
    guards: ["checksum", "page-tags"],
    undersizedPrefill: false,
    victim: "ordinary",
    topology: "threads",
  },
  {
    // A client aborts while prefill computes; the lost ack leaves decode's pages quarantined.
    fault: "drop-abort-ack",
    faults: ["drop-abort-ack"],
    guards: ["quarantine"],
    undersizedPrefill: false,
    victim: "aborted",
    topology: "threads",
  },
  {
    // Over TCP the receiver's lease check (the decode machine's leased page) stops it too.
    fault: "misaddressed-write",
    faults: ["misaddressed-write"],
    guards: ["lease-check", "checksum", "page-tags"],
    undersizedPrefill: false,
    victim: "ordinary",
    topology: "tcp",
  },
  {
    // B sends A's prompt; with the salt from the client alone both tenants share its keys.
    fault: "shared-prefix",
    faults: ["shared-prefix"],
    guards: ["tenant-salt", "page-tags"],
    undersizedPrefill: false,
    victim: "prefix",
    topology: "single",
  },
  {
    // Keys cut to 2 bits: B's own prompt's keys collide with A's cached pages.
    fault: "prefix-collision",
    faults: ["prefix-collision"],
    guards: ["prefix-tokens", "page-tags"],
    undersizedPrefill: false,
    victim: "prefix",
    topology: "single",
  },
  // The KV tier rows (tier-cells.ts): B's pages spilled to a disk tier, the directory written
  // between two runs of the node (or, for spill-race, the spill itself wrong), B's prompt again.
  ...(["tier-corrupt", "tier-planted", "stale-epoch", "spill-race"] as const).map((fault) => ({
    fault,
    faults: [fault],
    guards: FAULT_TABLE[fault].caughtBy,
    undersizedPrefill: false,
    victim: "tier" as const,
    topology: "single" as const,
  })),
];

/** Faults of docs/design.md §5 this matrix does not run end to end, and why (see `kvfence check`). */
export const NOT_IN_MATRIX: Readonly<Partial<Record<FaultName, string>>> = {
  "early-free":
    "needs an abort to overtake an in-flight write; shared-memory writes finish within one event-loop turn, so the window is not reachable deterministically over HTTP — `kvfence check --fault early-free` shows the trace",
  "late-write":
    "same window as early-free (plus the TCP receiver lease check); `kvfence check --fault late-write [--transport tcp]`",
  "stale-commit":
    "needs a retried attempt (a second epoch); the servers run one attempt per request; `kvfence check --fault stale-commit`",
  "held-unpinned":
    "needs another request's reservation to evict a held page between decode's reserve and its commit; over HTTP that race is not reachable deterministically — `kvfence check --fault held-unpinned` shows the trace, `src/protocol/decode-held.test.ts` runs it on the real decode machine with each guard",
};

async function guardCounterSum(metrics: () => Promise<Map<string, number>>): Promise<number> {
  const m = await metrics();
  let sum = 0;
  for (const name of GUARD_COUNTERS) sum += metricSum(m, name);
  return sum;
}

/** Polls the server's metrics until a decode node holds reserved pages (or `timeoutMs` passes). */
async function untilDecodeReserved(server: IncidentServer, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    for (const [key, value] of await server.metrics()) {
      if (
        key.startsWith("kvfence_node_kv_pages{") &&
        key.includes('role="decode"') &&
        key.includes('state="reserved"') &&
        value > 0
      )
        return;
    }
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/**
 * Tenant A sends a long prompt of its own and aborts it while prefill computes it (about 0.6 s
 * here): once decode has reserved its pages (so the abort finds a lease to quarantine), not at a
 * fixed time, which a loaded machine's queueing and tokenization would overrun. Returns the HTTP
 * status (0: the client's abort) and the milliseconds from the request to the abort.
 */
async function abortDuringPrefill(server: IncidentServer): Promise<{ status: number; waited: number }> {
  const controller = new AbortController();
  // A prompt of its own from its first token: no page of it can be in the prefix cache (a hit
  // would compute it in a few milliseconds, before any abort).
  const nonce = randomBytes(6).toString("hex");
  const content = `case ${nonce}: ${`${recordText(A_ACCOUNTS[0]!, A_CODES[0]!)} `.repeat(21)}`;
  const sent = fetch(`${server.url}/v1/chat/completions`, {
    method: "POST",
    signal: controller.signal,
    headers: { "content-type": "application/json", authorization: `Bearer ${server.keyA}` },
    body: JSON.stringify({
      model: "kvfence-tiny",
      messages: [{ role: "user", content }],
      max_tokens: 8,
      temperature: 0,
      stream: true,
    }),
  }).then(
    (res) => res.status,
    () => 0,
  );
  const t0 = Date.now();
  await untilDecodeReserved(server, 10_000);
  const waited = Date.now() - t0;
  controller.abort();
  return { status: await sent, waited };
}

/**
 * The `aborted` victim: A sends a long prompt and disconnects while prefill computes it; decode
 * quarantines the leased pages and relays the abort; the fault drops prefill's ABORT_ACK. With the
 * quarantine guard the pages stay quarantined (no ack, writer alive); without it a timer releases
 * them — while the writer never acknowledged that its writes drained.
 */
async function abortedCell(cell: Cell, server: IncidentServer): Promise<CellOutcome> {
  const { guardOn } = cell;
  const quarantinedNow = async () => metricSum(await server.metrics(), "kvfence_quarantined_pages");
  // The abort must overtake the transfer, or there is no lease to quarantine: where it did not
  // (no page quarantined right after it), the race is run again, up to 5 times. A node that never
  // quarantines still fails: no race shows a quarantined page. (Retrying only where decode's
  // commit count rose missed a lost race on a fast boot: the count had not risen by then.)
  let status = 0;
  let early = 0;
  let waited = 0;
  let races = 0;
  while (races < 5 && early === 0) {
    races++;
    ({ status, waited } = await abortDuringPrefill(server));
    // Right after the abort (within 1 s, before the 2 s release timer of a server without the
    // guard) the leased pages are quarantined: the abort really overtook the transfer. Scraped until
    // seen: on a loaded machine one scrape may come before the nodes' stats do.
    for (const until = Date.now() + 1000; early === 0 && Date.now() < until; ) {
      early = await quarantinedNow();
      if (early === 0) await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }
  // Past the release timer of a server without the quarantine guard (QUARANTINE_TIMEOUT_MS, 2 s).
  await new Promise((resolve) => setTimeout(resolve, 3500));
  const expect = guardOn === null ? "bug shows" : "caught";
  // Three scrapes 300 ms apart, the one that speaks for the guard taken (the most pages still
  // quarantined when it should hold them, the fewest when the bug releases them).
  const scrapes: number[] = [];
  for (let i = 0; i < 3; i++) {
    if (i > 0) await new Promise((resolve) => setTimeout(resolve, 300));
    scrapes.push(await quarantinedNow());
  }
  const quarantined = expect === "caught" ? Math.max(...scrapes) : Math.min(...scrapes);
  const acks = metricSum(await server.metrics(), "kvfence_abort_ack_latency_seconds_count");
  const ok =
    status !== 200 &&
    early > 0 &&
    acks === 0 &&
    (expect === "bug shows" ? quarantined === 0 : quarantined > 0);
  return {
    ...cellOf(cell, expect),
    status,
    errorCode: status === 0 ? "client aborted" : null,
    promptTokensReported: null,
    leakedCode: false,
    answer: "",
    guardCounterDelta: quarantined,
    differsFromBaseline: null,
    symptom:
      expect === "bug shows"
        ? `no ABORT_ACK, yet the ${early} quarantined pages were released by a timer (${quarantined} left) while prefill is alive (race ${races})`
        : `no ABORT_ACK: ${quarantined} pages stay quarantined (kvfence_quarantined_pages) until the ack or a fence (right after the abort ${early}; the abort ${waited} ms after the request, race ${races}; HTTP ${status}; scrapes ${scrapes.join("/")})`,
    caughtAsMiss: false,
    ok,
  };
}

/**
 * The prefix-cache victim: A plants its prompts (each twice, so they are cached and hit), then B
 * sends A's first prompt (`shared-prefix`) or its own (`prefix-collision`). The bug: B's answer is
 * computed from A's cached pages (cached_tokens > 0, HTTP 200). Caught: a miss (cached_tokens 0;
 * for `prefix-tokens` with the collision counted) or a 500 from the page tags.
 */
async function prefixCell(cell: Cell, server: IncidentServer, baseline: string | null): Promise<CellOutcome> {
  const { scenario, guardOn } = cell;
  for (let i = 0; i < 3; i++) await chat(server.url, server.keyA, plantPrompt(i, 400));
  const before = await guardCounterSum(() => server.metrics());
  const shared = scenario.fault === "shared-prefix";
  const b = await chat(server.url, server.keyB, shared ? plantPrompt(0, 400) : victimPrompt(200));
  const delta = (await guardCounterSum(() => server.metrics())) - before;
  const crossHit = (b.cachedTokens ?? 0) > 0;
  const differs = shared || baseline === null || b.status !== 200 ? null : b.content !== baseline;
  const expect = guardOn === null ? "bug shows" : "caught";
  const missed = b.status === 200 && b.cachedTokens === 0;
  const caughtAsMiss = expect === "caught" && missed;
  let ok: boolean;
  let symptom: string;
  if (expect === "bug shows") {
    ok = b.status === 200 && crossHit && delta === 0;
    symptom = `HTTP 200 with ${b.cachedTokens} prompt tokens served from tenant A's cached pages${differs === true ? "; answer differs from its isolated baseline" : ""}`;
  } else if (guardOn === "page-tags") {
    ok = b.status >= 400 && delta > 0;
    symptom = `HTTP ${b.status} ${b.errorCode ?? ""}, guard counters +${delta}`;
  } else {
    // The key guards make it a miss: nothing of A's is reused (a collision is counted).
    ok = missed && (guardOn !== "prefix-tokens" || delta > 0);
    symptom = `a miss: HTTP ${b.status}, cached_tokens ${b.cachedTokens}${guardOn === "prefix-tokens" ? `, ${delta} collisions counted` : ", B's keys differ from A's"}`;
  }
  return {
    ...cellOf(cell, expect),
    status: b.status,
    errorCode: b.errorCode,
    promptTokensReported: b.promptTokens,
    leakedCode: expect === "caught" && crossHit,
    answer: b.status === 200 ? b.content.slice(0, 40) : "",
    guardCounterDelta: delta,
    differsFromBaseline: differs,
    symptom,
    caughtAsMiss,
    ok,
  };
}

/** Runs one cell: the scenario with `guardOn` alone on (null: all its guards off). */
export async function runCell(
  scenario: MatrixScenario,
  guardOn: GuardName | null,
  options: {
    readonly model?: string;
    readonly baseline?: string | null;
    /** TLS flags for the processes of a TCP row (docs/tls.md). */
    readonly linkTlsArgs?: readonly string[];
  } = {},
): Promise<CellOutcome> {
  const disabledGuards = scenario.guards.filter((g) => g !== guardOn);
  if (scenario.victim === "tier") {
    const outcome = await tierCell(scenario.fault, guardOn, disabledGuards, options.model);
    return { ...cellOf({ scenario, guardOn, disabledGuards }, outcome.expect), ...outcome };
  }
  const server = await startIncidentServer({
    ...(options.model === undefined ? {} : { model: options.model }),
    faults: scenario.faults,
    disabledGuards,
    undersizedPrefill: scenario.undersizedPrefill,
    topology: scenario.topology,
    ...(options.linkTlsArgs === undefined ? {} : { linkTlsArgs: options.linkTlsArgs }),
    // The aborted victim disconnects while prefill computes: the plain TypeScript kernels keep
    // that computation long (over a second) where the WebAssembly ones finish in the abort window.
    ...(scenario.victim === "aborted" ? { kernels: "ts" as const } : {}),
  });
  try {
    const cell = { scenario, guardOn, disabledGuards };
    if (scenario.victim === "aborted") return await abortedCell(cell, server);
    if (scenario.victim === "prefix") return await prefixCell(cell, server, options.baseline ?? null);
    return await victimCell(cell, server, options.baseline ?? null);
  } finally {
    await server.close();
  }
}

type IncidentServer = Awaited<ReturnType<typeof startIncidentServer>>;

/** The fields of a cell's outcome that say which cell it is and what it expects. */
function cellOf(cell: Cell, expect: CellOutcome["expect"]) {
  const { scenario, guardOn, disabledGuards } = cell;
  return {
    fault: scenario.fault,
    faults: scenario.faults,
    topology: scenario.topology,
    guardOn,
    disabledGuards,
    expect,
  };
}

/** One cell of the matrix: its row's scenario and the guard on alone (null: none), the others off. */
interface Cell {
  readonly scenario: MatrixScenario;
  readonly guardOn: GuardName | null;
  readonly disabledGuards: readonly GuardName[];
}

/**
 * The ordinary victim: A plants first (each fits every pool; their pages are freed, not zeroed),
 * then B sends its prompt. Over the pool: A's plants nearly fill the prefill pool and B's prompt
 * just overflows it, so B's lease is, page for page, the pages A's last plant just freed (RoPE keys
 * keep A's positions).
 */
async function victimCell(cell: Cell, server: IncidentServer, baseline: string | null): Promise<CellOutcome> {
  const { scenario, guardOn } = cell;
  const overPool = scenario.victim === "over-pool";
  const plantChars = overPool ? 225 : 200;
  let plantTokens: number | null = null;
  for (let i = 0; i < 3; i++) {
    // Under a fault with its guard on, A's own requests may be caught too; their KV still landed.
    const r = await chat(server.url, server.keyA, plantPrompt(i, plantChars));
    if (r.status === 200) plantTokens = r.promptTokens;
  }
  const before = await guardCounterSum(() => server.metrics());
  const chars = overPool ? 240 : 200;
  const b = await chat(server.url, server.keyB, victimPrompt(chars));
  const after = await guardCounterSum(() => server.metrics());
  const leakedCode = A_CODES.some((code) => b.content.includes(code));
  const differs = baseline === null || b.status !== 200 ? null : b.content !== baseline;
  const delta = after - before;
  // The same template around ~`chars` characters: B sent at least A's count plus the difference.
  const sentAtLeast = plantTokens === null ? null : plantTokens + (chars - plantChars) - 16;
  const undercounted = b.promptTokens !== null && sentAtLeast !== null && b.promptTokens < sentAtLeast;
  const expect = guardOn === null ? "bug shows" : "caught";
  const { ok, symptom } =
    expect === "bug shows"
      ? bugShows(scenario, b, { undercounted, differs, leakedCode, delta })
      : {
          ok: b.status >= 400 && delta > 0 && !leakedCode,
          symptom: `HTTP ${b.status} ${b.errorCode ?? ""}, guard counters +${delta}`,
        };
  return {
    ...cellOf(cell, expect),
    status: b.status,
    errorCode: b.errorCode,
    promptTokensReported: b.promptTokens,
    leakedCode,
    answer: b.status === 200 ? b.content.slice(0, 40) : "",
    guardCounterDelta: delta,
    differsFromBaseline: differs,
    symptom,
    caughtAsMiss: false,
    ok,
  };
}

/** With every guard of the row off, the bug must show (and no guard counter move). */
function bugShows(
  scenario: MatrixScenario,
  b: ChatResult,
  seen: { undercounted: boolean; differs: boolean | null; leakedCode: boolean; delta: number },
): { ok: boolean; symptom: string } {
  const signs: string[] = [];
  if (b.status === 200) {
    if (scenario.victim === "over-pool") signs.push("HTTP 200 to a prompt over the prefill pool");
    else signs.push(`HTTP 200 over a ${scenario.fault} transfer, no guard counted it`);
    if (seen.undercounted) signs.push(`usage.prompt_tokens ${b.promptTokens}`);
    if (seen.differs === true) signs.push("answer differs from its isolated baseline");
    if (seen.leakedCode) signs.push("tenant A's code in tenant B's answer");
  } else if (scenario.fault === "undersized-pool" && b.errorCode !== "context_length_exceeded") {
    signs.push(`HTTP ${b.status} ${b.errorCode} instead of 400 context_length_exceeded (invariant 4)`);
  }
  return {
    ok: signs.length > 0 && seen.delta === 0,
    symptom: signs.length > 0 ? signs.join("; ") : `no symptom: HTTP ${b.status} ${b.errorCode ?? ""}`,
  };
}

/** B's ordinary prompt's greedy answer on a safe server of the same shape (after A's plants). */
export async function isolatedBaseline(options: { readonly model?: string } = {}): Promise<string> {
  const server = await startIncidentServer({
    ...(options.model === undefined ? {} : { model: options.model }),
    faults: [],
    disabledGuards: [],
    undersizedPrefill: false,
  });
  try {
    const b = await chat(server.url, server.keyB, victimPrompt(200));
    if (b.status !== 200) throw new Error(`The baseline request got HTTP ${b.status}: ${b.errorCode}`);
    return b.content;
  } finally {
    await server.close();
  }
}

/** Every cell of the matrix, in order: per fault, all guards off, then each guard alone. */
export async function runMatrix(
  options: {
    readonly model?: string;
    /** Only the rows of this topology. */
    readonly topology?: "threads" | "tcp" | "single";
    /** Only the rows of these faults. */
    readonly faults?: readonly FaultName[];
    /** TLS flags for the processes of the TCP rows (docs/tls.md). */
    readonly linkTlsArgs?: readonly string[];
    readonly onCell?: (cell: CellOutcome) => void;
  } = {},
): Promise<CellOutcome[]> {
  const cells: CellOutcome[] = [];
  const baseline = await isolatedBaseline(options);
  for (const scenario of MATRIX_SCENARIOS) {
    if (options.topology !== undefined && scenario.topology !== options.topology) continue;
    if (options.faults !== undefined && !options.faults.includes(scenario.fault)) continue;
    for (const guard of [null, ...scenario.guards]) {
      const cell = await runCell(scenario, guard, {
        ...options,
        baseline: scenario.victim === "ordinary" || scenario.victim === "prefix" ? baseline : null,
      });
      options.onCell?.(cell);
      cells.push(cell);
    }
  }
  return cells;
}

const TOPOLOGY_LABEL = {
  threads: "threads, shared memory",
  tcp: "processes, TCP",
  single: "one engine",
} as const;

/** The heading of the KV tier rows' section of docs/fault-matrix.md. */
export const TIER_SECTION_HEADING = "## KV tier cells (docs/design.md \u00a73b)";

/** The KV tier rows (`victim: "tier"`) as their section of docs/fault-matrix.md. */
export function renderTierSection(cells: readonly CellOutcome[]): string[] {
  return [
    TIER_SECTION_HEADING,
    "",
    "One engine (`--no-disaggregation`) with a disk tier (`--cache-disk`, a 40-page pool; src/tools/incident/tier-cells.ts). Run 1: tenant A sends its access codes, tenant B its own prompt, A's other prompts crowd every cached page out to disk. The node stops, the harness writes the directory (`tier-corrupt`: every KV byte of B's records flipped; `tier-planted`: A's valid records copied over B's files, depth for depth; `stale-epoch`: B's `cache_epoch` raised in the keys file, the fault keeping B's keys), the node restarts on the same directory and key, and B sends its prompt again: what it reuses comes from disk. The bug: B served from those records (`cached_tokens` > 0, nothing refused). A load guard catches it as a miss (`cached_tokens` 0, `kvfence_kv_tier_rejected_total{reason}` up); `tier-spill-copy` as a correct hit (B's fresh answer). The guards' unit tests: `dist/src/kvcache/kv-tiers.test.js`, `dist/src/engine/tier-prefetch.test.js`.",
    "",
    "| fault (switched on) | topology | guard on | expected | HTTP | error code | symptom / catch | B's answer | pass |",
    "|---|---|---|---|---|---|---|---|---|",
    ...cells.map(matrixRow),
  ];
}

function matrixRow(c: CellOutcome): string {
  return `| ${c.faults.join(" + ")} | ${TOPOLOGY_LABEL[c.topology]} | ${c.guardOn ?? "none (all off)"} | ${c.expect} | ${c.status} | ${c.errorCode ?? "-"} | ${c.symptom} | ${c.answer === "" ? "-" : `\`${c.answer.replace(/[`|\n]/g, " ").replace(/\p{Cc}/gu, "\u00b7")}\``} | ${c.ok ? "yes" : "**NO**"} |`;
}

/** The tier rows' faults (their own section). */
const TIER_FAULTS = new Set(MATRIX_SCENARIOS.filter((s) => s.victim === "tier").map((s) => s.fault));

/** The matrix as Markdown (docs/fault-matrix.md). */
export function renderMatrix(cells: readonly CellOutcome[], command: string, when: string): string {
  const lines = [
    "# Fault × guard matrix",
    "",
    `Generated by \`${command}\` on ${when} (bundled model, real HTTP; threads or TCP processes per row). Each fault`,
    "runs first with every guard that catches it switched off (the bug must show), then with each of",
    "those guards alone switched on (the client must get a 4xx or 5xx, never a 200, and a guard",
    "counter in /metrics must go up). Before tenant B's request, tenant A plants access codes whose",
    "KV stays in the decode pool's freed (never zeroed) pages. For `drop-abort-ack`, tenant A",
    "disconnects while prefill computes a long prompt (HTTP 0: the client aborted); the catch is",
    "`kvfence_quarantined_pages` staying up with no ABORT_ACK, the bug a timer releasing them",
    "(`--unsafe-disable-guard quarantine`: the node releases quarantined pages after 2 s); where",
    "the abort did not overtake the transfer (no page quarantined right after it: no lease left)",
    "the race is run again, up to 5 times. The",
    "prefix-cache rows run on one engine (`--no-disaggregation`): tenant A's prompts are cached, then",
    "B sends A's prompt (`shared-prefix`) or its own (`prefix-collision`); the bug is B served from",
    "A's cached pages (`cached_tokens` > 0), a key guard catches it as a miss (HTTP 200, nothing",
    "reused; collisions counted in `kvfence_prefix_cache_collisions_total`), the page tags as a 500.",
    "",
    "| fault (switched on) | topology | guard on | expected | HTTP | error code | symptom / catch | B's answer | pass |",
    "|---|---|---|---|---|---|---|---|---|",
  ];
  for (const c of cells) if (!TIER_FAULTS.has(c.fault)) lines.push(matrixRow(c));
  lines.push("", "## Faults not run end to end here", "");
  for (const [fault, why] of Object.entries(NOT_IN_MATRIX)) lines.push(`- \`${fault}\`: ${why}.`);
  lines.push("", ...renderTierSection(cells.filter((c) => TIER_FAULTS.has(c.fault))), "");
  return lines.join("\n");
}
