/**
 * `Kernels`: the set of numeric kernels (and the allocator for the buffers they run on) that the
 * forward pass calls, so it can run on the plain TypeScript reference (`referenceKernels`) or the
 * WebAssembly SIMD kernels (`WasmKernels` in wasm-kernels.ts) without knowing which.
 *
 * The signatures are those of reference.ts. Buffers a forward pass keeps (activations, RoPE tables,
 * positions) come from `allocF32/allocF64/allocI32`, so a fast implementation can place them where
 * its kernels read (for WebAssembly: inside its shared `WebAssembly.Memory`).
 */
import {
  add,
  addBias,
  matmul,
  matmulEach,
  pagedAttentionBatch,
  rmsnorm,
  rope,
  storeKv,
  swiglu,
} from "./reference.js";

export interface Kernels {
  /** "ts" or "wasm", for logs and benchmarks. */
  readonly name: string;
  /**
   * Throws unless `pool` is a KV pool this kernel set may read and write (the WebAssembly kernels
   * over a memory shared by several engines: inside this engine's region). Absent: any pool.
   */
  checkPool?(pool: Float32Array | Uint16Array): void;
  /** A zeroed Float32Array of n floats the kernels can operate on; call at construction only. */
  allocF32(n: number): Float32Array;
  allocF64(n: number): Float64Array;
  allocI32(n: number): Int32Array;
  matmul: typeof matmul;
  matmulEach: typeof matmulEach;
  addBias: typeof addBias;
  add: typeof add;
  rmsnorm: typeof rmsnorm;
  rope: typeof rope;
  swiglu: typeof swiglu;
  pagedAttentionBatch: typeof pagedAttentionBatch;
  storeKv: typeof storeKv;
}

/** The plain TypeScript reference kernels over ordinary typed arrays. */
export const referenceKernels: Kernels = Object.freeze({
  name: "ts",
  allocF32: (n: number) => new Float32Array(n),
  allocF64: (n: number) => new Float64Array(n),
  allocI32: (n: number) => new Int32Array(n),
  matmul,
  matmulEach,
  addBias,
  add,
  rmsnorm,
  rope,
  swiglu,
  pagedAttentionBatch,
  storeKv,
});
