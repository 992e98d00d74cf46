/**
 * `startServer` parses the main thread's tokenizer while the engine threads build their engines
 * (start-server.ts, `withTokenizerMeanwhile`): a tokenizer that does not belong to the model still
 * fails the start with its `bad_model_folder` line, and the engines and workers started meanwhile
 * are stopped (this file's process could not end otherwise).
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { writeModelFolder } from "../../testing/model-folder.js";
import { startTestServer } from "../../testing/start-server.js";
import { KvfenceError } from "../lib/errors.js";
import { byteLevelTokenizerJson } from "../model/gen-model.js";

for (const disaggregation of [true, false]) {
  test(`startServer() refuses a tokenizer with ids past the model's vocabulary (disaggregation ${disaggregation})`, async () => {
    // The weights and config.json hold 300 ids; the tokenizer names 400.
    const folder = writeModelFolder({
      files: { "tokenizer.json": JSON.stringify(byteLevelTokenizerJson(400)) },
    });
    try {
      await assert.rejects(
        startTestServer({ model: folder.dir, disaggregation }),
        (err: unknown) =>
          err instanceof KvfenceError &&
          err.code === "bad_model_folder" &&
          /tokenizer has token ids up to 399 but config\.json has vocab_size 300/.test(err.message),
      );
    } finally {
      folder.remove();
    }
  });
}
