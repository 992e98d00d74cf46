// Checks that the JS tokenizer (@huggingface/tokenizers + @huggingface/jinja) produces exactly the
// token ids the Python training code uses, and decodes them back.
//   /usr/bin/python3 scripts/tokenizer_cases.py > /tmp/cases.json
//   node scripts/check-tokenizer.mjs models/kvfence-tiny /tmp/cases.json
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";

const [dir = "models/kvfence-tiny", casesPath = "/dev/stdin"] = process.argv.slice(2);
const tokJson = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
const tokCfg = JSON.parse(readFileSync(join(dir, "tokenizer_config.json"), "utf8"));
const tokenizer = new Tokenizer(tokJson, tokCfg);
const template = new Template(tokCfg.chat_template);
const cases = JSON.parse(readFileSync(casesPath, "utf8"));
let failures = 0;
for (const [i, c] of cases.entries()) {
  const text = template.render({ messages: c.messages, add_generation_prompt: c.add_generation_prompt });
  const ids = tokenizer.encode(text, { add_special_tokens: false }).ids;
  const same = ids.length === c.ids.length && ids.every((v, j) => v === c.ids[j]);
  const back = tokenizer.decode(ids, { skip_special_tokens: false });
  if (!same || back !== text) {
    failures++;
    const j = ids.findIndex((v, k) => v !== c.ids[k]);
    console.log(`case ${i}: ids ${same ? "ok" : `differ at ${j}: js=${ids[j]} py=${c.ids[j]}`}; decode ${back === text ? "ok" : "differs"}`);
  }
}
console.log(`${cases.length - failures}/${cases.length} cases match`);
process.exit(failures === 0 ? 0 : 1);
