/**
 * The page-major KV layout of docs/design.md §3, shared by the forward pass, the pool, the transfer
 * engine and the handshake's layout signature.
 *
 * A pool is one flat Float32Array of `numPages * pageFloats` floats. Page p starts at float
 * `p * pageFloats`; inside it the order is layer → K|V → token-in-page → kv-head → dim, so one page
 * (all layers, K and V) is one contiguous byte range and moves with one write.
 */

export interface KvLayout {
  readonly numLayers: number;
  readonly numKvHeads: number;
  readonly headDim: number;
  /** Tokens per page. */
  readonly pageSize: number;
}

/** Floats in one page: all layers, K and V. */
export function pageFloats(layout: KvLayout): number {
  return layout.numLayers * 2 * layout.pageSize * layout.numKvHeads * layout.headDim;
}

/** Bytes in one page at f32. */
export function pageBytes(layout: KvLayout): number {
  return pageFloats(layout) * 4;
}

/** Bytes of KV one token needs at f32, over all layers. */
export function bytesPerToken(layout: KvLayout): number {
  return layout.numLayers * 2 * layout.numKvHeads * layout.headDim * 4;
}

/**
 * Float offset of the vector for (page, layer, kOrV, tokenInPage, kvHead) in the pool;
 * kOrV is 0 for K and 1 for V. The headDim floats from there are that head's vector.
 */
export function kvOffset(
  layout: KvLayout,
  page: number,
  layer: number,
  kOrV: 0 | 1,
  tokenInPage: number,
  kvHead: number,
): number {
  const rowFloats = layout.numKvHeads * layout.headDim;
  return (
    page * pageFloats(layout) +
    ((layer * 2 + kOrV) * layout.pageSize + tokenInPage) * rowFloats +
    kvHead * layout.headDim
  );
}

/** A string that two nodes compare in their handshake; any difference refuses to pair. */
export function layoutSignature(layout: KvLayout, model: string, dtype = "f32"): string {
  return `${model}|${dtype}|page=${layout.pageSize}|layers=${layout.numLayers}|kvh=${layout.numKvHeads}|hd=${layout.headDim}`;
}
