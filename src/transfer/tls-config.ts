/**
 * TLS for the cluster links — router ↔ node control links and decode → prefill transfer
 * connections — and the HTTPS front door (docs/tls.md). The one place that reads certificate files
 * and builds Node `tls` options; the links call `createLinkServer` / `connectLink` where they used to
 * call `net.createServer` / `net.connect`, and keep their own handshakes (cluster-secret MACs) on top.
 *
 * Links are mutually authenticated: every process presents `--tls-cert`/`--tls-key`, and both ends
 * require the peer's certificate to chain to `--tls-ca` (`requestCert` + `rejectUnauthorized` on the
 * server; `rejectUnauthorized` and the default host-name check on the client, so a node's
 * certificate must name the address the router and decode nodes dial). TLS 1.3 only. A peer with no
 * certificate or one from another CA fails the TLS handshake before any link byte is read; a
 * plaintext peer fails it too. The cluster secret stays (defence in depth: the links engineer's
 * handshake still proves membership), so TLS adds confidentiality and integrity of every byte, page
 * bodies included (the manifest checksums only detect corruption).
 *
 * The front door (`--https-cert`/`--https-key`) is a separate pair: it faces API clients (usually a
 * public CA's certificate for a public name) and asks them for no certificate (API keys authenticate
 * tenants), whereas the links use a private cluster CA.
 *
 * `linksExposure` is the start-up rule: a node that would carry prompts, output tokens or KV pages
 * in plaintext beyond loopback refuses to start unless `--insecure-plaintext-links`.
 */
import { X509Certificate } from "node:crypto";
import { readFileSync } from "node:fs";
import net from "node:net";
import tls from "node:tls";
import { KvfenceError } from "../lib/errors.js";
import { isLoopback } from "../lib/loopback.js";

/** Paths of the PEM files given on the command line. */
export interface TlsFiles {
  readonly cert: string;
  readonly key: string;
  readonly ca: string;
}

/** The loaded options of both ends of a mutually authenticated link. */
export interface LinkTls {
  readonly server: tls.TlsOptions;
  readonly client: tls.ConnectionOptions;
}

/** The loaded certificate and key of the HTTPS front door. */
export interface FrontDoorTls {
  readonly cert: Buffer;
  readonly key: Buffer;
}

function readPem(flag: string, path: string): Buffer {
  try {
    return readFileSync(path);
  } catch (err) {
    throw new KvfenceError(
      "config_invalid",
      `Cannot read ${flag}; give a PEM file (docs/tls.md says how to make one): ${(err as Error).message}`,
    );
  }
}

/** Checks a certificate's dates and that the key belongs to it; throws `config_invalid`. */
function checkPair(certFlag: string, cert: Buffer, key: Buffer, ca?: Buffer): void {
  let x509: X509Certificate;
  try {
    tls.createSecureContext({ cert, key, ...(ca === undefined ? {} : { ca }) });
    x509 = new X509Certificate(cert);
  } catch (err) {
    throw new KvfenceError(
      "config_invalid",
      `${certFlag} and its key do not make a TLS identity (a PEM certificate and the PEM private key it was issued for); check both files: ${(err as Error).message}`,
    );
  }
  const now = Date.now();
  if (Date.parse(x509.validTo) < now || Date.parse(x509.validFrom) > now) {
    throw new KvfenceError(
      "config_invalid",
      `${certFlag} is not valid now; issue a new certificate: valid ${x509.validFrom} to ${x509.validTo}`,
    );
  }
}

/** Reads the link certificate, key and CA once and builds both ends' options. */
export function loadLinkTls(files: TlsFiles): LinkTls {
  const cert = readPem("--tls-cert", files.cert);
  const key = readPem("--tls-key", files.key);
  const ca = readPem("--tls-ca", files.ca);
  checkPair("--tls-cert", cert, key, ca);
  const common = { cert, key, ca, minVersion: "TLSv1.3" as const };
  return {
    server: { ...common, requestCert: true, rejectUnauthorized: true },
    client: { ...common, rejectUnauthorized: true },
  };
}

