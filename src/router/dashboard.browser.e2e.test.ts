/**
 * The dashboard in a real browser (issue #18 item 5): playwright-core drives Debian's chromium
 * (/usr/bin/chromium, installed by npm test's pretest step) against real servers — the threaded topology on the
 * bundled model — with the operator key. Under load from the official `openai` client the page
 * map changes (pages held on both nodes, drawn on the canvas), and it returns to all free when the
 * requests end; a server started with the corrupt-transfer fault (its checksum guard on, as in
 * docs/fault-matrix.md) shows its checksum guard counter, standing out, after one request. Without
 * the operator key the page is refused. With KVFENCE_WRITE_SCREENSHOTS=1 the screenshots the
 * README and docs/api.md show are written to docs/ (docs/dashboard.png, docs/dashboard-guard.png).
 */
import assert from "node:assert/strict";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";
import { type Browser, chromium, type Page } from "playwright-core";
import { modelDir, TEST_OPERATOR_KEY } from "../../testing/start-server.js";
import { startInProcess, type TopologyServer } from "../../testing/topology-servers.js";

const CHROMIUM = process.env.KVFENCE_CHROMIUM ?? "/usr/bin/chromium";
const KEY = "sk-tenant-alpha-0001";
const KEYS = { [KEY]: "alpha", "sk-tenant-beta-00002": "beta" };
const DOCS = fileURLToPath(new URL("../../../docs/", import.meta.url));
const WRITE = process.env.KVFENCE_WRITE_SCREENSHOTS === "1";

/** Node cards' `data-busy` (pages not free), by node id. */
async function busyPages(page: Page): Promise<Record<string, number>> {
  return page.locator("section.node").evaluateAll((cards) =>
    Object.fromEntries(
      cards.map((c) => {
        const { dataset } = c as unknown as { dataset: Record<string, string> };
        return [dataset.node, Number(dataset.busy)];
      }),
    ),
  );
}

/** Pixels of a node's page map drawn in another colour than a free page's. */
async function heldPixels(page: Page, node: string): Promise<number> {
  return page.locator(`section.node[data-node="${node}"] canvas`).evaluate((el) => {
    // The browser's canvas (no DOM types in this Node project).
    const canvas = el as unknown as {
      width: number;
      height: number;
      getContext(kind: "2d"): {
        getImageData(x: number, y: number, w: number, h: number): { data: Uint8ClampedArray };
      };
    };
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let held = 0;
    for (let i = 0; i < data.length; i += 4) {
      const [r, g, b, a] = [data[i]!, data[i + 1]!, data[i + 2]!, data[i + 3]!];
      const free = r === 0xe8 && g === 0xec && b === 0xef;
      if (a > 0 && !free) held++;
    }
    return held;
  });
}

