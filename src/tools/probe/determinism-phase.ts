/**
 * The probe's last phase: four fixed prompts sent alone (greedy) for a baseline, then twice mixed
 * with concurrent load; an output under load that differs from its isolated run is a finding
 * (`nondeterminism`: another request's KV, or its batch, changed this one's answer). Every answer,
 * load included, is judged as in the probe phase.
 */
import type { ChatOutcome } from "./chat-client.js";
import { judge } from "./judge.js";
import { loadCase, plantedAccounts } from "./probe-phase.js";
import { askingPrompt, find, type ProbeCase, type ProbeRun, runPool, send } from "./probe-run.js";

export async function determinismPhase(ctx: ProbeRun, plantChars: number): Promise<void> {
  const summary = ctx.phases.get("determinism")!;
  const prompts = Array.from(
    { length: 4 },
    (_, i) => askingPrompt(ctx, 3 + i, Math.round(plantChars * (0.3 + 0.2 * i))).content,
  );
  ctx.progress(`determinism: ${prompts.length} prompts alone, then twice under load`);
  const baseline: Array<ChatOutcome | null> = [];
  for (const [i, p] of prompts.entries()) {
    const out = await send(ctx, { key: ctx.keyB, content: p, stream: false });
    judge({ ctx, phase: "determinism", c: fixedCase(`determinism#${i}/alone`), out });
    baseline.push(out.status === 200 ? out : null);
  }
  if (baseline.every((b) => b === null)) {
    summary.skipped = "no baseline answer (every isolated request failed)";
    return;
  }
  for (let round = 0; round < 2; round++) {
    const jobs = roundJobs(ctx, prompts, round);
    await runPool(jobs, Math.max(2, ctx.concurrency), async (job) => {
      const out = await job.c.send();
      judge({ ctx, phase: "determinism", c: job.c, out });
      if (job.index === null) return;
      const base = baseline[job.index];
      if (base === null || base === undefined || out.status !== 200) return;
      summary.checks++;
      if (out.text !== base.text) {
        const message = `greedy output under load differs from the isolated run: ${JSON.stringify(base.text.slice(0, 40))} → ${JSON.stringify(out.text.slice(0, 40))}`;
        find(ctx, { phase: "determinism", kind: "nondeterminism", case: job.c.name, message }, out);
      }
    });
  }
}

/** One round: each fixed prompt (its index into the baseline) followed by its share of load (null). */
function roundJobs(
  ctx: ProbeRun,
  prompts: readonly string[],
  round: number,
): Array<{ index: number | null; c: ProbeCase }> {
  const aAccounts = plantedAccounts(ctx.aCodes);
  const jobs: Array<{ index: number | null; c: ProbeCase }> = [];
  const load = Math.max(ctx.concurrency, 2);
  for (let i = 0; i < prompts.length; i++) {
    const content = prompts[i]!;
    jobs.push({
      index: i,
      c: {
        ...fixedCase(`determinism#${i}/load${round}`),
        send: () => send(ctx, { key: ctx.keyB, content, stream: false }),
      },
    });
    for (let j = 0; j < Math.ceil(load / prompts.length); j++) {
      const name = `determinism-load${round}.${i}.${j}`;
      jobs.push({ index: null, c: loadCase(ctx, { name, aAccounts, stream: (i + j + round) % 2 === 0 }) });
    }
  }
  return jobs;
}

function fixedCase(name: string): ProbeCase {
  return {
    name,
    send: () => Promise.reject(new Error("unused")),
    expect: "ok",
    malformed: false,
    askOwn: null,
    estTokens: null,
  };
}
