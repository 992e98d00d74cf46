/**
 * `kvfence bench serve BASE_URL`: a serving benchmark against any OpenAI-compatible server, with a
 * contamination check (docs/benchmarks.md §6).
 *
 * The load generator sends a dataset (src/tools/bench/serve-datasets.ts) as streamed chat or
 * completion requests, either all at once or in Poisson arrivals at an offered rate (exponential
 * gaps from the seed, scaled so the last request arrives at n / rate, as vLLM does), optionally
 * under a cap on requests in flight (`--max-concurrency`); a list of rates runs one after the other
 * (a sweep) over the same dataset. A turn of a multi-turn session is sent at its arrival time or
 * when the session's previous turn has been answered, whichever is later. Each request is timed by
 * src/tools/bench/serve-client.ts; the figures are src/tools/bench/serve-report.ts's, the page of
 * charts src/tools/bench/serve-plot.ts's.
 *
 * Every request plants a nonce (a record with a code unique in the run); after the run every
 * response is searched for the codes of the others (the probe's `CanaryIndex`,
 * src/tools/probe/canary.ts). A response holding another request's code is contamination: the
 * failure of the incident kvfence answers (docs/incident.md), invisible in latency and status.
 * The command exits 1 when any response was contaminated.
 */
import { writeFileSync } from "node:fs";
import { Command, InvalidArgumentError, Option } from "commander";
import { KvfenceError } from "../../lib/errors.js";
import { CanaryIndex, Rng } from "../probe/canary.js";
import { normalizeBaseUrl } from "../probe/probe.js";
import { positiveInteger } from "./bench-cli.js";
import { type ServeEndpoint, type StreamOutcome, streamRequest } from "./serve-client.js";
import {
  buildDataset,
  DATASET_NAMES,
  type Dataset,
  type DatasetName,
  type NonceStyle,
  nonceTag,
} from "./serve-datasets.js";
import { renderServePlot } from "./serve-plot.js";
import {
  formatRun,
  formatSweep,
  type RequestRecord,
  type ServeRunResult,
  type Slo,
  summarizeRun,
} from "./serve-report.js";

export const SERVE_ENDPOINTS: readonly ServeEndpoint[] = ["/v1/chat/completions", "/v1/completions"];

export interface ServeBenchOptions {
  /** Server base URL, with or without `/v1`. */
  readonly baseUrl: string;
  readonly endpoint?: ServeEndpoint;
  readonly apiKey?: string;
  /** Model id; default the first of /v1/models. */
  readonly model?: string;
  readonly datasetName?: DatasetName;
  readonly datasetPath?: string;
  readonly numPrompts?: number;
  readonly inputLen?: number;
  readonly outputLen?: number;
  readonly rangeRatio?: number;
  readonly prefixGroups?: number;
  readonly prefixLen?: number;
  readonly turns?: number;
  readonly sharegptOutputLen?: number;
  /** max_tokens of every request, over the dataset's output lengths. */
  readonly maxTokens?: number;
  /** Offered rates in requests/s, run in turn; Infinity sends every request at once. */
  readonly requestRates?: readonly number[];
  readonly maxConcurrency?: number | null;
  readonly seed?: number;
  readonly temperature?: number;
  /** Send `ignore_eos: true` (vLLM, SGLang and kvfence honour it: every request runs to max_tokens). */
  readonly ignoreEos?: boolean;
  readonly slo?: Slo | null;
  /** `ask` (the prompt asks for its nonce back), `plant`, or `auto`: ask of kvfence-tiny only. */
  readonly nonce?: NonceStyle | "auto";
  /** Characters per token to size prompts; `auto`: 1 for kvfence-tiny (byte tokens), else 4. */
  readonly charsPerToken?: number | "auto";
  readonly timeoutMs?: number;
  /** Send one short request first, outside the figures, and stop if it fails (default true). */
  readonly warmup?: boolean;
  /** Progress (a bar on a TTY, periodic lines otherwise); null for none. */
  readonly progress?: ProgressSink | null;
  /** Notes for the operator (model, dataset notes). */
  readonly log?: (line: string) => void;
}

