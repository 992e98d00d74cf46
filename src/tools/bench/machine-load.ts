/**
 * How busy the machine was during a benchmark run: the 1-minute load average at its start and its
 * end, and the CPU count — the line every bench report opens with, so a reader knows how far to
 * trust figures measured on a shared machine.
 */
import os from "node:os";

/** The 1-minute load average at the start and the end of a run, and the machine's CPUs. */
export interface MachineLoad {
  readonly start: number;
  readonly end: number;
  readonly cpus: number;
}

/** The 1-minute load average now. */
export function loadAverage(): number {
  return os.loadavg()[0]!;
}

/** The load of a run that started at load average `start`, as it ends now. */
export function machineLoad(start: number): MachineLoad {
  return { start, end: loadAverage(), cpus: os.cpus().length };
}

/** `machine: N CPUs, 1-min load average S at start, E at end`. */
export function describeLoad(load: MachineLoad): string {
  return `machine: ${load.cpus} CPUs, 1-min load average ${load.start.toFixed(1)} at start, ${load.end.toFixed(1)} at end`;
}
