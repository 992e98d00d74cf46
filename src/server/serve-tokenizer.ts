/**
 * The router's tokenizer in `kvfence serve` (start-server.ts). The first preparation worker loads
 * the model's tokenizer anyway; when its vocabulary is byte-level it hands this thread the tokens'
 * bytes and the chat template (`PreparePool.vocabulary`, src/tokenizer/token-table.ts), and this
 * thread answers from them without building a tokenizer of its own: about a quarter of a second of
 * CPU off the start of a 2-core machine (tokenizer.json's parse and the Hugging Face tokenizer's
 * build). Otherwise (another decoder, or no worker ready: its failure is the start's) it parses the
 * model's tokenizer itself as before, with the same refusals of a broken or mismatched one.
 */
import { checkTokenizerFits, type ModelHeader, withTokenizer } from "../model/load-model.js";
import { routerTokenizer } from "../router/model-tokenizer.js";
import type { PreparePool } from "../router/prepare-pool.js";
import type { RouterTokenizer } from "../router/router-server.js";
import { TableTokenizer } from "../tokenizer/token-table.js";
import { ChatTemplate, loadChatTemplate } from "../tokenizer/tokenizer.js";
import type { ServeConfig } from "./serve-config.js";

/** The router's tokenizer, once the first preparation worker is ready (`preparing`) or has failed. */
export async function serveTokenizer(
  header: ModelHeader,
  config: Pick<ServeConfig, "chatTemplate" | "toolCallParser">,
  preparing: Promise<PreparePool>,
): Promise<RouterTokenizer> {
  const pool = await preparing.catch(() => undefined);
  const bounds = pool?.tokenBounds;
  const vocabulary = pool?.vocabulary;
  if (vocabulary?.table != null) {
    checkTokenizerFits(header, vocabulary.table.numIds);
    const tokenizer = new TableTokenizer(vocabulary.table, () => withTokenizer(header).tokenizer);
    // The worker parsed the same source (`--chat-template FILE`'s when given).
    const template =
      vocabulary.chatTemplate === null
        ? null
        : new ChatTemplate(vocabulary.chatTemplate, {
            bosToken: vocabulary.bosToken,
            eosToken: vocabulary.eosToken,
            label: config.chatTemplate ?? header.dir,
          });
    return routerTokenizer(tokenizer, template, config.toolCallParser, bounds);
  }
  const model = withTokenizer(header);
  // `--chat-template FILE` in place of the folder's template when given.
  const template =
    config.chatTemplate === undefined
      ? model.chatTemplate
      : loadChatTemplate(model.dir, model.tokenizer, config.chatTemplate);
  return routerTokenizer(model.tokenizer, template, config.toolCallParser, bounds);
}
