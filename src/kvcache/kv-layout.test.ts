import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { bytesPerToken, type KvLayout, layoutSignature, pageBytes } from "./kv-layout.js";
import { PagePool } from "./page-pool.js";

const SHAPE = { numLayers: 30, numKvHeads: 3, headDim: 64, pageSize: 16 };

describe("KV layout dtype", () => {
  it("an f16 or bf16 page is half the bytes of an f32 one; a layout without a dtype is f32", () => {
    const f32: KvLayout = { ...SHAPE, dtype: "f32" };
    assert.equal(pageBytes(SHAPE), pageBytes(f32));
    assert.equal(bytesPerToken(f32), 30 * 2 * 3 * 64 * 4);
    for (const dtype of ["f16", "bf16"] as const) {
      assert.equal(pageBytes({ ...SHAPE, dtype }) * 2, pageBytes(f32));
      assert.equal(bytesPerToken({ ...SHAPE, dtype }) * 2, bytesPerToken(f32));
    }
  });

  it("the layout signature names the dtype, so layouts that differ only in it refuse to pair", () => {
    const sigs = (["f32", "f16", "bf16"] as const).map((dtype) => layoutSignature({ ...SHAPE, dtype }, "m"));
    assert.equal(new Set(sigs).size, 3);
    assert.match(sigs[1] as string, /kv=f16/);
    assert.equal(layoutSignature(SHAPE, "m"), sigs[0]);
  });

  it("PagePool holds 2-byte pages in a Uint16Array of half the bytes, f32 ones in a Float32Array", () => {
    const f16 = new PagePool({ ...SHAPE, dtype: "f16" }, 4);
    const f32 = new PagePool(SHAPE, 4);
    assert.ok(f16.data instanceof Uint16Array);
    assert.ok(f32.data instanceof Float32Array);
    assert.equal(f16.data.byteLength * 2, f32.data.byteLength);
    assert.equal(f16.pageBytes, pageBytes({ ...SHAPE, dtype: "f16" }));
    assert.equal(PagePool.dataBytesFor({ ...SHAPE, dtype: "bf16" }, 4), f16.data.byteLength);
    assert.equal(f16.capacityTokens, f32.capacityTokens);
  });
});
