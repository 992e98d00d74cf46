/**
 * HMAC-SHA256 authentication of the links between cluster processes with a cluster secret
 * (docs/prior-art.md H7: SGLang's control sockets that carry page indices and aborts are unauthenticated).
 *
 * Every link opens with the same three-message handshake (docs/protocol.md, "Handshake"), so a
 * handshake recorded off the wire is worth nothing when replayed:
 *
 *   1. initiator → acceptor  HELLO      {v, nonceA, dialled, …}        MAC(secret)        (a wrong secret is told apart here)
 *   2. acceptor → initiator  CHALLENGE  {nonceB, peerNonce: nonceA, advertised, …}   MAC(s2c key, transcript)
 *   3. initiator → acceptor  PROOF                                      MAC(c2s key, transcript)
 *
 * The session keys are `HMAC(secret, direction | nonceA | nonceB)` (`sessionKeys`); the transcript
 * is both messages (`transcript`). The initiator admits the acceptor only after a MAC over its own
 * fresh nonceA; the acceptor admits the initiator (creates the link, sends anything) only after a
 * MAC over its own fresh nonceB. After it every control frame's MAC covers its header (with a
 * per-direction sequence number) and payload, so a frame cannot be altered, replayed, reordered or
 * moved to another connection. Page bodies are not MACed (hot path): the per-page checksums of the
 * manifest cover them. `dialled` (the address the initiator dialled) and `advertised` (the one the
 * acceptor answers to) bind the link to its two ends' addresses (link-address.ts): a relay elsewhere
 * is refused by both.
 *
 * `clusterSecretBytes` also refuses a secret that is short or trivially guessable (see
 * docs/security.md for the rule).
 */
import { createHmac, timingSafeEqual } from "node:crypto";
import { KvfenceError } from "../lib/errors.js";

/**
 * The handshake's version, `v` in every HELLO: 2 since the HELLO names the dialled address and the
 * CHALLENGE the advertised one. A HELLO of another version (none at all: 1) is refused
 * (`malformed`), saying to run one kvfence version on every process.
 */
export const HANDSHAKE_VERSION = 2;

/** Why a HELLO's `v` is not this handshake's version, or null when it is. */
export function handshakeVersionMismatch(v: unknown): string | null {
  if (v === HANDSHAKE_VERSION) return null;
  const theirs = v === undefined ? 1 : String(v);
  return `the peer speaks handshake version ${theirs}, this process ${HANDSHAKE_VERSION}; run the same kvfence version on every process: ${theirs}`;
}

export const MAC_BYTES = 32;
export const NONCE_BYTES = 16;
export const MIN_SECRET_BYTES = 16;
/** Fewest distinct byte values a secret may have. */
export const MIN_SECRET_DISTINCT = 6;
/**
 * Longest run of one repeated byte a secret may have: 6, or a quarter of its length when that is
 * more, so that a random value is refused only with a negligible probability (a 48-character
 * `openssl rand -hex 24` holds a run of 7 once in about 400,000 draws; of 13, once in 10^13).
 */
export const MAX_SECRET_RUN = 6;
/** Smallest estimated entropy (bits): byte-frequency Shannon entropy times length. */
export const MIN_SECRET_ENTROPY_BITS = 32;

/** Why `bytes` is a trivially guessable secret, or null when it passes (docs/security.md). */
export function weakSecretReason(bytes: Uint8Array): string | null {
  const n = bytes.length;
  if (n < MIN_SECRET_BYTES) return `too short, ${MIN_SECRET_BYTES} bytes at least: ${n} bytes`;
  const counts = new Map<number, number>();
  for (const b of bytes) counts.set(b, (counts.get(b) ?? 0) + 1);
  if (counts.size < MIN_SECRET_DISTINCT) {
    return `too few distinct characters, ${MIN_SECRET_DISTINCT} at least: ${counts.size}`;
  }
  const maxRun = Math.max(MAX_SECRET_RUN, Math.floor(n / 4));
  let run = 1;
  let longest = 1;
  for (let i = 1; i < n; i++) {
    run = bytes[i] === bytes[i - 1] ? run + 1 : 1;
    longest = Math.max(longest, run);
  }
  if (longest > maxRun) return `a character repeats more than ${maxRun} times in a row: ${longest}`;
  const steps = new Map<number, number>();
  for (let i = 1; i < n; i++) {
    const d = (bytes[i]! - bytes[i - 1]! + 256) & 255;
    steps.set(d, (steps.get(d) ?? 0) + 1);
  }
  const commonStep = Math.max(...steps.values());
  if (commonStep * 2 > n - 1) {
    return `more than half of it is one arithmetic sequence (like abcdef or 123456): ${commonStep} of ${n - 1} steps`;
  }
  for (let period = 1; period <= n / 2; period++) {
    let periodic = true;
    for (let i = period; i < n && periodic; i++) periodic = bytes[i] === bytes[i - period];
    if (periodic) return `it repeats a ${period}-character pattern`;
  }
  let bits = 0;
  for (const c of counts.values()) bits -= c * Math.log2(c / n);
  if (bits < MIN_SECRET_ENTROPY_BITS) {
    return `estimated entropy under ${MIN_SECRET_ENTROPY_BITS} bits: ${bits.toFixed(1)} bits`;
  }
  return null;
}

/**
 * Checks the cluster secret once at startup: at least 16 bytes and not trivially guessable
 * (`weakSecretReason`). Throws `config_invalid` saying what to do.
 */
export function clusterSecretBytes(secret: string | Uint8Array): Buffer {
  const bytes = typeof secret === "string" ? Buffer.from(secret, "utf8") : Buffer.from(secret);
  const weak = weakSecretReason(bytes);
  if (weak !== null) {
    throw new KvfenceError(
      "config_invalid",
      `Cluster secret is too weak; set --cluster-secret (or KVFENCE_CLUSTER_SECRET) to a random value, e.g. \`openssl rand -hex 24\`: ${weak}`,
    );
  }
  return bytes;
}

/** The handshake transcript under `label`: each message length-prefixed (u32 LE), in order. */
export function transcript(label: string, ...messages: readonly Uint8Array[]): Buffer {
  const parts: Buffer[] = [Buffer.from(label)];
  for (const m of messages) {
    const len = Buffer.alloc(4);
    len.writeUInt32LE(m.length);
    parts.push(len, Buffer.from(m.buffer, m.byteOffset, m.byteLength));
  }
  return Buffer.concat(parts);
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
