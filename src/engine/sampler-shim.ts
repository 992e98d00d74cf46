/** TEMPORARY stand-in for src/model/sampler.ts until it lands; removed then. */
import type { Prng } from "../lib/prng.js";

export function sampleToken(
  logits: Float32Array,
  temperature: number,
  topP: number,
  topK: number,
  rng: Prng,
): number {
  let best = 0;
  for (let v = 1; v < logits.length; v++) if (logits[v]! > logits[best]!) best = v;
  if (temperature <= 0) return best;
  const idx = Array.from({ length: logits.length }, (_, i) => i).sort((a, b) => logits[b]! - logits[a]!);
  const k = topK > 0 ? Math.min(topK, idx.length) : idx.length;
  const probs = idx.slice(0, k).map((i) => Math.exp((logits[i]! - logits[best]!) / temperature));
  const z = probs.reduce((a, b) => a + b, 0);
  let cum = 0;
  let n = 0;
  for (; n < probs.length; n++) {
    cum += probs[n]! / z;
    if (cum >= topP) {
      n++;
      break;
    }
  }
  const kept = probs.slice(0, n);
  const z2 = kept.reduce((a, b) => a + b, 0);
  let u = rng.next() * z2;
  for (let i = 0; i < kept.length; i++) {
    u -= kept[i]!;
    if (u <= 0) return idx[i]!;
  }
  return idx[kept.length - 1]!;
}
