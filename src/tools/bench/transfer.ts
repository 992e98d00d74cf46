/**
 * `kvfence bench transfer`: KV transfer bandwidth of both transports next to this machine's limits,
 * measured in the same run with interleaved repetitions (the order of the paths rotates each rep).
 *
 * Paths, each moving one 4,096-token SmolLM2-135M sequence by default (256 pages × 720 KiB):
 * - memcpy: `Uint8Array.set` between two pre-faulted buffers (main thread) — the shm ceiling;
 * - shm: prefill worker → decode pool SharedArrayBuffer, decode worker learns through the ring;
 * - raw-tcp: a plain socket pair over 127.0.0.1, 1 MiB writes, `onread` receiver that only counts
 *   (prefill worker → main thread) — the TCP ceiling;
 * - tcp: the TCP transport (prefill worker → main thread applying into the pool).
 * - tcp+tls: the same over mutual TLS 1.3 (docs/tls.md; `--tls-cert/--tls-key/--tls-ca`, by default
 *   the test certificates of testing/fixtures/tls): the cost of encrypting every page.
 * Each transport also runs with checksums, through the serving path's own code (`PageChecksums`
 * of src/transfer/page-checksum.ts, called as `PrefillNode` and `DecodeNode` call it):
 * - "+verify": the serving path — prefill hashed each page when its KV was produced (before the
 *   transfer) and reads the records into the manifest; decode hashes each page in `pagesLanded`
 *   while later pages are in flight and reads the records at the commit check;
 * - "+ondemand": the same calls with nothing recorded, so prefill hashes every page when it builds
 *   the manifest and decode every page at commit, in series with the transfer (the serving path
 *   before checksums moved off it);
 * - "tcp+verify-worker": decode hashes landed pages on a worker thread instead (not the serving path).
 * A transfer ends when decode has processed the manifest. The checksum cost is the paired,
 * interleaved ratio of transfer times with and without checksums; raise `--reps` to narrow its CI.
 */

import { join } from "node:path";
import { xxh64 } from "@node-rs/xxhash";
import { Command, InvalidArgumentError } from "commander";
import xxhashWasm from "xxhash-wasm";
import { DEFAULT_KV_CACHE_DTYPE, isKvDtype, type KvLayout } from "../../kvcache/kv-layout.js";
import { packageRoot } from "../../lib/package-root.js";
import { pairedRatio, type RatioInterval, type Summary, summarize } from "../../lib/stats.js";
import type { TlsFiles } from "../../transfer/tls-config.js";
import { positiveInt, runBenchCli } from "./bench-cli.js";
import { describeLoad, loadAverage, type MachineLoad, machineLoad } from "./machine-load.js";
import { now, TransferRig } from "./transfer-rig.js";

/**
 * SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, 16-token pages → 360 KiB per page in the default
 * f16 (720 KiB at f32, `--kv-cache-dtype f32`).
 */
export const SMOLLM2_LAYOUT: KvLayout = {
  numLayers: 30,
  numKvHeads: 3,
  headDim: 64,
  pageSize: 16,
  dtype: DEFAULT_KV_CACHE_DTYPE,
};

export const PATHS = [
  "memcpy",
  "shm",
  "shm+verify",
  "shm+ondemand",
  "raw-tcp",
  "tcp",
  "tcp+tls",
  "tcp+verify",
  "tcp+ondemand",
  "tcp+verify-worker",
] as const;
export type PathName = (typeof PATHS)[number];

export interface TransferBenchOptions {
  readonly pages?: number;
  readonly reps?: number;
  readonly warmup?: number;
  /** Shared-memory signal batch in bytes (≥ 64 KiB by design). */
  readonly signalBytes?: number;
  readonly layout?: KvLayout;
  /** Pages per `writePages` call, one prefill chunk (default 16 = 256 tokens). */
  readonly chunkPages?: number;
  /** Run only these paths (default all; ratios need both of their paths). */
  readonly paths?: readonly PathName[];
  /** TCP receiver: read page bodies straight into the pool (default true). */
  readonly directReads?: boolean;
  /** The tcp+tls path's certificates (default: testing/fixtures/tls). */
  readonly tlsFiles?: TlsFiles;
  readonly log?: (line: string) => void;
}

export interface PathResult {
  readonly ms: Summary;
  /** CPU time of the whole process (all threads, user + system) per transfer, in ms. */
  readonly cpuMs: Summary;
  readonly gbps: Summary;
  readonly pagesPerSecond: number;
}

