/**
 * `createForward`: a forward pass and its KV page pools on either kernel set, so the server's
 * engines (src/topology/engine-worker.ts) and the benchmarks (src/tools/bench/) build them one way.
 *
 * - `"ts"`: the TypeScript reference kernels over ordinary typed arrays; each pool is a fresh
 *   `SharedArrayBuffer`.
 * - `"wasm"`: `WasmKernels` over one shared `WebAssembly.Memory` holding the weights (copied in),
 *   the activations, the attention staging and every pool. The memory is sized once here from the
 *   model, the step limits and the pools, so it does not grow while serving; each pool is a window
 *   of the memory's `SharedArrayBuffer` (the buffer the shared-memory transport hands to a prefill
 *   node, which then writes straight into the decode node's pages). A model plus pools beyond
 *   wasm32's 4 GiB is refused with a `KvfenceError` that names `--kernels native` and `ts`.
 * - `"native"`: the same class over the native addon (docs/kernels.md) and a plain
 *   SharedArrayBuffer sized here once, fixed (it never grows), which may pass 4 GiB.
 */
import type { KernelProfile } from "../kernels/kernel-profile.js";
import type { Kernels } from "../kernels/kernels.js";
import { referenceKernels } from "../kernels/kernels.js";
import { type KernelMemory, type MemoryRegion, WasmKernels } from "../kernels/wasm-kernels.js";
import { type Matrix, matrixBytes } from "../kernels/weight-format.js";
import type { KvLayout } from "../kvcache/kv-layout.js";
import { PagePool } from "../kvcache/page-pool.js";
import { KvfenceError } from "../lib/errors.js";
import { ForwardPass } from "../model/forward.js";
import type { ModelConfig, ModelWeights } from "../model/model-config.js";
import { attentionStagingBytes, matmulScratchBytes } from "./engine-sizing.js";

/** Which kernels a forward pass runs on (`--kernels auto` resolved first: `chooseKernels`). */
export type KernelsName = "ts" | "wasm" | "native";

export interface ForwardSetupOptions {
  readonly kernels: KernelsName;
  /** Times every kernel call of the forward pass into this profile (`bench model --profile`); absent: none. */
  readonly profile?: KernelProfile;
  /** Threads of the WebAssembly kernels: 1 (this thread) or 2 (plus a spinning worker). Default 1. */
  readonly kernelThreads?: 1 | 2;
  /** WebAssembly kernels: the fused multiply-add build where the engine has it (default true). */
  readonly wasmFma?: boolean;
  /**
   * WebAssembly kernels: batches on Q8_0/Q4_0 may take the int8 dot with accumulate where the
   * engine computes it exactly (default true; false: the i16 tile, `WasmKernels.dotAdd`).
   */
  readonly wasmDotAdd?: boolean;
  readonly maxBatchTokens: number;
  readonly maxSequences: number;
  /** Pages of each KV pool to create (one pool per entry). */
  readonly poolPages: readonly number[];
  readonly scrubOnFree?: boolean;
  /**
   * WebAssembly kernels: a memory shared with the process's other engines, holding the weights
   * already (src/engine/engine-memory.ts), and this engine's region of it; the weights are then
   * used in place, not copied.
   */
  readonly shared?: { readonly memory: KernelMemory; readonly region: MemoryRegion };
}

export interface ForwardSetup {
  readonly forward: ForwardPass;
  readonly pools: readonly PagePool[];
  readonly kernels: Kernels;
  /** The weights as the forward pass reads them (for wasm: the copies inside the memory). */
  readonly weights: ModelWeights;
  /** Stops the kernels' worker, if any (the memory stays usable on this thread). */
  close(): Promise<void>;
}

/** Bytes a wasm32 memory can address, less the 64 KiB the arena leaves unused. */
const WASM_MEMORY_LIMIT_BYTES = 4 * 1024 ** 3 - 65536;

export async function createForward(
  config: ModelConfig,
  weights: ModelWeights,
  layout: KvLayout,
  options: ForwardSetupOptions,
): Promise<ForwardSetup> {
  const passOptions = { maxBatchTokens: options.maxBatchTokens, maxSequences: options.maxSequences };
  const scrubOnFree = options.scrubOnFree ?? false;
  if (options.kernels === "ts") {
    return {
      forward: new ForwardPass(config, weights, layout, {
        ...passOptions,
        ...(options.profile === undefined ? {} : { kernels: options.profile.wrap(referenceKernels) }),
      }),
      pools: options.poolPages.map((n) => new PagePool(layout, n, { scrubOnFree })),
      kernels: referenceKernels,
      weights,
      close: async () => {},
    };
  }
  const poolBytes = options.poolPages.map((n) => aligned(PagePool.dataBytesFor(layout, n)));
  const totalPages = options.poolPages.reduce((a, b) => a + b, 0);
  const bytes =
    modelBytes(weights) +
    ForwardPass.bufferBytes(config, passOptions) +
    poolBytes.reduce((a, b) => a + b, 0) +
    attentionStagingBytes(config, totalPages);
  const native = options.kernels === "native";
  if (!native && options.shared === undefined && bytes > WASM_MEMORY_LIMIT_BYTES) {
    throw new KvfenceError(
      "config_invalid",
      `The WebAssembly kernels address at most 4 GiB and this model plus its KV pool needs more: ${bytes} bytes; use a smaller --kv-memory or --kv-pages, --kernels native, or --kernels ts`,
    );
  }
  const k = await WasmKernels.create({
    backend: native ? "native" : "wasm",
    threads: options.kernelThreads ?? 1,
    // The native memory never grows: room for the matmul's scratch and the control block too.
    initialBytes: native ? bytes + matmulScratchBytes(config, options.maxBatchTokens) + (1 << 20) : bytes,
    fma: options.wasmFma ?? true,
    dotAdd: options.wasmDotAdd ?? true,
    ...(options.shared === undefined ? {} : { shared: options.shared }),
  });
  await k.ready();
  const placed = k.placeWeights(weights);
  const kernels = options.profile === undefined ? k : options.profile.wrap(k);
  const forward = new ForwardPass(config, placed, layout, { ...passOptions, kernels });
  const pools = options.poolPages.map((n, i) => {
    const at = k.allocBytes(poolBytes[i] as number);
    return new PagePool(layout, n, {
      scrubOnFree,
      dataBuffer: k.buffer(),
      dataByteOffset: at,
      zeroed: k.freshArena,
    });
  });
  return { forward, pools, kernels: k, weights: placed, close: () => k.close() };
}

function aligned(bytes: number): number {
  return Math.ceil(bytes / 64) * 64;
}

/** Bytes of every weight tensor (a tied LM head once), as `placeWeights` copies them. */
function modelBytes(w: ModelWeights): number {
  const size = (a: Matrix | null): number => (a === null ? 0 : aligned(matrixBytes(a).byteLength));
  let bytes = size(w.embed) + size(w.finalNorm) + (w.lmHead === w.embed ? 0 : size(w.lmHead));
  for (const l of w.layers) {
    for (const a of [l.inputNorm, l.q, l.k, l.v, l.qBias, l.kBias, l.vBias, l.o, l.postNorm])
      bytes += size(a);
    bytes += size(l.gate) + size(l.up) + size(l.down);
  }
  return bytes;
}
