/**
 * The router's preparation workers: a small pool of worker threads (`--tokenizer-threads`, default
 * 2) that parse, validate, render the chat template and tokenize each generation request's body
 * (prepare-worker.ts running prepare-request.ts), so the router's event loop only reads bytes and
 * never waits on a request's content (docs/design.md §2).
 *
 * Two lanes keep small requests from queueing behind big ones: a body over `LARGE_BODY_BYTES` is
 * prepared only by the workers after the first, so with two or more workers the first is always
 * free for small bodies within the time of one small body. (With one worker, both lanes share it.)
 * Each lane is fair between tenants (`src/lib/fair-queue.ts`, costed by body bytes): one tenant's
 * hundred queued prompts delay another tenant's body by about one of them, not all (issue #22:
 * a flood's bodies held every other tenant's first request behind their tokenization). With one
 * tenant, or `--scheduling-policy fcfs`, a lane is first-come. Each worker prepares one body at a time. A worker that dies fails its body with `internal` and is
 * replaced; nothing else is lost.
 *
 * A prepared body with an output constraint is not answered yet: its constraint (as JSON) queues
 * as a "compile" job of the large lane — the first worker, free for small bodies, never compiles —
 * whose worker compiles it (structured output's check, src/grammar/). Compiling can take minutes (a
 * 1 MB JSON schema of optional properties: 230 s) and cannot be interrupted, so a compilation past
 * `GRAMMAR_COMPILE_MS` is refused with `invalid_request` and its worker replaced: no worker, and no
 * engine later, spends longer on one.
 */
import { Worker } from "node:worker_threads";
import type { SchedulingPolicy } from "../fair-share/fair-share.js";
import { KvfenceError, type WireError } from "../lib/errors.js";
import { FairQueue } from "../lib/fair-queue.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import type { TokenTable } from "../tokenizer/token-table.js";
import type { SamplingRequest } from "./openai-schemas.js";
import type { PrepareContext, PreparedRequest } from "./prepare-request.js";
import type { RequestLimits } from "./request-limits.js";
import type { GenerateEndpointName, UtilityEndpointName } from "./request-names.js";
import type { TokenBounds } from "./response-size.js";
import type { ToolCallFormat } from "./tool-call-parser.js";

/** Turns a generation body into a request ready for admission, off the caller's event loop or not. */
export interface RequestPreparer {
  /** `tenant`: the index of the request's tenant (bodies wait fairly between tenants). */
  prepare(endpoint: GenerateEndpointName, body: Uint8Array, tenant?: number): Promise<PreparedRequest>;
  /** /tokenize and /detokenize: the answer's JSON body (`answerUtility`). */
  answer(endpoint: UtilityEndpointName, body: Uint8Array, tenant?: number): Promise<object>;
  close(): Promise<void>;
}

/** Bodies over this go to the large lane. */
export const LARGE_BODY_BYTES = 16 * 1024;

/** How long the check of a request's output constraint may compile before it is refused. */
export const GRAMMAR_COMPILE_MS = 1000;

/**
 * How long after the first worker is ready the others start at the latest (sooner when a body
 * would wait for the first): ~0.6 s of CPU each, which the first requests of a fresh server
 * would otherwise share with them.
 */
export const LATER_WORKERS_MS = 2000;

/** The nice value of the large lane's workers (Linux; lib/thread-priority.ts). */
export const LARGE_LANE_NICE = 10;

interface PoolData {
  readonly modelDir: string;
  /** The served model's names (`--served-model-name`; the first is the one reported). */
  readonly modelId: string | readonly string[];
  readonly limits: RequestLimits;
  /** `--chat-template FILE`, in place of the model folder's template. */
  readonly chatTemplateFile?: string;
  /** `--tool-call-parser`, in place of the format the template names. */
  readonly toolCallParser?: ToolCallFormat;
}

