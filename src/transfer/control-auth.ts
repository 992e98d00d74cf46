/**
 * HMAC-SHA256 authentication of control frames with a cluster secret (docs/prior-art.md H7: SGLang's
 * control sockets that carry page indices and aborts are unauthenticated).
 *
 * The handshake frames are signed with the cluster secret itself. After it, each direction uses its
 * own session key `HMAC(secret, direction | clientNonce | serverNonce)`, and every control frame's
 * MAC covers its 32-byte header (which carries a per-direction sequence number in `index`) and its
 * payload, so a frame cannot be altered, replayed, reordered or moved to another connection. Page
 * bodies are not MACed (hot path): the per-page checksums of the manifest cover them.
 */
import { createHmac, timingSafeEqual } from "node:crypto";
import { KvfenceError } from "../lib/errors.js";

export const MAC_BYTES = 32;
const MIN_SECRET_BYTES = 16;

/** Checks the cluster secret once at startup. */
export function clusterSecretBytes(secret: string | Uint8Array): Buffer {
  const bytes = typeof secret === "string" ? Buffer.from(secret, "utf8") : Buffer.from(secret);
  if (bytes.length < MIN_SECRET_BYTES) {
    throw new KvfenceError(
      "config_invalid",
      `Cluster secret is too short, ${MIN_SECRET_BYTES} bytes at least; set a longer --cluster-secret: ${bytes.length} bytes`,
    );
  }
  return bytes;
}

/** HMAC-SHA256 of the concatenated parts. */
export function hmac(key: Uint8Array, ...parts: readonly Uint8Array[]): Buffer {
  const h = createHmac("sha256", key);
  for (const part of parts) h.update(part);
  return h.digest();
}

/** Constant-time comparison of `mac` with the HMAC of `parts`. */
export function verifyHmac(key: Uint8Array, mac: Uint8Array, ...parts: readonly Uint8Array[]): boolean {
  if (mac.length !== MAC_BYTES) return false;
  return timingSafeEqual(hmac(key, ...parts), mac);
}

/** The two per-direction session keys of one connection. */
export function sessionKeys(
  secret: Uint8Array,
  clientNonce: Uint8Array,
  serverNonce: Uint8Array,
): { clientToServer: Buffer; serverToClient: Buffer } {
  return {
    clientToServer: hmac(secret, Buffer.from("kvfence c2s"), clientNonce, serverNonce),
    serverToClient: hmac(secret, Buffer.from("kvfence s2c"), clientNonce, serverNonce),
  };
}
