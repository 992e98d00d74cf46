/**
 * The page-major KV layout of docs/design.md §3, shared by the forward pass, the pool, the transfer
 * engine and the handshake's layout signature.
 *
 * A pool is one flat array of `numPages * pageFloats` elements. Page p starts at element
 * `p * pageFloats`; inside it the order is layer → K|V → token-in-page → kv-head → dim, so one page
 * (all layers, K and V) is one contiguous byte range and moves with one write.
 *
 * ## The element type (`--kv-cache-dtype`)
 * An element is an f32 (a `Float32Array` pool) or a 2-byte half float (a `Uint16Array` of raw bits):
 * IEEE f16 or bf16. The forward pass writes K/V rounded to the dtype (round to nearest, ties to
 * even: `roundKv` in src/kernels/reference.ts) and the attention kernels widen them to f32 as they
 * read, so a 2-byte pool holds twice the tokens of an f32 one in the same bytes. The transfer, the
 * checksums and the page tags see pages as bytes and work unchanged; the dtype is part of
 * `layoutSignature`, so a prefill and a decode node with different dtypes refuse to pair. The
 * default is f16, as in llama.cpp and vLLM (`DEFAULT_KV_CACHE_DTYPE`); a layout without a dtype
 * is f32.
 */

/** The KV cache element types: `f32`, or a 2-byte `f16` (IEEE half) or `bf16` (bfloat16). */
export type KvDtype = "f32" | "f16" | "bf16";

export const KV_DTYPES: readonly KvDtype[] = ["f32", "f16", "bf16"];

/** Whether `value` names a KV dtype (for the command lines' `--kv-cache-dtype` parsers). */
export function isKvDtype(value: string): value is KvDtype {
  return (KV_DTYPES as readonly string[]).includes(value);
}

/** What `--kv-cache-dtype` defaults to (as in llama.cpp and vLLM). */
export const DEFAULT_KV_CACHE_DTYPE: KvDtype = "f16";

/** The numeric code of a dtype for the WebAssembly kernels: 0 f32, 1 f16, 2 bf16. */
export function kvDtypeCode(dtype: KvDtype): number {
  return dtype === "f32" ? 0 : dtype === "f16" ? 1 : 2;
}

/** Bytes of one KV element of `dtype`. */
export function kvElementBytes(dtype: KvDtype): number {
  return dtype === "f32" ? 4 : 2;
}

export interface KvLayout {
  readonly numLayers: number;
  readonly numKvHeads: number;
  readonly headDim: number;
  /** Tokens per page. */
  readonly pageSize: number;
  /** The element type; absent means f32. */
  readonly dtype?: KvDtype;
}

/** The element type of `layout` (f32 when it names none). */
export function kvDtypeOf(layout: KvLayout): KvDtype {
  return layout.dtype ?? "f32";
}

/** Elements in one page: all layers, K and V. */
export function pageFloats(layout: KvLayout): number {
  return layout.numLayers * 2 * layout.pageSize * layout.numKvHeads * layout.headDim;
}

/** Bytes in one page at the layout's dtype. */
export function pageBytes(layout: KvLayout): number {
  return pageFloats(layout) * kvElementBytes(kvDtypeOf(layout));
}

/** Bytes of KV one token needs at the layout's dtype, over all layers. */
export function bytesPerToken(layout: KvLayout): number {
  return layout.numLayers * 2 * layout.numKvHeads * layout.headDim * kvElementBytes(kvDtypeOf(layout));
}

/**
 * Element offset of the vector for (page, layer, kOrV, tokenInPage, kvHead) in the pool;
 * kOrV is 0 for K and 1 for V. The headDim elements from there are that head's vector.
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

/**
 * A string that two nodes compare in their handshake; any difference refuses to pair (the dtype
 * included: an f16 page read as bf16 or f32 would be garbage).
 */
export function layoutSignature(layout: KvLayout, model: string): string {
  return `${model}|kv=${kvDtypeOf(layout)}|page=${layout.pageSize}|layers=${layout.numLayers}|kvh=${layout.numKvHeads}|hd=${layout.headDim}`;
}
