/**
 * How the probe judges one answer to tenant B. Every output (text, error body, stream) is scanned
 * for tenant A's codes (`leak`); a request that must be refused (over a limit, malformed) must get
 * a 4xx, and a 200 is a finding even when the text looks clean; a 200 that asked about B's own
 * record must answer with its code (`wrong-answer`, a warning when the model does not repeat its
 * context); a code-shaped answer for an account absent from the context is a warning; and the
 * usage a large prompt reports must not be far below its size (`usage-mismatch`: a placeholder).
 */
import type { ChatOutcome } from "./chat-client.js";
import type { FindingKind, ProbePhase } from "./probe-report.js";
import { find, type ProbeCase, type ProbeRun, warn } from "./probe-run.js";

/** An access-code-shaped string (the default record format). */
const CODE_SHAPE = /\b[A-Z0-9]{3}-[A-Z0-9]{3}\b/;

/** One answer to judge: the case `c` sent in `phase`, and what came back. */
export interface Judging {
  readonly ctx: ProbeRun;
  readonly phase: ProbePhase;
  readonly c: ProbeCase;
  readonly out: ChatOutcome;
}

export function judge(j: Judging): void {
  const { ctx, phase, c, out } = j;
  if (out.status === 0) {
    warn(ctx, phase, `${c.name}: no response (${out.error})`);
    return;
  }
  ctx.phases.get(phase)!.checks++;
  const leaked = judgeLeak(j);
  if (c.expect === "reject") judgeRefusal(j);
  else if (out.status !== 200) warnFailed(j);
  else judgeAnswer(j, leaked);
}

/** Tenant A's codes in anything B got back; true when there were any. */
function judgeLeak({ ctx, phase, c, out }: Judging): boolean {
  const scanned = [out.text, out.error ?? "", out.rawExcerpt].join("\n");
  const hits = ctx.aCodes.scan(scanned);
  if (hits.length === 0) return false;
  const list = hits.map((h) => `${h.code} (account ${h.account}, ${h.match})`).join(", ");
  find(
    ctx,
    { phase, kind: "leak", case: c.name, message: `tenant B's output holds tenant A's code: ${list}` },
    out,
  );
  return true;
}

/** A request that must be refused: a 4xx, nothing else. */
function judgeRefusal({ ctx, c, out }: Judging): void {
  ctx.phases.get("status")!.checks++;
  if (out.status === 200) {
    const kind: FindingKind = c.malformed ? "malformed-accepted" : "over-limit-accepted";
    const what = c.malformed ? "a malformed request" : `an over-limit prompt (~${c.estTokens} tokens)`;
    const inBand = out.inBandError ? " (error sent in-band in the stream)" : "";
    const message = `HTTP 200 to ${what}${inBand}; a 4xx is required`;
    find(ctx, { phase: "status", kind, case: c.name, message }, out);
  } else if (out.status < 400 || out.status >= 500) {
    const message = `HTTP ${out.status} (${out.error}); a 4xx is required`;
    find(ctx, { phase: "status", kind: "not-4xx", case: c.name, message }, out);
  }
}

/** A request that may be refused got no 200: a warning where a 200 was expected, or on a 5xx. */
function warnFailed({ ctx, phase, c, out }: Judging): void {
  if (c.expect === "ok") {
    const size = c.estTokens === null ? "" : ` (~${c.estTokens} tokens, under the limit)`;
    warn(ctx, phase, `${c.name}: HTTP ${out.status}${size}: ${out.error ?? ""}`);
  } else if (out.status >= 500) {
    warn(ctx, phase, `${c.name}: HTTP ${out.status}: ${out.error ?? ""}`);
  }
}

/** A 200: the answer from B's own context, no code for an absent account, an honest usage. */
function judgeAnswer(j: Judging, leaked: boolean): void {
  const { ctx, phase, c, out } = j;
  if (out.inBandError) warn(ctx, phase, `${c.name}: stream carried an error: ${out.error}`);
  if (c.askOwn !== null) {
    ctx.phases.get(phase)!.checks++;
    if (!out.text.includes(c.askOwn.code)) {
      const message = `HTTP 200 but the answer is not ${c.askOwn.code} from its own context: ${JSON.stringify(out.text.slice(0, 60))}`;
      if (ctx.reliable) find(ctx, { phase, kind: "wrong-answer", case: c.name, message }, out);
      else warn(ctx, phase, `${c.name}: ${message}`);
    }
  }
  if (c.askAbsent === true && !leaked && CODE_SHAPE.test(out.text)) {
    warn(
      ctx,
      phase,
      `${c.name}: answered a code for an account that is not in its context: ${JSON.stringify(out.text.slice(0, 60))}`,
    );
  }
  judgeUsage(j);
}

function judgeUsage({ ctx, phase, c, out }: Judging): void {
  if (c.estTokens === null || out.promptTokens === null || c.estTokens < 256) return;
  ctx.phases.get(phase)!.checks++;
  if (out.promptTokens < c.estTokens / 2) {
    const message = `usage.prompt_tokens is ${out.promptTokens} for a prompt of ~${c.estTokens} tokens (a placeholder prompt?)`;
    find(ctx, { phase, kind: "usage-mismatch", case: c.name, message }, out);
  }
}
