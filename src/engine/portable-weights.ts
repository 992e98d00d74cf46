/**
 * Model weights in a form that crosses a thread boundary intact. V8's structured clone (a worker's
 * `workerData`, `postMessage`; Node 20 and 24 alike) writes a typed array's `byteOffset` in 32 bits,
 * so a view past 4 GiB of the engines' shared memory — the native kernels' SharedArrayBuffer, which
 * holds a 3B model in bf16 (6.4 GB) — arrives in the worker at its offset modulo 2^32: a view of
 * the wrong bytes, with no error. So the weights cross as numbers (each tensor's buffer, byte
 * offset and length) and are views again on the other side (`fromPortable`); the buffers are
 * shared, nothing is copied. Both places that hand an engine's build options to a worker (the
 * threaded topology's nodes, the single engine's worker) send `portableOptions(options)`, and
 * `buildEngine` takes either form.
 */
import type { Matrix, WeightDType } from "../kernels/weight-format.js";
import { type ByteRange, byteView } from "../lib/byte-range.js";
import type { LayerWeights, ModelWeights } from "../model/model-config.js";

/** A tensor as plain numbers over its buffer: a Float32Array when `dtype` is absent, else a `WeightTensor`. */
export interface TensorRef extends ByteRange {
  readonly dtype?: WeightDType;
  readonly shape?: readonly number[];
}

type LayerRefs = { readonly [K in keyof LayerWeights]: TensorRef | null };

/** `ModelWeights` as tensor references (`portable`), safe to structured-clone. */
export interface PortableWeights {
  readonly portable: true;
  readonly embed: TensorRef;
  readonly layers: readonly LayerRefs[];
  readonly finalNorm: TensorRef;
  /** Null when tied to `embed` (it is the same object again on the other side). */
  readonly lmHead: TensorRef | null;
}

const LAYER_KEYS: readonly (keyof LayerWeights)[] = [
  "inputNorm",
  "q",
  "k",
  "v",
  "qBias",
  "kBias",
  "vBias",
  "o",
  "postNorm",
  "gate",
  "up",
  "down",
];

function toRef(m: Matrix): TensorRef {
  if (m instanceof Float32Array)
    return { buffer: m.buffer, byteOffset: m.byteOffset, byteLength: m.byteLength };
  const { buffer, byteOffset, byteLength } = m.bytes;
  return { buffer, byteOffset, byteLength, dtype: m.dtype, shape: m.shape };
}

function fromRef(r: TensorRef): Matrix {
  if (r.dtype === undefined) return new Float32Array(r.buffer, r.byteOffset, r.byteLength / 4);
  return {
    dtype: r.dtype,
    shape: r.shape ?? [],
    bytes: byteView(r, 0, r.byteLength),
  };
}

export function toPortable(w: ModelWeights): PortableWeights {
  return {
    portable: true,
    embed: toRef(w.embed),
    layers: w.layers.map(
      (l) => Object.fromEntries(LAYER_KEYS.map((k) => [k, l[k] === null ? null : toRef(l[k])])) as LayerRefs,
    ),
    finalNorm: toRef(w.finalNorm),
    lmHead: w.lmHead === w.embed ? null : toRef(w.lmHead),
  };
}

/** The weights again, as views of the same buffers (a tied LM head the same object as the embedding). */
export function fromPortable(p: PortableWeights): ModelWeights {
  const embed = fromRef(p.embed);
  return Object.freeze({
    embed,
    layers: Object.freeze(
      p.layers.map(
        (l) =>
          Object.freeze(
            Object.fromEntries(LAYER_KEYS.map((k) => [k, l[k] === null ? null : fromRef(l[k])])),
          ) as unknown as LayerWeights,
      ),
    ),
    finalNorm: fromRef(p.finalNorm) as Float32Array,
    lmHead: p.lmHead === null ? embed : fromRef(p.lmHead),
  });
}

/** Build options (anything with a `model`) with in-memory weights made portable, to post to a worker. */
export function portableOptions<O extends { readonly model: object }>(options: O): O {
  const model = options.model as { weights?: ModelWeights | PortableWeights };
  if (model.weights === undefined || "portable" in model.weights) return options;
  return { ...options, model: { ...model, weights: toPortable(model.weights) } };
}
