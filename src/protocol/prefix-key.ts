/**
 * Prefix-cache block keys (docs/design.md §3): a hash chain over token blocks, seeded with a salt the
 * server derives from the **authenticated** tenant, so a block cached for one tenant can never be a
 * hit for another (docs/prior-art.md H9: vLLM's client-supplied `cache_salt`, CVE-2025-46570). A client's
 * own cache salt may only narrow the namespace further, never replace the tenant's.
 *
 * Under the `shared-prefix` fault (with the `tenant-salt` guard off) the salt is the client's
 * field alone, as in engines where the gateway must inject it.
 */
import { faultOn, guardOn, type Safety } from "./safety.js";

/** The salt that seeds a request's block-hash chain. */
export function prefixCacheSalt(safety: Safety, tenant: number, clientSalt: string | null): string {
  if (guardOn(safety, "tenant-salt"))
    return clientSalt === null ? `tenant:${tenant}` : `tenant:${tenant}|${clientSalt}`;
  if (faultOn(safety, "shared-prefix")) return clientSalt ?? "";
  return "";
}

/** FNV-1a over a string, 32 bits, as 8 hex digits. */
function fnv1a(s: string): string {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193);
  return (h >>> 0).toString(16).padStart(8, "0");
}

/** The key of one block: hash of the parent block's key (or the salt, for the first block) and its tokens. */
export function prefixBlockKey(parentOrSalt: string, tokens: readonly number[]): string {
  return fnv1a(`${parentOrSalt}\u0000${tokens.join(",")}`);
}
