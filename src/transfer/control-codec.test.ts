import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";
import { clusterSecretBytes, hmac, sessionKeys, verifyHmac, weakSecretReason } from "./control-auth.js";
import {
  decodeControl,
  encodeControl,
  parseWithInt32Arrays,
  stringifyWithInt32Arrays,
} from "./control-codec.js";

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

test("stringifyWithInt32Arrays() writes an Int32Array as base64 that parseWithInt32Arrays() reads back", () => {
  const prompt = Int32Array.from([0, 1, -5, 2 ** 31 - 1, -(2 ** 31), 151_643]);
  const message = { kind: "protocol", msg: { type: "prefill", rid: 3, promptTokens: prompt } };
  const text = stringifyWithInt32Arrays(message);
  assert.match(text, /"promptTokens":\{"\$i32":"[A-Za-z0-9+/=]+"\}/);
  assert.deepEqual(parseWithInt32Arrays(text), message);
  // An empty one, and a message without any: plain JSON either way.
  assert.deepEqual(parseWithInt32Arrays(stringifyWithInt32Arrays({ ids: new Int32Array(0) })), {
    ids: new Int32Array(0),
  });
  assert.deepEqual(parseWithInt32Arrays('{"tokens":[1,2],"note":"$i32"}'), { tokens: [1, 2], note: "$i32" });
});

test("parseWithInt32Arrays() refuses an Int32Array whose bytes are not whole int32s, with transfer_failed", () => {
  assert.throws(() => parseWithInt32Arrays('{"p":{"$i32":"AQID"}}'), {
    code: "transfer_failed",
    message: /not a multiple of 4: 3/,
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
  assert.equal(clusterSecretBytes("9f3c07be51d2a86e").length, 16);
});

test("clusterSecretBytes() refuses a trivially guessable secret and says which rule it broke", () => {
  const weak: Array<[string, RegExp]> = [
    ["aaaaaaaaaaaaaaaa", /too few distinct characters, 6 at least: 1$/],
    ["passwordpassword", /repeats a 8-character pattern$/],
    ["abababababababababab", /too few distinct characters, 6 at least: 2$/],
    ["abcdefghijklmnop", /arithmetic sequence/],
    ["0123456789abcdef", /arithmetic sequence/],
    ["k3x9q7w2k3x9q7w2k3x9q7w2", /repeats a 8-character pattern$/],
    ["secret-zzzzzzzz-value", /repeats more than 6 times in a row: 8$/],
    ["a-long-cluster-secret-0000000000000000", /repeats more than 9 times in a row: 16$/],
    ["aaaefbaeabcaaaad", /estimated entropy under 32 bits: 31.5 bits$/],
  ];
  for (const [secret, message] of weak) {
    assert.throws(() => clusterSecretBytes(secret), { code: "config_invalid", message }, secret);
  }
  // Random secrets pass: `openssl rand -hex 24` (48 characters) and 16 random bytes.
  for (let i = 0; i < 200; i++) {
    assert.ok(clusterSecretBytes(randomBytes(24).toString("hex")));
    assert.equal(weakSecretReason(randomBytes(16)), null);
  }
  // A random hex secret may hold a run of 7 (about once in 400,000 draws; it once failed CI): the
  // longest run allowed grows with the length, a quarter of it (12 characters here).
  const hex = randomBytes(24).toString("hex");
  assert.equal(weakSecretReason(Buffer.from(`${hex.slice(0, 20)}7777777${hex.slice(27)}`)), null);
  assert.match(
    weakSecretReason(Buffer.from(`${hex.slice(0, 20)}7777777777777${hex.slice(33)}`)) ?? "",
    /more than 12 times in a row/,
  );
});
