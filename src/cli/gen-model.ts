/** `kvfence gen-model`: write a random-weight model folder with a known model's shapes (for benchmarks). */
import { Command, InvalidArgumentError, Option } from "commander";
import { genModel, MODEL_SHAPES } from "../model/gen-model.js";

function integer(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isSafeInteger(n))
    throw new InvalidArgumentError(`Expected an integer: ${value}`);
  return n;
}

export function command(): Command {
  return new Command("gen-model")
    .description(
      "Write a random-weight model folder (f32, bf16 or f16) with the exact shapes of a known model (for benchmarks; not trained)",
    )
    .argument("<dir>", "folder to write (created if missing)")
    .addOption(
      new Option("--like <model>", "model whose shapes to copy")
        .choices(Object.keys(MODEL_SHAPES))
        .default("smollm2-135m"),
    )
    .option("--seed <n>", "seed of the weights", integer, 0)
    .addOption(
      new Option("--dtype <dtype>", "format of the weights in model.safetensors")
        .choices(["f32", "bf16", "f16"])
        .default("f32"),
    )
    .action((dir: string, opts: { like: string; seed: number; dtype: "f32" | "bf16" | "f16" }) => {
      const started = performance.now();
      const tty = process.stderr.isTTY === true;
      let shown = -1;
      try {
        const { bytes } = genModel(dir, {
          like: opts.like,
          seed: opts.seed,
          dtype: opts.dtype.toUpperCase() as "F32" | "F16" | "BF16",
          onProgress: (written, total) => {
            const percent = Math.floor((written / total) * 100);
            // A TTY gets a line redrawn per percent; logs get one line per 10%.
            const step = tty ? percent : Math.floor(percent / 10) * 10;
            if (step === shown) return;
            shown = step;
            process.stderr.write(
              `${tty ? "\r" : ""}writing weights: ${step}% of ${(total / 1e6).toFixed(1)} MB${tty ? "" : "\n"}`,
            );
          },
        });
        if (tty) process.stderr.write("\n");
        const seconds = (performance.now() - started) / 1000;
        process.stdout.write(
          `Wrote ${dir} (like ${opts.like}, seed ${opts.seed}, ${opts.dtype}, ${(bytes / 1e6).toFixed(1)} MB of weights) in ${seconds.toFixed(2)} s\n`,
        );
      } catch (err) {
        process.stderr.write(
          `${tty && shown >= 0 ? "\n" : ""}kvfence gen-model: ${err instanceof Error ? err.message : String(err)}\n`,
        );
        process.exitCode = 1;
      }
    });
}
