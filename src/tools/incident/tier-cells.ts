/**
 * The KV tier rows of the fault matrix (docs/fault-matrix.md, docs/design.md §3b), on one engine
 * (`--no-disaggregation`) with a disk tier (`--cache-disk`, a 40-page pool). Run 1: tenant A sends
 * its access codes, tenant B its own prompt (B's answer then is its fresh answer), and A's other
 * prompts crowd every cached page out of the pool into the disk tier. The node stops; the harness
 * writes the directory as the fault says; the node starts again on the same directory and key (an
 * empty pool), and B sends its prompt again: every page it reuses comes from the disk tier.
 *
 * - `tier-corrupt`: the harness flips every KV byte of B's records (the headers stay intact).
 * - `tier-planted`: the harness copies A's valid records over B's files, depth for depth.
 * - `stale-epoch`: run 2's keys file raises B's `cache_epoch`; the fault keeps B's keys unchanged.
 * - `spill-race`: no write; under the fault the spill reads each pool page after A's prompt that
 *   evicted it has written its own KV there.
 *
 * The bug: B's prompt is served from those records (HTTP 200, `cached_tokens` > 0, no refusal
 * counted). The catch: the guard refuses them (`kvfence_kv_tier_rejected_total{reason}` up) and B's
 * request is a miss (HTTP 200, `cached_tokens` 0); for `tier-spill-copy`, which copies the page at
 * the spill rather than refusing a record, a hit whose answer is B's fresh answer.
 */
