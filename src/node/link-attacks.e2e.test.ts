/**
 * Acceptance (issue #21): an outsider who reaches the ports of a TCP cluster — the control port of
 * the prefill and of the decode node, prefill's transfer port — and who recorded real handshakes
 * off the wire (no secret) gets nothing. Replayed handshakes of every link (router → prefill,
 * router → decode, decode → prefill), a replayed control line, garbage, half frames, huge declared
 * lengths, page frames for a live lease and a flood of connections are each refused and counted in
 * the router's `kvfence_link_auth_failures_total{node,port,reason}`, and after each the cluster
 * answers the next request with 200 and the same answer, without a restart.
 *
 * The nodes are real `kvfence serve --role prefill|decode` processes; the router runs in this
 * process (real HTTP, the official `openai` client) and reaches the nodes through recording relays
 * (testing/tcp-tap.ts), which is how the test holds the captures an eavesdropper would have. The
 * links bind the address dialled (src/transfer/link-address.ts), so the relays sit at the nodes'
 * advertised addresses, as port-forwards would: the prefill node advertises 127.0.0.2 (`--advertise
 * 127.0.0.2:<its tap>`) and listens on 127.0.0.1, so decode reaches its transfer port through a
 * relay on 127.0.0.2 at the same port, whose capture is the real decode node's handshake. A relay
 * at any other address is refused (`address_mismatch`).
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import net from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";
import { listeningSockets } from "../../testing/listening-sockets.js";
import { modelDir, operatorGet, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { replay, startTcpTap, type TcpTap } from "../../testing/tcp-tap.js";
import { transferFixture } from "../../testing/transfer-fixture.js";
import { createLogger } from "../lib/logger.js";
import { connectControlLink } from "../links/control-link.js";
import type { FromNode, ToNode } from "../links/node-messages.js";
import { parseServeConfig } from "../server/serve-config.js";
import { startServer } from "../server/start-server.js";
import { type NodeProcesses, startNodeProcesses } from "../topology/local-cluster.js";
import { FrameType, frameHeaderBytes } from "../transfer/frame-codec.js";
import { connectTcpReceiver } from "../transfer/tcp-transport.js";

const MODEL = "kvfence-tiny";
/** The prefill node's advertised host: another loopback address than the one it listens on. */
const PREFILL_HOST = "127.0.0.2";
const KEY = "sk-tenant-alpha-0001";
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The node's hello (JSON before the MAC) among the lines it sent the router. */
function nodeHello(bytes: Buffer): { incarnation: number; layoutSignature: string; transferPort?: number } {
  for (const line of bytes.toString().split("\n")) {
    const payload = line.slice(0, line.lastIndexOf("\t"));
    if (payload.includes('"kind":"hello"')) return JSON.parse(payload);
  }
  throw new Error("no hello on the wire");
}