export const SERVE_BENCH_DEFAULTS = Object.freeze({
  endpoint: "/v1/chat/completions" as ServeEndpoint,
  datasetName: "random" as DatasetName,
  numPrompts: 100,
  inputLen: 256,
  outputLen: 128,
  rangeRatio: 0,
  prefixGroups: 4,
  prefixLen: 512,
  turns: 3,
  requestRates: [Number.POSITIVE_INFINITY] as readonly number[],
  seed: 0,
  temperature: 0,
  timeoutMs: 600_000,
});

export interface ServeBenchReport {
  readonly model: string;
  readonly runs: readonly ServeRunResult[];
}

export async function runServeBench(options: ServeBenchOptions): Promise<ServeBenchReport> {
  const d = SERVE_BENCH_DEFAULTS;
  const baseUrl = normalizeBaseUrl(options.baseUrl);
  const endpoint = options.endpoint ?? d.endpoint;
  const log = options.log ?? (() => {});
  const model = options.model ?? (await firstModel(baseUrl, options.apiKey));
  const { nonce, charsPerToken } = promptStyle(options, model);
  const seed = options.seed ?? d.seed;
  const datasetName = options.datasetName ?? d.datasetName;
  const dataset = datasetOf(options, { name: datasetName, seed, nonce, charsPerToken });
  for (const note of dataset.notes) log(note);
  log(
    `bench serve: model ${model}, ${datasetName} dataset, ${dataset.order.length} requests, nonce style ${nonce}, ${charsPerToken} chars/token`,
  );
  const canaries = plantedCanaries(dataset);
  const ctx: RunContext = {
    baseUrl,
    endpoint,
    apiKey: options.apiKey,
    model,
    dataset,
    maxTokens: options.maxTokens,
    temperature: options.temperature ?? d.temperature,
    ignoreEos: options.ignoreEos === true,
    timeoutMs: options.timeoutMs ?? d.timeoutMs,
    charsPerToken,
  };
  if (options.warmup !== false) await warmUp(ctx, nonce);
  const runs: ServeRunResult[] = [];
  const rates = options.requestRates ?? d.requestRates;
  for (const [i, rate] of rates.entries()) {
    const label =
      rates.length > 1 ? `rate ${formatRate(rate)} (${i + 1}/${rates.length})` : `rate ${formatRate(rate)}`;
    const bar =
      options.progress === null
        ? null
        : new ProgressBar(options.progress ?? process.stderr, label, dataset.order.length);
    const started = new Date();
    const { records, durationS } = await runOnce(ctx, rate, options.maxConcurrency ?? null, seed, bar);
    bar?.finish();
    runs.push(
      summarizeRun(
        records,
        durationS,
        {
          date: started,
          endpoint,
          modelId: model,
          baseUrl,
          requestRate: rate,
          maxConcurrency: options.maxConcurrency ?? null,
          datasetName,
          seed,
          slo: options.slo ?? null,
          nonceStyle: nonce,
        },
        canaries,
      ),
    );
  }
  return { model, runs };
}

/** The nonce style and the characters per token: as given, or by the model (`auto`: kvfence-tiny's). */
function promptStyle(
  options: ServeBenchOptions,
  model: string,
): { nonce: NonceStyle; charsPerToken: number } {
  const tiny = /kvfence-tiny/i.test(model);
  const nonce =
    options.nonce === undefined || options.nonce === "auto" ? (tiny ? "ask" : "plant") : options.nonce;
  const charsPerToken =
    options.charsPerToken === undefined || options.charsPerToken === "auto"
      ? tiny
        ? 1
        : 4
      : options.charsPerToken;
  return { nonce, charsPerToken };
}

/** The dataset the options ask for, their defaults filled in. */
function datasetOf(
  options: ServeBenchOptions,
  how: { name: DatasetName; seed: number; nonce: NonceStyle; charsPerToken: number },
): Dataset {
  const d = SERVE_BENCH_DEFAULTS;
  return buildDataset({
    ...how,
    numPrompts: options.numPrompts ?? d.numPrompts,
    inputLen: options.inputLen ?? d.inputLen,
    outputLen: options.outputLen ?? d.outputLen,
    rangeRatio: options.rangeRatio ?? d.rangeRatio,
    prefixGroups: options.prefixGroups ?? d.prefixGroups,
    prefixLen: options.prefixLen ?? d.prefixLen,
    turns: options.turns ?? d.turns,
    ...(options.datasetPath === undefined ? {} : { datasetPath: options.datasetPath }),
    ...(options.sharegptOutputLen === undefined ? {} : { sharegptOutputLen: options.sharegptOutputLen }),
  });
}

