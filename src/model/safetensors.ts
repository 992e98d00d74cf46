/**
 * A small reader for the safetensors format: an 8-byte little-endian header length N, N bytes of
 * JSON `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__"?: {...}}`, then the data,
 * with offsets relative to the end of the header.
 *
 * The whole file is read into one buffer (optionally a SharedArrayBuffer, so worker threads can
 * share the weights) in large chunks, each through its own view: the file's bytes are a byte range
 * of the buffer (`ByteRange`), not one Uint8Array, because a typed array holds at most 2^32
 * elements and a file may pass 4 GiB (a 3B model in bf16); every tensor is a view of its own range.
 * F32 tensors whose data is 4-byte aligned are returned as views into that buffer (no copy). `toMatrix` keeps F16 and BF16 at 2 bytes (a `WeightTensor` over the
 * same buffer, src/kernels/weight-format.ts); `toFloat32` widens them with tight loops over 16-bit
 * views (norms and biases, which stay f32).
 * Every offset is taken relative to the Uint8Array's own `byteOffset`, so parsing is correct for
 * pooled Node Buffers too. Parsing checks the header length, the JSON, each tensor's offsets
 * against the data actually present, and shape × dtype size against each byte range.
 */
import { closeSync, fstatSync, openSync, readSync, writeSync } from "node:fs";
import {
  f16ValueTable,
  f32ToBf16Bits,
  f32ToF16Bits,
  type Matrix,
  QK,
  WEIGHT_DTYPES,
  type WeightDType,
  weightBytes,
} from "../kernels/weight-format.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import { KvfenceError } from "../lib/errors.js";

/**
 * The `__metadata__` key naming the tensors stored in a block format (written by `kvfence
 * quantize`, docs/weights.md): a JSON object `{tensor name: {"dtype": "q8_0"|"q4_0", "shape":
 * [rows, cols]}}`. Such a tensor is stored as U8 of shape [rows, bytes per row] holding llama.cpp's
 * GGUF blocks, so any safetensors reader still reads the file.
 */
export const WEIGHT_FORMATS_KEY = "kvfence.weight_formats";

/** Element sizes of every dtype the format defines (used to validate byte ranges). */
const DTYPE_BYTES: Readonly<Record<string, number>> = {
  BOOL: 1,
  U8: 1,
  I8: 1,
  F8_E4M3: 1,
  F8_E5M2: 1,
  I16: 2,
  U16: 2,
  F16: 2,
  BF16: 2,
  I32: 4,
  U32: 4,
  F32: 4,
  I64: 8,
  U64: 8,
  F64: 8,
};

/** The dtypes this reader converts to f32. */
export const SUPPORTED_DTYPES: readonly string[] = ["F32", "F16", "BF16"];

const READ_CHUNK_BYTES = 64 * 1024 * 1024;
const MAX_HEADER_BYTES = 100 * 1024 * 1024;

export interface TensorInfo {
  readonly name: string;
  readonly dtype: string;
  readonly shape: readonly number[];
  /** Offset of the tensor's first byte within the file. */
  readonly fileOffset: number;
  readonly byteLength: number;
}

function bad(file: string, problem: string, cause?: unknown): KvfenceError {
  return new KvfenceError(
    "bad_model_folder",
    `Bad model folder: ${file}: ${problem}`,
    cause === undefined ? {} : { cause },
  );
}

/** Where a file's bytes go when it is read (`readWholeFile`, `SafetensorsFile.open`). */
export interface ReadFileOptions {
  /** A fresh SharedArrayBuffer (not an ArrayBuffer) when there is no `into`. */
  readonly shared?: boolean;
  /** Called after each chunk with the file position reached and the file's size. */
  readonly onBytes?: (bytesRead: number, totalBytes: number) => void;
  /** Where the bytes go (a window of the engines' shared memory); else a fresh buffer. */
  readonly into?: (bytes: number) => ByteRange;
  /**
   * Maps the open file (`fd`, `bytes` long) into the engines' memory in place of `into` and
   * reading it, and returns its window (src/engine/engine-memory.ts); null: read as usual.
   */
  readonly map?: (fd: number, bytes: number) => ByteRange | null;
}

