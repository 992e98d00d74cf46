/**
 * The normalized model configuration every other module reads. `loadModelConfig` (in
 * config-loader.ts) turns a Hugging Face `config.json` (Llama, Mistral, Qwen2) into this, refusing
 * anything it does not implement.
 */
import type { Matrix } from "../kernels/weight-format.js";
export interface ModelConfig {
  readonly architecture: "llama" | "mistral" | "qwen2";
  readonly hiddenSize: number;
  readonly numHeads: number;
  readonly numKvHeads: number;
  readonly headDim: number;
  readonly intermediateSize: number;
  readonly numLayers: number;
  readonly rmsNormEps: number;
  readonly ropeTheta: number;
  readonly tieWordEmbeddings: boolean;
  /** Qwen2: q/k/v projections carry biases. */
  readonly attentionBias: boolean;
  readonly maxPositionEmbeddings: number;
  readonly vocabSize: number;
  readonly bosTokenId: number | null;
  readonly eosTokenIds: readonly number[];
}

/**
 * Weights row-major `[out][in]` exactly as stored in safetensors (a Linear's weight). The matrices
 * are in their stored format (src/kernels/weight-format.ts: a Float32Array for f32, a `WeightTensor`
 * for f16, bf16, Q8_0, Q4_0); norms and biases are always f32, as llama.cpp keeps them. When
 * embeddings are tied, `lmHead` is the same object as `embed`.
 */
export interface LayerWeights {
  readonly inputNorm: Float32Array; // [hidden]
  readonly q: Matrix; // [numHeads*headDim][hidden]
  readonly k: Matrix; // [numKvHeads*headDim][hidden]
  readonly v: Matrix; // [numKvHeads*headDim][hidden]
  readonly qBias: Float32Array | null;
  readonly kBias: Float32Array | null;
  readonly vBias: Float32Array | null;
  readonly o: Matrix; // [hidden][numHeads*headDim]
  readonly postNorm: Float32Array; // [hidden]
  readonly gate: Matrix; // [intermediate][hidden]
  readonly up: Matrix; // [intermediate][hidden]
  readonly down: Matrix; // [hidden][intermediate]
}

export interface ModelWeights {
  readonly embed: Matrix; // [vocab][hidden]
  readonly layers: readonly LayerWeights[];
  readonly finalNorm: Float32Array; // [hidden]
  readonly lmHead: Matrix; // [vocab][hidden]
}
