/**
 * Model folders in every weight format: `convertModelFolder` (kvfence quantize) writes what the
 * loader reads back unchanged, `--quantize` at load equals converting the folder, bf16/f16 stay at
 * 2 bytes after load, and a damaged block-format entry is refused with a one-line error.
 */
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { matrixBytes, matrixDType, type WeightDType } from "../kernels/weight-format.js";
import { KvfenceError } from "../lib/errors.js";
import { packageRoot } from "../lib/package-root.js";
import { convertModelFolder, convertWeights } from "./convert-model.js";
import { genModel } from "./gen-model.js";
import { loadModel } from "./load-model.js";
import { WEIGHT_FORMATS_KEY } from "./safetensors.js";

const tiny = (): string => join(packageRoot(), "models", "kvfence-tiny");

function withDir(fn: (dir: string) => void): void {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-convert-"));
  try {
    fn(dir);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

test("convertModelFolder() writes each format so that loading gives back the same bytes", () => {
  const source = loadModel(tiny());
  for (const dtype of ["bf16", "f16", "q8_0", "q4_0"] as WeightDType[]) {
    withDir((dir) => {
      convertModelFolder(tiny(), dir, dtype);
      const loaded = loadModel(dir);
      const want = convertWeights(source.weights, source.config, dtype);
      const got = loaded.weights;
      for (const [g, w] of [
        [got.embed, want.embed],
        [got.lmHead, want.lmHead],
        [got.layers[1]?.q, want.layers[1]?.q],
        [got.layers[2]?.down, want.layers[2]?.down],
      ] as const) {
        assert.ok(g !== undefined && w !== undefined);
        assert.equal(matrixDType(g), dtype);
        assert.deepEqual(Buffer.from(matrixBytes(g)), Buffer.from(matrixBytes(w)), dtype);
      }
      assert.ok(got.finalNorm instanceof Float32Array, "norms stay f32");
      assert.deepEqual(got.finalNorm, source.weights.finalNorm);
      assert.equal(loaded.tokenizer.decode(loaded.tokenizer.encode("héllo")), "héllo", "tokenizer copied");
    });
  }
});

test("loadModel({ quantize }) equals loading a folder quantised on disk", () => {
  const atLoad = loadModel(tiny(), { quantize: "q4_0", shared: true });
  withDir((dir) => {
    convertModelFolder(tiny(), dir, "q4_0");
    const fromDisk = loadModel(dir);
    assert.deepEqual(
      Buffer.from(matrixBytes(atLoad.weights.layers[0]?.gate ?? new Float32Array())),
      Buffer.from(matrixBytes(fromDisk.weights.layers[0]?.gate ?? new Float32Array())),
    );
    assert.ok(matrixBytes(atLoad.weights.embed).buffer instanceof SharedArrayBuffer, "shared stays shared");
    assert.ok(atLoad.weights.finalNorm.buffer instanceof SharedArrayBuffer);
  });
});

test("gen-model --dtype bf16 writes 2-byte weights that load without widening", () => {
  withDir((dir) => {
    const f32 = genModel(join(dir, "f32"), { like: "tiny", seed: 3 });
    const bf16 = genModel(join(dir, "bf16"), { like: "tiny", seed: 3, dtype: "BF16" });
    assert.ok(bf16.bytes < f32.bytes * 0.51, `${bf16.bytes} vs ${f32.bytes}`);
    const m = loadModel(join(dir, "bf16"));
    const q = m.weights.layers[0]?.q ?? new Float32Array();
    assert.equal(matrixDType(q), "bf16");
    assert.equal(matrixBytes(q).byteLength, 2 * 64 * 64);
  });
});

test("a damaged block-format entry is refused with a one-line error naming the tensor", () => {
  withDir((dir) => {
    convertModelFolder(tiny(), dir, "q8_0");
    const path = join(dir, "model.safetensors");
    const bytes = readFileSync(path);
    const headerLength = Number(bytes.readBigUInt64LE(0));
    const header = JSON.parse(bytes.subarray(8, 8 + headerLength).toString("utf8"));
    const formats = JSON.parse(header.__metadata__[WEIGHT_FORMATS_KEY]);
    for (const [mutate, pattern, code] of [
      [
        (f: Record<string, { dtype: string; shape: number[] }>) => {
          (f["model.layers.0.mlp.up_proj.weight"] as { shape: number[] }).shape = [512, 224];
        },
        /up_proj\.weight is q8_0 \[512,224\]/,
        "bad_model_folder",
      ],
      [
        (f: Record<string, { dtype: string; shape: number[] }>) => {
          (f["model.layers.0.mlp.up_proj.weight"] as { dtype: string }).dtype = "q5_1";
        },
        /weight format "q5_1"; supported: q8_0, q4_0/,
        "unsupported_model",
      ],
    ] as const) {
      const copy = structuredClone(formats);
      mutate(copy);
      const h = {
        ...header,
        __metadata__: { ...header.__metadata__, [WEIGHT_FORMATS_KEY]: JSON.stringify(copy) },
      };
      let text = JSON.stringify(h);
      text += " ".repeat((8 - (text.length % 8)) % 8);
      const body = Buffer.from(text, "utf8");
      const out = Buffer.alloc(8 + body.length + bytes.length - 8 - headerLength);
      out.writeBigUInt64LE(BigInt(body.length), 0);
      body.copy(out, 8);
      bytes.copy(out, 8 + body.length, 8 + headerLength);
      writeFileSync(path, out);
      assert.throws(
        () => loadModel(dir),
        (err: unknown) =>
          err instanceof KvfenceError &&
          err.code === code &&
          pattern.test(err.message) &&
          !err.message.includes("\n"),
      );
    }
  });
});
