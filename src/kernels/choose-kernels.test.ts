import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { describe, it } from "node:test";
import { chooseKernels, nativeSelfTest } from "./choose-kernels.js";
import { nativeAddon } from "./kernel-backend.js";

describe("chooseKernels", () => {
  // The suite runs where gcc is (scripts/ensure-test-deps.mjs installs it): the build made the addon,
  // so auto must pick native here. A machine where it did not would fail this, not skip it.
  it("chooseKernels() picks native on auto where the addon is built and passes its self-test, saying the ISA level", async () => {
    const choice = await chooseKernels("auto");
    assert.equal(choice.kernels, "native", choice.message);
    assert.ok(nativeAddon().levels.includes(choice.isa as string));
    assert.equal(choice.message, `native kernels (${choice.isa})`);
    assert.deepEqual(await chooseKernels("wasm"), {
      kernels: "wasm",
      isa: null,
      message: "WebAssembly kernels (--kernels wasm)",
    });
  });

  it("nativeSelfTest() passes at every ISA level this CPU runs", async () => {
    const a = nativeAddon();
    const best = a.levels.indexOf(a.isa());
    for (const level of a.levels.slice(best)) assert.deepEqual(await nativeSelfTest(level), { isa: level });
  });

  it("chooseKernels() falls back to wasm on auto, saying why, where the addon is missing; native then refuses", () => {
    const script = `
      import { chooseKernels } from ${JSON.stringify(new URL("./choose-kernels.js", import.meta.url).href)};
      console.log(JSON.stringify(await chooseKernels("auto")));
      await chooseKernels("native").catch((e) => console.log(e.message));
    `;
    const r = spawnSync(process.execPath, ["--input-type=module", "-e", script], {
      env: { ...process.env, KVFENCE_NATIVE_ADDON: "/nonexistent/kvfence-kernels.node" },
      encoding: "utf8",
    });
    assert.equal(r.status, 0, r.stderr);
    const [auto, native] = r.stdout.trim().split("\n");
    const choice = JSON.parse(auto as string);
    assert.equal(choice.kernels, "wasm");
    assert.match(
      choice.message,
      /^WebAssembly kernels: the native addon is not built \(.*no C compiler at install/,
    );
    assert.match(native as string, /^--kernels native cannot run: the native addon is not built/);
  });
});
