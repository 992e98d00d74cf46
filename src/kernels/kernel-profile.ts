/**
 * Where a forward step's time goes, kernel by kernel (`kvfence bench model --profile`): a `Kernels`
 * wrapper that times every call the forward pass makes and sums the wall time per kernel and, for
 * the matrix multiplies, per weight shape (q/k/v, o, gate/up, down, the logits), as llama.cpp's
 * per-op profile does. Wall time on the calling thread: a multi-threaded kernel's time includes
 * waiting for its other thread, and time outside every kernel (the forward pass's own JavaScript,
 * the sampling) is what the step took beyond their sum.
 *
 * Only the benchmark wraps its kernels; the server never does (each call through the wrapper costs
 * two clock reads, under a microsecond).
 */
import type { Kernels } from "./kernels.js";
import type { Matrix } from "./weight-format.js";

/** One row of a profile: a kernel (or a matmul shape), its calls and its wall time. */
export interface KernelTime {
  readonly kernel: string;
  readonly calls: number;
  readonly ms: number;
}

/** The kernels the forward pass calls, each timed under a name of its own. */
const TIMED = ["add", "addBias", "rmsnorm", "rope", "swiglu", "storeKv", "pagedAttentionBatch"] as const;

export class KernelProfile {
  readonly #ms = new Map<string, number>();
  readonly #calls = new Map<string, number>();

  /** `kernels` with every kernel the forward pass calls timed into this profile. */
  wrap(kernels: Kernels): Kernels {
    const timed = <F extends (...args: never[]) => void>(name: (args: Parameters<F>) => string, fn: F): F =>
      ((...args: Parameters<F>) => {
        const t0 = performance.now();
        fn.apply(kernels, args);
        this.#add(name(args), performance.now() - t0);
      }) as F;
    const wrapped: Record<string, unknown> = {
      name: kernels.name,
      allocF32: (n: number) => kernels.allocF32(n),
      allocF64: (n: number) => kernels.allocF64(n),
      allocI32: (n: number) => kernels.allocI32(n),
      matmul: timed<Kernels["matmul"]>((a) => `matmul ${shape(a[2], a[4], a[5])}`, kernels.matmul),
      matmulEach: timed<Kernels["matmulEach"]>(
        (a) => `matmul ${a[2].map((w, i) => shape(w, a[4], a[5][i] as number)).join(" + ")}`,
        kernels.matmulEach,
      ),
    };
    if (kernels.checkPool !== undefined) {
      const check = kernels.checkPool;
      wrapped.checkPool = (pool: Float32Array | Uint16Array) => check.call(kernels, pool);
    }
    for (const name of TIMED) {
      const label = name === "pagedAttentionBatch" ? "attention" : name;
      wrapped[name] = timed(() => label, kernels[name] as (...args: never[]) => void);
    }
    return Object.freeze(wrapped) as unknown as Kernels;
  }

  /** Forgets every call so far. */
  reset(): void {
    this.#ms.clear();
    this.#calls.clear();
  }

  /** Every kernel timed since the last reset, the slowest first. */
  rows(): KernelTime[] {
    return [...this.#ms]
      .map(([kernel, ms]) => ({ kernel, ms, calls: this.#calls.get(kernel) as number }))
      .sort((a, b) => b.ms - a.ms);
  }

  #add(kernel: string, ms: number): void {
    this.#ms.set(kernel, (this.#ms.get(kernel) ?? 0) + ms);
    this.#calls.set(kernel, (this.#calls.get(kernel) ?? 0) + 1);
  }
}

/** A weight's shape and format as a profile names it: `576→1536 q8_0`. */
function shape(w: Matrix, inDim: number, outDim: number): string {
  const format = w instanceof Float32Array ? "f32" : w.dtype;
  return `${inDim}→${outDim} ${format}`;
}