export interface PrepareWorkerData extends PoolData {
  /**
   * The worker thread's nice value, set before it loads its modules (prepare-worker-start.ts): 0
   * for the small lane, `LARGE_LANE_NICE` for the large lane, which yields the CPU.
   */
  readonly nice: number;
  /** Whether its ready message carries the vocabulary's `TokenBounds` (the first worker's does). */
  readonly bounds: boolean;
}

/**
 * The `workerData` of a worker started before its data is known (src/server/early-threads.ts):
 * `modelGuess` is the model its command line names, whose tokenizer it reads while it waits (its
 * data's `modelDir` is the one it serves: it reads that one if they differ).
 */
export interface EarlyPrepareWorkerData {
  readonly nice: 0;
  readonly early: true;
  readonly modelGuess?: string;
}

/** The first message of a worker started without its `workerData` (`PreparePoolOptions.first`). */
export interface PrepareWorkerStart {
  readonly data: PrepareWorkerData;
}

/** A job's kind: a body of an endpoint, or a prepared request's constraint to compile. */
type JobKind = GenerateEndpointName | UtilityEndpointName | "compile";

export interface ToPrepareWorker {
  readonly id: number;
  readonly endpoint: JobKind;
  readonly body: Uint8Array;
}

/** What the first worker hands the router's thread of the tokenizer it loaded (start-server.ts). */
export interface PreparedVocabulary {
  readonly table: TokenTable | null;
  /** The chat template's source (`--chat-template FILE`'s when given); null without one. */
  readonly chatTemplate: string | null;
  readonly bosToken: string | null;
  readonly eosToken: string | null;
}

export type FromPrepareWorker =
  /** Loaded; the first worker's ready carries the vocabulary's bounds (`PreparePool.tokenBounds`). */
  | {
      readonly ready: true;
      readonly tokenBounds?: TokenBounds;
      /** With the bounds: the byte-level vocabulary's bytes (null for another decoder) and the chat template. */
      readonly vocabulary?: PreparedVocabulary;
    }
  | {
      readonly id: number;
      readonly ok: true;
      readonly parsed: SamplingRequest;
      readonly prompts: readonly Int32Array[];
    }
  | { readonly id: number; readonly ok: true; readonly answer: object }
  /** The body's constraint is compiling now (`compiling` names it, `param` its field): time it. */
  | { readonly id: number; readonly compiling: string; readonly param: string }
  /** `error` null: not a KvfenceError (a bug); `detail` is for the log only. */
  | { readonly id: number; readonly ok: false; readonly error: WireError | null; readonly detail?: string };

const WORKER_URL = new URL("./prepare-worker-start.js", import.meta.url);

interface Job {
  readonly id: number;
  readonly tenant: number;
  readonly endpoint: JobKind;
  readonly body: Uint8Array;
  readonly large: boolean;
  resolve(result: PreparedRequest | object): void;
  reject(error: unknown): void;
}

interface Slot {
  worker: Worker;
  /** Loaded (its ready message came): until then it takes no small body, which would wait for its start. */
  ready: boolean;
  job: Job | null;
  /** The deadline of its job's constraint compiling, if it is. */
  compiling: ReturnType<typeof setTimeout> | null;
  /** Replaced on purpose (a compilation overran): its exit is no failure. */
  retired: boolean;
}

/** Prepares in the caller's thread: for routers over a tokenizer that cannot move to a worker (tests). */
export function inThreadPreparer(context: PrepareContext): RequestPreparer {
  // Loaded with the first body: the request schemas stay off a server's start-up path.
  const preparing = () => import("./prepare-request.js");
  return {
    prepare: async (endpoint, body) => (await preparing()).prepareRequest(endpoint, body, context),
    answer: async (endpoint, body) => (await preparing()).answerUtility(endpoint, body, context),
    close: async () => {},
  };
}

