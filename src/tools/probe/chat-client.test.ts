import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";
import { postChat, postRaw } from "./chat-client.js";

let server: Server;
let baseUrl: string;

const chunk = (content: string) => `data: ${JSON.stringify({ choices: [{ index: 0, delta: { content } }] })}`;

before(async () => {
  server = createServer((req, res) => {
    let body = "";
    req.on("data", (c: Buffer) => {
      body += c.toString();
    });
    req.on("end", () => {
      const mode = (JSON.parse(body || "{}") as { mode?: string }).mode;
      if (mode === "split-stream") {
        res.writeHead(200, { "content-type": "text/event-stream" });
        // Events split across writes, CRLF line ends, and a [DONE] terminator.
        const text = `${chunk("QX7")}\r\n\r\n${chunk("-PL")}\r\n\r\n${chunk("2")}\r\n\r\ndata: [DONE]\r\n\r\n`;
        res.write(text.slice(0, 17));
        setTimeout(() => res.end(text.slice(17)), 5);
      } else if (mode === "inband-error") {
        res.writeHead(200, { "content-type": "text/event-stream" });
        res.end(
          `${chunk("ab")}\n\ndata: {"error": {"message": "prompt too long", "code": 400}}\n\ndata: [DONE]\n\n`,
        );
      } else if (mode === "error") {
        res.writeHead(400, { "content-type": "application/json" });
        res.end(
          JSON.stringify({ error: { message: "too long: 5000 tokens", type: "invalid_request_error" } }),
        );
      } else if (mode === "vllm-error") {
        res.writeHead(400, { "content-type": "application/json" });
        res.end(JSON.stringify({ object: "error", message: "maximum context length is 2048", code: 400 }));
      } else if (mode === "hang") {
        // Never answers.
      } else {
        res.writeHead(200, { "content-type": "application/json" });
        res.end(
          JSON.stringify({ choices: [{ message: { content: "unknown" } }], usage: { prompt_tokens: 42 } }),
        );
      }
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  baseUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

after(() => {
  server.closeAllConnections();
  server.close();
});

const client = () => ({ baseUrl, timeoutMs: 2000 });

test("postChat() joins SSE deltas split across reads with CRLF line ends", async () => {
  const out = await postChat(client(), "k", { mode: "split-stream", stream: true });
  assert.equal(out.status, 200);
  assert.equal(out.streamed, true);
  assert.equal(out.text, "QX7-PL2");
  assert.equal(out.error, null);
});

test("postChat() reports an error event inside a 200 stream", async () => {
  const out = await postChat(client(), "k", { mode: "inband-error", stream: true });
  assert.equal(out.status, 200);
  assert.equal(out.inBandError, true);
  assert.equal(out.error, "prompt too long");
  assert.equal(out.text, "ab");
});

test("postChat() returns text and usage.prompt_tokens of a plain completion", async () => {
  const out = await postChat(client(), "k", { mode: "plain" });
  assert.deepEqual([out.status, out.text, out.promptTokens], [200, "unknown", 42]);
});

test("postRaw() reads OpenAI and vLLM error bodies without throwing", async () => {
  const a = await postRaw(client(), undefined, JSON.stringify({ mode: "error" }), false);
  assert.deepEqual([a.status, a.error], [400, "too long: 5000 tokens"]);
  const b = await postRaw(client(), undefined, JSON.stringify({ mode: "vllm-error" }), false);
  assert.deepEqual([b.status, b.error], [400, "maximum context length is 2048"]);
});

test("postChat() turns a timeout into status 0", async () => {
  const out = await postChat({ baseUrl, timeoutMs: 100 }, "k", { mode: "hang" });
  assert.equal(out.status, 0);
  assert.match(out.error ?? "", /timed out/);
});
