// Builds the WebAssembly SIMD kernels (src/kernels/assembly/index.ts) with AssemblyScript into
// dist/src/kernels/kernels.wasm, next to the loader (src/kernels/wasm-kernels.ts) that reads it.
// The module imports a shared memory (env.memory) and has no data segments, so the main thread and
// the worker can both instantiate it over the same memory. Run by `npm run build` (and so by
// `npm ci` through `prepare`); the .wasm is never committed.
import { existsSync, mkdirSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const entry = "src/kernels/assembly/index.ts";
if (!existsSync(`${root}${entry}`)) process.exit(0);

const { default: asc } = await import("assemblyscript/asc");
mkdirSync(`${root}dist/src/kernels`, { recursive: true });
const args = [
  entry,
  "--outFile",
  "dist/src/kernels/kernels.wasm",
  "-O3",
  "--noAssert",
  "--runtime",
  "stub",
  "--enable",
  "simd,threads",
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
  console.error(`build-wasm: AssemblyScript failed: ${error.message}\n${stderr.toString()}`);
  process.exit(1);
}
