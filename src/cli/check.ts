/** `kvfence check`: the model checker of the transfer protocol (docs/protocol.md). */
import { writeFile } from "node:fs/promises";
import { Command, InvalidArgumentError, Option } from "commander";
import { FAULT_NAMES, type FaultName, GUARD_NAMES, type GuardName, isGuardName } from "../protocol/safety.js";
import {
  type CheckOptions,
  type CheckReport,
  counterexampleToDot,
  DECODE_CACHE_BOUND,
  DEFAULT_BOUND,
  DEFAULT_SUITE,
  formatReport,
  runCheck,
} from "../tools/check/run-check.js";

interface CheckCliOptions {
  fault?: FaultName;
  allFaults?: boolean;
  keepGuards?: boolean;
  disableGuard?: GuardName[];
  requests?: number;
  samples?: number;
  pages?: number;
  prefillPages?: number;
  attempts?: number;
  crashes?: number;
  duplicates?: number;
  losses?: number;
  aborts: boolean;
  timeouts?: boolean;
  transport?: "shm" | "tcp";
  reorder?: boolean;
  routers?: number;
  decodeCache?: boolean;
  maxStates?: number;
  maxDepth?: number;
  dot?: string;
  json?: boolean;
}

function nonNegativeInt(value: string): number {
  const n = Number(value);
  if (!Number.isInteger(n) || n < 0)
    throw new InvalidArgumentError(`Expected a non-negative integer: ${value}`);
  return n;
}

function guardName(value: string, previous: GuardName[] = []): GuardName[] {
  if (!isGuardName(value))
    throw new InvalidArgumentError(`Unknown guard: ${value}; use one of ${GUARD_NAMES.join(", ")}`);
  return [...previous, value];
}

export function command(): Command {
  return new Command("check")
    .description(
      "Explore every interleaving of the transfer protocol on a small pool and check the invariants of docs/design.md §7 (exit 1 on a violation)",
    )
    .addOption(
      new Option("--fault <name>", "run a fault variant: switch the fault on and its guards off").choices(
        FAULT_NAMES,
      ),
    )
    .option("--all-faults", "run every fault variant in turn and expect a counterexample from each")
    .option("--keep-guards", "with --fault: keep every guard on (shows the guards catch the fault)")
    .option("--disable-guard <name>", "switch a guard off (repeatable)", guardName)
    .option(
      "--requests <n>",
      `requests in the model, 1-3 (default ${DEFAULT_BOUND.requests})`,
      nonNegativeInt,
    )
    .option(
      "--samples <n>",
      `n > 1: the first request's samples after its first, as one group (default ${DEFAULT_BOUND.samples})`,
      nonNegativeInt,
    )
    .option("--pages <n>", `decode pool pages (default ${DEFAULT_BOUND.pages})`, nonNegativeInt)
    .option(
      "--prefill-pages <n>",
      `prefill pool pages (default ${DEFAULT_BOUND.prefillPages})`,
      nonNegativeInt,
    )
    .option("--attempts <n>", `attempts per request (default ${DEFAULT_BOUND.maxAttempts})`, nonNegativeInt)
    .option(
      "--crashes <n>",
      `node crashes the environment may inject (default ${DEFAULT_BOUND.crashes})`,
      nonNegativeInt,
    )
    .option(
      "--duplicates <n>",
      `control messages it may duplicate (default ${DEFAULT_BOUND.duplicates})`,
      nonNegativeInt,
    )
    .option("--losses <n>", `control messages it may lose (default ${DEFAULT_BOUND.losses})`, nonNegativeInt)
    .option("--no-aborts", "no client aborts")
    .option("--timeouts", "let the router's transfer timeout fire (abort + retry with a new epoch)")
    .addOption(new Option("--transport <kind>", "page write transport").choices(["shm", "tcp"]))
    .option("--reorder", "let any message overtake any other (default: FIFO per connection)")
    .option(
      "--routers <n>",
      `routers over the one prefill/decode pair, 1-2; with 2 the requests alternate between them (default ${DEFAULT_BOUND.routers})`,
      nonNegativeInt,
    )
    .option(
      "--decode-cache",
      "decode keeps a prefix cache (decode-side reuse): a conversation's two turns and another tenant's copy of the second",
    )
    .option(
      "--max-states <n>",
      `stop after this many states (default ${DEFAULT_BOUND.maxStates})`,
      nonNegativeInt,
    )
    .option("--max-depth <n>", "stop at this search depth", nonNegativeInt)
    .option("--dot <file>", "write the counterexample trace as a Graphviz graph")
    .option("--json", "print the report as JSON")
    .action(runChecks);
}

