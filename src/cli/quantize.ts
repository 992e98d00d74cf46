/**
 * `kvfence quantize IN OUT --type`: writes a copy of a model folder with its weight matrices in
 * another format (src/model/convert-model.ts; the on-disk format is docs/weights.md's).
 */
import { Command, Option } from "commander";
import { WEIGHT_DTYPES, type WeightDType } from "../kernels/weight-format.js";
import { convertModelFolder } from "../model/convert-model.js";

export function command(): Command {
  return new Command("quantize")
    .description(
      "Write a copy of a model folder with its weight matrices in llama.cpp's q8_0 or q4_0 blocks (or f32, f16, bf16); norms and biases stay f32",
    )
    .argument("<in>", "model folder to read")
    .argument("<out>", "folder to write (created if missing)")
    .addOption(
      new Option("--type <type>", "the weights' format").choices([...WEIGHT_DTYPES]).makeOptionMandatory(),
    )
    .action((inDir: string, outDir: string, opts: { type: WeightDType }) => {
      const started = performance.now();
      try {
        const { bytes } = convertModelFolder(inDir, outDir, opts.type);
        const seconds = (performance.now() - started) / 1000;
        process.stdout.write(
          `Wrote ${outDir} (${opts.type}, ${(bytes / 1e6).toFixed(1)} MB of weights) in ${seconds.toFixed(2)} s\n`,
        );
      } catch (err) {
        process.stderr.write(`kvfence quantize: ${err instanceof Error ? err.message : String(err)}\n`);
        process.exitCode = 1;
      }
    });
}
