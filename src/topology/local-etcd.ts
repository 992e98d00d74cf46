/**
 * A throwaway etcd for tests and `kvfence bench cluster --compare registry`: Debian's `etcd` binary
 * (package etcd-server, installed by npm test's pretest step) on free 127.0.0.1 ports with a temporary data dir,
 * stopped and removed by `stop`. `restart` stops it and starts it again on the same ports and data
 * (etcd itself restarted).
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";

export interface LocalEtcd {
  /** `etcd://127.0.0.1:port`, for `--registry`. */
  readonly url: string;
  readonly endpoint: string;
  /** The running etcd's process id (a new one after `restart`), for CPU accounting. */
  pid(): number | undefined;
  restart(): Promise<void>;
  stop(): Promise<void>;
}

/** Whether the etcd binary is there (a clear skip message otherwise is the caller's). */
export function etcdAvailable(): boolean {
  return spawnSync("etcd", ["--version"], { stdio: "ignore" }).status === 0;
}

async function freePort(): Promise<number> {
  const server = net.createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as net.AddressInfo).port;
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return port;
}

export async function startEtcd(): Promise<LocalEtcd> {
  const dir = mkdtempSync(path.join(os.tmpdir(), "kvfence-etcd-"));
  const client = await freePort();
  const peer = await freePort();
  const endpoint = `http://127.0.0.1:${client}`;
  const args = [
    "--name",
    "test",
    "--data-dir",
    dir,
    "--listen-client-urls",
    endpoint,
    "--advertise-client-urls",
    endpoint,
    "--listen-peer-urls",
    `http://127.0.0.1:${peer}`,
    "--initial-advertise-peer-urls",
    `http://127.0.0.1:${peer}`,
    "--initial-cluster",
    `test=http://127.0.0.1:${peer}`,
    "--log-level",
    "error",
  ];
  let child: ChildProcess | null = null;
  const launch = async (): Promise<void> => {
    const c = spawn("etcd", args, { stdio: ["ignore", "ignore", "pipe"] });
    child = c;
    let err = "";
    c.stderr!.on("data", (d: Buffer) => {
      err = (err + d.toString()).slice(-2000);
    });
    const deadline = Date.now() + 20_000;
    for (;;) {
      if (c.exitCode !== null) throw new Error(`etcd exited: ${err}`);
      const ok = await fetch(`${endpoint}/health`).then(
        (r) => r.ok,
        () => false,
      );
      if (ok) return;
      if (Date.now() > deadline) throw new Error(`etcd did not come up: ${err}`);
      await new Promise((r) => setTimeout(r, 50));
    }
  };
  const kill = async (): Promise<void> => {
    const c = child;
    child = null;
    if (c === null || c.exitCode !== null) return;
    const exited = new Promise((r) => c.once("exit", r));
    c.kill("SIGTERM");
    await exited;
  };
  await launch();
  return {
    url: `etcd://127.0.0.1:${client}`,
    endpoint,
    pid: () => (child as ChildProcess | null)?.pid,
    async restart() {
      await kill();
      await launch();
    },
    async stop() {
      await kill();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