export interface TransferBenchResult {
  readonly pages: number;
  readonly pageBytes: number;
  readonly bytes: number;
  readonly reps: number;
  readonly signalBytes: number;
  readonly chunkPages: number;
  readonly paths: Record<PathName, PathResult>;
  /** Throughput of the transport over its ceiling (time ratio ceiling / transport). */
  readonly shmOverMemcpy: RatioInterval;
  readonly tcpOverRaw: RatioInterval;
  /** Throughput of tcp+tls over tcp (time ratio tcp / tcp+tls), and over the raw socket. */
  readonly tlsOverTcp: RatioInterval;
  readonly tlsOverRaw: RatioInterval;
  /** CPU time of tcp+tls over tcp (paired): what encryption costs the two ends together. */
  readonly tlsCpuCost: RatioInterval;
  /** Transfer time with checksums over without (paired). */
  readonly checksumCost: Record<
    "shmVerify" | "shmOndemand" | "tcpVerify" | "tcpOndemand" | "tcpVerifyWorker",
    RatioInterval
  >;
  /** CPU time with checksums over without (paired): all checksum work, wherever it ran. */
  readonly checksumCpuCost: Record<"shm" | "tcp", RatioInterval>;
  /** Hash throughput over the same pages, GB/s medians. */
  readonly hashGbps: { readonly nativeXxh64: Summary; readonly wasmH64Raw: Summary };
  readonly failures: readonly string[];
  /** 1-minute load average at the start and the end, and the CPU count: how shared the machine was. */
  readonly load: MachineLoad;
}

/** The committed test certificates (scripts/make-test-certs.sh), for the tcp+tls path. */
export function defaultBenchTlsFiles(): TlsFiles {
  const dir = join(packageRoot(), "testing", "fixtures", "tls");
  return { cert: join(dir, "node.crt"), key: join(dir, "node.key"), ca: join(dir, "ca.crt") };
}

export async function runTransferBench(options: TransferBenchOptions = {}): Promise<TransferBenchResult> {
  const numPages = options.pages ?? 256;
  const reps = options.reps ?? 31;
  const signalBytes = options.signalBytes ?? 1 << 20;
  const chunkPages = options.chunkPages ?? 16;
  const withTls = options.paths === undefined || options.paths.includes("tcp+tls");
  const loadStart = loadAverage();
  const rig = await TransferRig.start({
    layout: options.layout ?? SMOLLM2_LAYOUT,
    numPages,
    signalBytes,
    chunkPages,
    directReads: options.directReads !== false,
    tlsFiles: withTls ? (options.tlsFiles ?? defaultBenchTlsFiles()) : undefined,
  });
  const selected = PATHS.filter((p) => options.paths === undefined || options.paths.includes(p));
  const { times, cpus, hashNs } = await measure(rig, {
    selected,
    reps,
    warmup: options.warmup ?? 1,
    log: options.log,
  });
  await rig.close();

  const bytes = rig.bytes;
  const result = (path: PathName): PathResult => {
    const ns = times[path];
    return {
      ms: summarize(ns.map((t) => t / 1e6)),
      cpuMs: summarize(cpus[path]),
      gbps: summarize(ns.map((t) => bytes / t)),
      pagesPerSecond: numPages / (summarize(ns).median / 1e9),
    };
  };
  return {
    pages: numPages,
    pageBytes: rig.pageBytes,
    bytes,
    reps,
    signalBytes,
    chunkPages,
    paths: Object.fromEntries(PATHS.map((p) => [p, result(p)])) as Record<PathName, PathResult>,
    shmOverMemcpy: pairedRatio(times.memcpy, times.shm),
    tcpOverRaw: pairedRatio(times["raw-tcp"], times.tcp),
    tlsOverTcp: pairedRatio(times.tcp, times["tcp+tls"]),
    tlsOverRaw: pairedRatio(times["raw-tcp"], times["tcp+tls"]),
    tlsCpuCost: pairedRatio(cpus["tcp+tls"], cpus.tcp),
    checksumCost: {
      shmVerify: pairedRatio(times["shm+verify"], times.shm),
      shmOndemand: pairedRatio(times["shm+ondemand"], times.shm),
      tcpVerify: pairedRatio(times["tcp+verify"], times.tcp),
      tcpOndemand: pairedRatio(times["tcp+ondemand"], times.tcp),
      tcpVerifyWorker: pairedRatio(times["tcp+verify-worker"], times.tcp),
    },
    checksumCpuCost: {
      shm: pairedRatio(cpus["shm+verify"], cpus.shm),
      tcp: pairedRatio(cpus["tcp+verify"], cpus.tcp),
    },
    hashGbps: {
      nativeXxh64: summarize(hashNs.native.map((t) => bytes / t)),
      wasmH64Raw: summarize(hashNs.wasm.map((t) => bytes / t)),
    },
    failures: rig.failures,
    load: machineLoad(loadStart),
  };
}

/**
 * The interleaved repetitions: each rep runs every selected path (the order rotates each rep) and
 * hashes the pool with both xxhash64s; warm-up reps are run and dropped.
 */
