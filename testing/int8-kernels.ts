/**
 * The reference kernels with every matmul's activations first quantised as the int8 kernels
 * quantise them (src/kernels/q8-activations.ts: 32-value blocks, or ggml's 256-value q8_K for
 * k-quant weights on the native kernels) and dequantised back: a forward pass on these computes
 * what the int8 path computes (on block-quantised weights; f32, f16 and bf16 ones take x as it
 * is), in doubles, so a model-level test can hold the fast kernels on Q8_0/Q4_0/k-quant weights to
 * f32 rounding instead of to the (model-dependent) cost of 8-bit activations.
 */
import { type Kernels, referenceKernels } from "../src/kernels/kernels.js";
import { q8Activations, q8KActivations } from "../src/kernels/q8-activations.js";
import * as ref from "../src/kernels/reference.js";
import { blockWeights, isKQuant, type Matrix, matrixDType } from "../src/kernels/weight-format.js";

/**
 * How the kernels quantise activations for k-quant weights: in 32-value blocks as for Q8_0/Q4_0
 * (the WebAssembly kernels), or as ggml's 256-value `block_q8_K` (the native kernels).
 */
export type KQuantActivations = "q8_0" | "q8_K";

/** x's rows as the int8 kernels see them when w is block-quantised; else x. */
function quantized(
  x: Float32Array,
  w: Matrix,
  rows: number,
  inDim: number,
  k: KQuantActivations,
): Float32Array {
  const dtype = matrixDType(w);
  if (blockWeights(dtype) === 1) return x;
  const q8K = k === "q8_K" && isKQuant(dtype);
  const { q, d } = (q8K ? q8KActivations : q8Activations)(x.subarray(0, rows * inDim), rows, inDim);
  const shift = q8K ? 8 : 5;
  const y = new Float32Array(rows * inDim);
  for (let i = 0; i < y.length; i++) y[i] = (q[i] as number) * (d[i >> shift] as number);
  return y;
}

/** The reference kernels with every block-quantised matmul's activations quantised as the kernels do. */
export function int8Emulation(k: KQuantActivations): Kernels {
  const kernels: Kernels = {
    ...referenceKernels,
    name: `ts-int8-${k}`,
    matmul: (out, x, w, rows, inDim, outDim) =>
      ref.matmul(out, quantized(x, w, rows, inDim, k), w, rows, inDim, outDim),
    matmulEach: (outs, x, ws, rows, inDim, outDims) => {
      // Q4_K_M mixes formats in one call (a Q6_K attn_v): each weight takes its own activations.
      for (let i = 0; i < ws.length; i++) {
        const w = ws[i] as Matrix;
        ref.matmul(
          outs[i] as Float32Array,
          quantized(x, w, rows, inDim, k),
          w,
          rows,
          inDim,
          outDims[i] as number,
        );
      }
    },
  };
  return Object.freeze(kernels);
}

/** `int8Emulation` of the WebAssembly kernels. */
export const int8EmulatingKernels: Kernels = int8Emulation("q8_0");
