/**
 * The words of a `kvfence check` counterexample: a readable label for each environment event in
 * the world it applies to (`describeEvent`), and a one-line picture of a pool's pages — state,
 * owner and the ghost data each holds (`describeTable`).
 */
import { NO_WRITER, PageState } from "../../kvcache/ownership-table.js";
import type { ControlMessage } from "../../protocol/wire.js";
import { GHOST_WORDS, type GhostPool } from "./ghost-pool.js";
import type {
  EnvEvent,
  Envelope,
  InflightWrite,
  ModelConfig,
  Party,
  PendingFence,
  World,
} from "./world-state.js";

/** A readable label of `event` in the context of the world it applies to. */
export function describeEvent(
  w: World,
  event: EnvEvent,
  config: ModelConfig,
  channels: readonly (readonly [Party, Party])[],
): string {
  const message = (c: number, j: number): string => {
    const [from, to] = channels[c]!;
    return describeEnvelope({ from, to, msg: JSON.parse(w.chans[c]![j]!) as ControlMessage });
  };
  switch (event.k) {
    case "submit": {
      const r = config.requests[event.i]!;
      return `client submits request ${w.order.length + 1} (tenant ${r.tenant}, prompt ${r.promptLen}, max_tokens ${r.maxTokens})`;
    }
    case "deliver":
      return `deliver ${message(event.c, event.j)}`;
    case "land": {
      const { header: h, corrupt } = JSON.parse(w.writes[event.j]!) as InflightWrite;
      return `page write of r${h.rid}#${h.epoch} page ${h.index} lands in decode page ${h.page}${corrupt ? " (corrupted in flight)" : ""}`;
    }
    case "fence": {
      const f = JSON.parse(w.fences[event.j]!) as PendingFence;
      const what = f.event.type === "peer_lost" ? "the connection close of" : "the handshake of";
      return `${f.to} observes ${what} ${f.to === "decode" ? "prefill" : "decode"} incarnation ${f.event.incarnation}`;
    }
    case "step":
      return `decode step of r${event.rid}#${event.epoch}`;
    case "client_abort":
      return `client of request ${event.rid} disconnects`;
    case "timeout":
      return `router's transfer timeout fires for request ${event.rid}`;
    case "quarantine_timeout":
      return `decode's deferred-release timer fires for r${event.rid}#${event.epoch}`;
    case "crash":
      return `${event.role} node crashes and restarts empty (peers see the connection close)`;
    case "duplicate":
      return `network duplicates ${message(event.c, event.j)}`;
    case "lose":
      return `network loses ${message(event.c, event.j)}`;
  }
}

const SHORT_STATE = ["F", "R", "Y", "Q", "S"] as const;

/** Every page of a loaded pool: its state letter, owner `rR#E` and the data it holds `(rR#E.I)`. */
export function describeTable(pool: GhostPool): string {
  const t = pool.table;
  const parts: string[] = [];
  for (let p = 0; p < t.numPages; p++) {
    const s = t.state(p);
    const c = pool.content;
    const at = p * GHOST_WORDS;
    const data = c[at] === -1 ? "-" : `r${c[at]}#${c[at + 1]}.${c[at + 2]}${c[at + 3] === 1 ? "!" : ""}`;
    // A prefix-cache page (decode-side reuse): its tenant and references, no owning attempt.
    const owner =
      s === PageState.SHARED && t.ownerEpoch(p) === NO_WRITER
        ? `t${t.tenant(p)}x${t.refcount(p)}`
        : `r${t.owner(p)}#${t.ownerEpoch(p)}`;
    parts.push(s === PageState.FREE ? `F(${data})` : `${SHORT_STATE[s]}:${owner}(${data})`);
  }
  return parts.join(" ");
}

function describeEnvelope(env: Envelope): string {
  const m = env.msg;
  let detail = "";
  if (m.type === "lease") detail = ` pages [${m.pages.map((p) => p.page).join(",")}]`;
  else if (m.type === "rejected" || m.type === "failed") detail = ` ${m.error.code}`;
  else if (m.type === "manifest")
    detail = ` tokens [${m.tokenStart},${m.tokenEnd}) ${m.checksums.length} checksums`;
  else if (m.type === "prefill")
    detail = ` prompt ${m.promptLen} into [${m.lease.pages.map((p) => p.page).join(",")}]`;
  return `${env.from}→${env.to} ${m.type.toUpperCase()} r${m.rid}#${m.epoch}${detail}`;
}
