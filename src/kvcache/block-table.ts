/**
 * A request's block table: the physical pages holding its KV, in logical order, each with the
 * generation it had when leased. `pages` is what the forward pass indexes (logical page → physical
 * page); `generations` is what every read check compares against the ownership table, so a page
 * freed and re-leased under a request is caught even though its number is unchanged.
 *
 * Both arrays are allocated once per request at its maximum size (its whole context), so a step
 * appends and clears without allocating.
 */
export class BlockTable {
  /** Physical page of each logical page; only the first `length` entries are meaningful. */
  readonly pages: Int32Array;
  /** Generation of each page when it was leased; only the first `length` entries are meaningful. */
  readonly generations: Uint32Array;
  #length = 0;

  constructor(capacityPages: number) {
    this.pages = new Int32Array(capacityPages);
    this.generations = new Uint32Array(capacityPages);
  }

  get length(): number {
    return this.#length;
  }

  get capacity(): number {
    return this.pages.length;
  }

  /** Appends one leased `(page, generation)`; throws past capacity (a scheduler bug). */
  push(page: number, generation: number): void {
    const i = this.#length;
    if (i >= this.pages.length) {
      throw new RangeError(`Block table is full at ${this.pages.length} pages; cannot add page: ${page}`);
    }
    this.pages[i] = page;
    this.generations[i] = generation;
    this.#length = i + 1;
  }

  /** Forgets every entry (after its pages were freed). */
  clear(): void {
    this.#length = 0;
  }
}
