/**
 * The DNS-rebinding guard of the keyless operator listener (docs/security.md, "DNS rebinding").
 * Without `--operator-key` the operator listener (/metrics, /kvfence/nodes, /kvfence/ui, …) asks
 * for no key: it is bound to loopback (src/server/serve-config.ts), so only this machine reaches
 * it. A web page open in a browser on the same machine could still read it by DNS rebinding: its
 * own name, re-pointed at 127.0.0.1, makes the browser send the page's requests there as
 * same-origin ones. Such a request carries the page's name in `Host`, so the listener answers only
 * `Host` values that name this machine: `localhost` and loopback literals (127.0.0.0/8 in any form
 * the URL parser reads, `[::1]`), with or without a port. Anything else, or no `Host` at all, gets
 * 421 `misdirected_request`, saying what to do instead.
 */
import { KvfenceError } from "../lib/errors.js";
import { isLoopback } from "../lib/loopback.js";

/** A `Host` value: a name or IPv4 literal, or a bracketed IPv6 literal, then an optional port. */
const HOST = /^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$/;

/** True when `host` (a `Host` header) names this machine: localhost or a loopback literal. */
export function isLoopbackHost(host: string | undefined): boolean {
  if (host === undefined || !HOST.test(host)) return false;
  let hostname: string;
  try {
    // The URL parser reads every form a browser would send as the same address (127.1, 0x7f.1).
    hostname = new URL(`http://${host}/`).hostname;
  } catch {
    return false;
  }
  return isLoopback(hostname);
}

/** Throws 421 `misdirected_request` unless `host` names this machine (`isLoopbackHost`). */
export function checkOperatorHost(host: string | undefined): void {
  if (isLoopbackHost(host)) return;
  const shown = host === undefined ? "(none)" : host.length > 100 ? `${host.slice(0, 100)}…` : host;
  throw new KvfenceError(
    "misdirected_request",
    "The operator listener answers only requests addressed to this machine by a loopback Host " +
      `(localhost, 127.0.0.1, [::1]), so that no web page can read it by DNS rebinding: ${shown}; ` +
      "connect to http://127.0.0.1 or http://localhost (a proxy in front must send Host: localhost), " +
      "or give --operator-key to serve the operator endpoints with a key",
  );
}
