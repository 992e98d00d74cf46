import assert from "node:assert/strict";
import { test } from "node:test";
import { prefixBlockKey, prefixCacheSalt } from "./prefix-key.js";
import { makeSafety, SAFE } from "./safety.js";

test("prefixCacheSalt() derives the salt from the authenticated tenant, not the client field", () => {
  assert.notEqual(prefixCacheSalt(SAFE, 0, null), prefixCacheSalt(SAFE, 1, null));
  // A client of tenant 1 forging tenant 0's salt still lands in tenant 1's namespace.
  assert.notEqual(prefixCacheSalt(SAFE, 1, "tenant:0"), prefixCacheSalt(SAFE, 0, null));
});

test("prefixCacheSalt() under shared-prefix with the guard off shares keys across tenants", () => {
  const leaky = makeSafety({ faults: ["shared-prefix"], disabledGuards: ["tenant-salt"] });
  assert.equal(prefixCacheSalt(leaky, 0, null), prefixCacheSalt(leaky, 1, null));
});

test("prefixBlockKey() chains: different salts or tokens give different keys", () => {
  const a = prefixBlockKey("tenant:0", [1, 2]);
  assert.equal(a, prefixBlockKey("tenant:0", [1, 2]));
  assert.notEqual(a, prefixBlockKey("tenant:1", [1, 2]));
  assert.notEqual(a, prefixBlockKey("tenant:0", [1, 3]));
  assert.notEqual(prefixBlockKey(a, [3]), prefixBlockKey(prefixBlockKey("tenant:1", [1, 2]), [3]));
});
