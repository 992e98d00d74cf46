/**
 * The load of a bench whose arms are servers (`cluster`, `fair-share`, `observability`): the model
 * and each server's KV pool, the rounds and warm-up, and each round's chat requests — as the run
 * options take them (`ArmLoadOptions`), as the command line gives them (`armLoadOptions`,
 * `ArmLoadCliOptions`, `armLoadOf`), and as the `kvfence serve` flags every arm shares
 * (`serveArgsOf`). Each bench keeps its own defaults.
 */
import type { Command } from "commander";
import { bundledModelDir } from "../../lib/package-root.js";
import { positiveInt } from "./bench-cli.js";

/** The load options of a bench's run. */
export interface ArmLoadOptions {
  /** A Hugging Face model folder (default: the bundled kvfence-tiny). */
  readonly model?: string;
  /** KV pool of each engine or node in pages. */
  readonly kvPages?: number;
  /** Measured rounds (each runs every arm). */
  readonly rounds?: number;
  readonly warmup?: number;
  /** Requests per arm per round. */
  readonly requests?: number;
  /** Requests in flight at once. */
  readonly concurrency?: number;
  readonly maxTokens?: number;
  /** Characters per prompt (the bundled model: about one token each). */
  readonly promptChars?: number;
  readonly log?: (line: string) => void;
}

/** The load options as commander gives them. */
export interface ArmLoadCliOptions {
  model?: string;
  kvPages: number;
  rounds: number;
  warmup: number;
  requests: number;
  concurrency: number;
  maxTokens: number;
  promptChars: number;
}

/** Those options as the bench's run options take them (no `model`: the bundled one). */
export function armLoadOf(o: ArmLoadCliOptions) {
  return {
    ...(o.model === undefined ? {} : { model: o.model }),
    kvPages: o.kvPages,
    rounds: o.rounds,
    warmup: o.warmup,
    requests: o.requests,
    concurrency: o.concurrency,
    maxTokens: o.maxTokens,
    promptChars: o.promptChars,
  };
}

/**
 * The options of a bench that loads server arms with the same chats (cluster, fair-share,
 * observability): the model and pool, rounds and warm-up, and each round's requests; `--json`.
 */
export function armLoadOptions(
  cmd: Command,
  defaults: {
    kvPages: number;
    rounds: number;
    warmup: number;
    requests: number;
    concurrency: number;
    promptChars: number;
  },
): Command {
  return cmd
    .option("--model <dir>", "Hugging Face model folder (default: bundled kvfence-tiny)")
    .option(
      "--kv-pages <n>",
      "KV pool of each engine or node in pages",
      positiveInt("--kv-pages"),
      defaults.kvPages,
    )
    .option("--rounds <n>", "measured rounds (each runs both arms)", positiveInt("--rounds"), defaults.rounds)
    .option(
      "--warmup <n>",
      "warm-up rounds",
      (v) => (v === "0" ? 0 : positiveInt("--warmup")(v)),
      defaults.warmup,
    )
    .option("--requests <n>", "chat requests per arm per round", positiveInt("--requests"), defaults.requests)
    .option("--concurrency <n>", "requests in flight", positiveInt("--concurrency"), defaults.concurrency)
    .option("--max-tokens <n>", "max_tokens of each request", positiveInt("--max-tokens"), 64)
    .option(
      "--prompt-chars <n>",
      "characters per prompt",
      positiveInt("--prompt-chars"),
      defaults.promptChars,
    )
    .option("--json", "print the result as JSON");
}

/** The `kvfence serve` flags every arm shares: the model (default the bundled one) and its pool's pages. */
export function serveArgsOf(
  options: { readonly model?: string; readonly kvPages?: number },
  defaultKvPages: number,
): string[] {
  return [
    "--model",
    options.model ?? bundledModelDir(),
    "--kv-pages",
    String(options.kvPages ?? defaultKvPages),
  ];
}