/** Opens `path`, hands its descriptor and size to `read`, closes it. */
function withFile<T>(path: string, read: (fd: number, size: number) => T): T {
  let fd: number;
  try {
    fd = openSync(path, "r");
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    throw bad(path, code === "ENOENT" ? "file is missing" : `cannot open the file: ${String(err)}`, err);
  }
  try {
    return read(fd, fstatSync(fd).size);
  } finally {
    closeSync(fd);
  }
}

/** The window a file of `size` bytes is read into: `into`'s, or a fresh buffer. */
function destination(size: number, options: ReadFileOptions | undefined): ByteRange {
  return (
    options?.into?.(size) ?? {
      buffer: options?.shared === true ? new SharedArrayBuffer(size) : new ArrayBuffer(size),
      byteOffset: 0,
      byteLength: size,
    }
  );
}

/**
 * Reads bytes [from, to) of the open file into the same range of `bytes`, in chunks of
 * READ_CHUNK_BYTES each through its own view (a typed array holds at most 2^32 elements, and
 * readSync takes at most 2^31 - 1 bytes); `onBytes(end, size)` after each chunk.
 */
function readRange(
  fd: number,
  file: { readonly path: string; readonly size: number; readonly bytes: ByteRange },
  from: number,
  to: number,
  onBytes?: (bytesRead: number, totalBytes: number) => void,
): void {
  let done = from;
  while (done < to) {
    const want = Math.min(READ_CHUNK_BYTES, to - done);
    const n = readSync(fd, byteView(file.bytes, done, want), 0, want, done);
    if (n === 0) throw bad(file.path, `file shrank while reading: got ${done} of ${file.size} bytes`);
    done += n;
    onBytes?.(done, file.size);
  }
}

/**
 * Reads a whole file into memory (so it may pass 4 GiB: see `readRange`), into a SharedArrayBuffer
 * when `shared` is set.
 */
export function readWholeFile(path: string, options?: ReadFileOptions): ByteRange {
  return withFile(path, (fd, size) => {
    const mapped = options?.map?.(fd, size) ?? null;
    if (mapped !== null) {
      options?.onBytes?.(size, size);
      return mapped;
    }
    const bytes = destination(size, options);
    readRange(fd, { path, size, bytes }, 0, size, options?.onBytes);
    if (size === 0) options?.onBytes?.(0, 0);
    return bytes;
  });
}

/** A parsed safetensors file held in memory. */
export class SafetensorsFile {
  readonly path: string;
  readonly metadata: Readonly<Record<string, string>>;
  readonly #bytes: ByteRange;
  readonly #tensors: ReadonlyMap<string, TensorInfo>;
  /** Block-format tensors named by the WEIGHT_FORMATS_KEY metadata. */
  readonly #blocks: ReadonlyMap<string, { dtype: WeightDType; shape: readonly number[] }>;

  private constructor(
    path: string,
    bytes: ByteRange,
    tensors: Map<string, TensorInfo>,
    metadata: Record<string, string>,
  ) {
    this.path = path;
    this.#bytes = bytes;
    this.#tensors = tensors;
    this.metadata = metadata;
    this.#blocks = parseBlockFormats(path, metadata, tensors);
  }