async function until<T>(
  what: string,
  probe: () => Promise<T>,
  ok: (v: T) => boolean,
  timeoutMs = 30_000,
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await probe();
    if (ok(v)) return v;
    if (Date.now() > deadline) throw new Error(`${what}: still ${JSON.stringify(v)} after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

describe("the dashboard in chromium", { timeout: 180_000 }, () => {
  let browser: Browser;
  let server: TopologyServer;
  let faulty: TopologyServer;
  const shots = mkdtempSync(join(tmpdir(), "kvfence-dashboard-"));

  before(async () => {
    assert.ok(
      existsSync(CHROMIUM),
      `no chromium at ${CHROMIUM}: install Debian's (apt-get install -y chromium; npm test's pretest step does) or set KVFENCE_CHROMIUM`,
    );
    // The prefix cache off: its cached pages would stay held (shared) after the requests end, and
    // this test watches the map return to all free.
    const options = {
      model: modelDir("kvfence-tiny"),
      kvPages: 128,
      apiKeys: KEYS,
      prefixCache: "off" as const,
    };
    [server, faulty, browser] = await Promise.all([
      startInProcess("threads", options),
      startInProcess("threads", { ...options, faults: ["corrupt-transfer"] }),
      chromium.launch({ executablePath: CHROMIUM, args: ["--no-sandbox"] }),
    ]);
  });
  after(async () => {
    await browser?.close();
    await Promise.all([server?.close(), faulty?.close()]);
    rmSync(shots, { recursive: true, force: true });
  });

  async function open(url: string, key: string | null = TEST_OPERATOR_KEY): Promise<Page> {
    const context = await browser.newContext({
      viewport: { width: 1200, height: 900 },
      ...(key === null ? {} : { extraHTTPHeaders: { authorization: `Bearer ${key}` } }),
    });
    const page = await context.newPage();
    const errors: string[] = [];
    page.on("pageerror", (e) => errors.push(e.message));
    await page.goto(`${url}/kvfence/ui?interval=150`);
    await page.locator("body[data-updates]").waitFor({ timeout: 20_000 });
    assert.deepEqual(errors, [], "no script error on the page");
    return page;
  }

  test("without the operator key the dashboard is refused", async () => {
    const context = await browser.newContext();
    const page = await context.newPage();
    const res = await page.goto(`${server.url}/kvfence/ui`);
    assert.equal(res?.status(), 401);
    const state = await page.request.get(`${server.url}/kvfence/state`);
    assert.equal(state.status(), 401);
    await context.close();
  });

  test("the page map fills as requests run and returns to all free", async () => {
    const page = await open(server.url);
    assert.deepEqual(await busyPages(page), { "prefill-0": 0, "decode-0": 0 }, "idle: every page free");
    assert.equal(await heldPixels(page, "decode-0"), 0);
    const clients = Object.keys(KEYS).map(
      (apiKey) => new OpenAI({ baseURL: server.baseURL, apiKey, maxRetries: 0 }),
    );
    const load = Promise.all(
      Array.from({ length: 12 }, async (_, i) => {
        const stream = await clients[i % 2]!.chat.completions.create({
          model: "kvfence-tiny",
          messages: [
            {
              role: "user",
              content: `the code of account ${i} is QX${i}-PL2. ${"the weather was mild. ".repeat(6)}`,
            },
          ],
          max_tokens: 200,
          temperature: 0,
          stream: true,
        });
        for await (const _ of stream) {
          // drain
        }
      }),
    );
    const busy = await until(
      "pages held on decode under load",
      () => busyPages(page),
      (b) => (b["decode-0"] ?? 0) > 0,
    );
    assert.ok(busy["decode-0"]! > 0);
    assert.ok((await heldPixels(page, "decode-0")) > 0, "held pages are drawn");
    await page.locator('tr[data-phase="decode/commit"]').waitFor({ timeout: 20_000 });
    const shot = await page.screenshot({ fullPage: true });
    writeFileSync(join(shots, "dashboard.png"), shot);
    if (WRITE) writeFileSync(join(DOCS, "dashboard.png"), shot);
    await load;
    await until(
      "every page free again",
      () => busyPages(page),
      (b) => Object.values(b).every((n) => n === 0),
    );
    assert.equal(await heldPixels(page, "decode-0"), 0, "the map is all free again");
    // Decode's inter-token window closes when it goes idle (src/engine/engine.ts, ITL_WINDOW).
    await page.locator('tr[data-phase="decode/inter_token"]').waitFor({ timeout: 20_000 });
    await page.locator('tr[data-phase="router/inter_token"]').waitFor({ timeout: 20_000 });
    assert.equal(await page.locator(".guard.fired").count(), 0, "no guard fired on the default server");
    await page.context().close();
  });

  test("a fault-injected server shows its guard counter, standing out", async () => {
    const page = await open(faulty.url);
    const guard = page.locator('.guard[data-guard="checksum_failures"]');
    assert.equal(await guard.getAttribute("data-count"), "0");
    const client = new OpenAI({ baseURL: faulty.baseURL, apiKey: KEY, maxRetries: 0 });
    await assert.rejects(
      client.chat.completions.create({
        model: "kvfence-tiny",
        messages: [{ role: "user", content: "the access code of account 4821 is QX7-PL2." }],
        max_tokens: 8,
        temperature: 0,
      }),
      (err: { status?: number }) => err.status === 500,
    );
    await until(
      "the checksum guard counted",
      async () => guard.getAttribute("data-count"),
      (c) => Number(c) >= 1,
    );
    assert.match((await guard.getAttribute("class")) ?? "", /\bfired\b/);
    // Looked up and read in one task: the page re-renders the guards on every poll.
    const colour = await page.evaluate(() => {
      const g = globalThis as unknown as {
        document: { querySelector(s: string): unknown };
        getComputedStyle(e: unknown): { backgroundColor: string };
      };
      return g.getComputedStyle(g.document.querySelector('.guard[data-guard="checksum_failures"]'))
        .backgroundColor;
    });
    assert.equal(colour, "rgb(198, 40, 40)", "a fired guard is drawn in the alert colour");
    assert.equal(await page.locator(".guard.fired").count(), 1, "only that guard fired");
    const shot = await page.screenshot({ fullPage: false });
    writeFileSync(join(shots, "dashboard-guard.png"), shot);
    if (WRITE) writeFileSync(join(DOCS, "dashboard-guard.png"), shot);
    await page.context().close();
  });
});
