/**
 * A preparation worker thread (prepare-pool.ts): loads the model folder's tokenizer and chat
 * template (never its weights), then turns each posted request body into its sampling fields and
 * prompt tokens with `prepareRequest`, one at a time, answering with the tokens (transferred) or
 * the refusal as plain error data. A request with an output constraint (structured output) has it
 * compiled here first (`compileCheck`, src/grammar/), so what xgrammar cannot compile is refused
 * with a 400 before anything is allocated, and never on the router's event loop.
 */
import { parentPort, workerData } from "node:worker_threads";
import { CONSTRAINT_NAME, CONSTRAINT_PARAM, compileCheck } from "../grammar/grammar-engine.js";
import { type GrammarVocab, grammarVocab } from "../grammar/grammar-vocab.js";
import { KvfenceError } from "../lib/errors.js";
import { lowerThreadPriority } from "../lib/thread-priority.js";
import type { OutputConstraint } from "../protocol/output-constraint.js";
import { loadChatTemplate, openTokenizer } from "../tokenizer/tokenizer.js";
import { routerTokenizer } from "./model-tokenizer.js";
import {
  type FromPrepareWorker,
  LARGE_LANE_NICE,
  type PrepareWorkerData,
  type ToPrepareWorker,
} from "./prepare-pool.js";
import { answerUtility, prepareRequest } from "./prepare-request.js";

const data = workerData as PrepareWorkerData;
const port = parentPort!;
// The large lane's workers prepare big bodies: they yield the CPU to the threads serving requests.
if (data.lane === "large") lowerThreadPriority(LARGE_LANE_NICE);
const { tokenizer, chatTemplate } = await openTokenizer(data.modelDir);
const context = {
  modelId: data.modelId,
  // `--chat-template FILE` replaces the model's own.
  tokenizer: routerTokenizer(
    tokenizer,
    data.chatTemplateFile === undefined
      ? chatTemplate
      : loadChatTemplate(data.modelDir, tokenizer, data.chatTemplateFile),
    data.toolCallParser,
  ),
  limits: data.limits,
};

let vocab: GrammarVocab | null = null;

port.on("message", async (job: ToPrepareWorker) => {
  let reply: FromPrepareWorker;
  try {
    if (job.endpoint === "tokenize" || job.endpoint === "detokenize") {
      port.postMessage({ id: job.id, ok: true, answer: answerUtility(job.endpoint, job.body, context) });
      return;
    }
    const { parsed, prompts } = prepareRequest(job.endpoint, job.body, context);
    // The parsed request's constraint (set by the request parser when the body asks for one).
    const constraint = (parsed as { readonly constraint?: OutputConstraint }).constraint;
    if (constraint !== undefined) {
      vocab ??= grammarVocab(tokenizer);
      // The pool times the compilation (xgrammar cannot be interrupted: it replaces a worker that overruns).
      const { kind } = constraint;
      port.postMessage({ id: job.id, compiling: CONSTRAINT_NAME[kind], param: CONSTRAINT_PARAM[kind] });
      await compileCheck(constraint, vocab);
    }
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
port.postMessage({ ready: true } satisfies FromPrepareWorker);