/** Reads the front door's certificate and key once. */
export function loadFrontDoorTls(files: { readonly cert: string; readonly key: string }): FrontDoorTls {
  const cert = readPem("--https-cert", files.cert);
  const key = readPem("--https-key", files.key);
  checkPair("--https-cert", cert, key);
  return { cert, key };
}

/** OpenSSL's reason ("peer did not return a certificate") rather than its whole error string. */
export function tlsReason(error: Error & { reason?: unknown; code?: unknown }): string {
  if (typeof error.reason === "string") return error.reason;
  if (error.code === "ECONNRESET") return "the peer closed the connection during the TLS handshake";
  return error.message;
}

/** A connection refused during the TLS handshake, as a link server reports it. */
export function tlsRefusal(error: Error, socket?: tls.TLSSocket): KvfenceError {
  // Node checks a client's certificate after the handshake and only records why it failed.
  const why = socket?.authorizationError ?? tlsReason(error);
  return new KvfenceError(
    "transfer_failed",
    `TLS handshake with a cluster peer failed; give every process a certificate issued by the same --tls-ca: ${String(why)}`,
  );
}

/**
 * A link's listening server: mutual TLS with `linkTls`, plain TCP without. `onSocket` gets each
 * connection once the link's own handshake may start (after the TLS handshake); a TLS handshake
 * that fails (no certificate, another CA, a plaintext peer) closes the connection and goes to
 * `onRefused`.
 */
export function createLinkServer(
  options: {
    readonly tls?: LinkTls | undefined;
    readonly onRefused?: ((error: KvfenceError, socket: net.Socket) => void) | undefined;
  },
  onSocket: (socket: net.Socket) => void,
): net.Server {
  const { tls: linkTls, onRefused } = options;
  if (linkTls === undefined) return net.createServer({ noDelay: true }, onSocket);
  // A peer that opens a connection and never completes the handshake is dropped after 10 s.
  const server = tls.createServer({ ...linkTls.server, noDelay: true, handshakeTimeout: 10_000 }, onSocket);
  server.on("tlsClientError", (error, socket) => {
    onRefused?.(tlsRefusal(error, socket), socket);
    socket.destroy();
  });
  return server;
}

/**
 * Connects a link's client end: TLS with `linkTls` (the server's certificate checked against the
 * CA and the dialled address), plain TCP without. `ready` names the socket event after which the
 * link's own handshake may start.
 */
export function connectLink(
  linkTls: LinkTls | undefined,
  options: net.TcpNetConnectOpts,
): { socket: net.Socket; ready: "connect" | "secureConnect" } {
  if (linkTls === undefined) return { socket: net.connect(options), ready: "connect" };
  return { socket: tls.connect({ ...linkTls.client, ...options }), ready: "secureConnect" };
}

/**
 * Why a process would expose its cluster links in plaintext, or null: a prefill or decode node
 * listening beyond loopback, or a router dialling a node beyond loopback, without link TLS. The
 * one-line text says what is exposed and the two ways out.
 */
export function linksExposure(options: {
  readonly role: "all" | "router" | "prefill" | "decode";
  readonly host: string;
  readonly nodeHosts: readonly string[];
  readonly tls: boolean;
  readonly insecurePlaintextLinks: boolean;
}): string | null {
  if (options.tls || options.insecurePlaintextLinks) return null;
  const what =
    "prompt token ids, output tokens and KV page bodies would cross the network in plaintext, readable and alterable by anyone on the path";
  const fix =
    "give --tls-cert, --tls-key and --tls-ca (docs/tls.md), or accept it with --insecure-plaintext-links";
  if ((options.role === "prefill" || options.role === "decode") && !isLoopback(options.host)) {
    return `The ${options.role} node would listen on ${options.host} (beyond loopback) without TLS: ${what}; ${fix}`;
  }
  const remote = options.role === "router" ? options.nodeHosts.find((h) => !isLoopback(h)) : undefined;
  if (remote !== undefined) {
    return `The router would reach the node at ${remote} (beyond loopback) without TLS: ${what}; ${fix}`;
  }
  return null;
}
