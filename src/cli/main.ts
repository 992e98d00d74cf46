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

// One line per subcommand file (kept sorted). Each module exports `command(): Command`.
const commands: Array<() => Promise<{ command(): Command }>> = [
  // cli-commands:begin
  () => import("./bench.js"),
  () => import("./check.js"),
  () => import("./cluster.js"),
  () => import("./drain.js"),
  () => import("./gen-model.js"),
  () => import("./generate.js"),
  () => import("./preflight.js"),
  () => import("./probe.js"),
  () => import("./quantize.js"),
  () => import("./serve.js"),
  // cli-commands:end
];

for (const load of commands) program.addCommand((await load()).command());

try {
  await program.parseAsync(process.argv);
} catch (err) {
  // A subcommand's own refusal of its arguments or input (a KvfenceError carries a message meant
  // for the user) is one line on stderr and exit 2, not a stack trace; anything else is a bug.
  if (!(err instanceof KvfenceError)) throw err;
  process.stderr.write(`kvfence ${process.argv[2] ?? ""}: ${err.message}\n`);
  process.exitCode = 2;
}
