/**
 * Which addresses only this host can reach: the one test behind every "loopback only" rule — the
 * cluster links' plaintext refusal (src/transfer/tls-config.ts), the keyless operator listener's
 * bind address (src/server/serve-config.ts) and the `Host` names it answers
 * (src/router/operator-host.ts).
 */
import net from "node:net";

/** True for an address only this host can reach (127.0.0.0/8, ::1, localhost). */
export function isLoopback(host: string): boolean {
  const h = host.replace(/^\[|\]$/g, "").toLowerCase();
  if (h === "localhost" || h === "::1") return true;
  if (net.isIPv4(h)) return h.startsWith("127.");
  if (h.startsWith("::ffff:")) return net.isIPv4(h.slice(7)) && h.slice(7).startsWith("127.");
  return false;
}