/** Every request's nonce in one index, and which request (its place in the order) planted each code. */
function plantedCanaries(dataset: Dataset): { index: CanaryIndex; plantedBy: Map<string, number> } {
  const index = new CanaryIndex();
  const plantedBy = new Map<string, number>();
  dataset.order.forEach(({ session, turn }, j) => {
    const n = dataset.sessions[session]!.turns[turn]!.nonce;
    index.add(n);
    plantedBy.set(n.code, j);
  });
  return { index, plantedBy };
}

/**
 * One short request first, outside the figures (the first request's nonce alone, 16 tokens at most),
 * so a wrong URL, model, key or field fails at once.
 */
async function warmUp(ctx: RunContext, nonce: NonceStyle): Promise<void> {
  const { dataset, baseUrl, endpoint } = ctx;
  const first = dataset.order[0];
  if (first === undefined) return;
  const tag = nonceTag(dataset.sessions[first.session]!.turns[first.turn]!.nonce, nonce);
  const outcome = await streamRequest({
    baseUrl,
    endpoint,
    apiKey: ctx.apiKey,
    body: requestBody(ctx, [{ role: "user", content: tag }], 16),
    timeoutMs: ctx.timeoutMs,
  });
  if (!outcome.ok) {
    throw new KvfenceError(
      outcome.status === 401
        ? "invalid_api_key"
        : outcome.status >= 400 && outcome.status < 500
          ? "invalid_request"
          : "node_unavailable",
      `The first request to ${baseUrl}${endpoint} failed, so the benchmark did not start (check --endpoint, --model, --api-key): ${outcome.error}`,
    );
  }
}

/** What one run's requests share (the server, the dataset, the sampling); `sendTurn` takes it. */
export interface RunContext {
  readonly baseUrl: string;
  readonly endpoint: ServeEndpoint;
  readonly apiKey: string | undefined;
  readonly model: string;
  readonly dataset: Dataset;
  readonly maxTokens: number | undefined;
  readonly temperature: number;
  readonly ignoreEos: boolean;
  readonly timeoutMs: number;
  readonly charsPerToken: number;
}

/** Poisson arrival times in seconds (all 0 for an infinite rate), the last one at n / rate. */
export function arrivalTimes(n: number, rate: number, rng: Rng): number[] {
  if (!Number.isFinite(rate)) return new Array<number>(n).fill(0);
  const out: number[] = [];
  let t = 0;
  for (let i = 0; i < n; i++) {
    t += -Math.log(1 - rng.next()) / rate;
    out.push(t);
  }
  const scale = n > 0 ? n / rate / out[n - 1]! : 1;
  return out.map((v) => v * scale);
}

async function runOnce(
  ctx: RunContext,
  rate: number,
  maxConcurrency: number | null,
  seed: number,
  bar: ProgressBar | null,
): Promise<{ records: RequestRecord[]; durationS: number }> {
  const { dataset } = ctx;
  const arrivals = arrivalTimes(dataset.order.length, rate, new Rng(seed + 0x9e37));
  const replies = dataset.sessions.map((s) => s.turns.map(() => ""));
  const answered = dataset.sessions.map((s) => s.turns.map(() => deferred()));
  const slots = new Slots(maxConcurrency ?? Number.POSITIVE_INFINITY);
  const records: RequestRecord[] = new Array(dataset.order.length);
  const t0 = performance.now();
  await Promise.all(
    dataset.order.map(async ({ session, turn }, j) => {
      const wait = t0 + arrivals[j]! * 1000 - performance.now();
      if (wait > 0) await new Promise((r) => setTimeout(r, wait));
      if (turn > 0) await answered[session]![turn - 1]!.promise;
      await slots.acquire();
      try {
        const { outcome, promptText } = await sendTurn(ctx, session, turn, replies);
        replies[session]![turn] = outcome.text;
        records[j] = toRecord(ctx, j, session, turn, t0, outcome, promptText);
      } finally {
        slots.release();
        answered[session]![turn]!.resolve();
        bar?.tick();
      }
    }),
  );
  return { records, durationS: (performance.now() - t0) / 1000 };
}

