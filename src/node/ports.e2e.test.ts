/**
 * Acceptance (issue #21): every port every role opens is in docs/security.md's port table. A real
 * `kvfence cluster`-style set of processes (router, one prefill, one decode on 127.0.0.1) is
 * started, and the listening sockets of each process are read from /proc
 * (`testing/listening-sockets.ts`). Each must be one the table lists for that role — the router's
 * HTTP port and operator listener, a node's control port, prefill's transfer port — bound to 127.0.0.1; any other
 * listening socket fails the test, as does a table row this test does not know.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import { listeningSockets } from "../../testing/listening-sockets.js";
import { modelDir } from "../../testing/start-server.js";
import { type LocalCluster, startLocalCluster } from "../topology/local-cluster.js";

const SECURITY_MD = fileURLToPath(new URL("../../../docs/security.md", import.meta.url));

/** The "port" column of each row of the table under "## Ports", keyed by role. */
function portTable(): Array<{ role: string; port: string }> {
  const text = readFileSync(SECURITY_MD, "utf8");
  const section = text.slice(text.indexOf("## Ports"), text.indexOf("\n## ", text.indexOf("## Ports") + 1));
  const rows = section
    .split("\n")
    .filter((l) => l.startsWith("| ") && !l.startsWith("| role") && !l.startsWith("| ---"));
  return rows.map((l) => {
    const cells = l.split(/(?<!\\)\|/).map((c) => c.trim());
    return { role: cells[1]!, port: cells[2]! };
  });
}

describe("every listening socket of every role is in docs/security.md", { timeout: 120_000 }, () => {
  let cluster: LocalCluster;
  before(async () => {
    cluster = await startLocalCluster({
      prefill: 1,
      decode: 1,
      model: modelDir("kvfence-tiny"),
      nodeArgs: ["--kv-pages", "256"],
    });
  });
  after(async () => {
    await cluster?.close();
  });

  test("router: the HTTP port and the loopback operator listener; prefill: control and transfer port; decode: control port; all on 127.0.0.1", () => {
    const table = portTable();
    const listed = (role: string, port: string): boolean =>
      table.some((r) => r.role.includes(role) && r.port.startsWith(port));
    // The kinds of port this test can tell apart; a new row in the table needs a rule here.
    for (const row of table) {
      assert.ok(
        /^(HTTP API|operator listener|control port|transfer port)/.test(row.port),
        `a port kind the test does not know: ${row.port}`,
      );
    }
    const classify = (role: string, port: number, knownPort: number): string => {
      if (port === knownPort) return role === "router" ? "HTTP API" : "control port";
      if (role === "router") return "operator listener";
      return role === "prefill" ? "transfer port" : `unknown port ${port}`;
    };
    const processes = [
      { role: "router", pid: cluster.router.pid!, url: cluster.url },
      { role: "prefill", pid: cluster.prefill[0]!.process.pid!, url: cluster.prefill[0]!.url },
      { role: "decode", pid: cluster.decode[0]!.process.pid!, url: cluster.decode[0]!.url },
    ];
    const seen: string[] = [];
    for (const p of processes) {
      const known = Number(new URL(p.url).port);
      const sockets = listeningSockets(p.pid);
      assert.ok(sockets.length > 0, `${p.role}: no listening socket found`);
      const kinds = new Set<string>();
      for (const s of sockets) {
        const kind = classify(p.role, s.port, known);
        assert.equal(s.address, "127.0.0.1", `${p.role} ${kind} binds ${s.address}`);
        assert.ok(
          listed(p.role, kind),
          `${p.role} listens on a port not in docs/security.md: ${kind} (${s.port})`,
        );
        assert.ok(!kinds.has(kind), `${p.role}: two sockets of one kind: ${kind}`);
        kinds.add(kind);
        seen.push(`${p.role}: ${kind}`);
      }
    }
    assert.deepEqual(seen.sort(), [
      "decode: control port",
      "prefill: control port",
      "prefill: transfer port",
      "router: HTTP API",
      "router: operator listener",
    ]);
  });
});
