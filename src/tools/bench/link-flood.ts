/**
 * Measurement: what a flood of unauthenticated, half-open connections costs prefill's transfer
 * port (issue #21; the limits are in src/transfer/link-guard.ts, docs/security.md).
 *
 * Opens `--connections` (400) TCP connections to a `TcpTransferServer` in this process; each sends a
 * HELLO frame header and half of its body, every other one declaring 1 MiB (the post-handshake
 * control limit), the rest 4000 bytes (under the 4 KiB pre-handshake limit). Reports, at 2 s and
 * after the handshake deadline, how many of them are still open and how much ArrayBuffer memory
 * and RSS the process holds over its baseline. Before the limits every connection stayed open and
 * staged 1 MiB (about 400 MiB for 400).
 *
 * Run: `kvfence bench link-flood [--connections 400] [--json]` (the process's garbage collector is
 * run before the baseline when Node exposes it: `node --expose-gc dist/src/cli/main.js bench link-flood`).
 */
import net from "node:net";
import { Command, InvalidArgumentError } from "commander";
import { FrameType, frameHeaderBytes } from "../../transfer/frame-codec.js";
import { TcpTransferServer } from "../../transfer/tcp-transport.js";

interface Sample {
  readonly atSeconds: number;
  readonly open: number;
  readonly arrayBuffersMiB: number;
  readonly rssMiB: number;
}

/**
 * One unauthenticated connection to a transfer port that sends a HELLO frame header and half its
 * body, then nothing: declaring 1 MiB (`big`, the post-handshake control limit) or 4000 bytes
 * (under the pre-handshake limit). `halfBody` is shared by every caller (a write does not copy it).
 */
export function halfOpenHello(port: number, big: boolean, halfBody: Buffer): net.Socket {
  const socket = net.connect({ host: "127.0.0.1", port });
  socket.on("error", () => {});
  const length = big ? 1 << 20 : 4000;
  socket.on("connect", () => {
    socket.write(
      frameHeaderBytes({
        type: FrameType.HELLO,
        rid: 0,
        epoch: 0,
        page: 0,
        generation: 0,
        index: 0,
        tokens: 0,
        length,
      }),
    );
    socket.write(halfBody.subarray(0, length / 2));
  });
  return socket;
}

export async function linkFlood(connections: number): Promise<Sample[]> {
  const server = await TcpTransferServer.listen({
    secret: "bench-cluster-secret-5f1c9a7e",
    layoutSignature: "bench",
    onWriter: () => {},
  });
  // One body buffer for every client write (a write does not copy it): the process's ArrayBuffer
  // memory is then the server's, not the clients'.
  const halfBody = Buffer.alloc(1 << 19, 0x41);
  (globalThis as { gc?: () => void }).gc?.();
  const base = process.memoryUsage();
  const started = Date.now();
  let open = 0;
  const sockets: net.Socket[] = [];
  for (let i = 0; i < connections; i++) {
    const socket = halfOpenHello(server.port, i % 2 === 1, halfBody);
    socket.on("connect", () => open++);
    socket.on("close", () => open--);
    sockets.push(socket);
  }
  const samples: Sample[] = [];
  const mib = (n: number): number => Math.round((n / (1 << 20)) * 10) / 10;
  // 8 s: after the 5 s handshake deadline (link-guard.ts). The bench imports nothing newer than the
  // transport, so its compiled file also runs against an older build (the "before" numbers).
  for (const at of [2000, 8000]) {
    await new Promise((r) => setTimeout(r, at - (Date.now() - started)));
    const m = process.memoryUsage();
    samples.push({
      atSeconds: at / 1000,
      open,
      arrayBuffersMiB: mib(m.arrayBuffers - base.arrayBuffers),
      rssMiB: mib(m.rss - base.rss),
    });
  }
  for (const s of sockets) s.destroy();
  await server.close();
  return samples;
}

export function linkFloodCommand(): Command {
  return new Command("link-flood")
    .description(
      "Memory and open connections of prefill's transfer port under a flood of half-open, unauthenticated connections",
    )
    .option(
      "--connections <n>",
      "half-open connections",
      (v) => {
        const n = Number(v);
        if (!Number.isInteger(n) || n < 1) throw new InvalidArgumentError("a positive integer");
        return n;
      },
      400,
    )
    .option("--json", "print JSON")
    .action(async (options: { connections: number; json?: boolean }) => {
      const samples = await linkFlood(options.connections);
      if (options.json === true) {
        process.stdout.write(`${JSON.stringify({ connections: options.connections, samples })}\n`);
        return;
      }
      for (const s of samples) {
        process.stdout.write(
          `t=${s.atSeconds}s: ${s.open} of ${options.connections} connections open; ArrayBuffers +${s.arrayBuffersMiB} MiB, RSS +${s.rssMiB} MiB\n`,
        );
      }
    });
}