/** Send turn `turn` of a session with the history so far (earlier turns and their answers). */
export async function sendTurn(
  ctx: RunContext,
  session: number,
  turn: number,
  replies: readonly (readonly string[])[],
): Promise<{ outcome: StreamOutcome; promptText: string }> {
  const turns = ctx.dataset.sessions[session]!.turns;
  const messages: Array<{ role: "user" | "assistant"; content: string }> = [];
  for (let k = 0; k <= turn; k++) {
    const t = turns[k]!;
    messages.push({ role: "user", content: k === 0 ? `${t.prefix}${t.content}` : t.content });
    if (k < turn) messages.push({ role: "assistant", content: replies[session]?.[k] ?? "" });
  }
  const outcome = await streamRequest({
    baseUrl: ctx.baseUrl,
    endpoint: ctx.endpoint,
    apiKey: ctx.apiKey,
    body: requestBody(ctx, messages, ctx.maxTokens ?? turns[turn]!.outputLen),
    timeoutMs: ctx.timeoutMs,
  });
  return { outcome, promptText: promptTextOf(messages) };
}

/** The text a request sends: its messages' contents, one per line (the completions prompt). */
function promptTextOf(messages: ReadonlyArray<{ content: string }>): string {
  return messages.map((m) => m.content).join("\n");
}

/** A chat body with these messages, or a completions body with their text as the prompt. */
function requestBody(
  ctx: RunContext,
  messages: ReadonlyArray<{ role: string; content: string }>,
  maxTokens: number,
): Record<string, unknown> {
  const common = {
    model: ctx.model,
    max_tokens: maxTokens,
    temperature: ctx.temperature,
    ...(ctx.ignoreEos ? { ignore_eos: true } : {}),
  };
  return ctx.endpoint === "/v1/completions"
    ? { ...common, prompt: promptTextOf(messages) }
    : { ...common, messages };
}

function toRecord(
  ctx: RunContext,
  index: number,
  session: number,
  turn: number,
  t0: number,
  o: StreamOutcome,
  promptText: string,
): RequestRecord {
  const first = o.tokenTimes[0] ?? o.firstChoiceAt ?? o.endAt;
  const itl: number[] = [];
  for (let i = 1; i < o.tokenTimes.length; i++) itl.push((o.tokenTimes[i]! - o.tokenTimes[i - 1]!) / 1000);
  return {
    index,
    session,
    turn,
    startTime: (o.sentAt - t0) / 1000,
    success: o.ok,
    error: o.error ?? "",
    ttft: (first - o.sentAt) / 1000,
    itl,
    latency: (o.endAt - o.sentAt) / 1000,
    promptLen: o.promptTokens ?? Math.round(promptText.length / ctx.charsPerToken),
    outputLen: o.ok ? (o.completionTokens ?? o.tokenTimes.length) : 0,
    usageReported: o.completionTokens !== null,
    generatedText: o.text,
    promptText,
    nonceCode: ctx.dataset.sessions[session]!.turns[turn]!.nonce.code,
  };
}

async function firstModel(baseUrl: string, apiKey: string | undefined): Promise<string> {
  let res: Response;
  try {
    res = await fetch(`${baseUrl}/v1/models`, {
      headers: apiKey === undefined ? {} : { authorization: `Bearer ${apiKey}` },
      signal: AbortSignal.timeout(30_000),
    });
  } catch (err) {
    throw new KvfenceError(
      "node_unavailable",
      `Cannot reach the server (${(err as Error).message}): ${baseUrl}`,
    );
  }
  const body = (await res.json().catch(() => null)) as { data?: Array<{ id?: unknown }> } | null;
  const id = body?.data?.[0]?.id;
  if (res.status !== 200 || typeof id !== "string") {
    throw new KvfenceError(
      res.status === 401 ? "invalid_api_key" : res.status >= 500 ? "node_unavailable" : "model_not_found",
      `GET ${baseUrl}/v1/models gave no model (HTTP ${res.status}); pass --model, or --api-key if the server needs one`,
    );
  }
  return id;
}

function deferred(): { promise: Promise<void>; resolve: () => void } {
  let resolve = () => {};
  const promise = new Promise<void>((r) => {
    resolve = r;
  });
  return { promise, resolve };
}

/** At most `limit` holders at once; waiters are served in arrival order. */
class Slots {
  readonly #limit: number;
  #held = 0;
  readonly #waiting: Array<() => void> = [];

  constructor(limit: number) {
    this.#limit = limit;
  }

