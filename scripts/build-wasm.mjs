// Builds the WebAssembly SIMD kernels from src/kernels/assembly with AssemblyScript, if present.
// The fast-kernel work fills this in; until then there is nothing to build.
import { existsSync } from "node:fs";
if (!existsSync(new URL("../src/kernels/assembly/index.ts", import.meta.url))) process.exit(0);
