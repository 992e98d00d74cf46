// What the test suite needs beyond npm packages, checked before it builds (npm test's pretest
// step, so `npm ci && npm test` is the whole command on a fresh machine and in .ci/run): Debian's
// chromium for the dashboard's browser test (src/router/dashboard.browser.e2e.test.ts, at
// /usr/bin/chromium or $KVFENCE_CHROMIUM), gcc with libasan for the native kernels and their
// sanitizer test (src/kernels/native-sanitize.solo.test.ts), and etcd on PATH for the registry tests
// (src/topology/registry.e2e.test.ts, src/topology/routers.e2e.test.ts; Debian's etcd-server).
// Where one is missing and this runs as root with apt-get, it says in one line what it installs and
// why, runs `apt-get update` once and installs the packages. Otherwise it names what is missing and
// how to install it, and exits 1 before the build and the tests start, not minutes into the run.
import { spawnSync } from "node:child_process";
import { accessSync, constants } from "node:fs";

const chromium = process.env.KVFENCE_CHROMIUM ?? "/usr/bin/chromium";

/** A program the suite runs, the tests that need it, and the Debian package that brings it. */
const NEEDS = [
  {
    name: "chromium",
    debian: "chromium",
    why: "the dashboard's browser test",
    where: process.env.KVFENCE_CHROMIUM === undefined ? chromium : `KVFENCE_CHROMIUM=${chromium}`,
    present: () => isExecutable(chromium),
    // apt-get installs /usr/bin/chromium: it does not help a KVFENCE_CHROMIUM that points elsewhere.
    installable: () => process.env.KVFENCE_CHROMIUM === undefined,
  },
  {
    name: "gcc",
    debian: "gcc",
    why: "the native kernels (scripts/build-native.mjs: the suite runs on them) and their sanitizer test (libasan)",
    where: "gcc on PATH with libasan",
    present: () => runs("gcc", ["--version"]) && asanPresent(),
    installable: () => true,
  },
  {
    name: "etcd",
    debian: "etcd-server",
    why: "the registry tests",
    where: "etcd on PATH",
    present: () => runs("etcd", ["--version"]),
    installable: () => true,
  },
];

function isExecutable(path) {
  try {
    accessSync(path, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

function asanPresent() {
  const r = spawnSync("gcc", ["-print-file-name=libasan.so"], { encoding: "utf8" });
  return r.status === 0 && r.stdout.trim().startsWith("/");
}

function runs(command, args) {
  return spawnSync(command, args, { stdio: "ignore" }).status === 0;
}

/** Runs apt-get quietly: its output is shown only when it fails. */
function apt(args) {
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
  const r = spawnSync("apt-get", args, { env, encoding: "utf8", maxBuffer: 256 * 1024 * 1024 });
  if (r.status !== 0) {
    process.stderr.write(`${r.stdout ?? ""}${r.stderr ?? ""}`);
    throw new Error(`apt-get ${args.join(" ")} failed: exit ${r.status ?? r.error?.message}`);
  }
}

const missing = NEEDS.filter((need) => !need.present());
const installable = missing.filter((need) => need.installable());

if (installable.length > 0 && process.getuid?.() === 0 && runs("apt-get", ["--version"])) {
  const packages = installable.map((need) => need.debian);
  const reasons = installable.map((need) => `${need.name} for ${need.why}`).join(", ");
  console.log(`npm test: installing ${packages.join(" ")} with apt-get (${reasons})`);
  try {
    apt(["update", "-qq"]);
    apt(["install", "-y", "-qq", ...packages]);
  } catch (err) {
    console.error(`npm test: ${err.message}`);
  }
}

const still = NEEDS.filter((need) => !need.present());
if (still.length > 0) {
  const lines = still.map((need) => `  ${need.name} (${need.where}), for ${need.why}`);
  const debian = still.map((need) => need.debian).join(" ");
  console.error(
    [
      "npm test: the test suite needs programs that are not installed:",
      ...lines,
      `Install them (Debian, as root or with sudo): apt-get install -y ${debian}`,
      "or point KVFENCE_CHROMIUM at a Chromium binary and put an etcd binary on PATH, then run npm test again",
      "(run as root on Debian, npm test installs them itself)",
    ].join("\n"),
  );
  process.exit(1);
}
