/**
 * `kvfence bench combine FILE...`: pools the paired ratios of several runs of one benchmark (their
 * `--json` results), so a long A/B comparison can run in chunks. Every paired ratio in a result
 * (an object with a `ratio` and the pairs' `logs`, `src/lib/stats.ts`) is found by its path in the
 * JSON; the same path's logs from every file are concatenated and the interval computed again, as
 * if the pairs had come from one run. With three or more files it also gives the interval with each
 * file one unit (`byFile`: the mean of the files' mean logs, Student's t over the files): where each
 * chunk runs on fresh servers and two servers of one build differ by a draw (docs/benchmarks.md §8),
 * the pairs of one chunk share their servers' draw, the pooled interval leaves that out and this one
 * does not.
 */
import { readFileSync } from "node:fs";
import { Command, InvalidArgumentError } from "commander";
import { type RatioInterval, ratioOfLogs } from "../../lib/stats.js";

/** One pooled ratio: its path in the results, the interval of each file's pairs, and of all. */
export interface PooledRatio {
  readonly path: string;
  readonly perFile: readonly (RatioInterval | null)[];
  readonly pooled: RatioInterval;
  /** Each file one unit: the interval of the files' mean log ratios (null under three files). */
  readonly byFile: RatioInterval | null;
}

/** The paired ratios in a bench's JSON result, by path (e.g. `variantOverBaseline`, `arms.0.ratio`). */
export function pairedRatiosIn(value: unknown, path = ""): Map<string, RatioInterval> {
  const found = new Map<string, RatioInterval>();
  const visit = (v: unknown, at: string): void => {
    if (v === null || typeof v !== "object") return;
    const o = v as Record<string, unknown>;
    if (typeof o.ratio === "number" && Array.isArray(o.logs)) {
      found.set(at, o as unknown as RatioInterval);
      return;
    }
    for (const [k, child] of Object.entries(o)) visit(child, at === "" ? k : `${at}.${k}`);
  };
  visit(value, path);
  return found;
}

/**
 * Pools the ratios found at the same path in every result (or at `only`, so runs of different arm
 * sets pool on what they share); a path some results lack is an error.
 */
export function poolRatios(results: readonly unknown[], only?: string): PooledRatio[] {
  const maps = results.map((r) => pairedRatiosIn(r));
  const found = [...new Set(maps.flatMap((m) => [...m.keys()]))];
  if (only !== undefined && !found.includes(only))
    throw new Error(`no ratio at "${only}"; the results have ${found.join(", ")}`);
  const paths = only === undefined ? found : [only];
  if (paths.length === 0)
    throw new Error("no paired ratios with their logs in these results (run the bench with --json)");
  return paths.map((path) => {
    const perFile = maps.map((m) => m.get(path) ?? null);
    const missing = perFile.indexOf(null);
    if (missing >= 0)
      throw new Error(`result ${missing + 1} has no paired ratio at "${path}": not the same benchmark`);
    const means = perFile.map((r) => Math.log(r!.ratio));
    return {
      path,
      perFile,
      pooled: ratioOfLogs(perFile.flatMap((r) => r?.logs ?? [])),
      byFile: means.length >= 3 ? ratioOfLogs(means) : null,
    };
  });
}

const pct = (x: number): string => `${(x * 100).toFixed(1)}%`;

/** What to check of the pooled intervals: the lower end at or above `atLeast`, the upper at or below `atMost`. */
export interface PooledGoal {
  readonly atLeast?: number;
  readonly atMost?: number;
}

export function formatPooled(pooled: readonly PooledRatio[], goal: PooledGoal = {}): string {
  const verdict = (p: RatioInterval, bound: number, above: boolean, indent: string): string => {
    const holds = above ? p.low >= bound : p.high <= bound;
    const fails = above ? p.high < bound : p.low > bound;
    return `\n${indent}${above ? "≥" : "≤"} ${pct(bound)}: ${holds ? "holds" : fails ? "FAILS" : "undecided"}`;
  };
  /** The goal's verdicts on `p`, one line each. */
  const verdicts = (p: RatioInterval, indent: string): string =>
    (goal.atLeast === undefined ? "" : verdict(p, goal.atLeast, true, indent)) +
    (goal.atMost === undefined ? "" : verdict(p, goal.atMost, false, indent));
  return pooled
    .map(({ path, perFile, pooled: p, byFile }) => {
      const files = perFile.map((r) => `${pct(r!.ratio)} (n ${r!.n})`).join(", ");
      let line = `${path}: ${pct(p.ratio)} [95% CI ${pct(p.low)}–${pct(p.high)}] over ${p.n} pairs; per file ${files}`;
      line += verdicts(p, "  ");
      if (byFile !== null) {
        line += `\n  each file one unit: ${pct(byFile.ratio)} [95% CI ${pct(byFile.low)}–${pct(byFile.high)}] over ${byFile.n} files`;
        line += verdicts(byFile, "    ");
      }
      return line;
    })
    .join("\n");
}

const ratioOption = (v: string): number => {
  const x = Number(v);
  if (!(x > 0)) throw new InvalidArgumentError("give a positive ratio, e.g. 0.98");
  return x;
};

export function combineCommand(): Command {
  return new Command("combine")
    .description(
      "Pools the paired A/B ratios of several --json results of one benchmark (runs made in chunks)",
    )
    .argument("<files...>", "JSON results of the same benchmark (`kvfence bench … --json > chunk1.json`)")
    .option("--path <path>", "only the ratio at this path of the results (e.g. variantOverBaseline)")
    .option(
      "--at-least <ratio>",
      "whether each pooled CI's lower end is at or above this (a throughput goal: 0.98)",
      ratioOption,
    )
    .option(
      "--at-most <ratio>",
      "whether each pooled CI's upper end is at or below this (a cost goal: 1.02)",
      ratioOption,
    )
    .option("--json", "print the pooled ratios as JSON")
    .action((files: string[], o: { path?: string; atLeast?: number; atMost?: number; json?: boolean }) => {
      try {
        const results = files.map((f) => {
          try {
            return JSON.parse(readFileSync(f, "utf8")) as unknown;
          } catch (err) {
            throw new Error(`${f}: ${err instanceof Error ? err.message : String(err)}`);
          }
        });
        const pooled = poolRatios(results, o.path);
        process.stdout.write(
          `${o.json === true ? JSON.stringify(pooled, null, 2) : formatPooled(pooled, o)}\n`,
        );
      } catch (err) {
        process.stderr.write(`kvfence bench combine: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 1;
      }
    });
}
