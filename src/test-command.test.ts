/**
 * The README's test command is the whole of what a fresh machine needs (issue #32 item 7):
 * `npm ci && npm test`, which .ci/run runs as it stands, and whose pretest step
 * (scripts/ensure-test-deps.mjs) brings the programs the suite runs besides Node — Debian's
 * chromium and etcd — or, where it cannot, names them and how to install them and fails before the
 * build. The script runs here as a real process, on a PATH of its own: a fake `apt-get` (a shell
 * script that logs its arguments and "installs" etcd into that PATH) stands in for Debian's.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { chmodSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const SCRIPT = join(ROOT, "scripts", "ensure-test-deps.mjs");
const TEST_COMMAND = "npm ci && npm test";
const isRoot = process.getuid?.() === 0;

function executable(path: string, text: string): void {
  writeFileSync(path, text);
  chmodSync(path, 0o755);
}

/** The machine's gcc (the suite needs it: scripts/ensure-test-deps.mjs). */
function realGcc(): string {
  const r = spawnSync("sh", ["-c", "command -v gcc"], { encoding: "utf8" });
  assert.equal(r.status, 0, "gcc is on PATH");
  return r.stdout.trim();
}

/** Runs the pretest script with only `bin` on PATH and `chromium` as KVFENCE_CHROMIUM. */
function ensure(bin: string, chromium: string) {
  const r = spawnSync(process.execPath, [SCRIPT], {
    env: { PATH: bin, KVFENCE_CHROMIUM: chromium, HOME: bin },
    encoding: "utf8",
  });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

test("the README's test command is what .ci/run runs, and npm test checks the suite's programs first", () => {
  const readme = readFileSync(join(ROOT, "README.md"), "utf8");
  assert.match(readme, /^npm ci && npm test\b/m, "the README gives the test command on a line of its own");
  const ci = readFileSync(join(ROOT, ".ci", "run"), "utf8");
  const runs = ci
    .split("\n")
    .filter((line) => !line.trimStart().startsWith("#") && line.includes(TEST_COMMAND));
  assert.equal(runs.length, 1, `.ci/run runs ${TEST_COMMAND} once:\n${ci}`);
  assert.doesNotMatch(ci, /apt-get/, ".ci/run installs nothing the README's command does not");
  const pkg = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")) as {
    scripts: Record<string, string>;
  };
  assert.equal(pkg.scripts.pretest, "node scripts/ensure-test-deps.mjs");
});

test("ensure-test-deps.mjs names each missing program and how to install it, and exits 1 where it cannot install", () => {
  const bin = mkdtempSync(join(tmpdir(), "kvfence-deps-"));
  try {
    const r = ensure(bin, join(bin, "no-chromium"));
    assert.equal(r.status, 1, r.stderr);
    assert.match(r.stderr, /chromium \(KVFENCE_CHROMIUM=.*no-chromium\), for the dashboard's browser test/);
    assert.match(r.stderr, /etcd \(etcd on PATH\), for the registry tests/);
    assert.match(r.stderr, /gcc \(gcc on PATH with libasan\), for the native kernels/);
    assert.match(r.stderr, /apt-get install -y chromium gcc etcd-server/);
    assert.equal(r.stdout, "", "nothing was installed");
  } finally {
    rmSync(bin, { recursive: true, force: true });
  }
});

test("ensure-test-deps.mjs installs a missing etcd with apt-get as root, one update and one install, then nothing", () => {
  const bin = mkdtempSync(join(tmpdir(), "kvfence-deps-"));
  try {
    const log = join(bin, "apt-get.log");
    const chromium = join(bin, "chromium");
    executable(chromium, "#!/bin/sh\nexit 0\n");
    symlinkSync(realGcc(), join(bin, "gcc")); // present: only etcd is missing
    executable(
      join(bin, "apt-get"),
      `#!/bin/sh\necho "$*" >> ${log}\n` +
        `if [ "$1" = install ]; then printf '#!/bin/sh\\nexit 0\\n' > ${bin}/etcd; /bin/chmod +x ${bin}/etcd; fi\n`,
    );
    const r = ensure(bin, chromium);
    if (!isRoot) {
      // Not root: apt-get is not tried, the message says what to install.
      assert.equal(r.status, 1, r.stderr);
      assert.match(r.stderr, /apt-get install -y etcd-server/);
      return;
    }
    assert.equal(r.status, 0, r.stderr);
    assert.equal(r.stdout, "npm test: installing etcd-server with apt-get (etcd for the registry tests)\n");
    const calls = () => readFileSync(log, "utf8").trim().split("\n");
    assert.deepEqual(calls().slice(1), ["update -qq", "install -y -qq etcd-server"]);
    assert.equal(calls()[0], "--version", "apt-get is looked for before it is used");
    const again = ensure(bin, chromium);
    assert.deepEqual([again.status, again.stdout, again.stderr], [0, "", ""]);
    assert.equal(calls().length, 3, "nothing missing: apt-get is not run again");
  } finally {
    rmSync(bin, { recursive: true, force: true });
  }
});