  /**
   * Reads and parses a file: the header, then the data of every tensor `skip` does not name (all
   * by default; adjacent tensors in one read). A skipped tensor's bytes are not read (its range of
   * the window stays as it was: zeros in a fresh memory, untouched); the loader skips what it
   * ignores (a RoPE `inv_freq` buffer, an `lm_head.weight` saved beside tied embeddings).
   */
  static open(
    path: string,
    options?: ReadFileOptions & { readonly skip?: (name: string) => boolean },
  ): SafetensorsFile {
    return withFile(path, (fd, size) => {
      const mapped = options?.map?.(fd, size) ?? null;
      if (mapped !== null) {
        options?.onBytes?.(size, size);
        return SafetensorsFile.parse(mapped, path);
      }
      const file = { path, size, bytes: destination(size, options) };
      readRange(fd, file, 0, Math.min(size, 8));
      if (size >= 8) {
        const declared = new DataView(file.bytes.buffer, file.bytes.byteOffset, 8).getBigUint64(0, true);
        const header = Number(declared > BigInt(MAX_HEADER_BYTES) ? MAX_HEADER_BYTES : declared);
        readRange(fd, file, 8, Math.min(size, 8 + header));
      }
      const st = SafetensorsFile.parse(file.bytes, path);
      const ranges = st
        .names()
        .filter((name) => options?.skip?.(name) !== true)
        .map((name) => st.info(name) as TensorInfo)
        .sort((a, b) => a.fileOffset - b.fileOffset);
      let at = 0;
      let end = 0;
      for (const t of ranges) {
        if (t.fileOffset > end) {
          readRange(fd, file, at, end, options?.onBytes);
          at = t.fileOffset;
        }
        end = Math.max(end, t.fileOffset + t.byteLength);
      }
      readRange(fd, file, at, end, options?.onBytes);
      options?.onBytes?.(size, size);
      return st;
    });
  }

  /** Parses safetensors bytes (any Uint8Array, including a pooled Buffer, or `ByteRange`); `path` names it in errors. */
  static parse(bytes: ByteRange, path: string): SafetensorsFile {
    if (bytes.byteLength < 8)
      throw bad(path, `file is ${bytes.byteLength} bytes, too short for the 8-byte header length`);
    const view = new DataView(bytes.buffer, bytes.byteOffset, 8);
    const headerLength64 = view.getBigUint64(0, true);
    const available = bytes.byteLength - 8;
    if (headerLength64 > BigInt(available)) {
      throw bad(
        path,
        `header length ${headerLength64} runs past the end of the file (${bytes.byteLength} bytes); the file is truncated or not safetensors`,
      );
    }
    const headerLength = Number(headerLength64);
    if (headerLength > MAX_HEADER_BYTES)
      throw bad(path, `header length ${headerLength} exceeds the ${MAX_HEADER_BYTES}-byte limit`);
    let header: unknown;
    try {
      header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(byteView(bytes, 8, headerLength)));
    } catch (err) {
      throw bad(path, `header is not valid JSON: ${(err as Error).message}`, err);
    }
    if (typeof header !== "object" || header === null || Array.isArray(header))
      throw bad(path, "header is not a JSON object");

