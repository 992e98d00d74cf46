/**
 * A preparation worker thread (prepare-pool.ts): loads the model folder's tokenizer and chat
 * template (never its weights), then turns each posted request body into its sampling fields and
 * prompt tokens with `prepareRequest`, one at a time, answering with the tokens (transferred) or
 * the refusal as plain error data.
 */
import { parentPort, workerData } from "node:worker_threads";
import { KvfenceError } from "../lib/errors.js";
import { lowerThreadPriority } from "../lib/thread-priority.js";
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

port.on("message", (job: ToPrepareWorker) => {
  let reply: FromPrepareWorker;
  try {
    if (job.endpoint === "tokenize" || job.endpoint === "detokenize") {
      port.postMessage({ id: job.id, ok: true, answer: answerUtility(job.endpoint, job.body, context) });
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
port.postMessage({ ready: true } satisfies FromPrepareWorker);
