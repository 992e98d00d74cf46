/**
 * What `kvfence serve`'s main thread loads before it listens (cli/serve.js's static imports): the
 * router, the weights' loader and the kernels' choice, but not the modules only its worker threads
 * run: the engine and the node server (the prefill and decode threads; a `--role` node loads
 * them when it starts) and the request schemas (the preparation workers). Each is a share of the
 * main thread's start-up (the schemas and the engine: ~0.2 s CPU on Node 20).
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { importChain, staticImports } from "../../testing/static-imports.js";

const WORKER_ONLY = [
  "engine/engine.js",
  "node/node-server.js",
  "router/openai-schemas.js",
  "router/prepare-request.js",
];

test("kvfence serve's main thread statically imports neither the engine, the node server nor the request schemas", () => {
  const graph = staticImports(fileURLToPath(new URL("../cli/serve.js", import.meta.url)));
  assert.ok(graph.size > 50, `the walk found the main thread's modules: ${graph.size}`);
  assert.ok(
    [...graph.keys()].some((k) => k.endsWith("/router/router-server.js")),
    "the router is there",
  );
  for (const module of WORKER_ONLY) {
    const hit = [...graph.keys()].find((k) => k.endsWith(`/${module}`));
    if (hit !== undefined) assert.fail(`${module} is loaded by: ${importChain(graph, hit)}`);
  }
});
