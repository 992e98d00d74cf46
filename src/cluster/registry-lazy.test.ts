/**
 * A server without `--registry` never loads the etcd client: `etcd3` and its gRPC stack (about a
 * hundred modules, ~0.1 s of the main thread at start, issue #15's start-up) are imported only when
 * a registry is used. Checked in a fresh process that imports everything `kvfence serve` and
 * `kvfence drain` import, then lists the CommonJS modules it loaded.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";

test("importing the server, the cluster router and drain loads no etcd3 or gRPC module", () => {
  const modules = ["../server/start-server.js", "./cluster-router.js", "../cli/drain.js"].map(
    (m) => new URL(m, import.meta.url).href,
  );
  const script = `
    import { createRequire } from "node:module";
    for (const m of ${JSON.stringify(modules)}) await import(m);
    const loaded = Object.keys(createRequire(import.meta.url).cache);
    process.stdout.write(JSON.stringify(loaded.filter((k) => /node_modules\\/(etcd3|@grpc)\\//.test(k))));
  `;
  const run = spawnSync(process.execPath, ["--input-type=module", "-e", script], { encoding: "utf8" });
  assert.equal(run.status, 0, run.stderr);
  assert.deepEqual(JSON.parse(run.stdout), []);
});