async function measure(
  rig: TransferRig,
  run: {
    readonly selected: readonly PathName[];
    readonly reps: number;
    readonly warmup: number;
    readonly log: ((line: string) => void) | undefined;
  },
) {
  const { selected, reps, warmup } = run;
  const log = run.log ?? (() => {});
  const wasm = await xxhashWasm();
  const { pool, pageBytes } = rig;
  const numPages = pool.length / pageBytes;
  const hashPass = (fn: (page: Uint8Array, seed: bigint) => bigint): number => {
    const t0 = now();
    for (let i = 0; i < numPages; i++) fn(pool.subarray(i * pageBytes, (i + 1) * pageBytes), BigInt(i));
    return Number(now() - t0);
  };
  const times = Object.fromEntries(PATHS.map((p) => [p, [] as number[]])) as Record<PathName, number[]>;
  const cpus = Object.fromEntries(PATHS.map((p) => [p, [] as number[]])) as Record<PathName, number[]>;
  const hashNs = { native: [] as number[], wasm: [] as number[] };
  for (let rep = -warmup; rep < reps; rep++) {
    const order = selected.map((_, i) => selected[(i + Math.max(rep, 0)) % selected.length]!);
    for (const path of order) {
      const cpu0 = process.cpuUsage();
      const ns = await rig.run(path);
      const cpu = process.cpuUsage(cpu0);
      if (rep >= 0) {
        times[path].push(ns);
        cpus[path].push((cpu.user + cpu.system) / 1000);
      }
    }
    const native = hashPass((p, s) => xxh64(p, s));
    const wasmNs = hashPass((p, s) => wasm.h64Raw(p, s));
    if (rep >= 0) {
      hashNs.native.push(native);
      hashNs.wasm.push(wasmNs);
      log(
        `rep ${rep + 1}/${reps}: ${selected.map((p) => `${p} ${(rig.bytes / times[p].at(-1)!).toFixed(2)}`).join(", ")} GB/s`,
      );
    }
  }
  return { times, cpus, hashNs };
}

function fmtRatio(r: RatioInterval, asPercent: boolean): string {
  if (Number.isNaN(r.ratio)) return "not run (add both paths to --paths)";
  const f = (x: number): string => (asPercent ? `${(x * 100).toFixed(0)}%` : x.toFixed(3));
  return `${f(r.ratio)} [95% CI ${f(r.low)}–${f(r.high)}]`;
}

/** The human-readable report of a run. */
export function formatTransferReport(r: TransferBenchResult): string {
  const lines: string[] = [];
  lines.push(
    `KV transfer: ${r.pages} pages × ${(r.pageBytes / 1024).toFixed(0)} KiB = ${(r.bytes / 1e6).toFixed(1)} MB per transfer, ` +
      `${r.reps} interleaved reps, ${r.chunkPages} pages per write call, shm signal every ${(r.signalBytes / 1024).toFixed(0)} KiB`,
  );
  lines.push(describeLoad(r.load));
  lines.push("path               median ms   GB/s median [min–max]     pages/s   CPU ms (all threads)");
  for (const p of PATHS) {
    const x = r.paths[p];
    if (x.ms.n === 0) continue;
    const gbps = `${x.gbps.median.toFixed(2).padStart(5)} [${x.gbps.min.toFixed(2)}–${x.gbps.max.toFixed(2)}]`;
    lines.push(
      `${p.padEnd(18)} ${x.ms.median.toFixed(2).padStart(9)}   ${gbps.padEnd(23)} ${String(Math.round(x.pagesPerSecond)).padEnd(9)} ${x.cpuMs.median.toFixed(1)}`,
    );
  }
  lines.push(`shm throughput / memcpy:      ${fmtRatio(r.shmOverMemcpy, true)}  (target ≥ 80%)`);
  lines.push(`tcp throughput / raw socket:  ${fmtRatio(r.tcpOverRaw, true)}  (target ≥ 70%)`);
  lines.push(`tcp+tls throughput / tcp:     ${fmtRatio(r.tlsOverTcp, true)}`);
  lines.push(`tcp+tls throughput / raw:     ${fmtRatio(r.tlsOverRaw, true)}`);
  lines.push(`tcp+tls CPU time / tcp:       ${fmtRatio(r.tlsCpuCost, false)}`);
  lines.push("checksum cost, time with / without (target ≤ 1.10):");
  lines.push(`  shm, serving path (production/landed): ${fmtRatio(r.checksumCost.shmVerify, false)}`);
  lines.push(`  shm, on demand (in series):            ${fmtRatio(r.checksumCost.shmOndemand, false)}`);
  lines.push(`  tcp, serving path (production/landed): ${fmtRatio(r.checksumCost.tcpVerify, false)}`);
  lines.push(`  tcp, on demand (in series):            ${fmtRatio(r.checksumCost.tcpOndemand, false)}`);
  lines.push(`  tcp, verify on a decode worker:        ${fmtRatio(r.checksumCost.tcpVerifyWorker, false)}`);
  lines.push("checksum CPU cost (hash at production + verify), CPU time with / without:");
  lines.push(
    `  shm ${fmtRatio(r.checksumCpuCost.shm, false)}, tcp ${fmtRatio(r.checksumCpuCost.tcp, false)}`,
  );
  const h = r.hashGbps;
  lines.push(
    `xxhash64 per page: native ${h.nativeXxh64.median.toFixed(1)} GB/s [${h.nativeXxh64.min.toFixed(1)}–${h.nativeXxh64.max.toFixed(1)}], ` +
      `wasm h64Raw ${h.wasmH64Raw.median.toFixed(1)} GB/s [${h.wasmH64Raw.min.toFixed(1)}–${h.wasmH64Raw.max.toFixed(1)}]`,
  );
  if (r.failures.length > 0) lines.push(`FAILURES: ${r.failures.join("; ")}`);
  return lines.join("\n");
}

