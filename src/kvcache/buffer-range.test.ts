import assert from "node:assert/strict";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import { checkBufferRange } from "./buffer-range.js";
import type { KvLayout } from "./kv-layout.js";
import { OwnershipTable } from "./ownership-table.js";
import { PagePool } from "./page-pool.js";

const LAYOUT: KvLayout = { numLayers: 2, numKvHeads: 2, headDim: 4, pageSize: 4 };

/** The assertion that `make` throws config_invalid with exactly `message`. */
function refuses(make: () => unknown, message: string): void {
  assert.throws(make, (err: unknown) => {
    assert.ok(err instanceof KvfenceError);
    assert.equal(err.code, "config_invalid");
    assert.equal(err.message, message);
    return true;
  });
}

test("checkBufferRange() passes a range that fits at a multiple of 4, up to the buffer's last byte", () => {
  const buffer = new ArrayBuffer(64);
  checkBufferRange("Table", { numPages: 2, bytes: 60, byteOffset: 4, buffer, sizedBy: "Table.bytesFor" });
  checkBufferRange("Table", { numPages: 2, bytes: 0, byteOffset: 64, buffer, sizedBy: "Table.bytesFor" });
});

test("checkBufferRange() refuses a misaligned or negative offset and a buffer too small, naming the structure and its sizer", () => {
  const tableBytes = OwnershipTable.bytesFor(4);
  const buffer = new SharedArrayBuffer(64 + tableBytes);
  refuses(
    () => new OwnershipTable(4, { buffer, byteOffset: 6 }),
    "Ownership table byte offset must be a non-negative multiple of 4: 6",
  );
  refuses(
    () => new OwnershipTable(4, { buffer, byteOffset: -4 }),
    "Ownership table byte offset must be a non-negative multiple of 4: -4",
  );
  refuses(
    () => new OwnershipTable(4, { buffer, byteOffset: 68 }),
    `Ownership table of 4 pages needs ${tableBytes} bytes at offset 68, buffer has: ${64 + tableBytes}; size it with OwnershipTable.bytesFor()`,
  );
  const dataBytes = PagePool.dataBytesFor(LAYOUT, 3);
  const data = new SharedArrayBuffer(dataBytes);
  refuses(
    () => new PagePool(LAYOUT, 3, { dataBuffer: data, dataByteOffset: 2 }),
    "KV pool byte offset must be a non-negative multiple of 4: 2",
  );
  refuses(
    () => new PagePool(LAYOUT, 3, { dataBuffer: data, dataByteOffset: 4 }),
    `KV pool of 3 pages needs ${dataBytes} bytes at offset 4, buffer has: ${dataBytes}; size it with PagePool.dataBytesFor()`,
  );
});
