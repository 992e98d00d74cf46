// CPU a span costs the exporting thread (docs/benchmarks.md §8, "One exporter a process"):
//   node scripts/span-pipeline-cost.mjs [spans=20000]
// Starts this build's exporting tracer (dist/src/lib/tracing.js, `startTracing`) towards an
// OTLP/HTTP receiver in a child process (it reads each post and answers {}), then, after a warm-up
// of 5,000, hands it `spans` records the way a worker thread's forwarded batches arrive (groups of
// 100, structured-cloned, every 2 ms, with ~100 KB of other garbage per group), and shuts it down
// (everything built, exported and answered). Prints this process's CPU (every thread: user +
// system, process.cpuUsage) per span, with and without the tracer (the loop alone), and their
// difference: what a span costs from its record to its OTLP post.
import { fork } from "node:child_process";
import { fileURLToPath } from "node:url";

if (process.argv[2] === "--sink") {
  const { createServer } = await import("node:http");
  const server = createServer((req, res) => {
    req.resume();
    req.on("end", () => res.end("{}"));
  });
  server.listen(0, "127.0.0.1", () => process.send(server.address().port));
} else {
  const n = Number(process.argv[2] ?? 20000);
  const child = fork(fileURLToPath(import.meta.url), ["--sink"]);
  const port = await new Promise((resolve) => child.once("message", resolve));
  const t = await import(new URL("../dist/src/lib/tracing.js", import.meta.url).href);
  const record = (i, name) => ({
    name,
    startEpochMs: t.epochNow() - 5,
    endEpochMs: t.epochNow(),
    attributes: { "kvfence.tokens": i, "kvfence.request_id": `req-${i}` },
    parent: `00-0af7651916cd43dd8448eb211c80319c-${i.toString(16).padStart(16, "0")}-01`,
    ids: null,
  });
  const run = async (count, tracer) => {
    for (let i = 0; i < count; i += 100) {
      const spans = [];
      for (let k = 0; k < 100; k++) spans.push(record(i + k, k % 2 ? "decode" : "commit"));
      const forwarded = structuredClone({ kind: "spans", service: "kvfence-decode", spans });
      tracer?.adopt(forwarded);
      let garbage = [];
      for (let k = 0; k < 1000; k++) garbage.push({ a: k, b: `x${k}` });
      garbage = null;
      await new Promise((resolve) => setTimeout(resolve, 2));
    }
  };
  const measure = async (tracer) => {
    await run(5000, tracer);
    await new Promise((resolve) => setTimeout(resolve, 300));
    const c0 = process.cpuUsage();
    await run(n, tracer);
    if (tracer !== null) await tracer.shutdown();
    const c = process.cpuUsage(c0);
    return (c.user + c.system) / n;
  };
  const alone = await measure(null);
  const tracer = await t.startTracing(`http://127.0.0.1:${port}`, "kvfence-router");
  const traced = await measure(tracer);
  console.log(
    JSON.stringify({
      spans: n,
      cpuUsPerSpanTraced: +traced.toFixed(2),
      cpuUsPerSpanLoopAlone: +alone.toFixed(2),
      cpuUsPerSpan: +(traced - alone).toFixed(2),
    }),
  );
  child.kill();
}
