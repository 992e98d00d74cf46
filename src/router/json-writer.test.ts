import assert from "node:assert/strict";
import { createServer, type IncomingMessage, request, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";
import { JSON_CHUNK_CHARS, LazyArray } from "../lib/json-chunks.js";
import { JsonWriter, sendJson } from "./json-writer.js";

/** A server on 127.0.0.1 answering every request with `answer`. */
async function serve(answer: (res: ServerResponse) => void): Promise<{ server: Server; url: string }> {
  const server = createServer((_req, res) => answer(res));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return { server, url: `http://127.0.0.1:${(server.address() as AddressInfo).port}/` };
}

function get(url: string): Promise<IncomingMessage> {
  return new Promise((resolve, reject) => request(url, resolve).on("error", reject).end());
}

async function text(res: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  for await (const chunk of res) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks).toString();
}

const fail = (err: unknown) => assert.fail(String(err));

test("sendJson() answers a small value at once, with its Content-Length", async (t) => {
  const value = { object: "list", data: [{ id: "kvfence-tiny", n: 1 }] };
  const { server, url } = await serve((res) => sendJson(res, 201, value, { "X-Extra": "1" }, fail));
  t.after(() => server.close());
  const res = await get(url);
  assert.equal(res.statusCode, 201);
  assert.equal(res.headers["content-length"], String(JSON.stringify(value).length));
  assert.equal(res.headers["content-type"], "application/json; charset=utf-8");
  assert.equal(res.headers["x-extra"], "1");
  assert.equal(await text(res), JSON.stringify(value));
});

test("sendJson() writes a large value chunk by chunk, yielding to the event loop between chunks", async (t) => {
  const value = { items: Array.from({ length: 200_000 }, (_, i) => ({ i, top: { a: -i, b: `x${i}` } })) };
  const expected = JSON.stringify(value);
  let writing = false;
  let turns = 0;
  const tick = () => {
    turns++;
    if (writing) setImmediate(tick);
  };
  const { server, url } = await serve((res) => {
    writing = true;
    res.on("finish", () => {
      writing = false;
    });
    setImmediate(tick);
    sendJson(res, 200, value, {}, fail);
  });
  t.after(() => server.close());
  const res = await get(url);
  assert.equal(res.headers["content-length"], undefined);
  assert.equal(res.headers["transfer-encoding"], "chunked");
  assert.equal(await text(res), expected);
  // Other work ran between the chunks: at least one turn of the loop per two chunks.
  const chunks = expected.length / JSON_CHUNK_CHARS;
  assert.ok(turns >= chunks / 2, `${turns} turns of the event loop for ${chunks.toFixed(0)} chunks`);
});

test("JsonWriter makes the next chunk only once the socket took the last: a client that does not read costs one buffer", async (t) => {
  const total = 2_000_000;
  let made = 0;
  const items = new LazyArray(total, (i) => {
    made++;
    return { i, pad: "xxxxxxxxxxxxxxxxxxxx" };
  });
  const { server, url } = await serve((res) => sendJson(res, 200, { items }, {}, fail));
  t.after(() => server.close());
  const res = await get(url);
  res.pause();
  // Until the socket's buffers are full; then nothing more is made while the client reads nothing.
  let last = -1;
  while (made !== last) {
    last = made;
    await new Promise((r) => setTimeout(r, 200));
  }
  assert.ok(made < total / 2, `${made} of ${total} items made for a client that reads nothing`);
  const body = await text(res);
  assert.equal(made, total);
  assert.equal(
    body.length,
    JSON.stringify({ items: Array.from({ length: total }, (_, i) => ({ i, pad: "xxxxxxxxxxxxxxxxxxxx" })) })
      .length,
  );
});

test("JsonWriter writes values in the order given and ends after the last, however large the first", async (t) => {
  const big = Array.from({ length: 100_000 }, (_, i) => i);
  const { server, url } = await serve((res) => {
    res.writeHead(200, { "Content-Type": "text/plain" });
    const writer = new JsonWriter(res, fail);
    writer.write(big, "a: ", "\n");
    writer.write({ small: true }, "b: ", "\n");
    writer.end("end\n");
    writer.write({ late: true });
  });
  t.after(() => server.close());
  assert.equal(await text(await get(url)), `a: ${JSON.stringify(big)}\nb: {"small":true}\nend\n`);
});
