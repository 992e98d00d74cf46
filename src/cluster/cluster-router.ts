/**
 * The router of the multi-process topology (`kvfence serve --role router --prefill URL… --decode
 * URL…`): connects an authenticated control link to every node, reads each node's hello (pool,
 * page size, context length, layout), tells every decode node to connect its transfer channel to
 * every prefill node, waits until every pair is up, and returns the `DisaggregatedEngine` the HTTP
 * server drives.
 */
import { KvfenceError } from "../lib/errors.js";
import { SAFE, type Safety } from "../protocol/safety.js";
import type { LinkTls } from "../transfer/tls-config.js";
import { type ControlLink, connectControlLink } from "./control-link.js";
import { DisaggregatedEngine, type RouterNode } from "./disaggregated-engine.js";
import type { FromNode, NodeHello, ToNode } from "./node-messages.js";

/**
 * This router process's incarnation, sent in its control-link hello: a node admits a newer router
 * in place of an older one it still believes connected, never an equal or older one.
 */
const ROUTER_INCARNATION = Date.now();

export interface ClusterRouterOptions {
  readonly prefill: readonly string[];
  readonly decode: readonly string[];
  readonly secret: string;
  /** Mutual TLS on every control link (docs/tls.md); plain TCP without. */
  readonly tls?: LinkTls;
  readonly maxModelLen: number;
  readonly safety?: Safety;
  /** How long to wait for the nodes and their transfer channels. Default 30 s. */
  readonly connectTimeoutMs?: number;
}

/** "http://host:port", "tcp://host:port" or "host:port" → host and port. */
export function parseNodeUrl(url: string): { host: string; port: number } {
  const match = /^(?:[a-z]+:\/\/)?(\[[^\]]+\]|[^:/]+):(\d+)\/?$/i.exec(url.trim());
  const port = match === null ? Number.NaN : Number(match[2]);
  if (match === null || !Number.isInteger(port) || port < 1 || port > 65535) {
    throw new KvfenceError(
      "config_invalid",
      `Node address must look like http://127.0.0.1:9001: ${JSON.stringify(url)}`,
    );
  }
  return { host: match[1]!.replace(/^\[|\]$/g, ""), port };
}

/** Connects the router's control link to one node (`--prefill` or `--decode` `url`) and awaits its hello. */
async function connectNode(
  node: { readonly id: string; readonly url: string; readonly role: "prefill" | "decode" },
  { secret, tls }: Pick<ClusterRouterOptions, "secret" | "tls">,
): Promise<RouterNode> {
  const { id, url, role } = node;
  const { host, port } = parseNodeUrl(url);
  const link = await connectControlLink<ToNode, FromNode>({
    host,
    port,
    secret,
    ...(tls === undefined ? {} : { tls }),
    incarnation: ROUTER_INCARNATION,
  });
  const hello = await new Promise<NodeHello>((resolve, reject) => {
    link.onMessage((m) => {
      if (m.kind === "hello") resolve(m);
    });
    link.onClose(() =>
      reject(
        new KvfenceError(
          "node_unavailable",
          `The node at ${url} closed the link before its hello; it admits one router at a time (its log says why): closed`,
        ),
      ),
    );
  });
  if (hello.role !== role) {
    link.close();
    throw new KvfenceError(
      "config_invalid",
      `The node at ${url} is a ${hello.role} node, listed as --${role}: ${url}`,
    );
  }
  return { id, url, hello, link: link as ControlLink<ToNode, FromNode> };
}

export async function connectCluster(options: ClusterRouterOptions): Promise<DisaggregatedEngine> {
  const prefill = await Promise.all(
    options.prefill.map((url, i) => connectNode({ id: `prefill-${i}`, url, role: "prefill" }, options)),
  );
  const decode = await Promise.all(
    options.decode.map((url, i) => connectNode({ id: `decode-${i}`, url, role: "decode" }, options)),
  );
  const engine = new DisaggregatedEngine({
    prefill,
    decode,
    maxModelLen: options.maxModelLen,
    safety: options.safety ?? SAFE,
  });
  for (const d of decode) {
    for (const p of prefill) {
      if (p.hello.transferPort === undefined) continue;
      d.link.send({
        kind: "connect_prefill",
        prefill: p.id,
        host: parseNodeUrl(p.url).host,
        port: p.hello.transferPort,
        incarnation: p.hello.incarnation,
      });
    }
  }
  const deadline = Date.now() + (options.connectTimeoutMs ?? 30_000);
  while (!engine.allPairsUp) {
    if (Date.now() > deadline) {
      await engine.close();
      throw new KvfenceError(
        "node_unavailable",
        "The decode nodes could not connect their transfer channels to every prefill node; check the nodes' logs and --cluster-secret: timeout",
      );
    }
    await new Promise((r) => setTimeout(r, 20));
  }
  return engine;
}
