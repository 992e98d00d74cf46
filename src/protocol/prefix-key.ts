/**
 * Prefix-cache block keys (docs/design.md §3): a SHA-256 hash chain over full pages of token ids,
 * seeded with a salt the server derives from the **authenticated** tenant (and, in the `key`
 * scope, the API key), so a page cached for one tenant can never be a hit for another
 * (docs/prior-art.md H9: vLLM's client-supplied `cache_salt`, CVE-2025-46570). A client's own
 * `cache_salt` may only narrow the namespace further, never replace the tenant's. A key is
 * `SHA-256(parent key, token ids as u32 little-endian)`, the root's parent being
 * `SHA-256("kvfence prefix root", salt)`; SHA-256, not a 32-bit hash, because a collision would
 * serve one prefix's KV for another (vLLM moved its block hashes to SHA-256 for this), and the
 * cache compares the stored token ids on every hit as well (`prefix-tokens`,
 * `src/protocol/prefix-cache.ts`).
 *
 * Faults: under `shared-prefix` (with the `tenant-salt` guard off) the salt is the client's field
 * alone, as in engines where the gateway must inject it; under `prefix-collision` every key is cut
 * to `COLLISION_KEY_BITS` bits, so different prefixes share keys; under `stale-epoch` the salt omits the
 * tenant's cache epoch, so a rotation retires no key.
 */
import { createHash } from "node:crypto";
import { faultOn, guardOn, type Safety } from "./safety.js";

/** Bits a key keeps under the `prefix-collision` fault. */
export const COLLISION_KEY_BITS = 2;

/**
 * The salt that seeds a request's block-hash chain: the authenticated tenant and its cache epoch
 * (keys file `cache_epoch`; 0 adds nothing, so keys of before epochs existed stay valid), then the
 * server's narrower namespace (`scope`: the API key's in the `key` scope, "" in the `tenant`
 * scope), then the client's `cache_salt`.
 */
export function prefixCacheSalt(
  safety: Safety,
  tenant: number,
  clientSalt: string | null,
  scope = "",
  cacheEpoch = 0,
): string {
  if (guardOn(safety, "tenant-salt")) {
    // Under `stale-epoch` a rotation changes no key (the tiers' `tier-epoch` guard still refuses the record).
    const epoch = faultOn(safety, "stale-epoch") ? 0 : cacheEpoch;
    const owner = epoch === 0 ? `tenant:${tenant}` : `tenant:${tenant}|epoch:${epoch}`;
    const server = scope === "" ? owner : `${owner}|${scope}`;
    return clientSalt === null ? server : `${server}|client:${clientSalt}`;
  }
  if (faultOn(safety, "shared-prefix")) return clientSalt ?? "";
  return "";
}

/** The parent key of a chain's first block. */
export function prefixRootKey(salt: string): string {
  return createHash("sha256").update("kvfence prefix root\u0000").update(salt).digest("hex");
}

/**
 * The key of one block: SHA-256 of the parent block's key (or the root key) and the block's token
 * ids. With `safety` given, the `prefix-collision` fault cuts it to `COLLISION_KEY_BITS` bits.
 */
export function prefixBlockKey(parentKey: string, tokens: ArrayLike<number>, safety?: Safety): string {
  const bytes = Buffer.allocUnsafe(tokens.length * 4);
  for (let i = 0; i < tokens.length; i++) bytes.writeUInt32LE(tokens[i]! >>> 0, i * 4);
  const key = createHash("sha256").update(parentKey).update(bytes).digest("hex");
  if (safety !== undefined && faultOn(safety, "prefix-collision")) {
    return (Number.parseInt(key.slice(0, 2), 16) >>> (8 - COLLISION_KEY_BITS)).toString(16);
  }
  return key;
}
