/**
 * The normalized model configuration every other module reads. `loadModelConfig` (in
 * config-loader.ts) turns a Hugging Face `config.json` (Llama, Mistral, Qwen2) into this, refusing
 * anything it does not implement.
 */
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
 * Weights in f32, row-major `[out][in]` exactly as stored in safetensors (a Linear's weight).
 * When embeddings are tied, `lmHead` is the same array as `embed`.
 */
export interface LayerWeights {
  readonly inputNorm: Float32Array; // [hidden]
  readonly q: Float32Array; // [numHeads*headDim][hidden]
  readonly k: Float32Array; // [numKvHeads*headDim][hidden]
  readonly v: Float32Array; // [numKvHeads*headDim][hidden]
  readonly qBias: Float32Array | null;
  readonly kBias: Float32Array | null;
  readonly vBias: Float32Array | null;
  readonly o: Float32Array; // [hidden][numHeads*headDim]
  readonly postNorm: Float32Array; // [hidden]
  readonly gate: Float32Array; // [intermediate][hidden]
  readonly up: Float32Array; // [intermediate][hidden]
  readonly down: Float32Array; // [hidden][intermediate]
}

export interface ModelWeights {
  readonly embed: Float32Array; // [vocab][hidden]
  readonly layers: readonly LayerWeights[];
  readonly finalNorm: Float32Array; // [hidden]
  readonly lmHead: Float32Array; // [vocab][hidden]
}
