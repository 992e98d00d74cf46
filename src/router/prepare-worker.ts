/**
 * A preparation worker thread (prepare-pool.ts; its entry, prepare-worker-start.ts, sets the
 * thread's priority first): loads the model folder's tokenizer and chat
 * template (never its weights), then turns each posted request body into its sampling fields and
 * prompt tokens with `prepareRequest`, one at a time, answering with the tokens (transferred) or
 * the refusal as plain error data. A request's output constraint (structured output) comes back as
 * a job of its own ("compile", its JSON), which compiles it (`compileCheck`, src/grammar/): what
 * xgrammar cannot compile is refused with a 400 before anything is allocated, and never on the
 * router's event loop.
 */
import { parentPort, workerData } from "node:worker_threads";
import { type GrammarVocab, grammarVocab } from "../grammar/grammar-vocab.js";
import { KvfenceError } from "../lib/errors.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";

const utf8 = new TextDecoder();

import { packTokenTable } from "../tokenizer/token-table.js";
import { loadChatTemplate, openTokenizer, type TokenizerAndTemplate } from "../tokenizer/tokenizer.js";
import { routerTokenizer } from "./model-tokenizer.js";
import type {
  EarlyPrepareWorkerData,
  FromPrepareWorker,
  PrepareWorkerData,
  PrepareWorkerStart,
  ToPrepareWorker,
} from "./prepare-pool.js";
import { answerUtility, prepareRequest } from "./prepare-request.js";

const port = parentPort!;
/**
 * A worker started early (src/server/early-threads.ts) gets its data as its first message, and
 * meanwhile reads the tokenizer of the model its command line names (`modelGuess`).
 */
let guessed: { readonly dir: string; readonly loaded: Promise<TokenizerAndTemplate | null> } | null = null;

async function workerDataOrFirstMessage(): Promise<PrepareWorkerData> {
  const early = workerData as Partial<EarlyPrepareWorkerData>;
  if (early.early !== true) return workerData as PrepareWorkerData;
  const message = new Promise<PrepareWorkerData>((resolve) =>
    port.once("message", (m: PrepareWorkerStart) => resolve(m.data)),
  );
  if (early.modelGuess !== undefined)
    guessed = { dir: early.modelGuess, loaded: openTokenizer(early.modelGuess).catch(() => null) };
  return message;
}

/** The tokenizer of `dir`: the one read meanwhile when it is that folder's, else read now. */
async function loadTokenizer(dir: string): Promise<TokenizerAndTemplate> {
  const early = guessed?.dir === dir ? await guessed.loaded : null;
  guessed = null;
  return early ?? openTokenizer(dir);
}

const data = await workerDataOrFirstMessage();
const { tokenizer, chatTemplate: modelTemplate } = await loadTokenizer(data.modelDir);
// `--chat-template FILE` replaces the model's own.
const chatTemplate =
  data.chatTemplateFile === undefined
    ? modelTemplate
    : loadChatTemplate(data.modelDir, tokenizer, data.chatTemplateFile);
const context = {
  modelId: data.modelId,
  tokenizer: routerTokenizer(tokenizer, chatTemplate, data.toolCallParser),
  limits: data.limits,
};

let vocab: GrammarVocab | null = null;
// The grammar engine loads with this thread's first constraint, not before it serves (start-up).
let grammarEngine: Promise<typeof import("../grammar/grammar-engine.js")> | undefined;

port.on("message", async (job: ToPrepareWorker) => {
  let reply: FromPrepareWorker;
  try {
    if (job.endpoint === "tokenize" || job.endpoint === "detokenize") {
      port.postMessage({ id: job.id, ok: true, answer: answerUtility(job.endpoint, job.body, context) });
      return;
    }
    if (job.endpoint === "compile") {
      // The constraint and the client's field it came from (`guided_grammar`, `ebnf`, …), as the pool sends them.
      const { constraint, param: clientParam } = JSON.parse(utf8.decode(job.body)) as {
        readonly constraint: OutputConstraint;
        readonly param?: string;
      };
      grammarEngine ??= import("../grammar/grammar-engine.js");
      const { CONSTRAINT_NAME, CONSTRAINT_PARAM, checkerFor, compileCheck } = await grammarEngine;
      vocab ??= grammarVocab(tokenizer);
      // This thread's first compilation loads xgrammar first: not the constraint's time.
      await checkerFor(vocab);
      // The pool times the compilation (xgrammar cannot be interrupted: it replaces a worker that overruns).
      const { kind } = constraint;
      const param = clientParam ?? CONSTRAINT_PARAM[kind];
      port.postMessage({ id: job.id, compiling: CONSTRAINT_NAME[kind], param });
      await compileCheck(constraint, vocab).catch((err: unknown) => {
        // A refusal names the field the client sent.
        throw err instanceof KvfenceError && err.code === "invalid_request"
          ? new KvfenceError(err.code, err.message, { param, cause: err })
          : err;
      });
      port.postMessage({ id: job.id, ok: true, answer: {} });
      return;
    }
    const { parsed, prompts } = prepareRequest(job.endpoint, job.body, context);
    reply = { id: job.id, ok: true, parsed, prompts };
    port.postMessage(
      reply,
      prompts.map((tokens) => tokens.buffer as ArrayBuffer),
    );
    return;
  } catch (err) {
    reply =
      err instanceof KvfenceError
        ? { id: job.id, ok: false, error: err.toWire() }
        : { id: job.id, ok: false, error: null, detail: String((err as Error)?.stack ?? err) };
  }
  port.postMessage(reply);
});
port.postMessage({
  ready: true,
  // The first worker walks the vocabulary once for the router's answer-size bounds, and hands
  // the router's thread what it needs of the tokenizer (src/tokenizer/token-table.ts).
  ...(data.bounds
    ? {
        tokenBounds: context.tokenizer.tokenBounds,
        vocabulary: {
          table: packTokenTable(tokenizer),
          chatTemplate: chatTemplate?.source ?? null,
          bosToken: tokenizer.bosToken,
          eosToken: tokenizer.eosToken,
        },
      }
    : {}),
} satisfies FromPrepareWorker);
