/**
 * A `Link` to a node worker thread: messages are structured-cloned over the worker's port, and the
 * worker's exit is the link's close (the node's fence). The node's finished spans, when tracing is
 * on, come on the same port and go to this thread's exporter, not to the link's handlers.
 */
import type { Worker } from "node:worker_threads";
import { adoptSpans, type ForwardedSpans } from "../lib/tracing.js";
import type { FromNode, Link, ToNode } from "./node-messages.js";

export class WorkerLink implements Link<ToNode, FromNode> {
  readonly worker: Worker;
  readonly #handlers: ((m: FromNode) => void)[] = [];
  readonly #closeHandlers: ((error?: Error) => void)[] = [];
  #closed = false;
  #error: Error | undefined;

  constructor(worker: Worker) {
    this.worker = worker;
    worker.on("message", (m: FromNode | ForwardedSpans) => {
      if (m.kind === "spans") {
        adoptSpans(m);
        return;
      }
      for (const h of this.#handlers) h(m);
    });
    worker.on("error", (err) => {
      this.#error ??= err;
    });
    worker.on("exit", () => {
      if (this.#closed) return;
      this.#closed = true;
      for (const h of this.#closeHandlers) h(this.#error);
    });
  }

  get closed(): boolean {
    return this.#closed;
  }

  send(message: ToNode): void {
    if (this.#closed) throw new Error("Node worker has exited");
    this.worker.postMessage(message);
  }

  onMessage(handler: (message: FromNode) => void): void {
    this.#handlers.push(handler);
  }

  onClose(handler: (error?: Error) => void): void {
    if (this.#closed) queueMicrotask(() => handler(this.#error));
    else this.#closeHandlers.push(handler);
  }

  close(): void {
    void this.worker.terminate();
  }
}
