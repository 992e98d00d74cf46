import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { rawSafetensors, safetensorsBytes } from "../../testing/model-folder.js";
import { KvfenceError } from "../lib/errors.js";
import { bf16ToF32, encodeTensorData, f16ToF32, SafetensorsFile, writeSafetensors } from "./safetensors.js";

const VALUES = Float32Array.from([1.5, -2, 0.25, 0, -0, 3.140625, 65504, 2 ** -24, -(2 ** -14)]);

function assertBadFolder(fn: () => unknown, pattern: RegExp, code = "bad_model_folder"): void {
  assert.throws(fn, (err: unknown) => {
    assert.ok(err instanceof KvfenceError);
    assert.equal(err.code, code);
    assert.match(err.message, pattern);
    assert.ok(!err.message.includes("\n"), "one-line message");
    return true;
  });
}

test("SafetensorsFile.parse() reads F32, F16 and BF16 tensors to the exact f32 values", () => {
  const bytes = safetensorsBytes([
    { name: "a", shape: [3, 3], data: VALUES, dtype: "F32" },
    { name: "b", shape: [9], data: VALUES, dtype: "F16" },
    { name: "c", shape: [9], data: VALUES.map((v) => (v === 65504 ? 65536 : v)), dtype: "BF16" },
  ]);
  const file = SafetensorsFile.parse(bytes, "mem");
  assert.deepEqual(file.names(), ["a", "b", "c"]);
  assert.deepEqual(file.info("a")?.shape, [3, 3]);
  assert.deepEqual(Array.from(file.toFloat32("a")), Array.from(VALUES));
  assert.deepEqual(Array.from(file.toFloat32("b")), Array.from(VALUES));
  assert.deepEqual(Array.from(file.toFloat32("c")), Array.from(VALUES.map((v) => (v === 65504 ? 65536 : v))));
});

test("SafetensorsFile.parse() honours the byteOffset of a pooled Buffer", () => {
  Buffer.from("make sure the pool is in use");
  const bf = VALUES.map((v) => (v === 65504 ? 65536 : v));
  const pooledBf = Buffer.from(safetensorsBytes([{ name: "w", shape: [9], data: bf, dtype: "BF16" }]));
  assert.notEqual(pooledBf.byteOffset, 0, "the test needs a Buffer that does not start its ArrayBuffer");
  assert.deepEqual(Array.from(SafetensorsFile.parse(pooledBf, "pooled").toFloat32("w")), Array.from(bf));
});

test("SafetensorsFile.toFloat32() copies F32 and 16-bit data that is not aligned", () => {
  for (const dtype of ["F32", "F16"] as const) {
    const inner = safetensorsBytes([{ name: "w", shape: [9], data: VALUES, dtype }]);
    const backing = new Uint8Array(inner.byteLength + 1);
    backing.set(inner, 1);
    const file = SafetensorsFile.parse(backing.subarray(1), "odd");
    assert.deepEqual(Array.from(file.toFloat32("w")), Array.from(VALUES), dtype);
  }
});

test("SafetensorsFile.toFloat32() returns aligned F32 data as a view without copying", () => {
  const bytes = safetensorsBytes([{ name: "w", shape: [9], data: VALUES }]);
  const out = SafetensorsFile.parse(bytes, "mem").toFloat32("w");
  assert.equal(out.buffer, bytes.buffer);
});