describe("TCP cluster under attack on every port: refused, counted, still serving", {
  timeout: 240_000,
}, () => {
  let nodes: NodeProcesses;
  let prefillTap: TcpTap;
  let decodeTap: TcpTap;
  /** At the prefill node's advertised transfer address, PREFILL_HOST: the transfer port. */
  let transferTap: TcpTap;
  let router: { url: string; close(): Promise<void> };
  let keysDir: string;
  let baseline = "";
  /** The node processes' stderr (their log, warn level and above). */
  const logs: string[] = [];
  /** Decode → prefill handshake bytes: the real decode node's, recorded by `transferTap`. */
  let transferCapture: Buffer = Buffer.alloc(0);
  const ports = { prefillControl: 0, decodeControl: 0, transfer: 0 };

  const ask = async (): Promise<string> => {
    const client = new OpenAI({ baseURL: `${router.url}/v1`, apiKey: KEY, maxRetries: 0, timeout: 60_000 });
    const res = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "What is the access code of account 4242?" }],
      max_tokens: 16,
      temperature: 0,
    });
    return `${res.choices[0]!.finish_reason}: ${res.choices[0]!.message.content}`;
  };
  const failures = async (): Promise<Map<string, number>> => {
    const text = await (await operatorGet(router.url, "/metrics")).text();
    const out = new Map<string, number>();
    for (const m of text.matchAll(/^kvfence_link_auth_failures_total\{([^}]*)\} (\d+)$/gm)) {
      const labels = Object.fromEntries([...m[1]!.matchAll(/(\w+)="([^"]*)"/g)].map((l) => [l[1], l[2]]));
      out.set(`${labels.node} ${labels.port} ${labels.reason}`, Number(m[2]));
    }
    return out;
  };
  /** The attack is refused and counted under `key`, and the cluster still answers as before. */
  const expectRefusedAndServing = async (key: string, was: Map<string, number>, by = 1) => {
    let now = await failures();
    for (let i = 0; i < 100 && (now.get(key) ?? 0) < (was.get(key) ?? 0) + by; i++) {
      await sleep(100);
      now = await failures();
    }
    assert.equal(now.get(key), (was.get(key) ?? 0) + by, `${key}: ${JSON.stringify([...now])}`);
    assert.equal(await ask(), baseline, "the next request gets the same answer");
  };

  before(async () => {
    prefillTap = await startTcpTap(() => ports.prefillControl, { host: PREFILL_HOST });
    decodeTap = await startTcpTap(() => ports.decodeControl);
    nodes = await startNodeProcesses({
      prefill: 1,
      decode: 1,
      model: modelDir(MODEL),
      nodeArgs: ["--kv-pages", "256"],
      prefillArgs: ["--advertise", `${PREFILL_HOST}:${prefillTap.port}`],
      decodeArgs: ["--advertise", `127.0.0.1:${decodeTap.port}`],
      stderr: (line) => logs.push(line),
    });
    ports.prefillControl = Number(new URL(nodes.prefill[0]!.url).port);
    ports.decodeControl = Number(new URL(nodes.decode[0]!.url).port);
    // Prefill's other listening port is its transfer port; decode dials it at PREFILL_HOST.
    ports.transfer = listeningSockets(nodes.prefill[0]!.process.pid!).find(
      (l) => l.port !== ports.prefillControl,
    )!.port;
    transferTap = await startTcpTap(ports.transfer, { host: PREFILL_HOST, port: ports.transfer });
    keysDir = mkdtempSync(join(tmpdir(), "kvfence-keys-"));
    writeFileSync(join(keysDir, "keys.json"), JSON.stringify({ [KEY]: "alpha" }));
    const config = parseServeConfig({
      host: "127.0.0.1",
      port: "0",
      model: modelDir(MODEL),
      pageSize: "16",
      scrubOnFree: false,
      disaggregation: true,
      logLevel: "silent",
      role: "router",
      prefill: [`${PREFILL_HOST}:${prefillTap.port}`],
      decode: [`127.0.0.1:${decodeTap.port}`],
      clusterSecret: nodes.secret,
      apiKeys: join(keysDir, "keys.json"),
      operatorKey: TEST_OPERATOR_KEY,
    });
    router = await startServer(config, { logger: createLogger({ level: "silent" }) });
    assert.equal(nodeHello(prefillTap.received(0)).transferPort, ports.transfer);
    baseline = await ask();
    assert.match(baseline, /^(stop|length): /);
  });
  after(async () => {
    await router?.close();
    await prefillTap?.close();
    await decodeTap?.close();
    await transferTap?.close();
    await nodes?.close();
    if (keysDir !== undefined) rmSync(keysDir, { recursive: true, force: true });
  });

  test("the router's recorded handshake, replayed to the prefill and to the decode control port, is refused", async () => {
    for (const [name, tap, port] of [
      ["prefill-0", prefillTap, ports.prefillControl],
      ["decode-0", decodeTap, ports.decodeControl],
    ] as const) {
      const was = await failures();
      // The router's hello, proof and the control lines after them, byte for byte.
      const result = await replay(port, tap.sent(0), 10_000);
      assert.equal(result.open, false, `${name}: the replay was closed`);
      await expectRefusedAndServing(`${name} control bad_proof`, was);
      assert.match(logs.join("\n"), /control port: refused a connection \(bad_proof\)/);
    }
  });

  test("decode's recorded transfer handshake, replayed to prefill's transfer port, is refused; so are a second connection for its incarnation and a relay; decode keeps its link", async () => {
    const decodeHello = nodeHello(decodeTap.received(0));
    const fx = transferFixture(4, 4096);
    const connect = (host: string, port: number) =>
      connectTcpReceiver({
        host,
        port,
        secret: nodes.secret,
        layoutSignature: decodeHello.layoutSignature,
        pool: fx.pool,
        table: fx.table,
        pageBytes: 4096,
        incarnation: decodeHello.incarnation,
        handlers: {},
      });
    // A real handshake with the secret at prefill's transfer address, claiming the live decode
    // node's incarnation: prefill admits no second connection for it (no takeover) …
    let was = await failures();
    const receiver = await connect(PREFILL_HOST, ports.transfer);
    await expectRefusedAndServing("prefill-0 transfer peer_connected", was);
    await receiver.close();
    // … the real decode node's handshake, recorded off the wire and replayed byte for byte, fails
    // at the proof …
    was = await failures();
    transferCapture = transferTap.sent(0);
    const result = await replay(ports.transfer, transferCapture, 10_000);
    assert.equal(result.open, false);
    await expectRefusedAndServing("prefill-0 transfer bad_proof", was);
    assert.match(logs.join("\n"), /transfer port: refused a connection \(bad_proof\)/);
    // … and a relay at another address, even one of a secret holder, is refused at the challenge.
    const relay = await startTcpTap(ports.transfer);
    try {
      was = await failures();
      await assert.rejects(connect("127.0.0.1", relay.port), /answers to 127\.0\.0\.2:/);
      await expectRefusedAndServing("prefill-0 transfer address_mismatch", was);
      assert.match(logs.join("\n"), /transfer port: refused a connection \(address_mismatch\)/);
    } finally {
      await relay.close();
    }
  });

  test("garbage, half frames, huge lengths, replayed control lines and frames and page frames are refused on every port", async () => {
    const header = (type: number, length: number, page = 0) =>
      frameHeaderBytes({
        type: type as FrameType,
        rid: 1,
        epoch: 1,
        page,
        generation: 1,
        index: 0,
        tokens: 16,
        length,
      });
    const garbage = Buffer.from("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n");
    const pages = Buffer.concat([header(FrameType.PAGE, 4096 * 16, 3), Buffer.alloc(4096, 0xee)]);
    /** The router's first control line after its hello and proof on this node's link. */
    const controlLine = (tap: TcpTap) => Buffer.from(`${tap.sent(0).toString().split("\n")[2]}\n`);
    /** The PROOF frame of the decode → prefill handshake captured in the previous test. */
    const proofFrame = (() => {
      let at = 0;
      while (transferCapture[at + 3] !== FrameType.PROOF) at += 32 + transferCapture.readUInt32LE(at + 28);
      return transferCapture.subarray(at, at + 32 + transferCapture.readUInt32LE(at + 28));
    })();
    const controlAttacks = (tap: TcpTap): Array<[string, Buffer, string]> => [
      ["garbage", garbage, "malformed"],
      ["half a hello line", Buffer.from('{"nonce":"00'), "timeout"],
      ["a line that never ends", Buffer.alloc(64 * 1024, 0x7b), "oversized"],
      ["a replayed control line", controlLine(tap), "bad_hello"],
      ["page frames", pages, "oversized"],
    ];
    const matrix: Array<[string, string, number, Array<[string, Buffer, string]>]> = [
      ["prefill-0", "control", ports.prefillControl, controlAttacks(prefillTap)],
      ["decode-0", "control", ports.decodeControl, controlAttacks(decodeTap)],
      [
        "prefill-0",
        "transfer",
        ports.transfer,
        [
          ["garbage", garbage, "malformed"],
          ["half a frame", header(FrameType.HELLO, 600).subarray(0, 20), "timeout"],
          ["a huge declared length", header(FrameType.HELLO, 0xffff_0000), "oversized"],
          ["a replayed frame", Buffer.from(proofFrame), "malformed"],
          ["page frames", pages, "oversized"],
        ],
      ],
    ];
    for (const [node, kind, port, attacks] of matrix) {
      for (const [name, bytes, reason] of attacks) {
        const was = await failures();
        const result = await replay(port, bytes, 30_000);
        assert.equal(result.open, false, `${node} ${kind}, ${name}: closed`);
        await expectRefusedAndServing(`${node} ${kind} ${reason}`, was);
      }
    }
  });

  test("a flood of 200 silent connections per port is shed by the cap and the deadline; the cluster serves", async () => {
    const was = await failures();
    const sockets: net.Socket[] = [];
    const closed: Promise<void>[] = [];
    for (const port of [ports.prefillControl, ports.decodeControl, ports.transfer]) {
      for (let i = 0; i < 200; i++) {
        const s = net.connect({ host: "127.0.0.1", port });
        s.on("error", () => {});
        closed.push(new Promise((resolve) => s.once("close", () => resolve())));
        sockets.push(s);
      }
    }
    // During the flood the real links carry requests.
    assert.equal(await ask(), baseline);
    await Promise.all(closed);
    const now = await failures();
    for (const key of ["prefill-0 control", "decode-0 control", "prefill-0 transfer"]) {
      const shed = ["too_many_pending", "timeout"].reduce(
        (sum, r) => sum + (now.get(`${key} ${r}`) ?? 0) - (was.get(`${key} ${r}`) ?? 0),
        0,
      );
      assert.equal(shed, 200, `${key}: every flood connection closed and counted`);
    }
    assert.equal(await ask(), baseline);
  });

  test("decode reconnects by itself when its transfer connection to the live prefill node drops", async () => {
    assert.equal(await ask(), baseline);
    // Abort decode's end of the connection (a network fault; `ss -K` needs CAP_NET_ADMIN): the
    // kernel resets it, the tap closes its side to prefill, and both nodes see it close.
    const killed = execFileSync("ss", [
      "-K",
      "-tn",
      "dst",
      PREFILL_HOST,
      "dport",
      "=",
      `:${ports.transfer}`,
    ]).toString();
    assert.match(
      killed,
      new RegExp(`127\\.0\\.0\\.2:${ports.transfer}`),
      `no connection was reset: ${killed}`,
    );
    // No restart of anything: decode fences the connection, reconnects, and the pair serves again.
    let answer = "";
    const deadline = Date.now() + 60_000;
    while (Date.now() < deadline) {
      answer = await ask().catch((err: Error) => `error: ${err.message}`);
      if (answer === baseline) break;
      await sleep(200);
    }
    assert.equal(answer, baseline, "served again after decode reconnected");
    const established = execFileSync("ss", [
      "-Htn",
      "state",
      "established",
      "dst",
      PREFILL_HOST,
      "dport",
      "=",
      `:${ports.transfer}`,
    ])
      .toString()
      .trim()
      .split("\n")
      .filter((l) => l.length > 0);
    assert.equal(established.length, 1, "one transfer connection again");
  });

  test("a second router with the secret is refused while the router is connected; a newer incarnation replaces it, loudly", async () => {
    let was = await failures();
    // An older (or equal) incarnation: refused after its proof, the router keeps the node.
    // At the node's advertised address: its tap.
    const older = await connectControlLink<ToNode, FromNode>({
      host: "127.0.0.1",
      port: decodeTap.port,
      secret: nodes.secret,
      incarnation: 1,
    });
    await new Promise<void>((resolve) => older.onClose(() => resolve()));
    await expectRefusedAndServing("decode-0 control peer_connected", was);
    // A restarted router (a newer incarnation) gets the node: the node closes the old link and
    // greets the new one. (Last test: the router in this process loses decode-0 here.)
    was = await failures();
    const newer = await connectControlLink<ToNode, FromNode>({
      host: "127.0.0.1",
      port: decodeTap.port,
      secret: nodes.secret,
      incarnation: Date.now() + 1,
    });
    const hello = await new Promise<FromNode>((resolve) => newer.onMessage(resolve));
    assert.equal(hello.kind, "hello");
    assert.equal((hello as { role?: string }).role, "decode");
    newer.close();
  });
});
