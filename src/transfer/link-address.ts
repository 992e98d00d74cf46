/**
 * The address binding of the cluster links (docs/security.md, "The registry"; docs/protocol.md
 * §3a): a link is good only between the two addresses its ends believe they use.
 *
 * Every HELLO names the address its initiator dialled, as the initiator knows it (a registry
 * entry's or a `--prefill`/`--decode` URL's host and port; for decode's transfer connection the
 * prefill node's host and the transfer port from its hello), and every CHALLENGE the address its
 * acceptor advertises (`--advertise`, default `--host:--port`; prefill's transfer port at the
 * advertised host). Both are inside the MACed transcript. A relay at another address has no secret,
 * so it forwards the bytes unchanged and the two differ: the acceptor answers its challenge and
 * closes (`address_mismatch`, counted), and the initiator refuses that challenge. So the registry
 * cannot steer a link to an outsider: an etcd writer can deny service, not read or redirect traffic.
 *
 * Addresses compare as written, after `linkAddress` (lowercase host, IPv6 in brackets): names are
 * not resolved, so `localhost:9001` is not `127.0.0.1:9001`. A node reached under another name
 * than `--host:--port` (NAT, a Kubernetes pod IP, a port-forward) says so with `--advertise`.
 */

/** `host:port` with a lowercase host, an IPv6 host in brackets: the form both ends compare. */
export function linkAddress(host: string, port: number): string {
  const h = host.replace(/^\[|\]$/g, "").toLowerCase();
  return h.includes(":") ? `[${h}]:${port}` : `${h}:${port}`;
}

/** `host:port` or `[v6]:port` → host (brackets off) and port; null when it is not one. */
export function parseLinkAddress(address: string): { host: string; port: number } | null {
  const match = /^(\[[^\]]+\]|[^:/[\]\s]+):(\d{1,5})$/.exec(address.trim());
  const port = match === null ? Number.NaN : Number(match[2]);
  if (match === null || port < 1 || port > 65535) return null;
  return { host: match[1]!.replace(/^\[|\]$/g, ""), port };
}

/** What to do when the addresses differ, for both ends' messages. */
const FIX =
  "a relay, or a registry entry copied to another address; a node reached under another address (NAT, a pod IP, a proxy) is started with --advertise naming it";

/**
 * Why a link whose initiator dialled `dialled` (from its HELLO, unchecked) may not reach the
 * acceptor that advertises `advertised`, or null when they are the same address.
 */
export function dialledMismatch(dialled: unknown, advertised: string): string | null {
  if (typeof dialled === "string" && dialled === advertised) return null;
  const named = typeof dialled === "string" ? dialled : "no address (an older kvfence?)";
  return `the peer dialled ${named}, this node answers to ${advertised} (${FIX}): ${named}`;
}

/**
 * Why the acceptor whose CHALLENGE names `advertised` (unchecked) is not the one the initiator
 * dialled at `dialled`, or null when it is.
 */
export function advertisedMismatch(advertised: unknown, dialled: string): string | null {
  if (typeof advertised === "string" && advertised === dialled) return null;
  const named = typeof advertised === "string" ? advertised : "no address (an older kvfence?)";
  return `the node dialled at ${dialled} answers to ${named} (${FIX}): ${named}`;
}
