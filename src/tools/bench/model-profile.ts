/**
 * `kvfence bench model --profile`: where a step's time goes, kernel by kernel, for each arm's
 * prefill, decode batches and long-context decode. After the timed repeats, each phase runs once
 * more with every kernel call timed (src/kernels/kernel-profile.ts); the report gives each kernel's
 * (and each matmul shape's) milliseconds per step and share of the step, and the time outside every
 * kernel (the forward pass's own JavaScript). The profiled pass is not one of the timed repeats:
 * its clock reads cost under a microsecond a call, a few hundred calls a step.
 */
import type { KernelProfile, KernelTime } from "../../kernels/kernel-profile.js";

/** An arm's phases, each run once by `profilePhases` (each returns tokens/s; unused here). */
export interface ProfiledPhases {
  readonly profile: KernelProfile;
  prefill(): number;
  decode(batchIndex: number): number;
  readonly long: (() => number) | null;
}

/** One phase's profile: its steps, the wall time of a step and each kernel's share. */
export interface PhaseProfile {
  readonly phase: string;
  readonly steps: number;
  readonly stepMs: number;
  readonly rows: readonly KernelTime[];
}

export interface ProfileShape {
  readonly promptTokens: number;
  readonly contextTokens: number;
  readonly decodeSteps: number;
  readonly batchSizes: readonly number[];
  readonly longContext: number;
}

/** Runs each phase of `a` once with its kernels timed. */
export function profilePhases(a: ProfiledPhases, shape: ProfileShape): PhaseProfile[] {
  const phases: { phase: string; steps: number; run: () => void }[] = [
    { phase: `prefill (${shape.promptTokens}-token prompt)`, steps: 1, run: () => a.prefill() },
    ...shape.batchSizes.map((batch, i) => ({
      phase: `decode batch ${batch} (context ${shape.contextTokens})`,
      steps: shape.decodeSteps,
      run: () => a.decode(i),
    })),
  ];
  const long = a.long;
  if (long !== null)
    phases.push({
      phase: `decode batch 1 (context ${shape.longContext})`,
      steps: shape.decodeSteps,
      run: long,
    });
  return phases.map(({ phase, steps, run }) => {
    a.profile.reset();
    const t0 = performance.now();
    run();
    const ms = performance.now() - t0;
    return { phase, steps, stepMs: ms / steps, rows: a.profile.rows() };
  });
}

/** The report's lines for one arm's phases: the `top` kernels of each, the rest summed, and the time outside them. */
export function formatProfile(phases: readonly PhaseProfile[], top = 8): string[] {
  const lines: string[] = [];
  for (const p of phases) {
    lines.push(`    where a step's time goes, ${p.phase}: ${p.stepMs.toFixed(2)} ms a step`);
    const row = (label: string, ms: number, calls: number | null): string =>
      `      ${label.padEnd(52)} ${(ms / p.steps).toFixed(3).padStart(8)} ms ${((100 * ms) / p.steps / p.stepMs).toFixed(1).padStart(5)}%${calls === null ? "" : `  ${calls / p.steps} calls`}`;
    for (const r of p.rows.slice(0, top)) lines.push(row(r.kernel, r.ms, r.calls));
    const rest = p.rows.slice(top);
    if (rest.length > 0)
      lines.push(
        row(
          `${rest.length} other kernels`,
          rest.reduce((s, r) => s + r.ms, 0),
          rest.reduce((s, r) => s + r.calls, 0),
        ),
      );
    const inKernels = p.rows.reduce((s, r) => s + r.ms, 0);
    lines.push(row("outside the kernels", p.stepMs * p.steps - inKernels, null));
  }
  return lines;
}
