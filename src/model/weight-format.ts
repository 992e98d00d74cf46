/**
 * The weight formats live beside the kernels that read them, in src/kernels/weight-format.ts. This
 * re-export only keeps the four importers another pass of issue 32 is rewriting building
 * (src/cli/bench.ts, src/cli/quantize.ts, src/tools/bench/model.ts and its test); once they import
 * src/kernels/weight-format.ts, this file goes. Nothing new imports it.
 */
export * from "../kernels/weight-format.js";