  async acquire(): Promise<void> {
    if (this.#held < this.#limit) {
      this.#held++;
      return;
    }
    await new Promise<void>((r) => this.#waiting.push(r));
  }

  release(): void {
    const next = this.#waiting.shift();
    if (next === undefined) this.#held--;
    else next();
  }
}

/** Where progress goes: a terminal gets a redrawn bar, anything else a line per tenth of the run. */
export interface ProgressSink {
  write(text: string): unknown;
  readonly isTTY?: boolean;
}

/** The progress of one run on stderr (hand-written: one line, no dependency, plain lines off a TTY). */
export class ProgressBar {
  readonly #sink: ProgressSink;
  readonly #label: string;
  readonly #total: number;
  readonly #started = performance.now();
  #done = 0;
  #drawnAt = 0;
  #lastLine = 0;

  constructor(sink: ProgressSink, label: string, total: number) {
    this.#sink = sink;
    this.#label = label;
    this.#total = total;
    if (sink.isTTY === true) this.#draw();
  }

  tick(): void {
    this.#done++;
    const now = performance.now();
    if (this.#sink.isTTY === true) {
      if (now - this.#drawnAt >= 100 || this.#done === this.#total) this.#draw();
      return;
    }
    const step = Math.max(1, Math.ceil(this.#total / 10));
    if (this.#done % step === 0 || this.#done === this.#total || now - this.#lastLine >= 5000) {
      this.#lastLine = now;
      this.#sink.write(`${this.#label}: ${this.#done}/${this.#total} requests done (${this.#seconds()} s)\n`);
    }
  }

  finish(): void {
    if (this.#sink.isTTY === true) {
      this.#draw();
      this.#sink.write("\n");
    }
  }

  #draw(): void {
    this.#drawnAt = performance.now();
    const width = 30;
    const full = this.#total === 0 ? width : Math.round((this.#done / this.#total) * width);
    const bar = `${"█".repeat(full)}${"░".repeat(width - full)}`;
    this.#sink.write(`\r${this.#label} ${bar} ${this.#done}/${this.#total} ${this.#seconds()} s`);
  }

  #seconds(): string {
    return ((performance.now() - this.#started) / 1000).toFixed(1);
  }
}

export function formatRate(rate: number): string {
  return Number.isFinite(rate) ? String(rate) : "inf";
}

// ---- the command ----

function nonNegativeNumber(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n) || n < 0) {
    throw new InvalidArgumentError(`Expected a number ≥ 0: ${value}`);
  }
  return n;
}

/** `inf`, a positive number, or a comma-separated list of them. */
export function parseRates(value: string): number[] {
  const rates = value.split(",").map((v) => {
    const t = v.trim();
    if (t === "inf") return Number.POSITIVE_INFINITY;
    const n = Number(t);
    if (t === "" || !Number.isFinite(n) || n <= 0) {
      throw new InvalidArgumentError(`Expected inf or a rate > 0 in requests/s (a list: 1,2,4): ${value}`);
    }
    return n;
  });
  return rates;
}

/** `ttft=MS,tpot=MS[,e2el=MS]`: each bound in milliseconds. */
export function parseSlo(value: string): Slo {
  const slo: Record<string, number> = {};
  for (const part of value.split(",")) {
    const [key, ms, extra] = part.split("=").map((s) => s.trim());
    const n = Number(ms);
    if (
      (key !== "ttft" && key !== "tpot" && key !== "e2el") ||
      extra !== undefined ||
      ms === undefined ||
      ms === "" ||
      !Number.isFinite(n) ||
      n < 0
    ) {
      throw new InvalidArgumentError(
        `Expected ttft=MS,tpot=MS[,e2el=MS] (milliseconds, each of ttft, tpot, e2el at most once): ${value}`,
      );
    }
    if (key in slo) throw new InvalidArgumentError(`${key} is given twice: ${value}`);
    slo[key] = n;
  }
  return slo as Slo;
}

interface ServeCliOptions {
  endpoint: ServeEndpoint;
  apiKey?: string;
  model?: string;
  datasetName: DatasetName;
  datasetPath?: string;
  numPrompts: number;
  randomInputLen: number;
  randomOutputLen: number;
  randomRangeRatio: number;
  prefixGroups: number;
  prefixLen: number;
  turns: number;
  sharegptOutputLen?: number;
  maxTokens?: number;
  requestRate: number[];
  maxConcurrency?: number;
  seed: number;
  temperature: number;
  ignoreEos?: boolean;
  slo?: Slo;
  nonce: NonceStyle | "auto";
  charsPerToken: number | "auto";
  requestTimeout: number;
  saveResult?: string;
  plot?: string;
  progress: boolean;
  warmup: boolean;
}

export function serveCommand(): Command {
  const command = new Command("serve")
    .description(
      "Serving benchmark against any OpenAI-compatible server: TTFT, TPOT, ITL, end-to-end latency, throughput and goodput at a request rate or concurrency, and the responses that hold another request's nonce (exit 1 if any)",
    )
    .argument("<base-url>", "server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)");
  withLoadOptions(withDatasetOptions(withTargetOptions(command)));
  return command.action(runServeCli);
}

/** The server's options: the endpoint, the key, the model. */
function withTargetOptions(command: Command): Command {
  const d = SERVE_BENCH_DEFAULTS;
  return command
    .addOption(
      new Option("--endpoint <path>", "streamed chat or completions")
        .choices(SERVE_ENDPOINTS)
        .default(d.endpoint),
    )
    .option("--api-key <key>", "bearer token (default: env OPENAI_API_KEY)")
    .option("--model <id>", "model id (default: the first of /v1/models)");
}

/** The workload's options: the dataset, its lengths, max_tokens. */
function withDatasetOptions(command: Command): Command {
  const d = SERVE_BENCH_DEFAULTS;
  return command
    .addOption(
      new Option("--dataset-name <name>", "the workload").choices(DATASET_NAMES).default(d.datasetName),
    )
    .option("--dataset-path <file>", "sharegpt: a JSON array or JSON lines of ShareGPT conversations")
    .option(
      "--num-prompts <n>",
      "requests per rate (multi-turn: turns over all sessions)",
      positiveInteger,
      d.numPrompts,
    )
    .option(
      "--random-input-len <n>",
      "prompt tokens (random; shared-prefix suffix; each multi-turn turn)",
      positiveInteger,
      d.inputLen,
    )
    .option(
      "--random-output-len <n>",
      "max_tokens of a request (random, shared-prefix, multi-turn)",
      positiveInteger,
      d.outputLen,
    )
    .option("--random-range-ratio <r>", "lengths uniform on [len·(1−r), len·(1+r)]", rangeRatio, d.rangeRatio)
    .option(
      "--prefix-groups <n>",
      "shared-prefix: groups sharing one prefix",
      positiveInteger,
      d.prefixGroups,
    )
    .option("--prefix-len <n>", "shared-prefix: tokens of each group's prefix", positiveInteger, d.prefixLen)
    .option("--turns <n>", "multi-turn: turns per session", positiveInteger, d.turns)
    .option(
      "--sharegpt-output-len <n>",
      "sharegpt: max_tokens of every request (default: the gpt turn's length)",
      positiveInteger,
    )
    .option(
      "--max-tokens <n>",
      "max_tokens of every request, over the dataset's output lengths",
      positiveInteger,
    );
}

/** The load's and the output's options: rates, concurrency, sampling, SLOs, nonces, files, progress. */
function withLoadOptions(command: Command): Command {
  const d = SERVE_BENCH_DEFAULTS;
  return command
    .option(
      "--request-rate <rates>",
      "offered requests/s: inf (all at once), a number, or a sweep 1,2,4",
      parseRates,
      [...d.requestRates],
    )
    .option(
      "--max-concurrency <n>",
      "most requests in flight at once (with rate inf: fixed concurrency)",
      positiveInteger,
    )
    .option(
      "--seed <n>",
      "seed of the dataset, the nonces and the arrivals",
      (v) => (v.trim() === "0" ? 0 : positiveInteger(v)),
      d.seed,
    )
    .option("--temperature <t>", "sampling temperature (0 = greedy)", nonNegativeNumber, d.temperature)
    .option("--ignore-eos", "send ignore_eos: true (every request runs to max_tokens)")
    .option("--slo <bounds>", "goodput SLOs in ms: ttft=MS,tpot=MS[,e2el=MS]", parseSlo)
    .addOption(
      new Option(
        "--nonce <style>",
        "ask: the prompt asks for its nonce back; plant: no question; auto: ask of kvfence-tiny",
      )
        .choices(["auto", "ask", "plant"])
        .default("auto"),
    )
    .option(
      "--chars-per-token <x>",
      "characters per token, to size prompts (auto: 1 for kvfence-tiny, else 4)",
      (v) => (v === "auto" ? "auto" : positiveNumber(v)),
      "auto",
    )
    .option("--request-timeout <seconds>", "per-request timeout", positiveInteger, d.timeoutMs / 1000)
    .option("--save-result <file>", "write the result JSON (vLLM's field names; a sweep writes an array)")
    .option("--plot <file>", "write a self-contained HTML page of the latency distributions and the sweep")
    .option("--no-progress", "no progress bar on stderr")
    .option("--no-warmup", "skip the short first request that checks the endpoint before the figures");
}

/** The command's action: run, print, write the files asked for; exit 1 on contamination, 2 on refusal. */
async function runServeCli(baseUrl: string, opts: ServeCliOptions): Promise<void> {
  try {
    const report = await runServeBench(serveBenchOptions(baseUrl, opts));
    for (const run of report.runs) process.stdout.write(`${formatRun(run)}\n`);
    if (report.runs.length > 1) process.stdout.write(`\n${formatSweep(report.runs)}\n`);
    if (opts.saveResult !== undefined) {
      const json = report.runs.length === 1 ? report.runs[0] : report.runs;
      writeFileSync(opts.saveResult, `${JSON.stringify(json, null, 2)}\n`);
    }
    if (opts.plot !== undefined) writeFileSync(opts.plot, renderServePlot(report.runs));
    const contaminated = report.runs.reduce((n, r) => n + r.contamination.contaminated_responses, 0);
    if (contaminated > 0) {
      process.stderr.write(
        `kvfence bench serve: ${contaminated} responses hold another request's nonce: the server mixes requests' context\n`,
      );
      process.exitCode = 1;
    }
  } catch (err) {
    process.stderr.write(`kvfence bench serve: ${err instanceof Error ? err.message : String(err)}\n`);
    // 2: the arguments, the input or the key are wrong; 1: the server could not be used.
    const refused = ["invalid_request", "invalid_api_key", "model_not_found"];
    process.exitCode = err instanceof KvfenceError && refused.includes(err.code) ? 2 : 1;
  }
}

/** The benchmark's options from the command line's (the key from OPENAI_API_KEY when not given). */
function serveBenchOptions(baseUrl: string, opts: ServeCliOptions): ServeBenchOptions {
  const apiKey = opts.apiKey ?? process.env.OPENAI_API_KEY;
  return {
    baseUrl,
    endpoint: opts.endpoint,
    ...(apiKey === undefined || apiKey === "" ? {} : { apiKey }),
    ...(opts.model === undefined ? {} : { model: opts.model }),
    datasetName: opts.datasetName,
    ...(opts.datasetPath === undefined ? {} : { datasetPath: opts.datasetPath }),
    numPrompts: opts.numPrompts,
    inputLen: opts.randomInputLen,
    outputLen: opts.randomOutputLen,
    rangeRatio: opts.randomRangeRatio,
    prefixGroups: opts.prefixGroups,
    prefixLen: opts.prefixLen,
    turns: opts.turns,
    ...(opts.sharegptOutputLen === undefined ? {} : { sharegptOutputLen: opts.sharegptOutputLen }),
    ...(opts.maxTokens === undefined ? {} : { maxTokens: opts.maxTokens }),
    requestRates: opts.requestRate,
    maxConcurrency: opts.maxConcurrency ?? null,
    seed: opts.seed,
    temperature: opts.temperature,
    ignoreEos: opts.ignoreEos === true,
    slo: opts.slo ?? null,
    nonce: opts.nonce,
    charsPerToken: opts.charsPerToken,
    timeoutMs: opts.requestTimeout * 1000,
    progress: opts.progress ? process.stderr : null,
    warmup: opts.warmup,
    log: (line) => process.stderr.write(`${line}\n`),
  };
}

function rangeRatio(value: string): number {
  const n = nonNegativeNumber(value);
  if (n >= 1) throw new InvalidArgumentError(`Expected a ratio in [0, 1): ${value}`);
  return n;
}

function positiveNumber(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n) || n <= 0)
    throw new InvalidArgumentError(`Expected a number > 0: ${value}`);
  return n;
}
