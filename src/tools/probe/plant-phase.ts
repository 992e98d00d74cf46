/**
 * The probe's first phase: tenant A plants unique access codes in prompts of varied sizes and asks
 * for one back from each (if fewer than half come back, this model does not repeat its context and
 * answer checks become warnings). The usage the server reports for these prompts calibrates the
 * probe's token count per character, so that later prompts land just under, at and over a limit.
 */
import { askingPrompt, type ProbeRun, runPool, send, warn } from "./probe-run.js";

/** Template tokens around a prompt, guessed when the server reports no usage. */
const TEMPLATE_TOKENS_GUESS = 10;

/** Linear fit tokens ≈ perChar × chars + overhead, from the plant phase's usage reports. */
export interface TokenFit {
  readonly perChar: number;
  readonly overhead: number;
  readonly calibrated: boolean;
}

export function charsForTokens(fit: TokenFit, tokens: number): number {
  return Math.max(1, Math.ceil((tokens - fit.overhead) / fit.perChar));
}

export interface PlantResult {
  readonly planted: { codes: number; asked: number; repeated: number };
  readonly fit: TokenFit;
  /** Plant requests that got any HTTP answer. */
  readonly responded: number;
}

export async function plantPhase(ctx: ProbeRun, count: number, plantChars: number): Promise<PlantResult> {
  const summary = ctx.phases.get("plant")!;
  ctx.progress(`plant: tenant A plants ${count} prompts of up to ${plantChars} characters`);
  const jobs = Array.from({ length: count }, (_, i) => {
    // Lengths from a quarter of plantChars up to plantChars: varied sizes calibrate the token count.
    const chars = Math.round(plantChars * (0.25 + (0.75 * i) / Math.max(1, count - 1)));
    const { records, ask, content } = askingPrompt(
      ctx,
      Math.max(2, Math.min(32, Math.floor(chars / 160))),
      chars,
    );
    for (const r of records) ctx.aCodes.add(r);
    return { chars: content.length, ask, content, stream: i % 2 === 1 };
  });
  let repeated = 0;
  let responded = 0;
  const samples: Array<[number, number]> = [];
  let done = 0;
  await runPool(jobs, ctx.concurrency, async (job, i) => {
    const out = await send(ctx, { key: ctx.keyA, content: job.content, stream: job.stream });
    done++;
    if (done % 4 === 0 || done === jobs.length) ctx.progress(`plant: ${done}/${jobs.length}`);
    summary.checks++;
    if (out.status === 0) {
      warn(ctx, "plant", `plant#${i}: no response (${out.error})`);
      return;
    }
    responded++;
    if (out.status !== 200) {
      warn(ctx, "plant", `plant#${i}: HTTP ${out.status} (${out.error})`);
      return;
    }
    if (out.text.includes(job.ask.code)) repeated++;
    if (out.promptTokens !== null) samples.push([job.chars, out.promptTokens]);
  });
  const asked = jobs.length;
  ctx.reliable = asked > 0 && repeated * 2 >= asked;
  if (!ctx.reliable) {
    warn(
      ctx,
      "plant",
      `Only ${repeated} of ${asked} planted codes came back: this model does not repeat its context, so leaks ` +
        "may not be visible in its output (answer checks are reported as warnings)",
    );
  }
  return { planted: { codes: ctx.aCodes.size, asked, repeated }, fit: fitTokens(samples), responded };
}

function fitTokens(samples: Array<[number, number]>): TokenFit {
  const xs = new Set(samples.map((s) => s[0]));
  if (samples.length < 2 || xs.size < 2) {
    const s = samples[0];
    if (s === undefined) return { perChar: 1, overhead: TEMPLATE_TOKENS_GUESS, calibrated: false };
    return {
      perChar: Math.max(0.05, (s[1] - TEMPLATE_TOKENS_GUESS) / s[0]),
      overhead: TEMPLATE_TOKENS_GUESS,
      calibrated: true,
    };
  }
  const n = samples.length;
  const mx = samples.reduce((a, s) => a + s[0], 0) / n;
  const my = samples.reduce((a, s) => a + s[1], 0) / n;
  let sxy = 0;
  let sxx = 0;
  for (const [x, y] of samples) {
    sxy += (x - mx) * (y - my);
    sxx += (x - mx) ** 2;
  }
  const perChar = Math.max(0.05, sxy / sxx);
  return { perChar, overhead: Math.max(0, Math.round(my - perChar * mx)), calibrated: true };
}
