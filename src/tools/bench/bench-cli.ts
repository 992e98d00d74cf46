/**
 * What the `kvfence bench` subcommands share on the command line: the parsers of their integer
 * options and the action that runs a bench and prints its result.
 */
import { InvalidArgumentError } from "commander";

/** A commander parser of a positive integer option, saying `Expected a positive integer` in its error. */
export function positiveInteger(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isSafeInteger(n) || n < 1) {
    throw new InvalidArgumentError(`Expected a positive integer: ${value}`);
  }
  return n;
}

/** A commander parser of a positive integer option, naming `name` in its error. */
export function positiveInt(name: string): (value: string) => number {
  return (value) => {
    const n = Number(value);
    if (!Number.isInteger(n) || n < 1)
      throw new InvalidArgumentError(`${name} must be a positive integer: ${value}`);
    return n;
  };
}

/**
 * A bench command's action: runs it with its progress on stderr (with `--json` too: a run of
 * minutes shows how far it is, and stdout holds only the JSON), prints the result as JSON or as
 * `format` gives it, and exits 1 on a failure it reports or an error it throws.
 */
export async function runBenchCli<R extends { readonly failures: readonly string[] }>(
  name: string,
  json: boolean | undefined,
  run: (log: (line: string) => void) => Promise<R>,
  format: (result: R) => string,
): Promise<void> {
  try {
    const result = await run((line) => process.stderr.write(`${line}\n`));
    process.stdout.write(`${json === true ? JSON.stringify(result, null, 2) : format(result)}\n`);
    if (result.failures.length > 0) process.exitCode = 1;
  } catch (err) {
    process.stderr.write(`kvfence bench ${name}: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exitCode = 1;
  }
}
