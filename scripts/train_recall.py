#!/usr/bin/python3
"""Train the shipped kvfence-tiny: a 2-layer, 192-wide Llama that copies access codes from context.

Run with Debian's PyTorch (torch 1.13, CPU), ideally with OpenBLAS (`apt-get install
libopenblas0-openmp`; Debian's default reference BLAS is about 8x slower):

    /usr/bin/python3 scripts/train_recall.py --out models/kvfence-tiny
    /usr/bin/python3 scripts/train_recall.py --resume           # continue from <work>/last.pt

What it reuses: the corpus grammar, tokenizer and held-out split of `scripts/corpus.py`, and the
Hugging Face Llama definition, safetensors writer, export and teacher-forced recall eval of
`scripts/train_tiny.py` (whose own defaults — 4 layers, 160 wide, a fixed curriculum — never left
the plateau described in docs/kvfence-tiny.md). What differs:

- the shape: 2 layers, hidden 192, 6 heads of 32 (no GQA), intermediate 768, rope_theta 1e4
  (1,231,296 parameters). On a "string shown twice" toy this shape forms a copy circuit in ~300
  steps, where the 4-layer, 160-wide shape sits at chance for 1,000;
- many short conversations per step (16 conversations, 3–6 distinct questions each, loss 1.0 on answer
  tokens and 0.05 elsewhere), no weight decay, lr 1.5e-3 after a 30-step warm-up;
- an adaptive curriculum: contexts of 40..L bytes, L in 150, 250, 400, 650, 1100; every 50 steps
  the exact-match recall on 48 held-out prompts of the current level is measured and L moves up at
  85%. From the level where that gate passes, the 64-prompt full-range (100–1,000 bytes) recall
  is measured too and the best model is exported.

Data for step s comes from random.Random(seed * 1_000_003 + s), so a resumed run sees the same
stream. Checkpoints (model, optimizer, step, level, best) go to <work>/last.pt every 50 steps.
"""
import argparse
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import train_tiny as T  # noqa: E402

SHAPE = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=6, head_dim=32,
             intermediate_size=768, num_hidden_layers=2, rope_theta=10000.0)
LEVELS = [150, 250, 400, 650, 1100]


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/kvfence-tiny")
    ap.add_argument("--work", default="/work/scratch/kvfence-tiny-recall")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--batch", type=int, default=16, help="conversations per step")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--target", type=float, default=0.98, help="stop at this full-range recall")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    T.CFG.update(SHAPE)
    model = T.Llama(T.CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    pools = corpus.Pools(heldout=False)
    val = {h: corpus.make_eval_prompts(seed=4242 + h, n=48, min_bytes=60 if h < 300 else 100,
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
    print(f"{sum(p.numel() for p in model.parameters())} parameters, shape {SHAPE}", flush=True)

    def batch(s):
        rng = random.Random(args.seed * 1_000_003 + s)
        seqs = []
        for _ in range(args.batch):
            turns = corpus.make_conversation(rng, pools, rng.randint(40, LEVELS[level]), rng.randint(3, 6))
            seqs.append(corpus.encode_turns(first_asks(turns)))
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

    t0 = time.time()
    while step < args.max_steps:
        step += 1
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 30)
        x, y, w, ans = batch(step)
        logits = model(x)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view_as(w)
        loss = (nll * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            with torch.no_grad():
                acc = (((logits.argmax(-1) == y).float() * ans).sum() / ans.sum()).item()
            print(f"step {step} level {level} T={x.shape[1]} loss {loss.item():.3f} answer-token acc {acc:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if step % 50 == 0:
            r, _ = T.eval_recall(model, val[LEVELS[level]])
            print(f"EVAL step {step} level {level} (<= {LEVELS[level]} B) exact {r * 100:.1f}%", flush=True)
            if level == len(LEVELS) - 1 or r >= 0.85:
                rf, _ = T.eval_recall(model, full_val)
                print(f"  full range (100-1000 B) exact {rf * 100:.1f}%", flush=True)
                if rf >= best:
                    best = rf
                    T.export_hf(model, args.out)
                    print(f"  exported to {args.out}", flush=True)
                if rf >= args.target:
                    print(f"reached {rf * 100:.1f}% at step {step}", flush=True)
                    break
            if r >= 0.85 and level < len(LEVELS) - 1:
                level += 1
                print(f"  -> level {level} (contexts up to {LEVELS[level]} B)", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "level": level,
                        "best": best}, last + ".tmp")
            os.replace(last + ".tmp", last)
    print(f"done at step {step} in {time.time() - t0:.0f}s; best full-range recall {best * 100:.1f}%", flush=True)


if __name__ == "__main__":
    main()
