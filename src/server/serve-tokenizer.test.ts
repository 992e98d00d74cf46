/**
 * `serveTokenizer` (serve-tokenizer.ts): with a byte-level vocabulary the router's thread answers
 * from the bytes the first preparation worker hands it, never parsing tokenizer.json itself (a
 * quarter of a second of `kvfence serve`'s start-up), with the same pieces and streamed text as
 * the model's own tokenizer; without a ready worker it parses the tokenizer as before.
 */
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { writeModelFolder } from "../../testing/model-folder.js";
import { FIRST_SPECIAL_ID } from "../model/gen-model.js";
import { openModelHeader } from "../model/load-model.js";
import { PreparePool } from "../router/prepare-pool.js";
import { requestLimits } from "../router/request-limits.js";
import type { RouterTokenizer } from "../router/router-server.js";
import { ModelTokenizer } from "../tokenizer/tokenizer.js";
import { serveTokenizer } from "./serve-tokenizer.js";

/** Every id's piece, and a sequence (specials among ids of 1–3 bytes) streamed with and without the specials. */
function assertSameText(got: RouterTokenizer, want: ModelTokenizer): void {
  assert.equal(got.vocabSize, want.numIds);
  for (let id = 0; id < want.numIds; id++) {
    const { text, bytes } = want.tokenPiece(id);
    assert.deepEqual(got.tokenPiece(id), { text, bytes: Array.from(bytes) }, `token ${id}`);
  }
  assert.ok(want.isSpecial(FIRST_SPECIAL_ID), "a special token");
  const ids = [
    ...want.encode("héllo wörld ✓ 🙂 done"),
    FIRST_SPECIAL_ID,
    ...want.encode("🙂"),
    want.numIds - 1,
  ];
  for (const skipSpecialTokens of [true, false]) {
    const stream = want.streamDecoder({ skipSpecialTokens });
    const decoder = got.createDecoder({ skipSpecialTokens });
    assert.equal(
      ids.map((id) => decoder.push([id])).join("") + decoder.flush(),
      ids.map((id) => stream.push(id)).join("") + stream.flush(),
    );
  }
}

test("serveTokenizer() answers from the first preparation worker's token bytes without reading tokenizer.json", async () => {
  const folder = writeModelFolder();
  const pool = await PreparePool.start({
    modelDir: folder.dir,
    modelId: "m",
    limits: requestLimits(2048),
    threads: 1,
  });
  try {
    const header = await openModelHeader(folder.dir);
    const own = ModelTokenizer.fromFolder(folder.dir);
    // This thread could not parse it now: the worker's table must do.
    writeFileSync(join(folder.dir, "tokenizer.json"), "{ not json");
    const tokenizer = await serveTokenizer(header, {}, Promise.resolve(pool));
    assertSameText(tokenizer, own);
    assert.deepEqual(tokenizer.tokenBounds, pool.tokenBounds);
  } finally {
    await pool.close();
    folder.remove();
  }
});

test("serveTokenizer() parses the tokenizer itself when no preparation worker got ready", async () => {
  const folder = writeModelFolder();
  try {
    const header = await openModelHeader(folder.dir);
    const failed = Promise.reject(new Error("the preparation worker exited with code 1 before it was ready"));
    assertSameText(await serveTokenizer(header, {}, failed), ModelTokenizer.fromFolder(folder.dir));
  } finally {
    folder.remove();
  }
});
