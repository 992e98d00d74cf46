/**
 * Builds a prefill or decode node (engine + pool + node glue) from plain options, for both forms:
 * the worker thread (`node-worker.ts`) and the process (`node-server.ts`).
 */
import { randomInt } from "node:crypto";
import type { FromNode, NodeHello } from "../cluster/node-messages.js";
import type { EngineBuildOptions } from "../engine/build-engine.js";
import { buildEngine } from "../engine/build-engine.js";
import type { Engine } from "../engine/engine.js";
import { layoutSignature } from "../kvcache/kv-layout.js";
import { loadModelConfig } from "../model/config-loader.js";
import type { ModelConfig } from "../model/model-config.js";
import { makeSafety, type Safety } from "../protocol/safety.js";
import { DecodeNode } from "./decode-node.js";
import { PrefillNode } from "./prefill-node.js";

export interface NodeHostOptions {
  readonly role: "prefill" | "decode";
  readonly engine: EngineBuildOptions;
  /** `--unsafe-fault` names (tests and demos only). */
  readonly faults?: readonly string[];
}

export type BuiltNode =
  | {
      readonly role: "prefill";
      readonly engine: Engine;
      readonly node: PrefillNode;
      readonly hello: NodeHello;
      readonly layoutSignature: string;
    }
  | {
      readonly role: "decode";
      readonly engine: Engine;
      readonly node: DecodeNode;
      readonly hello: NodeHello;
      readonly layoutSignature: string;
    };

/** The layout signature both ends of a transfer compare: the model's shape and the page layout. */
export function nodeLayoutSignature(engine: Engine, config: ModelConfig): string {
  return layoutSignature(
    engine.pool.layout,
    `${config.architecture}-h${config.hiddenSize}-v${config.vocabSize}-l${config.numLayers}`,
  );
}

export async function buildNode(
  options: NodeHostOptions,
  toRouter: (message: FromNode) => void,
): Promise<BuiltNode> {
  const engine = await buildEngine(options.engine);
  const safety: Safety = makeSafety({
    faults: options.faults ?? [],
    disabledGuards: options.engine.disabledGuards ?? [],
  });
  const model = options.engine.model;
  const signature = nodeLayoutSignature(engine, "dir" in model ? loadModelConfig(model.dir) : model.config);
  const base = {
    kind: "hello" as const,
    poolTokens: engine.capacity.poolTokens,
    pageSize: engine.capacity.pageSize,
    maxModelLen: engine.capacity.maxModelLen,
    layoutSignature: signature,
    ...(engine.capacity.maxSequences === undefined ? {} : { maxSequences: engine.capacity.maxSequences }),
  };
  const incarnation = randomInt(1, 0x7fff_ffff);
  if (options.role === "prefill") {
    const node = new PrefillNode({ engine, layoutSignature: signature, safety, incarnation, toRouter });
    return {
      role: "prefill",
      engine,
      node,
      hello: { ...base, role: "prefill", incarnation },
      layoutSignature: signature,
    };
  }
  const node = new DecodeNode({ engine, layoutSignature: signature, safety, incarnation, toRouter });
  return {
    role: "decode",
    engine,
    node,
    hello: { ...base, role: "decode", incarnation },
    layoutSignature: signature,
  };
}
