// Builds the native kernels (issue #33, docs/kernels.md) into dist/native/kvfence-kernels.node with
// the machine's C compiler and the Node-API headers of the `node-api-headers` package (no
// downloads): native/src/addon.c (the Node-API glue, its checks and the dispatch tables) once, and
// every other native/src/*.c (matmul.c, attention.c, ops.c, kquants.c) once per ISA level with the
// level's -m flags and -DKF_ISA=<level> (native/include/kvfence-kernels.h), then links them with
// `cc -shared` (Node-API symbols stay undefined and resolve against the node binary at load). Run
// by `npm run build` after build-wasm; incremental (nothing is done when the output is newer than
// every input).
//
// Where there is no C compiler, or the compile fails, it says so in one line on stderr, removes
// any old .node (a stale addon must not load) and exits 0: install and build still succeed and
// kvfence runs on the WebAssembly kernels. KVFENCE_NATIVE_SANITIZE=1 builds
// dist/native/kvfence-kernels-asan.node instead, with AddressSanitizer and UBSan (-O1), for the
// sanitizer test (src/kernels/native-sanitize.solo.test.ts). CC picks the compiler (default gcc).
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, rmSync, statSync } from "node:fs";
import { fileURLToPath } from "node:url";

const root = fileURLToPath(new URL("..", import.meta.url));
const src = `${root}native/src`;
const include = `${root}native/include`;
const outDir = `${root}dist/native`;
const sanitize = process.env.KVFENCE_NATIVE_SANITIZE === "1";
const output = `${outDir}/${sanitize ? "kvfence-kernels-asan.node" : "kvfence-kernels.node"}`;
const cc = process.env.CC ?? "gcc";
const objDir = `${outDir}/obj${sanitize ? "-asan" : ""}`;

/** The ISA levels and their flags (the table in native/include/kvfence-kernels.h). */
const LEVELS = {
  avx512: [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512vnni",
    "-mavx512bf16",
    "-mfma",
    "-mf16c",
    "-mavx2",
  ],
  avxvnni: ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
  avx2: ["-mavx2", "-mfma", "-mf16c"],
  generic: [],
};

if (!existsSync(`${src}/addon.c`)) process.exit(0);

const x86 = process.arch === "x64";
const levels = x86 ? Object.keys(LEVELS) : ["generic"];
const kernelFiles = readdirSync(src)
  .filter((f) => f.endsWith(".c") && f !== "addon.c")
  .sort();
const napiInclude = fileURLToPath(new URL("../node_modules/node-api-headers/include", import.meta.url));
const inputs = [
  `${src}/addon.c`,
  ...kernelFiles.map((f) => `${src}/${f}`),
  ...readdirSync(include).map((f) => `${include}/${f}`),
  ...readdirSync(src)
    .filter((f) => f.endsWith(".h"))
    .map((f) => `${src}/${f}`),
  fileURLToPath(import.meta.url),
];

const mtime = (f) => statSync(f).mtimeMs;
if (existsSync(output) && inputs.every((f) => mtime(f) < mtime(output))) process.exit(0);

/** Says why there is no native addon, removes any old one, and leaves the build successful. */
function giveUp(why) {
  rmSync(output, { force: true });
  rmSync(objDir, { recursive: true, force: true });
  console.error(`build-native: ${why}; kvfence will run on the WebAssembly kernels`);
  process.exit(0);
}

if (spawnSync(cc, ["--version"], { stdio: "ignore" }).status !== 0) {
  giveUp(`no C compiler (${cc}) found, the native kernels are not built`);
}
if (!existsSync(`${napiInclude}/node_api.h`)) {
  giveUp(`the Node-API headers are missing (${napiInclude}: npm install node-api-headers)`);
}

const common = [
  "-std=gnu11",
  "-fPIC",
  "-fvisibility=hidden",
  "-Wall",
  "-Wextra",
  "-Wno-unused-parameter",
  `-I${include}`,
  `-I${napiInclude}`,
  "-DNAPI_VERSION=8",
  ...(sanitize ? ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"] : ["-O3"]),
];
rmSync(objDir, { recursive: true, force: true });
mkdirSync(objDir, { recursive: true });

function compile(args) {
  const r = spawnSync(cc, args, { encoding: "utf8" });
  if (r.status !== 0) {
    process.stderr.write(r.stderr ?? "");
    giveUp(`the C compiler failed (${cc} ${args.join(" ")})`);
  }
}

const objects = [];
for (const level of levels) {
  for (const file of kernelFiles) {
    const obj = `${objDir}/${file.replace(/\.c$/, "")}-${level}.o`;
    compile([...common, ...LEVELS[level], `-DKF_ISA=${level}`, "-c", `${src}/${file}`, "-o", obj]);
    objects.push(obj);
  }
}
const addonObj = `${objDir}/addon.o`;
const has = kernelFiles.map((f) => `-DKF_HAS_${f.replace(/\.c$/, "").toUpperCase()}=1`);
compile([...common, ...has, ...(x86 ? ["-DKF_X86=1"] : []), "-c", `${src}/addon.c`, "-o", addonObj]);
objects.push(addonObj);
compile([
  "-shared",
  ...(sanitize ? ["-fsanitize=address,undefined"] : []),
  "-o",
  `${output}.tmp`,
  ...objects,
  "-lm",
]);
const { renameSync } = await import("node:fs");
renameSync(`${output}.tmp`, output);
rmSync(objDir, { recursive: true, force: true });
