/**
 * A double-ended queue over a ring buffer: the engine's waiting queue, which admits from the front
 * (FIFO) and puts a preempted request back at the front, and each tenant's queue in the fair
 * queue (`fair-queue.ts`). `Array.prototype.shift`/`unshift` move every element on each call —
 * O(queue) per admission, with a queue of hundreds of requests under load — where this is O(1): a
 * head index into a power-of-two buffer that doubles when full (the only allocation, amortised; it
 * never shrinks). Removing an element from the middle (an abort of a waiting request) is O(queue)
 * and keeps the order.
 */
export class Deque<T> {
  #items: (T | undefined)[];
  #head = 0;
  #length = 0;

  constructor(initialCapacity = 16) {
    let capacity = 1;
    while (capacity < initialCapacity) capacity *= 2;
    this.#items = new Array<T | undefined>(capacity).fill(undefined);
  }

  get length(): number {
    return this.#length;
  }

  /** The element `i` places from the front (0: the front), or undefined past the end. */
  at(i: number): T | undefined {
    if (i < 0 || i >= this.#length) return undefined;
    return this.#items[(this.#head + i) & (this.#items.length - 1)];
  }

  /** The front element, or undefined when empty. */
  peekFront(): T | undefined {
    return this.#length === 0 ? undefined : this.#items[this.#head];
  }

  pushBack(item: T): void {
    if (this.#length === this.#items.length) this.#grow();
    this.#items[(this.#head + this.#length) & (this.#items.length - 1)] = item;
    this.#length++;
  }

  pushFront(item: T): void {
    if (this.#length === this.#items.length) this.#grow();
    this.#head = (this.#head - 1) & (this.#items.length - 1);
    this.#items[this.#head] = item;
    this.#length++;
  }

  /** Removes and returns the front element, or undefined when empty. */
  popFront(): T | undefined {
    if (this.#length === 0) return undefined;
    const item = this.#items[this.#head];
    this.#items[this.#head] = undefined;
    this.#head = (this.#head + 1) & (this.#items.length - 1);
    this.#length--;
    return item;
  }

  /** Removes the first occurrence of `item`, keeping the order of the rest; false when absent. */
  remove(item: T): boolean {
    const mask = this.#items.length - 1;
    let i = 0;
    while (i < this.#length && this.#items[(this.#head + i) & mask] !== item) i++;
    if (i === this.#length) return false;
    for (; i < this.#length - 1; i++) {
      this.#items[(this.#head + i) & mask] = this.#items[(this.#head + i + 1) & mask];
    }
    this.#items[(this.#head + this.#length - 1) & mask] = undefined;
    this.#length--;
    return true;
  }

  *[Symbol.iterator](): IterableIterator<T> {
    for (let i = 0; i < this.#length; i++) yield this.at(i)!;
  }

  #grow(): void {
    const old = this.#items;
    const items = new Array<T | undefined>(old.length * 2).fill(undefined);
    for (let i = 0; i < this.#length; i++) items[i] = old[(this.#head + i) & (old.length - 1)];
    this.#items = items;
    this.#head = 0;
  }
}
