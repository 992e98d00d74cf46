/**
 * Test worker: one tenant's client in its own thread, so that its work (sending large bodies) never
 * runs on the event loop of the server under test. On each message it sends every request of
 * `workerData` at once, then posts back each answer's status, its size and the start of its body
 * (a 200 MB answer is counted as it arrives, not kept). It runs at the lowest CPU priority, standing
 * in for a client on another machine.
 */
import { request } from "node:http";
import { parentPort, workerData } from "node:worker_threads";
import { lowerThreadPriority } from "../src/lib/thread-priority.js";

export interface FloodRequest {
  readonly name: string;
  readonly path: string;
  readonly body: Uint8Array;
}

export interface FloodOptions {
  readonly url: string;
  readonly apiKey: string;
  readonly requests: readonly FloodRequest[];
}

export interface FloodAnswer {
  readonly name: string;
  readonly status: number;
  /** The body's first 1,000 characters. */
  readonly text: string;
  /** The body's size. */
  readonly bytes: number;
  /** The body's last 100 bytes. */
  readonly tail: string;
}

/** The bytes of a body kept as they arrive (the answer's text is cut to 1,000 characters). */
const KEPT_BYTES = 64 * 1024;

/**
 * One POST with node:http, which writes the body as it is (fetch would copy it first). A server
 * may answer and close before the whole body is sent (413): the answer counts, and a write error
 * after it is ignored; with no answer, `status` is 0 and `text` the socket error's code.
 */
function post(url: string, apiKey: string, body: Uint8Array): Promise<Omit<FloodAnswer, "name">> {
  return new Promise((resolve) => {
    let answered = false;
    const req = request(url, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        "content-length": body.byteLength,
        authorization: `Bearer ${apiKey}`,
      },
    });
    req.on("response", (res) => {
      answered = true;
      const head: Buffer[] = [];
      let bytes = 0;
      let last: Buffer = Buffer.alloc(0);
      res.on("data", (chunk: Buffer) => {
        if (bytes < KEPT_BYTES) head.push(chunk);
        bytes += chunk.length;
        last = chunk.length >= 100 ? chunk.subarray(-100) : Buffer.concat([last, chunk]).subarray(-100);
      });
      const done = () => {
        const text = Buffer.concat(head).toString().slice(0, 1000);
        resolve({ status: res.statusCode ?? 0, text, bytes, tail: last.toString() });
      };
      res.on("end", done);
      res.on("error", done);
    });
    req.on("error", (err: NodeJS.ErrnoException) => {
      if (!answered) resolve({ status: 0, text: err.code ?? err.message, bytes: 0, tail: "" });
    });
    req.end(body);
  });
}

// The attacker's client stands for another machine: it does not take the server's CPU share.
lowerThreadPriority(19);
const options = workerData as FloodOptions;
const port = parentPort!;
port.on("message", async () => {
  const answers = await Promise.all(
    options.requests.map(async ({ name, path, body }): Promise<FloodAnswer> => {
      return { name, ...(await post(`${options.url}${path}`, options.apiKey, body)) };
    }),
  );
  port.postMessage(answers);
});