interface TransferCliOptions {
  pages: number;
  reps: number;
  warmup: number;
  signalKib: number;
  chunkPages: number;
  paths?: PathName[];
  directReads: boolean;
  json?: boolean;
  kvCacheDtype: string;
  tlsCert?: string;
  tlsKey?: string;
  tlsCa?: string;
}

function pathList(value: string): PathName[] {
  const paths = value.split(",").map((p) => p.trim());
  const unknown = paths.filter((p) => !(PATHS as readonly string[]).includes(p));
  if (unknown.length > 0) {
    throw new InvalidArgumentError(`Unknown path; use ${PATHS.join(", ")}: ${unknown.join(",")}`);
  }
  return paths as PathName[];
}

/** `kvfence bench transfer`. */
export function transferCommand(): Command {
  return new Command("transfer")
    .description("KV transfer bandwidth of the shared-memory and TCP transports vs memcpy and a raw socket")
    .option(
      "--pages <n>",
      "pages per transfer (256 = a 4,096-token SmolLM2-135M sequence)",
      positiveInt("--pages"),
      256,
    )
    .option(
      "--reps <n>",
      "measured repetitions of each path (interleaved; more narrow the CIs)",
      positiveInt("--reps"),
      31,
    )
    .option("--warmup <n>", "warm-up repetitions", positiveInt("--warmup"), 1)
    .option(
      "--chunk-pages <n>",
      "pages per writePages call (a prefill chunk)",
      positiveInt("--chunk-pages"),
      16,
    )
    .option(
      "--signal-kib <n>",
      "shared-memory completion signal batch, KiB",
      positiveInt("--signal-kib"),
      1024,
    )
    .option("--paths <list>", `comma-separated subset of: ${PATHS.join(",")}`, pathList)
    .option(
      "--kv-cache-dtype <dtype>",
      "KV page element type: f32, f16 or bf16 (SmolLM2-135M pages of 720 or 360 KiB)",
      DEFAULT_KV_CACHE_DTYPE,
    )
    .option("--no-direct-reads", "TCP receiver copies page bodies through its receive buffer")
    .option("--tls-cert <file>", "tcp+tls: certificate of both ends (default testing/fixtures/tls/node.crt)")
    .option("--tls-key <file>", "tcp+tls: its private key (default testing/fixtures/tls/node.key)")
    .option("--tls-ca <file>", "tcp+tls: the CA both ends trust (default testing/fixtures/tls/ca.crt)")
    .option("--json", "print the result as JSON")
    .action((o: TransferCliOptions) =>
      runBenchCli(
        "transfer",
        o.json,
        (log) => {
          if (!isKvDtype(o.kvCacheDtype))
            throw new Error(`--kv-cache-dtype must be f32, f16 or bf16: ${o.kvCacheDtype}`);
          return runTransferBench({
            layout: { ...SMOLLM2_LAYOUT, dtype: o.kvCacheDtype },
            pages: o.pages,
            reps: o.reps,
            warmup: o.warmup,
            signalBytes: o.signalKib * 1024,
            chunkPages: o.chunkPages,
            directReads: o.directReads,
            tlsFiles: {
              cert: o.tlsCert ?? defaultBenchTlsFiles().cert,
              key: o.tlsKey ?? defaultBenchTlsFiles().key,
              ca: o.tlsCa ?? defaultBenchTlsFiles().ca,
            },
            ...(o.paths === undefined ? {} : { paths: o.paths }),
            log,
          });
        },
        formatTransferReport,
      ),
    );
}

if (import.meta.url === `file://${process.argv[1]}`) await transferCommand().parseAsync(process.argv);
