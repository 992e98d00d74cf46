/**
 * The threads `kvfence serve` starts before its modules load (early-threads.ts): which model the
 * first preparation worker reads meanwhile, from the command line alone.
 */
import assert from "node:assert/strict";
import { resolve } from "node:path";
import { test } from "node:test";
import { modelNamed } from "./early-threads.js";

test("modelNamed() takes the first word or --model's value as an absolute path, else none", () => {
  assert.equal(modelNamed(["/m/a", "--port", "0"]), "/m/a");
  assert.equal(modelNamed(["rel/b.gguf"]), resolve("rel/b.gguf"));
  assert.equal(modelNamed(["--host", "127.0.0.1", "--model", "/m/c"]), "/m/c");
  assert.equal(modelNamed(["--port", "0", "--model=/m/d"]), "/m/d");
  // The bundled model (no model named), and a value that is not one.
  assert.equal(modelNamed(["--port", "8000"]), undefined);
  assert.equal(modelNamed(["--model="]), undefined);
});
