#!/usr/bin/python3
"""Train the shipped kvfence-tiny: a 3-layer Llama that copies access codes from its context.

Run with Debian's PyTorch (torch 1.13, CPU), ideally with OpenBLAS (`apt-get install
libopenblas0-openmp`; Debian's default reference BLAS is about 8x slower):

    /usr/bin/python3 scripts/train_recall.py --out models/kvfence-tiny
    /usr/bin/python3 scripts/train_recall.py --resume           # continue from <work>/last.pt
    /usr/bin/python3 scripts/train_recall.py --eval-only        # recall of <out> on the fixture

What it reuses: the corpus grammar, tokenizer and held-out split of `scripts/corpus.py`, and the
Hugging Face Llama definition, safetensors writer, export and teacher-forced recall eval of
`scripts/train_tiny.py`.

The recipe (the defaults; docs/kvfence-tiny.md has the run that made the shipped weights):

- the model starts from the copy circuit of `scripts/circuit.py`: eight offset heads in layer 0
  and an 8-gram induction head in layer 1, written into the weights and held fixed by gradient
  masks (3 layers, hidden 256, 8 query heads of 128 over 2 KV heads, intermediate 512,
  rope_theta 1e20, untied LM head: 3,282,688 parameters). The circuit finds the record whose
  8 bytes before the code ("4821 is ") match the answer's and votes for its next byte. Everything
  else is trained: the answer's wording, copying the asked account's digits from the question,
  stopping after the code. Three sessions of runs from random weights (`--no-circuit`, the shape in
  SHAPE) learned where in a record the code sits but not which record: 16.5% exact recall at best;
- the answer restates the record ("the access code of account 4821 is QX7-PL2.", see corpus.py),
  so the code is the continuation of a line the context already holds;
- records repeat later in their context with probability 0.5 (`--p-dup`), and the repeat's code
  bytes are targets too; a record's account is, with probability 0.2 (`--p-near`), a near miss of
  another record's account in the same context (one or two digits changed);
- conversations are added to a step until it holds 6,000 tokens (`--tokens-per-step`), each
  asking 3 to 4 + bytes/250 distinct questions; loss 1.0 on answer and copy-target tokens and
  0.05 elsewhere; AdamW lr 1.5e-3 after a 30-step warm-up, no weight decay; grad clip 1.0; no
  questions about accounts without a record (`--unknown-until 0`);
- a curriculum over context lengths 150, 250, 400, 600, 850, 1,100 bytes: half the contexts are
  40..L bytes, half L/2..L; the level goes up when the exact recall of 48 held-out prompts of
  L/2..L bytes reaches 85% (`--gate`, checked every 50 steps). From the 850-byte level on, 64
  full-range (100-1,000 bytes) prompts are measured and the best model is exported; a run that
  stops before that exports its last weights;
- 350 steps (`--max-steps`); glibc is told to keep freed memory (`train_tiny.keep_freed_memory`),
  which saves the ~20% of each step the kernel otherwise spends faulting in fresh pages.

Data for step s comes from random.Random(seed * 1_000_003 + s), so a resumed run sees the same
stream. Checkpoints (model, optimizer, step, level, best) go to <work>/last.pt every 50 steps and
when the run stops.
The run stops at --target full-range recall, --max-steps, or after --max-minutes of this
invocation.
"""
import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import circuit  # noqa: E402
import corpus  # noqa: E402
import train_tiny as T  # noqa: E402

# the shape of the --no-circuit runs (trained from random weights; the circuit has its own)
SHAPE = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=6, head_dim=32,
             intermediate_size=768, num_hidden_layers=3, rope_theta=10000.0)
LEVELS = [150, 250, 400, 600, 850, 1100]


def first_asks(turns):
    """Drops questions asked earlier in the conversation, so an answer can only be found in the
    context, never copied from an earlier assistant turn (a shortcut the model otherwise learns)."""
    seen, out = set(), []
    for user, answer in turns:
        account = user[-5:-1]
        if account not in seen:
            seen.add(account)
            out.append((user, answer))
    return out


