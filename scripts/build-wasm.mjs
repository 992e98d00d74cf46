// Builds the WebAssembly SIMD kernels (src/kernels/assembly/index.ts) with AssemblyScript, twice,
// next to the loader (src/kernels/wasm-kernels.ts) that reads them:
//   dist/src/kernels/kernels.wasm      SIMD128 (multiply, then add)
//   dist/src/kernels/kernels-fma.wasm  SIMD128 plus relaxed SIMD (f32x4.relaxed_madd: fused multiply-add)
// The loader takes the second where the engine accepts relaxed SIMD. Each module imports a shared
// memory (env.memory) and has no data segments, so the main thread and the worker can both
// instantiate it over the same memory. Run by `npm run build` (and so by `npm ci` through
// `prepare`); the .wasm files are never committed.
import { existsSync, mkdirSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const entry = "src/kernels/assembly/index.ts";
if (!existsSync(`${root}${entry}`)) process.exit(0);

const { default: asc } = await import("assemblyscript/asc");
mkdirSync(`${root}dist/src/kernels`, { recursive: true });
for (const [out, features] of [
  ["kernels.wasm", "simd,threads"],
  ["kernels-fma.wasm", "simd,threads,relaxed-simd"],
]) {
  const args = [
    entry,
    "--outFile",
    `dist/src/kernels/${out}`,
    "-O3",
    "--noAssert",
    "--runtime",
    "stub",
    "--enable",
    features,
    "--importMemory",
    "--sharedMemory",
    "--initialMemory",
    "1",
    "--maximumMemory",
    "65536",
    "--use",
    "abort=",
  ];
  const { error, stderr } = await asc.main(args, { stdout: process.stdout, stderr: process.stderr, baseDir: root });
  if (error) {
    console.error(`build-wasm: AssemblyScript failed on ${out}: ${error.message}\n${stderr.toString()}`);
    process.exit(1);
  }
}