test("SafetensorsFile.open() puts tensors in SharedArrayBuffers when shared", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-st-"));
  try {
    const path = join(dir, "x.safetensors");
    writeSafetensors(path, [
      { name: "f", shape: [9], data: VALUES },
      { name: "h", shape: [9], data: VALUES, dtype: "F16" },
    ]);
    let lastBytes = 0;
    const file = SafetensorsFile.open(path, { shared: true, onBytes: (done) => (lastBytes = done) });
    assert.ok(lastBytes > 0);
    assert.ok(file.toFloat32("f").buffer instanceof SharedArrayBuffer);
    assert.ok(file.toFloat32("h").buffer instanceof SharedArrayBuffer);
    assert.ok(!(SafetensorsFile.open(path).toFloat32("h").buffer instanceof SharedArrayBuffer));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("SafetensorsFile.parse() rejects a file shorter than the header length field", () => {
  assertBadFolder(
    () => SafetensorsFile.parse(new Uint8Array(5), "/m/x.safetensors"),
    /^Bad model folder: \/m\/x\.safetensors: file is 5 bytes/,
  );
});

test("SafetensorsFile.parse() rejects a header length past the end of the file", () => {
  const bytes = safetensorsBytes([{ name: "w", shape: [2], data: new Float32Array(2) }]);
  new DataView(bytes.buffer).setBigUint64(0, BigInt(bytes.byteLength), true);
  assertBadFolder(
    () => SafetensorsFile.parse(bytes, "/m/x.safetensors"),
    /header length \d+ runs past the end of the file/,
  );
});

test("SafetensorsFile.parse() rejects a header that is not JSON", () => {
  const bytes = safetensorsBytes([{ name: "w", shape: [2], data: new Float32Array(2) }]);
  bytes[8] = "!".charCodeAt(0);
  assertBadFolder(() => SafetensorsFile.parse(bytes, "/m/x.safetensors"), /header is not valid JSON/);
});

test("SafetensorsFile.parse() rejects data shorter than the header says (truncated file)", () => {
  const bytes = safetensorsBytes([{ name: "w", shape: [4], data: new Float32Array(4) }]);
  assertBadFolder(
    () => SafetensorsFile.parse(bytes.subarray(0, bytes.byteLength - 3), "/m/x.safetensors"),
    /tensor w data ends at byte 16 but the file holds only 13 data bytes; the file is truncated/,
  );
});

test("SafetensorsFile.parse() rejects a shape that does not match the byte range", () => {
  const bytes = rawSafetensors([{ name: "w", shape: [3], dtype: "F32", bytes: new Uint8Array(12) }]);
  const text = new TextDecoder().decode(bytes).replace('"shape":[3]', '"shape":[4]');
  assertBadFolder(
    () => SafetensorsFile.parse(new TextEncoder().encode(text), "mem"),
    /tensor w has shape \[4\] of F32 \(16 bytes\) but data_offsets span 12 bytes/,
  );
});

test("SafetensorsFile.parse() rejects reversed data_offsets", () => {
  const bytes = rawSafetensors([{ name: "w", shape: [0], dtype: "F32", bytes: new Uint8Array(8) }]);
  const text = new TextDecoder().decode(bytes).replace('"data_offsets":[0,0]', '"data_offsets":[8,0]');
  assertBadFolder(
    () => SafetensorsFile.parse(new TextEncoder().encode(text), "mem"),
    /invalid data_offsets: \[8,0\]/,
  );
});

test("SafetensorsFile.toFloat32() refuses I8 and F64 as unsupported_model", () => {
  const file = SafetensorsFile.parse(
    rawSafetensors([
      { name: "i", shape: [4], dtype: "I8", bytes: new Uint8Array(4) },
      { name: "d", shape: [1], dtype: "F64", bytes: new Uint8Array(8) },
    ]),
    "/m/x.safetensors",
  );
  assertBadFolder(
    () => file.toFloat32("i"),
    /^Unsupported model: \/m\/x\.safetensors: tensor i has dtype I8; supported dtypes: F32, F16, BF16$/,
    "unsupported_model",
  );
  assertBadFolder(() => file.toFloat32("d"), /tensor d has dtype F64/, "unsupported_model");
});

test("SafetensorsFile.parse() refuses an unknown dtype name", () => {
  assertBadFolder(
    () =>
      SafetensorsFile.parse(
        rawSafetensors([{ name: "q", shape: [1], dtype: "Q4", bytes: new Uint8Array(1) }]),
        "mem",
      ),
    /unknown dtype "Q4"/,
    "unsupported_model",
  );
});

test("SafetensorsFile.open() names a missing file", () => {
  assertBadFolder(
    () => SafetensorsFile.open("/nonexistent/kvfence/x.safetensors"),
    /^Bad model folder: \/nonexistent\/kvfence\/x\.safetensors: file is missing$/,
  );
});

test("bf16ToF32() and f16ToF32() invert encodeTensorData() within half-precision rounding", () => {
  const values = Float32Array.from([0, 1, -1, 0.1, 1e-8, 6e-5, 1000.5, Number.POSITIVE_INFINITY]);
  const bf = new Uint16Array(encodeTensorData(values, "BF16").buffer);
  const bfOut = new Float32Array(values.length);
  bf16ToF32(bf, new Uint32Array(bfOut.buffer));
  values.forEach((v, i) => {
    assert.ok(Math.abs((bfOut[i] as number) - v) <= Math.abs(v) / 128 || v === bfOut[i], `bf16 ${v}`);
  });
  const half = new Uint16Array(encodeTensorData(values, "F16").buffer);
  const halfOut = new Float32Array(values.length);
  f16ToF32(half, halfOut);
  values.forEach((v, i) => {
    const err = Math.abs((halfOut[i] as number) - v);
    assert.ok(err <= Math.max(Math.abs(v) / 1024, 2 ** -24) || v === halfOut[i], `f16 ${v}`);
  });
  f16ToF32(Uint16Array.from([0x7e00]), halfOut);
  assert.ok(Number.isNaN(halfOut[0]));
});

test("writeSafetensors() writes a file SafetensorsFile reads back", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-st-"));
  try {
    const path = join(dir, "x.safetensors");
    writeSafetensors(path, [{ name: "w", shape: [3, 3], data: VALUES }], { format: "pt" });
    const file = SafetensorsFile.open(path);
    assert.equal(file.metadata.format, "pt");
    assert.deepEqual(Array.from(file.toFloat32("w")), Array.from(VALUES));
    writeFileSync(path, "x");
    assertBadFolder(() => SafetensorsFile.open(path), /too short/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
