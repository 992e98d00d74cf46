/**
 * `faultInWeights`: reads one byte of every page of a model's weights, so that the first forward
 * step finds them mapped. On the native kernels each weight file is mapped copy-on-write over its
 * window of the engines' memory (src/engine/engine-memory.ts): its pages are the page cache's, but
 * a thread's first read of each one is a page fault, and the first step that reads them all paid
 * those faults (/tmp/smol-q8, 143 MB of Q8_0: that step 180–250 ms against 10–30 ms for the next;
 * read ahead, 25–50 ms). Page tables are the process's, so one thread's reads serve every engine.
 *
 * The default topology's decode thread calls it once it said hello (src/node/node-worker.ts): it
 * is idle until prefill's first transfer, while the router's preparation worker finishes loading
 * the tokenizer. It reads at most `CHUNK_BYTES` between two turns of its event loop, so its
 * messages (the shared-memory pairing, a first request) are not held up. Weights read into the
 * memory (the WebAssembly kernels, or a file that could not be mapped) are resident already: the
 * reads then cost about a millisecond. Nothing is written.
 */
import { byteView } from "../lib/byte-range.js";
import type { ModelWeights } from "../model/model-config.js";
import { type PortableWeights, type TensorRef, toPortable } from "./portable-weights.js";

/** The smallest page a mapped weight file has here (engine-memory.ts maps on 4 KiB boundaries). */
const PAGE_BYTES = 4096;
/** Bytes read between two turns of the event loop (about 1 ms of faults). */
const CHUNK_BYTES = 1 << 20;

/** Every tensor of `weights` once (a tied LM head is the embedding). */
function tensorsOf(weights: ModelWeights | PortableWeights): TensorRef[] {
  const p = "portable" in weights ? weights : toPortable(weights);
  const tensors = [p.embed, p.finalNorm, ...(p.lmHead === null ? [] : [p.lmHead])];
  for (const layer of p.layers) for (const t of Object.values(layer)) if (t !== null) tensors.push(t);
  return tensors;
}

/**
 * Reads a byte of every `PAGE_BYTES` of each tensor of `weights` and its last byte, yielding to the event loop every
 * `CHUNK_BYTES`; resolves with the number of pages read.
 */
export async function faultInWeights(weights: ModelWeights | PortableWeights): Promise<number> {
  let pages = 0;
  let sum = 0; // the bytes read, kept so that no read is dropped as dead code
  for (const tensor of tensorsOf(weights)) {
    for (let start = 0; start < tensor.byteLength; start += CHUNK_BYTES) {
      const bytes = byteView(tensor, start, Math.min(CHUNK_BYTES, tensor.byteLength - start));
      for (let i = 0; i < bytes.length; i += PAGE_BYTES) {
        sum += bytes[i] as number;
        pages++;
      }
      sum += bytes[bytes.length - 1] as number; // the chunk's last page, where it starts mid-page
      await new Promise<void>((resolve) => setImmediate(resolve));
    }
  }
  return sum >= 0 ? pages : 0;
}
