/**
 * Builds a prefill or decode node (engine + pool + node glue) from plain options, for both forms:
 * the worker thread (`node-worker.ts`) and the process (`node-server.ts`).
 */
import { randomInt } from "node:crypto";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { buildEngine } from "../engine/build-engine.js";
import type { Engine } from "../engine/engine.js";
import { engineLayoutSignature } from "../engine/open-tiers.js";
import { type ForwardedSpans, startForwardedTracing, startTracing } from "../lib/tracing.js";
import type { FromNode, NodeHello } from "../links/node-messages.js";
import type { ModelConfig } from "../model/model-config.js";
import { makeSafety, type Safety } from "../protocol/safety.js";
import { CacheEventPublisher } from "./cache-events.js";
import { DecodeNode } from "./decode-node.js";
import { PrefillNode } from "./prefill-node.js";

export interface NodeHostOptions {
  readonly role: "prefill" | "decode";
  readonly engine: EngineBuildOptions;
  /** `--unsafe-fault` names (tests and demos only). */
  readonly faults?: readonly string[];
}

interface Built<Role extends "prefill" | "decode", Node> {
  readonly role: Role;
  readonly engine: Engine;
  readonly node: Node;
  readonly hello: NodeHello;
  readonly layoutSignature: string;
  /** Its prefix cache's events to every router (null: no cache). */
  readonly cacheEvents: CacheEventPublisher | null;
  /** Its guards and faults (kept across a role switch). */
  readonly safety: Safety;
}

export type BuiltNode = Built<"prefill", PrefillNode> | Built<"decode", DecodeNode>;

/** The layout signature both ends of a transfer compare: the model's shape and the page layout. */
export function nodeLayoutSignature(engine: Engine, config: ModelConfig): string {
  return engineLayoutSignature(engine.pool, config);
}

/**
 * `forwardSpans`: a worker thread's way to its process's main thread, which exports this node's
 * spans with its own (src/lib/tracing.ts); without it (a node process) the node exports them itself.
 */
export async function buildNode(
  options: NodeHostOptions,
  toRouter: (message: FromNode) => void,
  forwardSpans?: (spans: ForwardedSpans) => void,
): Promise<BuiltNode> {
  // The KV tiers sit below a prefill node's prefix cache (a decode node keeps none of its own here).
  const { tiers: _tiers, ...decodeEngine } = options.engine;
  const engine = await buildEngine(options.role === "prefill" ? options.engine : decodeEngine);
  // This node's spans (src/lib/tracing.ts): only with --otlp-endpoint are they recorded, and only
  // a node process loads the SDK.
  if (options.engine.otlpEndpoint !== undefined) {
    const service = `kvfence-${options.role}`;
    if (forwardSpans !== undefined) startForwardedTracing(service, forwardSpans);
    else await startTracing(options.engine.otlpEndpoint, service);
  }
  const safety: Safety = makeSafety({
    faults: options.faults ?? [],
    disabledGuards: options.engine.disabledGuards ?? [],
  });
  // What the node's caches hold, published to every router (src/node/cache-events.ts).
  const cacheEvents = engine.prefixCache === null ? null : new CacheEventPublisher(toRouter);
  if (cacheEvents !== null) engine.prefixCache!.observe(cacheEvents);
  // The KV tiers' pages too (docs/design.md §3b): what they store and drop, per tier.
  engine.tierPrefetch?.tiers.onTierChange((tenant, keys, tier, change) => {
    for (const key of keys) cacheEvents?.record(tenant, key, tier, change === "stored");
  });
  return roleNode(options.role, { engine, safety, cacheEvents }, toRouter);
}

/**
 * The node object of `role` over an engine already built (its pool, caches and safety), as a new
 * incarnation with its hello: at start, and again at each role switch (src/node/role-switch.ts).
 */
export function roleNode(
  role: "prefill" | "decode",
  parts: Pick<BuiltNode, "engine" | "cacheEvents"> & { readonly safety: Safety },
  toRouter: (message: FromNode) => void,
): BuiltNode {
  const { engine, safety, cacheEvents } = parts;
  const signature = nodeLayoutSignature(engine, engine.modelConfig);
  const incarnation = randomInt(1, 0x7fff_ffff);
  const hello: NodeHello = {
    kind: "hello",
    role,
    incarnation,
    poolTokens: engine.capacity.poolTokens,
    pageSize: engine.capacity.pageSize,
    maxModelLen: engine.capacity.maxModelLen,
    layoutSignature: signature,
    ...(engine.capacity.maxSequences === undefined ? {} : { maxSequences: engine.capacity.maxSequences }),
    ...(role === "prefill" && engine.prefixCache !== null ? { prefixCache: true } : {}),
  };
  const common = { engine, hello, layoutSignature: signature, cacheEvents, safety };
  const nodeOptions = { engine, layoutSignature: signature, safety, incarnation, toRouter };
  return role === "prefill"
    ? { ...common, role: "prefill", node: new PrefillNode(nodeOptions) }
    : { ...common, role: "decode", node: new DecodeNode(nodeOptions) };
}

/** The answer to a readiness ping, with the pages the node's prefix cache holds. */
export function pong(id: number, engine: Engine): FromNode {
  const cache = engine.prefixCache;
  return cache === null ? { kind: "pong", id } : { kind: "pong", id, cachedPages: cache.size };
}