@torch.no_grad()
def byte_errors(model, max_bytes, n=200):
    """Where the wrong code bytes come from, teacher-forced on n held-out prompts of max_bytes/2 to
    max_bytes: the same byte of another record's code (wrong record, right offset), another byte of
    the asked record's code, some other byte of the context, or nothing in the context."""
    model.eval()
    prompts = corpus.make_eval_prompts(seed=777 + max_bytes, n=n, min_bytes=max(60, max_bytes // 2),
                                       max_bytes=min(max_bytes, 1000))
    kinds, total = Counter(), 0
    for p in prompts:
        ctx, code, answer = p["messages"][0]["content"], p["expected"], p["answer"]
        prompt, target = corpus.encode_prompt(ctx), corpus.encode_text(answer) + [corpus.IM_END]
        pred = model(torch.tensor([prompt + target])).argmax(-1)[0, len(prompt) - 1:].tolist()
        at = answer.index(" is ") + 4
        others = [c for _, c in corpus.RECORD_RE.findall(ctx) if c != code]
        for k in (0, 1, 2, 4, 5, 6):
            total += 1
            got = chr(pred[at + k]) if pred[at + k] < 256 else "\ufffd"
            if got == code[k]:
                continue
            if any(o[k] == got for o in others):
                kinds["the same byte of another record's code"] += 1
            elif got in code:
                kinds["another byte of the asked code"] += 1
            elif got in ctx:
                kinds["another byte of the context"] += 1
            else:
                kinds["not in the context"] += 1
    print(f"contexts of {max(60, max_bytes // 2)}-{max_bytes} bytes: {sum(kinds.values())} of {total} code bytes wrong")
    for kind, count in kinds.most_common():
        print(f"  {count:5d}  {kind}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/kvfence-tiny")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "kvfence-tiny-recall"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--lr-drop-at", type=int, default=1200, help="from this step the lr is multiplied by --lr-drop")
    ap.add_argument("--lr-drop", type=float, default=1 / 3)
    ap.add_argument("--unknown-until", type=int, default=0,
                    help="steps before this one ask 12%% of questions about accounts without a record")
    ap.add_argument("--tokens-per-step", type=int, default=6000,
                    help="conversations are added to a step's batch until it holds this many tokens")
    ap.add_argument("--gate", type=float, default=0.85, help="recall at a level that moves the curriculum on")
    ap.add_argument("--p-near", type=float, default=0.2,
                    help="chance a record's account is a near miss (1-2 digits changed) of another record's")
    ap.add_argument("--max-steps", type=int, default=350)
    ap.add_argument("--target", type=float, default=0.98, help="stop at this full-range recall")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--eval-only", action="store_true",
                    help="exact recall of <out>/model.safetensors on testing/fixtures/recall-prompts.json")
    ap.add_argument("--byte-errors", type=int, metavar="BYTES",
                    help="classify the wrong code bytes of <out>/model.safetensors on contexts up to BYTES")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--heads", type=int, default=SHAPE["num_attention_heads"],
                    help="attention heads (and KV heads) per layer; head_dim = hidden_size / heads")
    ap.add_argument("--p-record-max", type=float, default=0.5,
                    help="a context's share of records is uniform in [0.2, this] (the rest distractors, filler)")
    ap.add_argument("--p-dup", type=float, default=0.5, help="chance a record repeats later in its context")
    ap.add_argument("--warmup-copy", type=int, default=0, help="steps whose batches are half repeat-copy")
    ap.add_argument("--p-repeat", type=float, default=0.0, help="share of repeat-copy sequences after the warm-up")
    ap.add_argument("--p-repeat-from", type=int, default=0, help="first step with --p-repeat sequences")
    ap.add_argument("--untied", action="store_true", help="a separate LM head (default: tied to the embeddings)")
    ap.add_argument("--max-minutes", type=float, default=60.0)
    ap.add_argument("--no-circuit", dest="circuit", action="store_false",
                    help="train from random weights in SHAPE instead of from the copy circuit of scripts/circuit.py")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    T.keep_freed_memory()
    torch.manual_seed(args.seed)
    SHAPE["num_hidden_layers"] = args.layers
    SHAPE.update(num_attention_heads=args.heads, num_key_value_heads=args.heads,
                 head_dim=SHAPE["hidden_size"] // args.heads)
    SHAPE["tie_word_embeddings"] = not args.untied
    T.CFG.update(circuit.SHAPE if args.circuit else SHAPE)
    if args.eval_only or args.byte_errors:  # the shape of the model being measured
        with open(os.path.join(args.out, "config.json")) as f:
            shipped = json.load(f)
        T.CFG.update({k: shipped[k] for k in T.CFG})
        model = T.Llama(T.CFG)
        model.load_state_dict(T.load_safetensors(os.path.join(args.out, "model.safetensors")), strict=False)
    else:
        model = T.Llama(T.CFG)
        if args.circuit:
            circuit.apply_masks(model, circuit.build(model))
    if args.byte_errors:
        byte_errors(model, args.byte_errors)
        return
    if args.eval_only:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(root, "testing", "fixtures", "recall-prompts.json")) as f:
            prompts = json.load(f)["prompts"]
        r, fails = T.eval_recall(model, prompts)
        print(f"{args.out}: exact recall {r * 100:.1f}% on {len(prompts)} held-out prompts; first misses: {fails[:3]}")
        return
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    pools = corpus.Pools(heldout=False)
    val = {h: corpus.make_eval_prompts(seed=4242 + h, n=48, min_bytes=max(60, h // 2),
                                       max_bytes=min(h, 1000)) for h in LEVELS}
    full_val = corpus.make_eval_prompts(seed=999, n=64)
    os.makedirs(args.work, exist_ok=True)
    last = os.path.join(args.work, "last.pt")
    step, level, best = 0, 0, -1.0
    if args.resume and os.path.exists(last):
        ck = torch.load(last)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, level, best = ck["step"], ck["level"], ck["best"]
        print(f"resumed at step {step}, level {level}, best {best * 100:.1f}%", flush=True)
    print(f"{sum(p.numel() for p in model.parameters())} parameters, shape {T.CFG}", flush=True)

    def batch(s):
        rng = random.Random(args.seed * 1_000_003 + s)
        seqs, top = [], LEVELS[level]
        while sum(len(ids) for ids, _ in seqs) < args.tokens_per_step:
            if s <= args.warmup_copy and rng.random() < 0.5:
                ids, _, rep = T.make_repeat(rng, 0, warm=True)
                seqs.append((ids, rep))
                continue
            if s > max(args.warmup_copy, args.p_repeat_from) and rng.random() < args.p_repeat:
                ids, _, rep = T.make_repeat(rng, rng.randint(40, top))
                seqs.append((ids, rep))
                continue
            # half the contexts anywhere up to the level's length, half in its upper half (the new lengths)
            size_b = rng.randint(40, top) if rng.random() < 0.5 else rng.randint(top // 2, top)
            turns = corpus.make_conversation(rng, pools, size_b, rng.randint(3, 4 + size_b // 250),
                                             p_dup=args.p_dup, p_near=args.p_near, p_record_max=args.p_record_max,
                                             p_unknown=0.12 if s < args.unknown_until else 0.0)
            turns = [(user, corpus.answer_text(user[-5:-1], code)) for user, code in first_asks(turns)]
            ids, w, rep = corpus.encode_turns(turns, with_repeats=True)
            seqs.append((ids, [max(a, b) for a, b in zip(w, rep)]))
        t = max(len(ids) for ids, _ in seqs)
        x = torch.full((len(seqs), t), corpus.ENDOFTEXT, dtype=torch.long)
        ans = torch.zeros((len(seqs), t))
        wt = torch.zeros((len(seqs), t))
        for i, (ids, w) in enumerate(seqs):
            x[i, : len(ids)] = torch.tensor(ids)
            ans[i, : len(ids)] = torch.tensor(w, dtype=torch.float32)
            wt[i, : len(ids)] = 0.05
        wt = torch.maximum(wt, ans)
        return x[:, :-1], x[:, 1:], wt[:, 1:], ans[:, 1:]

    def checkpoint():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "level": level,
                    "best": best}, last + ".tmp")
        os.replace(last + ".tmp", last)

    t0 = time.time()
    while step < args.max_steps and time.time() - t0 < args.max_minutes * 60:
        step += 1
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 30) * (args.lr_drop if step >= args.lr_drop_at else 1.0)
        x, y, w, ans = batch(step)
        logits, _, loss = T.train_step(model, opt, x, y, w)
        if step % 10 == 0:
            with torch.no_grad():
                acc = (((logits.argmax(-1) == y).float() * ans).sum() / ans.sum()).item()
            print(f"step {step} level {level} T={x.shape[1]} loss {loss.item():.3f} answer-token acc {acc:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if step % 50 == 0:
            r, _ = T.eval_recall(model, val[LEVELS[level]])
            print(f"EVAL step {step} level {level} (<= {LEVELS[level]} B) exact {r * 100:.1f}%", flush=True)
            if level >= len(LEVELS) - 2 and (step % 100 == 0 or r >= args.gate):
                rf, _ = T.eval_recall(model, full_val)
                print(f"  full range (100-1000 B) exact {rf * 100:.1f}%", flush=True)
                if rf >= best:
                    best = rf
                    T.export_hf(model, args.out)
                    print(f"  exported to {args.out}", flush=True)
                if rf >= args.target:
                    print(f"reached {rf * 100:.1f}% at step {step}", flush=True)
                    break
            if r >= args.gate and level < len(LEVELS) - 1:
                level += 1
                print(f"  -> level {level} (contexts up to {LEVELS[level]} B)", flush=True)
            checkpoint()
            if step % 250 == 0:
                shutil.copyfile(last, os.path.join(args.work, f"step{step}.pt"))
    checkpoint()  # where --resume continues
    if best < 0:  # the curriculum never reached the full range: ship the last weights
        T.export_hf(model, args.out)
        print(f"exported the step-{step} weights to {args.out}", flush=True)
    full = f"{best * 100:.1f}%" if best >= 0 else "not measured (the run stopped before the 850-byte level)"
    print(f"done at step {step} in {time.time() - t0:.0f}s; best full-range recall {full}", flush=True)


if __name__ == "__main__":
    main()
