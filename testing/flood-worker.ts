/**
 * Test worker: one tenant's client in its own thread, so that its work (sending large bodies) never
 * runs on the event loop of the server under test. On each message it sends every request of
 * `workerData` at once, then posts back each answer's status and body. It runs at the lowest CPU
 * priority, standing in for a client on another machine.
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
  readonly text: string;
}

/**
 * One POST with node:http, which writes the body as it is (fetch would copy it first). A server
 * may answer and close before the whole body is sent (413): the answer counts, and a write error
 * after it is ignored; with no answer, `status` is 0 and `text` the socket error's code.
 */
function post(url: string, apiKey: string, body: Uint8Array): Promise<{ status: number; text: string }> {
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
      const chunks: Buffer[] = [];
      res.on("data", (chunk: Buffer) => chunks.push(chunk));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, text: Buffer.concat(chunks).toString() }));
      res.on("error", () => resolve({ status: res.statusCode ?? 0, text: Buffer.concat(chunks).toString() }));
    });
    req.on("error", (err: NodeJS.ErrnoException) => {
      if (!answered) resolve({ status: 0, text: err.code ?? err.message });
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
      const { status, text } = await post(`${options.url}${path}`, options.apiKey, body);
      return { name, status, text: text.slice(0, 1000) };
    }),
  );
  port.postMessage(answers);
});
