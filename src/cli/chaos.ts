/**
 * `kvfence chaos --seed S --duration SECONDS`: the chaos campaign (src/tools/chaos/chaos.ts,
 * docs/topologies.md "Chaos campaign"): etcd, routers and prefill and decode node processes on
 * network-namespace hosts, the two tenants' canary workload, kill -9 / restart, SIGSTOP/SIGCONT,
 * partitions of node hosts and role switches (`kvfence role`, and back) from the seed; prints every injected fault and the checks, exit code 1
 * when a check fails (2 when the campaign cannot run: not root, no `ip` or `etcd`). Needs root.
 */
import { writeFile } from "node:fs/promises";
import { Command, InvalidArgumentError } from "commander";
import { BUNDLED_MODEL_DIR } from "../server/serve-config.js";
import { formatChaos, runChaos } from "../tools/chaos/chaos.js";
import { FAULT_KINDS, type FaultKind } from "../tools/chaos/faults.js";
import { netnsUnavailable } from "../tools/chaos/netns.js";

interface ChaosCliOptions {
  seed: number;
  duration: number;
  routers: number;
  prefill: number;
  decode: number;
  model: string;
  kvPages: number;
  concurrency: number;
  maxTokens: number;
  longTokens: number;
  faultGap: number;
  faults: FaultKind[];
  minCompleted: number;
  json?: string;
  nodeArg: string[];
  routerArg: string[];
}

const collect = (value: string, previous: string[] = []): string[] => [...previous, value];

function kinds(value: string): FaultKind[] {
  const list = value.split(",").map((k) => k.trim());
  const bad = list.find((k) => !(FAULT_KINDS as readonly string[]).includes(k));
  if (bad !== undefined || list.length === 0)
    throw new InvalidArgumentError(`Expected a list of ${FAULT_KINDS.join(", ")}: ${value}`);
  return list as FaultKind[];
}

function num(min: number, integer = true): (value: string) => number {
  return (value: string) => {
    const n = Number(value);
    if (!Number.isFinite(n) || n < min || (integer && !Number.isInteger(n)))
      throw new InvalidArgumentError(
        `Expected ${integer ? "an integer" : "a number"} of at least ${min}: ${value}`,
      );
    return n;
  };
}

export function command(): Command {
  return new Command("chaos")
    .description(
      "Chaos campaign on network-namespace hosts (needs root): kill -9, SIGSTOP/SIGCONT, partitions and role switches of nodes under two tenants' canary workload; checks leaks, wrong 200s, lost pages and completion",
    )
    .option("--seed <n>", "seed of the fault plan and the workload", num(0), 1)
    .option("--duration <seconds>", "how long the workload runs under faults", num(10), 300)
    .option("--routers <n>", "routers (each on its own host)", num(1), 2)
    .option("--prefill <n>", "prefill node processes", num(2), 3)
    .option("--decode <n>", "decode node processes", num(2), 3)
    .option("--model <dir|file.gguf>", "model of every process", BUNDLED_MODEL_DIR)
    .option("--kv-pages <n>", "KV pool of each node in pages", num(16), 256)
    .option("--concurrency <n>", "requests in flight at once", num(1), 4)
    .option(
      "--max-tokens <n>",
      "max_tokens of every request (greedy; kvfence-tiny restates a record in 44)",
      num(1),
      48,
    )
    .option("--long-tokens <n>", "max_tokens of the long requests (a sixth of all, ignore_eos)", num(1), 256)
    .option("--faults <kinds>", `the faults to inject, comma-separated: ${FAULT_KINDS.join(",")}`, kinds, [
      ...FAULT_KINDS,
    ])
    .option("--fault-gap <seconds>", "mean time between one fault's end and the next", num(0.5, false), 6)
    .option("--min-completed <fraction>", "fraction of requests that must complete", num(0, false), 0.99)
    .option("--node-arg <flag>", "one more `kvfence serve` argument for every node (repeatable)", collect, [])
    .option(
      "--router-arg <flag>",
      "one more `kvfence serve` argument for every router (repeatable; e.g. --router-arg=--max-migrations --router-arg=0)",
      collect,
      [],
    )
    .option("--json <file>", "write the full record (faults, every request, pages, checks) as JSON")
    .action(async (o: ChaosCliOptions) => {
      const why = netnsUnavailable();
      if (why !== null) {
        process.stderr.write(`kvfence chaos: network namespaces cannot be made here: ${why}\n`);
        process.exitCode = 2;
        return;
      }
      const result = await runChaos({
        seed: o.seed,
        durationS: o.duration,
        routers: o.routers,
        prefill: o.prefill,
        decode: o.decode,
        model: o.model,
        kvPages: o.kvPages,
        nodeArgs: o.nodeArg,
        routerArgs: o.routerArg,
        concurrency: o.concurrency,
        maxTokens: o.maxTokens,
        longTokens: o.longTokens,
        faultGapS: o.faultGap,
        faultKinds: o.faults,
        minCompleted: o.minCompleted,
        progress: (line) => process.stderr.write(`chaos: ${line}\n`),
      });
      process.stdout.write(formatChaos(result));
      if (o.json !== undefined) await writeFile(o.json, `${JSON.stringify(result, null, 2)}\n`);
      process.exitCode = result.ok ? 0 : 1;
    });
}
