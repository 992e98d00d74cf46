import assert from "node:assert/strict";
import { mkdtempSync, rmSync, unlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { KvfenceError } from "../lib/errors.js";
import { byteLevelTokenizerJson, CHATML_TEMPLATE, chatmlTokenizerConfig } from "../model/gen-model.js";
import {
  BYTE_TO_CHAR,
  ChatTemplate,
  loadChatTemplate,
  ModelTokenizer,
  type StreamDecoder,
} from "./tokenizer.js";
import { addedToken, bpeTokenizerJson, byteLevel as byteLevelJson } from "./tokenizer-json.js";

const MULTIBYTE = "héllo 世界 🎉 ok";

function byteLevel(): ModelTokenizer {
  return new ModelTokenizer(byteLevelTokenizerJson(300), chatmlTokenizerConfig());
}

/** A Llama-2-style SentencePiece tokenizer with byte fallback (not byte-level). */
function byteFallback(): ModelTokenizer {
  const vocab: Record<string, number> = { "<unk>": 0, "<s>": 1, "</s>": 2 };
  for (let b = 0; b < 256; b++) vocab[`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`] = 3 + b;
  let id = 259;
  for (const piece of ["▁", ..."abcdefghijklmnopqrstuvwxyz", "▁h", "▁o"]) vocab[piece] = id++;
  const json = {
    version: "1.0",
    added_tokens: [
      {
        id: 0,
        content: "<unk>",
        single_word: false,
        lstrip: false,
        rstrip: false,
        normalized: false,
        special: true,
      },
      {
        id: 1,
        content: "<s>",
        single_word: false,
        lstrip: false,
        rstrip: false,
        normalized: false,
        special: true,
      },
      {
        id: 2,
        content: "</s>",
        single_word: false,
        lstrip: false,
        rstrip: false,
        normalized: false,
        special: true,
      },
    ],
    normalizer: {
      type: "Sequence",
      normalizers: [
        { type: "Prepend", prepend: "▁" },
        { type: "Replace", pattern: { String: " " }, content: "▁" },
      ],
    },
    pre_tokenizer: null,
    post_processor: null,
    decoder: {
      type: "Sequence",
      decoders: [
        { type: "Replace", pattern: { String: "▁" }, content: " " },
        { type: "ByteFallback" },
        { type: "Fuse" },
        { type: "Strip", content: " ", start: 1, stop: 0 },
      ],
    },
    model: {
      type: "BPE",
      unk_token: "<unk>",
      byte_fallback: true,
      fuse_unk: true,
      vocab,
      merges: ["▁ h", "▁ o"],
    },
  };
  return new ModelTokenizer(json, { bos_token: "<s>", eos_token: "</s>" });
}

function streamAll(decoder: StreamDecoder, ids: ArrayLike<number>): string[] {
  const pieces = Array.from(ids, (id) => decoder.push(id));
  pieces.push(decoder.flush());
  return pieces;
}

test("ModelTokenizer.encode() returns an Int32Array that decode() turns back into the text", () => {
  const tok = byteLevel();
  const ids = tok.encode(MULTIBYTE);
  assert.ok(ids instanceof Int32Array);
  assert.equal(ids.length, new TextEncoder().encode(MULTIBYTE).length);
  assert.equal(tok.decode(ids), MULTIBYTE);
  assert.equal(tok.decode([]), "");
});

test("ModelTokenizer.decode() drops special tokens unless asked to keep them", () => {
  const tok = byteLevel();
  const ids = [257, ...tok.encode("hi"), 258];
  assert.equal(tok.decode(ids), "hi");
  assert.equal(tok.decode(ids, { skipSpecialTokens: false }), "<|im_start|>hi<|im_end|>");
  assert.ok(tok.isSpecial(258));
  assert.ok(!tok.isSpecial(100));
});

test("ModelTokenizer.streamDecoder() holds a split multibyte character until it is complete (byte-level)", () => {
  const tok = byteLevel();
  const ids = tok.encode("é");
  assert.equal(ids.length, 2);
  const stream = tok.streamDecoder();
  assert.equal(stream.push(ids[0] as number), "");
  assert.equal(stream.push(ids[1] as number), "é");
  const pieces = streamAll(tok.streamDecoder(), tok.encode(MULTIBYTE));
  assert.ok(
    pieces.every((p) => !p.includes("\uFFFD")),
    JSON.stringify(pieces),
  );
  assert.equal(pieces.join(""), MULTIBYTE);
});

test("ModelTokenizer.tokenPiece() gives each token's own bytes, its characters mapped back by GPT-2's byte table", () => {
  // Multi-character tokens (a space-led word, the three bytes of 世, an emoji's four) and an added one.
  const spell = (bytes: Uint8Array): string => Array.from(bytes, (b) => BYTE_TO_CHAR[b]).join("");
  const words = [" hello", "世", "🎉", "é!"].map((w) => spell(new TextEncoder().encode(w)));
  const vocab: Record<string, number> = {};
  for (let b = 0; b < 256; b++) vocab[BYTE_TO_CHAR[b] as string] = b;
  words.forEach((w, i) => {
    vocab[w] = 256 + i;
  });
  const tok = new ModelTokenizer(
    bpeTokenizerJson({
      vocab,
      merges: [],
      addedTokens: [addedToken(260, "<|im_end|>", true)],
      preTokenizer: byteLevelJson(false),
      postProcessor: null,
      decoder: byteLevelJson(false),
      ignoreMerges: false,
    }),
    {},
  );
  for (let id = 0; id <= 260; id++) {
    const token = tok.vocabulary()[id] as string;
    const want =
      id === 260 ? new TextEncoder().encode(token) : Uint8Array.from(token, (c) => BYTE_TO_CHAR.indexOf(c));
    const piece = tok.tokenPiece(id);
    assert.deepEqual(piece.bytes, want, `token ${id}: ${JSON.stringify(token)}`);
    assert.equal(piece.text, new TextDecoder().decode(want), `token ${id}`);
  }
  assert.deepEqual(
    [256, 257, 258, 259].map((id) => tok.tokenPiece(id).text),
    [" hello", "世", "🎉", "é!"],
  );
  // Each piece decodes alone: a lone lead byte and then a continuation byte are two U+FFFD.
  assert.deepEqual(
    [0xe4, 0xb8].map((b) => tok.tokenPiece(b).text),
    ["\uFFFD", "\uFFFD"],
  );
});

test("ModelTokenizer.streamDecoder() skips special tokens and decodes filler ids like decode()", () => {
  const tok = byteLevel();
  const ids = [257, ...tok.encode("a"), 259, 299, 258];
  assert.equal(streamAll(tok.streamDecoder(), ids).join(""), tok.decode(ids));
  assert.equal(
    streamAll(tok.streamDecoder({ skipSpecialTokens: false }), [257, 258]).join(""),
    "<|im_start|><|im_end|>",
  );
});

test("ModelTokenizer.streamDecoder() flushes an incomplete character as U+FFFD at the end", () => {
  const tok = byteLevel();
  const stream = tok.streamDecoder();
  assert.equal(stream.push(tok.encode("世")[0] as number), "");
  assert.equal(stream.flush(), "\uFFFD");
});

test("ModelTokenizer.streamDecoder() holds byte-fallback pieces and keeps spaces (SentencePiece)", () => {
  const tok = byteFallback();
  const text = "hi 世界 ok";
  const ids = tok.encode(text, { addSpecialTokens: false });
  assert.ok(ids.length > 8, "multibyte characters fall back to bytes");
  assert.equal(tok.decode(ids), text);
  const pieces = streamAll(tok.streamDecoder(), ids);
  assert.ok(
    pieces.every((p) => !p.includes("\uFFFD")),
    JSON.stringify(pieces),
  );
  assert.equal(pieces.join(""), text);
  const long = `${"ok hi 世界 ".repeat(30)}end`;
  assert.equal(streamAll(tok.streamDecoder(), tok.encode(long, { addSpecialTokens: false })).join(""), long);
  const partial = tok.streamDecoder();
  const bytes = tok.encode("世", { addSpecialTokens: false }).filter((id) => id >= 3 && id < 259);
  assert.equal(bytes.length, 3);
  assert.equal(partial.push(bytes[0] as number), "");
  assert.equal(partial.push(bytes[1] as number), "");
  assert.match(partial.push(bytes[2] as number), /世$/);
});

test("ChatTemplate.render() output encodes special tokens to their special ids", () => {
  const tok = byteLevel();
  const template = new ChatTemplate(CHATML_TEMPLATE, {
    bosToken: tok.bosToken,
    eosToken: tok.eosToken,
    label: "mem",
  });
  const text = template.render([
    { role: "system", content: "Be brief." },
    { role: "user", content: "Hi" },
  ]);
  assert.equal(
    text,
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
  );
  const ids = Array.from(tok.encode(text, { addSpecialTokens: false }));
  const start = tok.tokenId("<|im_start|>");
  const end = tok.tokenId("<|im_end|>");
  assert.equal(start, 257);
  assert.equal(end, 258);
  assert.equal(ids.filter((id) => id === start).length, 3);
  assert.equal(ids.filter((id) => id === end).length, 2);
  assert.equal(ids[0], start);
  assert.ok(
    !template.render([{ role: "user", content: "Hi" }], { addGenerationPrompt: false }).includes("assistant"),
  );
});

test("ChatTemplate.render() passes bos_token and eos_token to the template", () => {
  const template = new ChatTemplate(
    "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    {
      bosToken: "<s>",
      eosToken: "</s>",
      label: "mem",
    },
  );
  assert.equal(template.render([{ role: "user", content: "x" }]), "<s>x</s>");
});

