/**
 * Drives an `Engine` one forward step per `setImmediate` turn while it has work, so the event loop
 * polls ports and sockets between two steps: an abort or a fence is applied before the next step.
 * `kick()` after every submit; it is idempotent.
 */
import type { Engine } from "../engine/engine.js";

export class StepLoop {
  readonly #engine: Engine;
  readonly #afterStep: () => void;
  #scheduled = false;
  #stopped = false;

  constructor(engine: Engine, afterStep: () => void = () => {}) {
    this.#engine = engine;
    this.#afterStep = afterStep;
  }

  kick(): void {
    if (this.#scheduled || this.#stopped) return;
    this.#scheduled = true;
    setImmediate(this.#tick);
  }

  /**
   * Stops stepping and closes the engine (its grammar thread ends); `keepEngine`: the engine stays
   * open for the node object of another role built over it (src/node/role-switch.ts).
   */
  stop(keepEngine = false): void {
    this.#stopped = true;
    if (!keepEngine) this.#engine.close();
  }

  readonly #tick = (): void => {
    this.#scheduled = false;
    if (this.#stopped) return;
    let more = false;
    try {
      more = this.#engine.step();
    } catch (err) {
      const message = err instanceof Error ? err.message : String(err);
      this.#engine.failAll({ code: "internal", message: `Engine step failed: ${message}` });
    }
    this.#afterStep();
    if (more) this.kick();
  };
}
