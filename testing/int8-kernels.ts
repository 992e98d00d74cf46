/**
 * The reference kernels with every matmul's activations first quantised as the WebAssembly int8
 * kernels quantise them (32-value blocks, src/kernels/q8-activations.ts) and dequantised back: a
 * forward pass on these computes what the int8 path computes (on block-quantised weights; f32,
 * f16 and bf16 ones take x as it is), in doubles, so a model-level test
 * can hold the WebAssembly kernels on Q8_0/Q4_0/k-quant weights to f32 rounding instead of to the
 * (model-dependent) cost of 8-bit activations.
 */
import { type Kernels, referenceKernels } from "../src/kernels/kernels.js";
import { q8Activations } from "../src/kernels/q8-activations.js";
import * as ref from "../src/kernels/reference.js";
import { blockWeights, type Matrix, matrixDType } from "../src/kernels/weight-format.js";

/** x's rows as the int8 kernels see them when w is block-quantised; else x. */
function quantized(x: Float32Array, w: Matrix, rows: number, inDim: number): Float32Array {
  if (blockWeights(matrixDType(w)) === 1) return x;
  const { q, d } = q8Activations(x.subarray(0, rows * inDim), rows, inDim);
  const y = new Float32Array(rows * inDim);
  for (let i = 0; i < y.length; i++) y[i] = (q[i] as number) * (d[i >> 5] as number);
  return y;
}

const kernels: Kernels = {
  ...referenceKernels,
  name: "ts-int8",
  matmul: (out, x, w, rows, inDim, outDim) =>
    ref.matmul(out, quantized(x, w, rows, inDim), w, rows, inDim, outDim),
  matmulEach: (outs, x, ws, rows, inDim, outDims) =>
    ref.matmulEach(outs, quantized(x, ws[0] as Matrix, rows, inDim), ws, rows, inDim, outDims),
};

export const int8EmulatingKernels: Kernels = Object.freeze(kernels);
