import assert from "node:assert/strict";
import { test } from "node:test";
import { modelDir } from "../../testing/start-server.js";
import { parseServeConfig } from "../server/serve-config.js";
import { advertisedMismatch, dialledMismatch, linkAddress, parseLinkAddress } from "./link-address.js";

test("linkAddress() writes the host lowercase and an IPv6 host in brackets", () => {
  assert.equal(linkAddress("127.0.0.1", 9001), "127.0.0.1:9001");
  assert.equal(linkAddress("Node-1.Internal", 9001), "node-1.internal:9001");
  assert.equal(linkAddress("::1", 9001), "[::1]:9001");
  assert.equal(linkAddress("[FD00::5]", 9002), "[fd00::5]:9002");
});

test("parseLinkAddress() reads host:port and [v6]:port, and nothing else", () => {
  assert.deepEqual(parseLinkAddress("10.0.0.11:9001"), { host: "10.0.0.11", port: 9001 });
  assert.deepEqual(parseLinkAddress("[::1]:9001"), { host: "::1", port: 9001 });
  for (const bad of ["10.0.0.11", "http://10.0.0.11:9001", "::1:9001", "host:0", "host:70000", "a b:1"])
    assert.equal(parseLinkAddress(bad), null, bad);
});

test("dialledMismatch() and advertisedMismatch() accept the same address only, saying what differs", () => {
  assert.equal(dialledMismatch("127.0.0.1:9001", "127.0.0.1:9001"), null);
  assert.equal(advertisedMismatch("127.0.0.1:9001", "127.0.0.1:9001"), null);
  assert.match(
    dialledMismatch("127.0.0.1:4000", "127.0.0.1:9001") ?? "",
    /^the peer dialled 127\.0\.0\.1:4000, this node answers to 127\.0\.0\.1:9001 \(a relay.*--advertise.*\): 127\.0\.0\.1:4000$/,
  );
  assert.match(
    advertisedMismatch("127.0.0.1:9001", "127.0.0.1:4000") ?? "",
    /^the node dialled at 127\.0\.0\.1:4000 answers to 127\.0\.0\.1:9001 /,
  );
  // A peer that names no address (an older kvfence) is refused too.
  assert.match(
    dialledMismatch(undefined, "127.0.0.1:9001") ?? "",
    /dialled no address \(an older kvfence\?\)/,
  );
  assert.match(advertisedMismatch(7, "127.0.0.1:9001") ?? "", /answers to no address/);
});

test("parseServeConfig() refuses an --advertise that is not host:port", () => {
  const raw = {
    host: "127.0.0.1",
    port: "0",
    model: modelDir("kvfence-tiny"),
    pageSize: "16",
    logLevel: "silent",
    scrubOnFree: false,
    disaggregation: true,
    role: "prefill",
    clusterSecret: "a-cluster-secret-of-some-length",
  };
  assert.throws(
    () => parseServeConfig({ ...raw, advertise: "http://10.0.0.11:9001" }),
    /--advertise: must be host:port, e\.g\. 10\.0\.0\.11:9001/,
  );
  assert.equal(parseServeConfig({ ...raw, advertise: "10.0.0.11:9001" }).advertise, "10.0.0.11:9001");
});
