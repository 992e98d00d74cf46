/**
 * The TCP sockets a process listens on, read from /proc (Linux): the socket inodes among
 * /proc/<pid>/fd, matched against the LISTEN rows (state 0A) of /proc/<pid>/net/tcp and tcp6. For
 * the port-table test of docs/security.md and to find a node's transfer port.
 */
import { readdirSync, readFileSync, readlinkSync } from "node:fs";

export interface ListeningSocket {
  readonly address: string;
  readonly port: number;
}

function hexAddress(hex: string): string {
  if (hex.length === 8) {
    const n = Number.parseInt(hex, 16);
    return [n & 255, (n >>> 8) & 255, (n >>> 16) & 255, n >>> 24].join(".");
  }
  // IPv6 as four little-endian 32-bit words; enough to tell :: and ::1 apart.
  return hex === "00000000000000000000000000000000" ? "::" : `ipv6:${hex}`;
}

export function listeningSockets(pid: number): ListeningSocket[] {
  const inodes = new Set<string>();
  for (const fd of readdirSync(`/proc/${pid}/fd`)) {
    try {
      const m = /^socket:\[(\d+)\]$/.exec(readlinkSync(`/proc/${pid}/fd/${fd}`));
      if (m !== null) inodes.add(m[1]!);
    } catch {
      // The descriptor closed meanwhile.
    }
  }
  const out: ListeningSocket[] = [];
  for (const table of ["tcp", "tcp6"]) {
    let text = "";
    try {
      text = readFileSync(`/proc/${pid}/net/${table}`, "utf8");
    } catch {
      continue;
    }
    for (const line of text.split("\n").slice(1)) {
      const f = line.trim().split(/\s+/);
      if (f.length < 10 || f[3] !== "0A" || !inodes.has(f[9]!)) continue;
      const [addr, port] = f[1]!.split(":");
      out.push({ address: hexAddress(addr!), port: Number.parseInt(port!, 16) });
    }
  }
  return out.sort((a, b) => a.port - b.port);
}