export interface PreparePoolOptions extends PoolData {
  /** Worker threads (1 or more). */
  readonly threads: number;
  /**
   * The first worker, already started on prepare-worker-start.js without its data (which it gets
   * as its first message; src/server/early-threads.ts); a fresh one in its place if it exited.
   */
  readonly first?: { readonly worker: Worker; readonly exitCode: number | null };
  /** `--scheduling-policy`: fcfs serves each lane in arrival order across tenants (default fair). */
  readonly policy?: SchedulingPolicy;
  /** Told about a worker that failed (its body got `internal`). */
  readonly onWorkerError?: (detail: string) => void;
}

export class PreparePool implements RequestPreparer {
  readonly #data: PoolData;
  readonly #onWorkerError: (detail: string) => void;
  readonly #slots: Slot[] = [];
  readonly #small: FairQueue<Job>;
  readonly #large: FairQueue<Job>;
  readonly #size: number;
  #first: PreparePoolOptions["first"];
  #tokenBounds: TokenBounds | undefined;
  #vocabulary: PreparedVocabulary | undefined;
  #nextId = 1;
  #closed = false;
  /** The timer that starts the workers after the first; null once they started (or with one). */
  #later: ReturnType<typeof setTimeout> | null = null;

  private constructor(options: PreparePoolOptions) {
    this.#data = {
      modelDir: options.modelDir,
      modelId: options.modelId,
      limits: options.limits,
      ...(options.chatTemplateFile === undefined ? {} : { chatTemplateFile: options.chatTemplateFile }),
      ...(options.toolCallParser === undefined ? {} : { toolCallParser: options.toolCallParser }),
    };
    this.#onWorkerError = options.onWorkerError ?? (() => {});
    this.#size = Math.max(1, options.threads);
    this.#first = options.first;
    this.#small = PreparePool.#lane(options.policy);
    this.#large = PreparePool.#lane(options.policy);
  }

  /** A lane's queue: fair between tenants, each body costed by its bytes (or first-come: fcfs). */
  static #lane(policy: SchedulingPolicy = "fair"): FairQueue<Job> {
    return new FairQueue<Job>({
      flow: (job) => job.tenant,
      cost: (job) => job.body.byteLength,
      order: policy === "fcfs" ? "arrival" : "fair",
    });
  }

  /**
   * Starts `threads` workers and resolves once the first has loaded the tokenizer. The others (the
   * large lane, at a lower priority) start later (`#startOthers`): when a body would wait for the
   * first (a large body, a constraint to compile, or a small one while the first is busy), or
   * `LATER_WORKERS_MS` after it, so neither a server's start-up nor its first requests share the
   * CPU with their loading. They take their bodies once ready (large bodies wait for them
   * meanwhile). One that fails to start is reported, and the first then serves both lanes, as a
   * pool of one does.
   */
  static async start(options: PreparePoolOptions): Promise<PreparePool> {
    const pool = new PreparePool(options);
    try {
      await pool.#spawn(0);
    } catch (err) {
      await pool.close();
      throw err;
    }
    if (pool.#size > 1) {
      pool.#later = setTimeout(() => pool.#startOthers(), LATER_WORKERS_MS);
      pool.#later.unref();
    }
    return pool;
  }

  /** The workers after the first, once (see `start`). */
  #startOthers(): void {
    if (this.#later === null || this.#closed) return;
    clearTimeout(this.#later);
    this.#later = null;
    for (let i = 1; i < this.#size; i++) this.#spawn(i).catch((err: unknown) => this.#startFailed(i, err));
  }

  /** Workers started so far (the first, then all once `#startOthers` ran). */
  get startedWorkers(): number {
    return this.#slots.filter((s) => s !== undefined).length;
  }

  /**
   * The vocabulary's `TokenBounds` (response-size.ts), walked by the first worker once it loaded
   * the tokenizer (off the caller's thread, where it is the same walk of the same tokenizer).
   */
  get tokenBounds(): TokenBounds | undefined {
    return this.#tokenBounds;
  }

  /** The first worker's tokenizer as the router's thread can use it without loading its own. */
  get vocabulary(): PreparedVocabulary | undefined {
    return this.#vocabulary;
  }

  /** Bodies waiting for a worker (both lanes). */
  get queued(): number {
    return this.#small.length + this.#large.length;
  }

  prepare(endpoint: GenerateEndpointName, body: Uint8Array, tenant = 0): Promise<PreparedRequest> {
    return this.#run(endpoint, body, tenant) as Promise<PreparedRequest>;
  }

  answer(endpoint: UtilityEndpointName, body: Uint8Array, tenant = 0): Promise<object> {
    return this.#run(endpoint, body, tenant) as Promise<object>;
  }

  #run(endpoint: JobKind, body: Uint8Array, tenant: number): Promise<PreparedRequest | object> {
    if (this.#closed)
      return Promise.reject(new KvfenceError("node_unavailable", "The server is shutting down"));
    return new Promise((resolve, reject) => {
      const job: Job = {
        id: this.#nextId++,
        tenant,
        endpoint,
        body,
        // A constraint compiles in the large lane whatever its size (it may take up to GRAMMAR_COMPILE_MS).
        large: endpoint === "compile" || body.byteLength > LARGE_BODY_BYTES,
        resolve,
        reject,
      };
      (job.large ? this.#large : this.#small).push(job);
      // A body that would wait for the first worker starts the others now.
      if (job.large || this.#slots[0]?.job != null) this.#startOthers();
      this.#dispatch();
    });
  }

  /** A prepared request with a constraint: answered once its constraint compiled (a job of its own). */
  #compileThen(job: Job, prepared: PreparedRequest, constraint: OutputConstraint): void {
    const param = prepared.parsed.constraintParam;
    const body = new TextEncoder().encode(JSON.stringify({ constraint, param }));
    this.#run("compile", body, job.tenant).then(() => job.resolve(prepared), job.reject);
  }

  async close(): Promise<void> {
    this.#closed = true;
    if (this.#later !== null) clearTimeout(this.#later);
    const gone = new KvfenceError("node_unavailable", "The server is shutting down");
    for (const lane of [this.#small, this.#large]) {
      for (const job of [...lane]) {
        lane.remove(job);
        job.reject(gone);
      }
    }
    const slots = this.#slots.splice(0);
    for (const slot of slots) slot.job?.reject(gone);
    await Promise.all(slots.map((slot) => slot.worker.terminate()));
  }

  #spawn(index: number): Promise<void> {
    // With two or more workers the first serves small bodies only; the others are the large lane.
    const small = index === 0 || this.#size === 1;
    const workerData: PrepareWorkerData = {
      ...this.#data,
      nice: small ? 0 : LARGE_LANE_NICE,
      bounds: index === 0,
    };
    const early = index === 0 ? this.#first : undefined;
    this.#first = undefined;
    if (early !== undefined && early.exitCode !== null) void early.worker.terminate();
    const started = early !== undefined && early.exitCode === null;
    const worker = started ? early.worker : new Worker(WORKER_URL, { workerData });
    if (started) worker.postMessage({ data: workerData } satisfies PrepareWorkerStart);
    const slot: Slot = { worker, ready: false, job: null, compiling: null, retired: false };
    this.#slots[index] = slot;
    return new Promise((resolve, reject) => {
      let ready = false;
      worker.on("message", (message: FromPrepareWorker) => {
        if ("ready" in message) {
          ready = true;
          slot.ready = true;
          this.#tokenBounds ??= message.tokenBounds;
          this.#vocabulary ??= message.vocabulary;
          resolve();
          this.#dispatch();
          return;
        }
        if ("compiling" in message) this.#timeCompile(slot, message);
        else this.#finish(slot, message);
      });
      worker.on("error", (err) => {
        if (!ready) reject(err);
        else this.#lost(slot, index, String(err.stack ?? err));
      });
      worker.on("exit", (code) => {
        if (!ready) reject(new Error(`the preparation worker exited with code ${code} before it was ready`));
        else this.#lost(slot, index, `the preparation worker exited with code ${code}`);
      });
    });
  }

  /**
   * Refuses the job of `slot` if its constraint is still compiling after `GRAMMAR_COMPILE_MS`,
   * and replaces the worker (a wasm call cannot be stopped).
   */
  #timeCompile(slot: Slot, message: { id: number; compiling: string; param: string }): void {
    const job = slot.job;
    if (job === null || job.id !== message.id) return;
    slot.compiling = setTimeout(() => {
      if (slot.job !== job || this.#closed) return;
      slot.job = null;
      slot.retired = true;
      job.reject(
        new KvfenceError(
          "invalid_request",
          `${message.compiling} takes over ${GRAMMAR_COMPILE_MS} ms to compile: send a simpler one (fewer optional properties, alternatives or repetitions)`,
          { param: message.param },
        ),
      );
      void slot.worker.terminate();
    }, GRAMMAR_COMPILE_MS);
  }

  /** A worker of the large lane failed to start: the first worker takes its bodies too. */
  #startFailed(index: number, err: unknown): void {
    if (this.#closed) return;
    this.#onWorkerError(`a preparation worker failed to start: ${String(err)}`);
    delete this.#slots[index];
    this.#dispatch();
  }

  /** A worker died (or was retired): fail its body, replace it. */
  #lost(slot: Slot, index: number, detail: string): void {
    if (this.#slots[index] !== slot || this.#closed) return;
    if (!slot.retired) this.#onWorkerError(detail);
    const job = slot.job;
    slot.job = null;
    job?.reject(new KvfenceError("internal", "Internal server error"));
    void this.#spawn(index).catch((err: unknown) => this.#onWorkerError(String(err)));
  }

  #finish(slot: Slot, message: Exclude<FromPrepareWorker, { ready: true } | { compiling: string }>): void {
    if (slot.compiling !== null) clearTimeout(slot.compiling);
    slot.compiling = null;
    const job = slot.job;
    slot.job = null;
    if (job !== null && job.id === message.id) {
      if (message.ok && "answer" in message) job.resolve(message.answer);
      else if (message.ok) {
        const prepared = { parsed: message.parsed, prompts: message.prompts };
        const constraint = message.parsed.constraint;
        if (constraint === undefined) job.resolve(prepared);
        else this.#compileThen(job, prepared, constraint);
      } else if (message.error !== null) job.reject(KvfenceError.fromWire(message.error));
      else {
        this.#onWorkerError(message.detail ?? "unknown");
        job.reject(new KvfenceError("internal", "Internal server error"));
      }
    }
    this.#dispatch();
  }

  /** The next body of `lane`, taken out of it; undefined when it is empty. */
  static #next(lane: FairQueue<Job>): Job | undefined {
    return lane.peek() === undefined ? undefined : lane.take();
  }

  /** Gives each idle worker the next body of a lane it serves. */
  #dispatch(): void {
    // One worker (or none of the large lane started): both lanes share the first.
    const shared = this.#size === 1 || this.#slots.every((s, i) => i === 0 || s === undefined);
    for (let i = 0; i < this.#slots.length; i++) {
      const slot = this.#slots[i];
      if (slot === undefined || slot.job !== null || slot.retired) continue;
      // The first worker takes small bodies only (unless it is alone); the others large ones first,
      // and small ones only once loaded (a small body would wait for the worker's start).
      const job =
        i === 0 && !shared
          ? PreparePool.#next(this.#small)
          : (PreparePool.#next(this.#large) ?? (slot.ready ? PreparePool.#next(this.#small) : undefined));
      if (job === undefined) continue;
      slot.job = job;
      const { body } = job;
      const owned = body.byteOffset === 0 && body.byteLength === body.buffer.byteLength;
      const sent = owned ? body : new Uint8Array(body);
      const message: ToPrepareWorker = { id: job.id, endpoint: job.endpoint, body: sent };
      slot.worker.postMessage(message, [sent.buffer as ArrayBuffer]);
    }
  }
}
