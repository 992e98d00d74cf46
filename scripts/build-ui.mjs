// Builds the operator dashboard (ui/, served by the router at /kvfence/ui; src/router/dashboard.ts)
// into dist/ui/: esbuild bundles ui/dashboard.ts with uPlot (and their CSS) into dashboard.js and
// dashboard.css, and index.html is copied beside them. Nothing is loaded from a CDN at run time.
// Run by `npm run build` after the type check of ui/ (tsc -p ui).
import { copyFileSync, existsSync, mkdirSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
if (!existsSync(`${root}ui/dashboard.ts`)) process.exit(0);
const { build } = await import("esbuild");
mkdirSync(`${root}dist/ui`, { recursive: true });
await build({
  absWorkingDir: root,
  entryPoints: ["ui/dashboard.ts"],
  bundle: true,
  format: "esm",
  target: "es2022",
  minify: true,
  sourcemap: false,
  outdir: "dist/ui",
  logLevel: "warning",
});
copyFileSync(`${root}ui/index.html`, `${root}dist/ui/index.html`);
