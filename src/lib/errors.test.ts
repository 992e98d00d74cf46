import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError, publicError } from "./errors.js";

test("publicError() puts the table's public message in place of the internal one and keeps the Retry-After", () => {
  const internal = new KvfenceError(
    "node_unavailable",
    "Every prefill/decode node pair went down while request 7 waited on decode-0",
    { retryAfter: 1, param: "messages" },
  );
  const shown = publicError(internal);
  assert.equal(shown.code, "node_unavailable");
  assert.doesNotMatch(shown.message, /decode-0|request 7/);
  assert.equal(shown.retryAfter, 1, "a refusal the client may retry keeps its Retry-After");
  assert.equal(shown.param, "messages");
  // A code without a public message (the fair share's refusals name no internals) is unchanged.
  const busy = new KvfenceError("server_busy", "The server is full: retry later", { retryAfter: 1 });
  assert.equal(publicError(busy), busy);
});
