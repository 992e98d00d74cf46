/**
 * The unsafe switches of `kvfence serve` and `kvfence cluster`: `--unsafe-fault NAME` (a fault of
 * docs/design.md §5, switched on inside the real code path, or a node fault such as
 * `stall-transfer`) and `--unsafe-disable-guard NAME` (a guard switched off). Both are for tests
 * and demos only, so both are refused unless the command line also carries the one explicit opt-in
 * flag, `--i-understand-this-leaks-data`; a server that runs with either prints a loud warning on
 * stderr at startup (every role) and shows them in `/health` and `/metrics`.
 */
import {
  FAULT_NAMES,
  GUARD_NAMES,
  isFaultName,
  isGuardName,
  isNodeFaultName,
  NODE_FAULT_NAMES,
} from "../protocol/safety.js";

/** The one opt-in flag that allows the unsafe switches. */
export const UNSAFE_OPT_IN_FLAG = "--i-understand-this-leaks-data";

export interface UnsafeSwitches {
  readonly unsafeFault: readonly string[];
  readonly unsafeDisableGuard: readonly string[];
  readonly iUnderstandThisLeaksData: boolean;
}

/** The first problem with the unsafe switches (an unknown name, a missing opt-in), or null. */
export function unsafeSwitchesProblem(switches: UnsafeSwitches): string | null {
  for (const name of switches.unsafeFault) {
    if (!isFaultName(name) && !isNodeFaultName(name))
      return `--unsafe-fault: unknown fault name: ${name}; use one of ${[...FAULT_NAMES, ...NODE_FAULT_NAMES].join(", ")}`;
  }
  for (const name of switches.unsafeDisableGuard) {
    if (!isGuardName(name))
      return `--unsafe-disable-guard: unknown guard name: ${name}; use one of ${GUARD_NAMES.join(", ")}`;
  }
  const used = switches.unsafeFault.length > 0 || switches.unsafeDisableGuard.length > 0;
  if (used && !switches.iUnderstandThisLeaksData) {
    const given = [
      ...switches.unsafeFault.map((f) => `--unsafe-fault ${f}`),
      ...switches.unsafeDisableGuard.map((g) => `--unsafe-disable-guard ${g}`),
    ];
    return `${given.join(" ")} can leak one tenant's data to another and are refused without the opt-in flag: ${UNSAFE_OPT_IN_FLAG}; add it only for tests and demos`;
  }
  return null;
}

/** The multi-line stderr banner of a server with unsafe switches on, or null when there are none. */
export function unsafeWarning(
  role: string,
  faults: readonly string[],
  disabledGuards: readonly string[],
): string | null {
  if (faults.length === 0 && disabledGuards.length === 0) return null;
  const bar = "!".repeat(78);
  return [
    bar,
    `!! kvfence ${role}: UNSAFE — this server can leak one tenant's data to another.`,
    `!! faults on:      ${faults.length === 0 ? "none" : faults.join(", ")}`,
    `!! guards off:     ${disabledGuards.length === 0 ? "none" : disabledGuards.join(", ")}`,
    "!! For tests and demos only. Never serve real traffic like this.",
    bar,
    "",
  ].join("\n");
}

/** The arguments that pass the same switches on to child `kvfence serve` processes. */
export function unsafeArgs(faults: readonly string[], disabledGuards: readonly string[]): string[] {
  if (faults.length === 0 && disabledGuards.length === 0) return [];
  const args: string[] = [];
  for (const f of faults) args.push("--unsafe-fault", f);
  for (const g of disabledGuards) args.push("--unsafe-disable-guard", g);
  args.push(UNSAFE_OPT_IN_FLAG);
  return args;
}
