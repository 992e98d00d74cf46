/**
 * A small seeded pseudo-random generator (xoshiro128**, seeded through splitmix32) for sampling,
 * tests and benchmarks: the same seed gives the same sequence on every platform. One instance per
 * request; `next()` allocates nothing.
 */
export class Prng {
  #a: number;
  #b: number;
  #c: number;
  #d: number;

  /** Any integer seed (only its low 32 bits, plus the high 21 bits for seeds beyond 2³², count). */
  constructor(seed: number) {
    let s = (seed >>> 0) ^ Math.floor(seed / 0x1_0000_0000);
    const split = (): number => {
      s = (s + 0x9e3779b9) | 0;
      let z = s;
      z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
      z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
      return (z ^ (z >>> 16)) >>> 0;
    };
    this.#a = split();
    this.#b = split();
    this.#c = split();
    this.#d = split();
    if ((this.#a | this.#b | this.#c | this.#d) === 0) this.#a = 1;
  }

  /** The next 32-bit unsigned integer. */
  nextUint32(): number {
    const result = Math.imul(rotl(Math.imul(this.#b, 5), 7), 9) >>> 0;
    const t = this.#b << 9;
    this.#c ^= this.#a;
    this.#d ^= this.#b;
    this.#b ^= this.#c;
    this.#a ^= this.#d;
    this.#c ^= t;
    this.#d = rotl(this.#d, 11);
    return result;
  }

  /** A float uniform in [0, 1), with 32 bits of randomness. */
  next(): number {
    return this.nextUint32() / 0x1_0000_0000;
  }

  /** An integer uniform in [0, n). */
  nextInt(n: number): number {
    return Math.floor(this.next() * n);
  }

  /** A standard normal variate (Box–Muller; uses two draws). */
  nextGaussian(): number {
    const u = 1 - this.next();
    const v = this.next();
    return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
  }

  /** Fills `out` with normal values of the given standard deviation. */
  fillGaussian(out: Float32Array | Float64Array, std: number): void {
    for (let i = 0; i < out.length; i++) out[i] = this.nextGaussian() * std;
  }
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}