/** The bound options given, as `CheckOptions` (only those given: none given means the default suite). */
function boundOf(opts: CheckCliOptions): CheckOptions {
  const numbers = {
    requests: opts.requests,
    samples: opts.samples,
    pages: opts.pages,
    prefillPages: opts.prefillPages,
    maxAttempts: opts.attempts,
    crashes: opts.crashes,
    duplicates: opts.duplicates,
    losses: opts.losses,
    routers: opts.routers,
  };
  const given = Object.fromEntries(Object.entries(numbers).filter(([, v]) => v !== undefined));
  return {
    ...(opts.decodeCache === true ? DECODE_CACHE_BOUND : {}),
    ...given,
    ...(opts.aborts ? {} : { clientAborts: false }),
    ...(opts.timeouts === true ? { timeouts: true } : {}),
    ...(opts.transport === undefined ? {} : { transport: opts.transport }),
    ...(opts.reorder === true ? { reorder: true } : {}),
    ...(opts.maxStates === undefined ? {} : { maxStates: opts.maxStates }),
    ...(opts.maxDepth === undefined ? {} : { maxDepth: opts.maxDepth }),
    ...(opts.keepGuards === true ? { keepGuards: true } : {}),
    ...(opts.disableGuard === undefined ? {} : { disabledGuards: opts.disableGuard }),
  };
}

/** Every fault, one fault, the given bound, or (no fault and no bound option) the default suite. */
function runsOf(opts: CheckCliOptions, bound: CheckOptions): CheckOptions[] {
  if (opts.allFaults === true) return FAULT_NAMES.map((fault) => ({ ...bound, fault }));
  if (opts.fault !== undefined) return [{ ...bound, fault: opts.fault }];
  return Object.keys(bound).length === 0 ? DEFAULT_SUITE.map((s) => s.options) : [bound];
}

async function runChecks(opts: CheckCliOptions): Promise<void> {
  const runs = runsOf(opts, boundOf(opts));
  const text = opts.json !== true;
  let failed = false;
  const reports: CheckReport[] = [];
  for (const run of runs) {
    const report = runCheck(run);
    reports.push(report);
    const cex = report.result.counterexample;
    // The real protocol must hold; a fault variant (guards off) must produce a counterexample.
    const expectViolation = run.fault !== undefined && opts.keepGuards !== true;
    if ((cex !== null) !== expectViolation) failed = true;
    if (text) process.stdout.write(`${formatReport(report)}\n\n`);
    if (opts.dot !== undefined && cex !== null) {
      const file =
        runs.length > 1 ? opts.dot.replace(/(\.dot)?$/, `-${run.fault ?? reports.length}.dot`) : opts.dot;
      await writeFile(file, `${counterexampleToDot(cex)}\n`);
      if (text) process.stdout.write(`wrote the trace graph to ${file}\n\n`);
    }
  }
  if (reports.length > 1 && text) {
    const states = reports.reduce((n, r) => n + r.result.states, 0);
    const seconds = reports.reduce((n, r) => n + r.result.elapsedMs, 0) / 1000;
    process.stdout.write(`total: ${reports.length} runs, ${states} states in ${seconds.toFixed(1)} s\n`);
  }
  if (!text)
    process.stdout.write(`${JSON.stringify(reports.length === 1 ? reports[0] : reports, null, 2)}\n`);
  if (failed) process.exitCode = 1;
}
