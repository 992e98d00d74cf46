#!/usr/bin/env node
/**
 * The `kvfence` command. Each subcommand lives in its own file under src/cli/ and exports a
 * function returning a commander `Command`; this file only assembles them.
 */
import { Command } from "commander";
import { KvfenceError } from "../lib/errors.js";

const program = new Command("kvfence")
  .description("A disaggregated LLM inference server whose KV cache is fenced to its owner")
  .version("0.1.0");

// One line per subcommand file (kept sorted): its name and its module, which exports
// `command(): Command`. Only the subcommand named on the command line is loaded (`serve` starts
// without importing the benchmarks, the cluster tools and their packages); without one (help, a
// misspelt name) all are, for commander to list them.
const commands: ReadonlyArray<readonly [string, () => Promise<{ command(): Command }>]> = [
  // cli-commands:begin
  ["bench", () => import("./bench.js")],
  ["check", () => import("./check.js")],
  ["cluster", () => import("./cluster.js")],
  ["drain", () => import("./drain.js")],
  ["gen-model", () => import("./gen-model.js")],
  ["generate", () => import("./generate.js")],
  ["preflight", () => import("./preflight.js")],
  ["probe", () => import("./probe.js")],
  ["quantize", () => import("./quantize.js")],
  ["role", () => import("./role.js")],
  ["serve", () => import("./serve.js")],
  // cli-commands:end
];

const named = commands.filter(([name]) => name === process.argv[2]);
for (const [name, load] of named.length === 1 ? named : commands) {
  const cmd = (await load()).command();
  if (cmd.name() !== name) throw new Error(`src/cli/main.ts lists ${name} for the command: ${cmd.name()}`);
  program.addCommand(cmd);
}

try {
  await program.parseAsync(process.argv);
} catch (err) {
  // A subcommand's own refusal of its arguments or input (a KvfenceError carries a message meant
  // for the user) is one line on stderr and exit 2, not a stack trace; anything else is a bug.
  if (!(err instanceof KvfenceError)) throw err;
  process.stderr.write(`kvfence ${process.argv[2] ?? ""}: ${err.message}\n`);
  process.exitCode = 2;
}
