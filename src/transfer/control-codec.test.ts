import assert from "node:assert/strict";
import { test } from "node:test";
import { clusterSecretBytes, hmac, sessionKeys, verifyHmac } from "./control-auth.js";
import { decodeControl, encodeControl } from "./control-codec.js";

test("encodeControl() round-trips a manifest through decodeControl()", () => {
  const message = {
    type: "manifest",
    rid: 7,
    epoch: 1,
    tokenStart: 0,
    tokenEnd: 32,
    firstToken: 5,
    checksums: ["0000000000000000", "ffffffffffffffff"],
  } as const;
  assert.deepEqual(decodeControl(encodeControl(message)), message);
});

test("decodeControl() rejects non-objects and bad JSON with transfer_failed", () => {
  assert.throws(() => decodeControl(Buffer.from("[1,2]")), { code: "transfer_failed" });
  assert.throws(() => decodeControl(Buffer.from("{nope")), { code: "transfer_failed" });
  assert.throws(() => decodeControl(Buffer.from('{"type":3}')), {
    code: "transfer_failed",
    message: /no string type/,
  });
});

test("verifyHmac() accepts its own MAC and rejects a flipped bit or another key", () => {
  const key = Buffer.alloc(32, 1);
  const data = Buffer.from("abort rid=1 epoch=2");
  const mac = hmac(key, data);
  assert.equal(verifyHmac(key, mac, data), true);
  const flipped = Buffer.from(mac);
  flipped[0]! ^= 1;
  assert.equal(verifyHmac(key, flipped, data), false);
  assert.equal(verifyHmac(Buffer.alloc(32, 2), mac, data), false);
  assert.equal(verifyHmac(key, mac.subarray(0, 31), data), false);
});

test("sessionKeys() differ per direction and per nonce pair", () => {
  const secret = Buffer.alloc(32, 9);
  const a = sessionKeys(secret, Buffer.alloc(16, 1), Buffer.alloc(16, 2));
  const b = sessionKeys(secret, Buffer.alloc(16, 1), Buffer.alloc(16, 3));
  assert.notDeepEqual(a.clientToServer, a.serverToClient);
  assert.notDeepEqual(a.clientToServer, b.clientToServer);
});

test("clusterSecretBytes() rejects a short secret with config_invalid", () => {
  assert.throws(() => clusterSecretBytes("short"), {
    code: "config_invalid",
    message: /too short.*: 5 bytes$/,
  });
  assert.equal(clusterSecretBytes("0123456789abcdef").length, 16);
});