    const dataStart = 8 + headerLength;
    const dataBytes = bytes.byteLength - dataStart;
    const tensors = new Map<string, TensorInfo>();
    let metadata: Record<string, string> = {};
    for (const [name, entry] of Object.entries(header)) {
      if (name === "__metadata__") {
        metadata = (typeof entry === "object" && entry !== null ? entry : {}) as Record<string, string>;
        continue;
      }
      tensors.set(name, parseEntry({ path, dataStart, dataBytes }, name, entry));
    }
    return new SafetensorsFile(path, bytes, tensors, metadata);
  }

  /** Tensor names in header order. */
  names(): string[] {
    return [...this.#tensors.keys()];
  }

  has(name: string): boolean {
    return this.#tensors.has(name);
  }

  info(name: string): TensorInfo | undefined {
    return this.#tensors.get(name);
  }

  /** The tensor's shape as a matrix of weights (a block-format tensor's logical shape, not its U8 one). */
  logicalShape(name: string): readonly number[] | undefined {
    return this.#blocks.get(name)?.shape ?? this.#tensors.get(name)?.shape;
  }

  /**
   * The tensor in its stored format: F32 as `toFloat32`, F16 and BF16 as a 2-byte `WeightTensor`
   * over the file's buffer (copied only when not 2-byte aligned). Throws like `toFloat32` for
   * other dtypes.
   */
  toMatrix(name: string): Matrix {
    const t = this.#tensors.get(name);
    if (t === undefined) throw bad(this.path, `tensor ${name} is missing`);
    const block = this.#blocks.get(name);
    if (block !== undefined) {
      const start = this.#bytes.byteOffset + t.fileOffset;
      return {
        dtype: block.dtype,
        shape: block.shape,
        bytes: new Uint8Array(this.#bytes.buffer, start, t.byteLength),
      };
    }
    if (t.dtype !== "F16" && t.dtype !== "BF16") return this.toFloat32(name);
    const halves = halfView(this.#bytes, t);
    return {
      dtype: t.dtype === "F16" ? "f16" : "bf16",
      shape: t.shape,
      bytes: new Uint8Array(halves.buffer, halves.byteOffset, halves.byteLength),
    };
  }

  /**
   * The tensor as f32, row-major. F32 data aligned to 4 bytes is a view into the file's buffer (a
   * SharedArrayBuffer when the file was opened shared); anything converted gets a fresh buffer of
   * the same kind. Throws `unsupported_model` for dtypes other than F32, F16 and BF16.
   */
  toFloat32(name: string): Float32Array {
    const t = this.#tensors.get(name);
    if (t === undefined) throw bad(this.path, `tensor ${name} is missing`);
    const count = t.byteLength / (DTYPE_BYTES[t.dtype] as number);
    const start = this.#bytes.byteOffset + t.fileOffset;
    const buffer = this.#bytes.buffer;
    const shared = buffer instanceof SharedArrayBuffer;
    switch (t.dtype) {
      case "F32": {
        if (start % 4 === 0) return new Float32Array(buffer, start, count);
        const out = allocFloat32(count, shared);
        new Uint8Array(out.buffer, out.byteOffset, out.byteLength).set(
          byteView(this.#bytes, t.fileOffset, t.byteLength),
        );
        return out;
      }
      case "BF16": {
        const out = allocFloat32(count, shared);
        bf16ToF32(halfView(this.#bytes, t), new Uint32Array(out.buffer, out.byteOffset, count));
        return out;
      }
      case "F16": {
        const out = allocFloat32(count, shared);
        f16ToF32(halfView(this.#bytes, t), out);
        return out;
      }
      default:
        throw new KvfenceError(
          "unsupported_model",
          `Unsupported model: ${this.path}: tensor ${name} has dtype ${t.dtype}; supported dtypes: ${SUPPORTED_DTYPES.join(", ")}`,
        );
    }
  }
}

/** The block-format tensors the metadata names, each checked against its U8 entry. */
function parseBlockFormats(
  path: string,
  metadata: Readonly<Record<string, string>>,
  tensors: ReadonlyMap<string, TensorInfo>,
): Map<string, { dtype: WeightDType; shape: readonly number[] }> {
  const out = new Map<string, { dtype: WeightDType; shape: readonly number[] }>();
  const text = metadata[WEIGHT_FORMATS_KEY];
  if (text === undefined) return out;
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch (err) {
    throw bad(path, `metadata ${WEIGHT_FORMATS_KEY} is not valid JSON: ${(err as Error).message}`, err);
  }
  if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed))
    throw bad(path, `metadata ${WEIGHT_FORMATS_KEY} is not a JSON object`);
  for (const [name, entry] of Object.entries(parsed)) {
    const e = entry as { dtype?: unknown; shape?: unknown } | null;
    const t = tensors.get(name);
    if (t === undefined)
      throw bad(path, `metadata ${WEIGHT_FORMATS_KEY} names tensor ${name}, which the file does not hold`);
    const dtype = e?.dtype;
    if (dtype !== "q8_0" && dtype !== "q4_0") {
      throw new KvfenceError(
        "unsupported_model",
        `Unsupported model: ${path}: tensor ${name} has weight format ${JSON.stringify(dtype)}; supported: ${WEIGHT_DTYPES.filter((d) => d.startsWith("q")).join(", ")}`,
      );
    }
    const shape = e?.shape;
    if (!Array.isArray(shape) || shape.length !== 2 || !shape.every((d) => Number.isSafeInteger(d) && d > 0))
      throw bad(
        path,
        `tensor ${name} has an invalid ${dtype} shape in ${WEIGHT_FORMATS_KEY}: ${JSON.stringify(shape)}`,
      );
    const [rows, cols] = shape as [number, number];
    if (cols % QK !== 0)
      throw bad(
        path,
        `tensor ${name}: ${dtype} rows of ${cols} values are not a whole number of ${QK}-value blocks`,
      );
    const want = weightBytes(dtype, rows * cols);
    if (t.dtype !== "U8" || t.byteLength !== want) {
      throw bad(
        path,
        `tensor ${name} is ${dtype} [${rows},${cols}] (${want} bytes) but is stored as ${t.dtype} of ${t.byteLength} bytes`,
      );
    }
    out.set(name, { dtype, shape: Object.freeze([rows, cols]) });
  }
  return out;
}

/** One header entry of the file `path`, whose data section starts at `dataStart` and holds `dataBytes`. */
function parseEntry(
  file: { readonly path: string; readonly dataStart: number; readonly dataBytes: number },
  name: string,
  entry: unknown,
): TensorInfo {
  const { path, dataStart, dataBytes } = file;
  const e = entry as { dtype?: unknown; shape?: unknown; data_offsets?: unknown } | null;
  if (typeof e !== "object" || e === null)
    throw bad(path, `header entry for tensor ${name} is not an object`);
  const { dtype, shape, data_offsets: offsets } = e;
  if (typeof dtype !== "string") throw bad(path, `tensor ${name} has no dtype`);
  const size = DTYPE_BYTES[dtype];
  if (size === undefined) {
    throw new KvfenceError(
      "unsupported_model",
      `Unsupported model: ${path}: tensor ${name} has unknown dtype ${JSON.stringify(dtype)}; supported dtypes: ${SUPPORTED_DTYPES.join(", ")}`,
    );
  }
  if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw bad(path, `tensor ${name} has an invalid shape: ${JSON.stringify(shape)}`);
  }
  if (
    !Array.isArray(offsets) ||
    offsets.length !== 2 ||
    !offsets.every((o) => Number.isSafeInteger(o) && o >= 0) ||
    (offsets[0] as number) > (offsets[1] as number)
  ) {
    throw bad(path, `tensor ${name} has invalid data_offsets: ${JSON.stringify(offsets)}`);
  }
  const [begin, end] = offsets as [number, number];
  if (end > dataBytes) {
    throw bad(
      path,
      `tensor ${name} data ends at byte ${end} but the file holds only ${dataBytes} data bytes; the file is truncated`,
    );
  }
  const elements = (shape as number[]).reduce((a, b) => a * b, 1);
  if (elements * size !== end - begin) {
    throw bad(
      path,
      `tensor ${name} has shape ${JSON.stringify(shape)} of ${dtype} (${elements * size} bytes) but data_offsets span ${end - begin} bytes`,
    );
  }
  return {
    name,
    dtype,
    shape: Object.freeze([...(shape as number[])]),
    fileOffset: dataStart + begin,
    byteLength: end - begin,
  };
}

function allocFloat32(count: number, shared: boolean): Float32Array {
  return new Float32Array(shared ? new SharedArrayBuffer(count * 4) : new ArrayBuffer(count * 4));
}

/** A Uint16Array over a 16-bit tensor, copying only when the data is not 2-byte aligned. */
function halfView(bytes: ByteRange, t: TensorInfo): Uint16Array {
  const start = bytes.byteOffset + t.fileOffset;
  const count = t.byteLength / 2;
  if (start % 2 === 0) return new Uint16Array(bytes.buffer, start, count);
  const copy = new Uint16Array(count);
  new Uint8Array(copy.buffer).set(byteView(bytes, t.fileOffset, t.byteLength));
  return copy;
}

/** bf16 is the top half of an f32: widen by shifting into the high 16 bits. */
export function bf16ToF32(src: Uint16Array, dst: Uint32Array): void {
  const n = src.length;
  for (let i = 0; i < n; i++) dst[i] = (src[i] as number) << 16;
}

/** IEEE half → f32 through a 65536-entry table (256 KiB, built on first use). */
export function f16ToF32(src: Uint16Array, dst: Float32Array): void {
  const table = f16ValueTable();
  const n = src.length;
  for (let i = 0; i < n; i++) dst[i] = table[src[i] as number] as number;
}

/** One tensor to write: f32 data is stored as the given dtype (F32, F16 or BF16). */
export interface TensorToWrite {
  readonly name: string;
  readonly shape: readonly number[];
  readonly data: Float32Array;
  readonly dtype?: "F32" | "F16" | "BF16";
}

/**
 * Builds the header of a safetensors file for the given tensors (8-byte length + JSON padded with
 * spaces to a multiple of 8) and the byte offset of each tensor's data relative to the data start.
 */
export function safetensorsHeader(
  tensors: readonly { name: string; shape: readonly number[]; dtype: string }[],
  metadata?: Record<string, string>,
): { header: Uint8Array; dataBytes: number; offsets: number[] } {
  const json: Record<string, unknown> = {};
  if (metadata !== undefined) json.__metadata__ = metadata;
  const offsets: number[] = [];
  let offset = 0;
  for (const t of tensors) {
    const bytes = t.shape.reduce((a, b) => a * b, 1) * (DTYPE_BYTES[t.dtype] ?? 0);
    json[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + bytes] };
    offsets.push(offset);
    offset += bytes;
  }
  let text = JSON.stringify(json);
  text += " ".repeat((8 - (text.length % 8)) % 8);
  const body = new TextEncoder().encode(text);
  const header = new Uint8Array(8 + body.byteLength);
  new DataView(header.buffer).setBigUint64(0, BigInt(body.byteLength), true);
  header.set(body, 8);
  return { header, dataBytes: offset, offsets };
}

/** Encodes f32 values as the bytes of `dtype` (round-to-nearest-even for BF16 and F16). */
export function encodeTensorData(data: Float32Array, dtype: "F32" | "F16" | "BF16"): Uint8Array {
  if (dtype === "F32") return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const out = new Uint16Array(data.length);
  if (dtype === "BF16") {
    for (let i = 0; i < data.length; i++) out[i] = f32ToBf16Bits(data[i] as number);
  } else {
    for (let i = 0; i < data.length; i++) out[i] = f32ToF16Bits(data[i] as number);
  }
  return new Uint8Array(out.buffer);
}

/** Writes tensors to a safetensors file (used by tests and `kvfence gen-model`). */
export function writeSafetensors(
  path: string,
  tensors: readonly TensorToWrite[],
  metadata?: Record<string, string>,
): void {
  const { header } = safetensorsHeader(
    tensors.map((t) => ({ name: t.name, shape: t.shape, dtype: t.dtype ?? "F32" })),
    metadata,
  );
  const fd = openSync(path, "w");
  try {
    writeAllSync(fd, header);
    for (const t of tensors) writeAllSync(fd, encodeTensorData(t.data, t.dtype ?? "F32"));
  } finally {
    closeSync(fd);
  }
}

/** writeSync until every byte is written. */
export function writeAllSync(fd: number, bytes: Uint8Array): void {
  let done = 0;
  while (done < bytes.byteLength) done += writeSync(fd, bytes, done, bytes.byteLength - done);
}
