/**
 * A request's block table: the physical pages holding its KV, in logical order, each with the
 * generation it had when leased. `pages` is what the forward pass indexes (logical page → physical
 * page); `generations` is what every read check compares against the ownership table, so a page
 * freed and re-leased under a request is caught even though its number is unchanged.
 *
 * `shared[j]` is 1 where logical page `j` is a reference to a prefix-cache page (SHARED in the
 * ownership table, read-only, released by `unref` instead of freed), 0 for the request's own page.
 *
 * The arrays are allocated once per request at its maximum size (its whole context), so a step
 * appends and clears without allocating.
 */
export class BlockTable {
  /** Physical page of each logical page; only the first `length` entries are meaningful. */
  readonly pages: Int32Array;
  /** Generation of each page when it was leased; only the first `length` entries are meaningful. */
  readonly generations: Uint32Array;
  /** 1 where the page is a shared prefix-cache reference; only the first `length` entries are meaningful. */
  readonly shared: Uint8Array;
  #length = 0;

  constructor(capacityPages: number) {
    this.pages = new Int32Array(capacityPages);
    this.generations = new Uint32Array(capacityPages);
    this.shared = new Uint8Array(capacityPages);
  }

  get length(): number {
    return this.#length;
  }

  get capacity(): number {
    return this.pages.length;
  }

  /** Appends one leased `(page, generation)`; throws past capacity (a scheduler bug). */
  push(page: number, generation: number, shared = false): void {
    const i = this.#length;
    if (i >= this.pages.length) {
      throw new RangeError(`Block table is full at ${this.pages.length} pages; cannot add page: ${page}`);
    }
    this.pages[i] = page;
    this.generations[i] = generation;
    this.shared[i] = shared ? 1 : 0;
    this.#length = i + 1;
  }

  /** Forgets every entry (after its pages were freed). */
  clear(): void {
    this.#length = 0;
  }
}