test("ChatTemplate rejects an invalid template and turns raise_exception into invalid_request", () => {
  assert.throws(
    () =>
      new ChatTemplate("{% for %}", { bosToken: null, eosToken: null, label: "/m/tokenizer_config.json" }),
    {
      code: "bad_model_folder",
      message:
        /^Bad model folder: \/m\/tokenizer_config\.json: chat_template is not a valid Jinja template: /,
    },
  );
  const strict = new ChatTemplate(
    "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
    {
      bosToken: null,
      eosToken: null,
      label: "mem",
    },
  );
  assert.equal(strict.render([{ role: "user", content: "x" }]), "ok");
  assert.throws(
    () => strict.render([{ role: "assistant", content: "x" }]),
    (err: unknown) =>
      err instanceof KvfenceError &&
      err.code === "invalid_request" &&
      err.message.includes("first must be user"),
  );
});

test("loadChatTemplate() prefers chat_template.jinja, reads named template lists, and returns null without one", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-tok-"));
  try {
    const tok = byteLevel();
    const config = chatmlTokenizerConfig();
    writeFileSync(join(dir, "tokenizer_config.json"), JSON.stringify(config));
    assert.equal(loadChatTemplate(dir, tok)?.source, CHATML_TEMPLATE);
    writeFileSync(join(dir, "chat_template.jinja"), "J{{ messages[0].content }}");
    assert.equal(loadChatTemplate(dir, tok)?.render([{ role: "user", content: "1" }]), "J1");
    unlinkSync(join(dir, "chat_template.jinja"));
    const list = [
      { name: "tool_use", template: "T" },
      { name: "default", template: "D" },
    ];
    writeFileSync(join(dir, "tokenizer_config.json"), JSON.stringify({ ...config, chat_template: list }));
    assert.equal(loadChatTemplate(dir, tok)?.source, "D");
    writeFileSync(
      join(dir, "tokenizer_config.json"),
      JSON.stringify({ ...config, chat_template: undefined }),
    );
    assert.equal(loadChatTemplate(dir, tok), null);
    writeFileSync(join(dir, "tokenizer_config.json"), JSON.stringify({ ...config, chat_template: 5 }));
    assert.throws(() => loadChatTemplate(dir, tok), /chat_template must be a string/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("ModelTokenizer.fromFolder() names a missing tokenizer.json", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvfence-tok-"));
  try {
    assert.throws(() => ModelTokenizer.fromFolder(dir), {
      code: "bad_model_folder",
      message: `Bad model folder: ${join(dir, "tokenizer.json")}: file is missing`,
    });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("ModelTokenizer names its file when tokenizer.json describes no usable tokenizer", () => {
  assert.throws(
    () => new ModelTokenizer({ model: { type: "NoSuchModel" } }, {}, { label: "/m/tokenizer.json" }),
    {
      code: "bad_model_folder",
      message: /^Bad model folder: \/m\/tokenizer\.json: cannot build the tokenizer: /,
    },
  );
});
