#!/usr/bin/env node
/**
 * The `kvfence` command. Each subcommand lives in its own file under src/cli/ and exports a
 * function returning a commander `Command`; this file only assembles them.
 */
import module from "node:module";
import type { Command as CommandType } from "commander";

// Node ≥ 22.1 keeps the compiled code of every module loaded in a cache on disk (os.tmpdir(),
// checked against each file's source; NODE_DISABLE_COMPILE_CACHE=1 turns it off), which saves
// a good part of each thread's start; Node 20 has no cache and starts as before. The worker
// threads read the directory from the environment, so they share it.
const compileCache = (module as { enableCompileCache?: () => { directory?: string } }).enableCompileCache?.();
if (compileCache?.directory !== undefined) process.env.NODE_COMPILE_CACHE ??= compileCache.directory;
// Loaded after the cache is on, so that they come from it too.
const { Command } = await import("commander");
const { KvfenceError } = await import("../lib/errors.js");

const program = new Command("kvfence")
  .description("A disaggregated LLM inference server whose KV cache is fenced to its owner")
  .version("0.1.0");

// One line per subcommand file (kept sorted): its name and its module, which exports
// `command(): Command`. Only the subcommand named on the command line is loaded (`serve` starts
// without importing the benchmarks, the cluster tools and their packages); without one (help, a
// misspelt name) all are, for commander to list them.
const commands: ReadonlyArray<readonly [string, () => Promise<{ command(): CommandType }>]> = [
  // cli-commands:begin
  ["bench", () => import("./bench.js")],
  ["chaos", () => import("./chaos.js")],
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

// `serve` starts its worker threads first, so that their modules load beside its own.
if (process.argv[2] === "serve")
  (await import("../server/early-threads.js")).startEarlyThreads(process.argv.slice(3));
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
