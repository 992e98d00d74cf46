"""Prints tokenizer test cases (messages + the ids the Python training code uses) as JSON."""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

cases = []
fixture = json.load(open("testing/fixtures/recall-prompts.json"))["prompts"]
for p in fixture[:20]:
    cases.append({"messages": p["messages"], "add_generation_prompt": True,
                  "ids": corpus.encode_prompt(p["messages"][0]["content"])})
rng = random.Random(5)
for _ in range(10):
    turns = corpus.make_conversation(rng, corpus.Pools(False), rng.randint(50, 600), rng.randint(1, 4))
    msgs = []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    cases.append({"messages": msgs, "add_generation_prompt": False, "ids": corpus.encode_turns(turns)[0]})
for s in ["héllo wörld — ñ ç 日本語 テスト 🙂👍🏽 Привет", "tabs\tand\r\nnewlines\n\n  spaces  ", "\u0000\u007f"]:
    cases.append({"messages": [{"role": "user", "content": s}], "add_generation_prompt": True,
                  "ids": corpus.encode_prompt(s)})
json.dump(cases, sys.stdout, ensure_ascii=False)