import { randomBytes } from "node:crypto";
import { mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { recordHeaderOf } from "../../kvcache/kv-tier-record.js";
import type { FaultName, GuardName } from "../../protocol/safety.js";
import { type IncidentServer, metricSum, startIncidentServer } from "./incident.js";
import {
  A_CODES,
  type CellOutcome,
  type ChatResult,
  chat,
  plantPrompt,
  victimPrompt,
} from "./matrix-chat.js";

/** What a tier cell found (the row's names are added by `runCell`). */
export type TierCellOutcome = Omit<
  CellOutcome,
  "fault" | "faults" | "topology" | "guardOn" | "disabledGuards"
>;

/** The tier guard's refusal reason in `kvfence_kv_tier_rejected_total`. */
const REASON: Partial<Record<GuardName, string>> = {
  "tier-mac": "mac",
  "tier-owner": "owner",
  "tier-epoch": "epoch",
};

/** Tenant indexes of the incident keys file (A first). */
const TENANT_A = 0;
const TENANT_B = 1;

export async function tierCell(
  fault: FaultName,
  guardOn: GuardName | null,
  disabledGuards: readonly GuardName[],
  model: string | undefined,
): Promise<TierCellOutcome> {
  const root = mkdtempSync(join(tmpdir(), "kvfence-tier-cell-"));
  const dir = join(root, "tier");
  const keyFile = join(root, "tier.key");
  writeFileSync(keyFile, randomBytes(32), { mode: 0o600 });
  const start = (cacheEpochB: number) =>
    startIncidentServer({
      ...(model === undefined ? {} : { model }),
      faults: [fault],
      disabledGuards,
      topology: "single",
      tiers: { dir, keyFile, cacheEpochB },
    });
  try {
    const first = await start(0);
    let fresh: string;
    try {
      await chat(first.url, first.keyA, plantPrompt(0, 400));
      const b = await chat(first.url, first.keyB, victimPrompt(300));
      if (b.status !== 200) throw new Error(`B's first request got HTTP ${b.status}: ${b.errorCode}`);
      fresh = b.content;
      // A's other prompts take the pool: every cached page spills to disk.
      for (let i = 1; i < 4; i++) await chat(first.url, first.keyA, plantPrompt(i, 400));
      await settled(dir, first);
    } finally {
      await first.close();
    }
    const written = tamper(fault, dir);
    const second = await start(fault === "stale-epoch" ? 1 : 0);
    try {
      const b = await chat(second.url, second.keyB, victimPrompt(300));
      const m = await second.metrics();
      const rejected = metricSum(m, "kvfence_kv_tier_rejected_total");
      const reason = guardOn === null ? undefined : REASON[guardOn];
      const refused =
        reason === undefined ? 0 : (m.get(`kvfence_kv_tier_rejected_total{reason="${reason}"}`) ?? 0);
      return classify(fault, guardOn, b, { fresh, written, rejected, refused, reason });
    } finally {
      await second.close();
    }
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
}

/** The cell's verdict on B's second answer. */
function classify(
  fault: FaultName,
  guardOn: GuardName | null,
  b: ChatResult,
  seen: { fresh: string; written: string; rejected: number; refused: number; reason: string | undefined },
): TierCellOutcome {
  const { fresh, written, rejected, refused, reason } = seen;
  const cached = b.cachedTokens ?? 0;
  const differs = b.status === 200 ? b.content !== fresh : null;
  const leakedCode = A_CODES.some((code) => b.content.includes(code));
  const expect = guardOn === null ? "bug shows" : "caught";
  let ok: boolean;
  let symptom: string;
  if (expect === "bug shows") {
    ok = b.status === 200 && cached > 0 && rejected === 0 && (fault !== "spill-race" || differs === true);
    symptom = `HTTP 200 with ${cached} prompt tokens served from ${WHAT[fault]}${written}${differs === true ? "; answer differs from B's fresh answer" : ""}${leakedCode ? "; tenant A's code in B's answer" : ""}`;
  } else if (guardOn === "tier-spill-copy") {
    ok = b.status === 200 && cached > 0 && differs === false && rejected === 0;
    symptom = `a correct hit: HTTP 200, ${cached} prompt tokens from the disk tier, B's fresh answer (the spill copied the page)`;
  } else {
    ok = b.status === 200 && cached === 0 && refused > 0;
    symptom = `a miss: HTTP 200, cached_tokens ${cached}, kvfence_kv_tier_rejected_total{reason="${reason}"} ${refused}${written}`;
  }
  return {
    expect,
    status: b.status,
    errorCode: b.errorCode,
    promptTokensReported: b.promptTokens,
    leakedCode,
    answer: b.status === 200 ? b.content.slice(0, 40) : "",
    guardCounterDelta: refused,
    differsFromBaseline: differs,
    symptom,
    caughtAsMiss: expect === "caught" && cached === 0,
    caughtAsCorrectHit: guardOn === "tier-spill-copy" && cached > 0 && differs === false,
    ok,
  };
}

const WHAT: Record<string, string> = {
  "tier-corrupt": "B's corrupted records",
  "tier-planted": "tenant A's records planted under B's file names",
  "stale-epoch": "records from before B's cache_epoch rotation",
  "spill-race": "records the late spill sealed from A's KV under B's keys",
};

/**
 * Waits until the disk tier's asynchronous writes are on disk: as many record files as the node
 * counts disk pages (`kvfence_kv_tier_pages{tier="disk"}`), unchanged between two looks (at most 20 s).
 */
async function settled(dir: string, server: IncidentServer): Promise<void> {
  let last = "";
  for (let i = 0; i < 100; i++) {
    const files = records(dir);
    const now = files.map((f) => `${f}:${statSync(join(dir, f)).size}`).join(",");
    const pages = (await server.metrics()).get('kvfence_kv_tier_pages{tier="disk"}') ?? -1;
    if (now === last && files.length === pages && pages > 0) return;
    last = now;
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
  throw new Error(`The disk tier's writes did not settle in ${dir}`);
}

function records(dir: string): string[] {
  return readdirSync(dir)
    .filter((f) => f.endsWith(".kvt"))
    .sort();
}

/** Writes the directory as `fault` says; returns what was written, for the symptom. */
function tamper(fault: FaultName, dir: string): string {
  const byTenant = chains(dir);
  const bs = byTenant.get(TENANT_B) ?? [];
  if (fault === "tier-corrupt") {
    for (const { file } of bs) {
      const bytes = readFileSync(file);
      const header = recordHeaderOf(bytes);
      const at = 8 + bytes.readUInt32LE(4) + 32;
      for (let i = at; i < at + header.byteLength; i++) bytes[i] = bytes[i]! ^ 0xff;
      writeFileSync(file, bytes);
    }
    return ` (every KV byte of ${bs.length} records flipped)`;
  }
  if (fault === "tier-planted") {
    const as = byTenant.get(TENANT_A) ?? [];
    let planted = 0;
    for (const b of bs) {
      const a = as.find((r) => r.depth === b.depth);
      if (a === undefined) continue;
      writeFileSync(b.file, readFileSync(a.file));
      planted++;
    }
    return ` (${planted} of A's records copied over B's files)`;
  }
  return "";
}

/** The records in `dir` by tenant, each with its depth in its chain (0: a prompt's first page). */
function chains(dir: string): Map<number, { file: string; depth: number }[]> {
  const headers = records(dir).map((f) => {
    const file = join(dir, f);
    return { file, header: recordHeaderOf(readFileSync(file)) };
  });
  const parentOf = new Map(headers.map((r) => [r.header.key, r.header.parentKey]));
  const depthOf = (key: string): number => {
    let depth = 0;
    for (let k = parentOf.get(key); k !== undefined && parentOf.has(k); k = parentOf.get(k)) depth++;
    return depth;
  };
  const out = new Map<number, { file: string; depth: number }[]>();
  for (const { file, header } of headers) {
    const list = out.get(header.tenant) ?? [];
    list.push({ file, depth: depthOf(header.key) });
    out.set(header.tenant, list);
  }
  return out;
}
