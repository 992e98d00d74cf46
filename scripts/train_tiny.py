#!/usr/bin/python3
"""Train kvfence-tiny: a ~1.3 M parameter Llama that copies access codes from its context.

Run with Debian's PyTorch (torch 1.13, CPU):  /usr/bin/python3 scripts/train_tiny.py
  --out models/kvfence-tiny   where the Hugging Face files are written (best validation checkpoint)
  --work DIR (default $TMPDIR/kvfence-tiny)   checkpoints (last.pt every 3 min and at each eval, best.pt)
  --resume                     continue from <work>/last.pt (same data stream: batch s depends only
                               on --seed and s; pass the same --steps, or the schedule changes)
  --stop-after N               stop after N steps of this invocation (time-sliced training)
  --eval-only                  greedy recall of <out>/model.safetensors on the eval fixture

Corpus (scripts/corpus.py has the grammar): every QA training sequence is a ChatML conversation
whose first user turn holds a context of 'the access code of account NNNN is XXX-XXX.' records
mixed with filler sentences and distractor facts, followed by 'What is the access code of account
NNNN?'; later user turns ask more questions about the same context. The assistant answers the code,
or 'unknown' (~12%) when the account has no record in the context. With --p-dup a record is repeated
later in its context and the repeat's code is a target too. Auxiliary repeat-copy sequences (a
random string, then the same string again; every byte of the copy is a target) make up the first
20% of steps (induction warm-up, strings of [A-Z0-9]) and --p-repeat of later sequences.
Loss weights: 1.0 on answer tokens (code bytes and <|im_end|>) and copy targets, 0.05 elsewhere.
QA contexts follow a curriculum from 40-300 bytes to 60-1,100 bytes. Held-out accounts/codes never
appear in training (see corpus.py).

The model is the Hugging Face Llama definition implemented here: RMSNorm, RoPE (rotate_half on
[first half | second half] of head_dim), GQA attention, SwiGLU MLP, tied LM head; parameter
names match LlamaForCausalLM, and weights are saved as f32 safetensors written by hand.
"""

import argparse
import ctypes
import json
import math
import os
import random
import struct
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

CFG = dict(
    vocab_size=corpus.VOCAB_SIZE, hidden_size=160, num_attention_heads=4, num_key_value_heads=2,
    head_dim=40, intermediate_size=512, num_hidden_layers=4, rms_norm_eps=1e-5,
    rope_theta=1000000.0, max_position_embeddings=2048,
)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # GQA as in HF repeat_kv: query head h reads kv head h // rep. Grouping the rep query heads
        # of one kv head into one (rep*t, hd) matrix gives the same result with fewer, larger GEMMs.
        rep = self.nh // self.nkv
        qg = q.reshape(b * self.nkv, rep * t, self.hd)
        kt = k.reshape(b * self.nkv, t, self.hd).transpose(1, 2)
        s = torch.baddbmm(mask.repeat(rep, 1), qg, kt, alpha=1.0 / math.sqrt(self.hd))
        o = torch.bmm(torch.softmax(s, dim=-1), v.reshape(b * self.nkv, t, self.hd))
        o = o.view(b, self.nh, t, self.hd)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attn(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        if not c.get("tie_word_embeddings", True):
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c["num_hidden_layers"]) if n.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        t = ids.shape[1]
        pos = torch.arange(t, dtype=torch.float32)
        fr = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((fr, fr), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((t, t), float("-inf")).triu(1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        if hasattr(self, "lm_head"):
            return self.lm_head(self.model.norm(x))
        return self.model.norm(x) @ self.model.embed_tokens.weight.t()  # tied lm_head


def positional_init(model, strength=40.0):
    """Start layer 0 as four previous-token heads (query head h attends to offset h + 1).

    Without this the model sat for 600+ steps on a plateau (it has to discover such heads before
    any copying pays off). Embedding dimension 0 starts as a constant 1.0 for every token, so after
    RMSNorm it is a large constant x0; layer-0 queries and keys read only it, giving a score
    sum_m S cos((i - j - d) theta_m) over the RoPE pairs with theta_m >= 0.04, which puts ~99% of
    the attention on offset d. Values copy the token identity. Everything stays trainable."""
    c = model.c
    hd, nh, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        x0 = (1.0 / emb.pow(2).mean(-1).sqrt()).mean().item()
        a = model.model.layers[0].self_attn
        amp = math.sqrt(strength) / x0
        ms = [m for m in range(hd // 2) if model.inv_freq[m] >= 0.04]
        a.k_proj.weight.zero_()
        a.q_proj.weight.zero_()
        for g in range(nkv):
            for m in ms:
                a.k_proj.weight[g * hd + m, 0] = amp
        for h in range(nh):
            d = h + 1
            for m in ms:
                th = model.inv_freq[m].item()
                a.q_proj.weight[h * hd + m, 0] = amp * math.cos(d * th)
                a.q_proj.weight[h * hd + m + hd // 2, 0] = -amp * math.sin(d * th)
        nn.init.normal_(a.v_proj.weight, std=0.1)
        a.v_proj.weight[:, 0] = 0.0
        nn.init.normal_(a.o_proj.weight, std=0.05)


# ---------------------------------------------------------------------------------------------
def save_safetensors(path, tensors, dtype="F32"):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        if dtype == "F32":
            raw = t.float().numpy().tobytes()
        else:  # BF16: top 16 bits of the f32 bit pattern, round to nearest even
            bits = t.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            raw = bits.to(torch.int16 if False else torch.int32).numpy().astype("<u2").tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


def load_safetensors(path):
    import numpy as np
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        a, b = m["data_offsets"]
        assert m["dtype"] == "F32"
        out[name] = torch.from_numpy(np.frombuffer(data[a:b], dtype="<f4").copy()).view(m["shape"])
    return out


def export_hf(model, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if k != "inv_freq"}
    save_safetensors(os.path.join(out_dir, "model.safetensors"), sd)
    c = model.c
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **{k: v for k, v in c.items() if k != "tie_word_embeddings"},
        "hidden_act": "silu", "tie_word_embeddings": not hasattr(model, "lm_head"), "attention_bias": False,
        "mlp_bias": False, "rope_scaling": None, "initializer_range": 0.02, "torch_dtype": "float32",
        "bos_token_id": corpus.ENDOFTEXT, "eos_token_id": [corpus.IM_END, corpus.ENDOFTEXT],
        "pad_token_id": corpus.ENDOFTEXT, "use_cache": True,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    import tokenizer_files
    tokenizer_files.write(out_dir, model_max_length=c["max_position_embeddings"])


# ---------------------------------------------------------------------------------------------
CTX_OVERRIDE = None  # (lo, hi) from --ctx-range, for pilots
WARMUP_COPY_FRAC = 0.2
P_REPEAT = 0.0  # --p-repeat: share of batch sequences that are repeat-copy sequences (see make_repeat)
P_DUP = 0.0  # --p-dup: probability that a record is repeated later in its context (weight 1 on the repeat's code)


def schedule(step, total):
    """(min_ctx, max_ctx) bytes of context for this step: short first, then the full range."""
    if CTX_OVERRIDE:
        return CTX_OVERRIDE
    f = max(0.0, (step / total - WARMUP_COPY_FRAC) / (1 - WARMUP_COPY_FRAC))  # fraction of the QA phase
    if f < 0.20:
        return 40, 300
    if f < 0.35:
        return 40, 600
    if f < 0.55:
        return 60, 900
    return 60, 1100


def repeat_share(step, total):
    """Share of repeat-copy sequences: all of them during the first 8% (induction warm-up), then P_REPEAT."""
    return 1.0 if step < WARMUP_COPY_FRAC * total else P_REPEAT

REPEAT_CHARS = corpus.CODE_CHARS + "abcdefghijklmnopqrstuvwxyz -."


def make_repeat(rng, target_bytes, warm=False):
    """Auxiliary copy sequence: a user turn holding a random string and then the same string again.
    Every token of the second copy is a target (weight 1). Random text can only be predicted by
    copying, so this dense signal makes the model form induction (copy) heads within ~100 steps;
    the question answering then builds on them (without it the model sat on a plateau)."""
    n = rng.randint(16, 48) if warm else max(16, min(target_bytes, 600) // 2)
    s = "".join(rng.choice(corpus.CODE_CHARS if warm else REPEAT_CHARS) for _ in range(n))
    first = [corpus.IM_START] + corpus.encode_text("user\n" + s + "\n")
    second = corpus.encode_text(s) + [corpus.IM_END]
    ids = first + second + corpus.encode_text("\n")
    return ids, [0] * len(ids), [0] * len(first) + [1] * len(second) + [0]


def make_batch(seed, step, total, tokens_per_step):
    rng = random.Random(seed * 1_000_003 + step)
    lo, hi = schedule(step, total)
    target = rng.randint(lo, hi)
    seqs = []
    budget = 0
    pools = TRAIN_POOLS
    while budget < tokens_per_step or not seqs:
        tb = max(30, int(target * rng.uniform(0.85, 1.15)))
        nq = rng.randint(2, 3 + tb // 150)
        share = repeat_share(step, total)
        if share > 0 and rng.random() < share:
            seqs.append(make_repeat(rng, tb, warm=share == 1.0))
        else:
            conv = corpus.make_conversation(rng, pools, tb, nq, p_dup=P_DUP)
            seqs.append(corpus.encode_turns(conv, with_repeats=True))
        ids = seqs[-1][0]
        budget += len(ids)
    t = max(len(s[0]) for s in seqs)
    x = torch.full((len(seqs), t), corpus.ENDOFTEXT, dtype=torch.long)
    wt = torch.zeros((len(seqs), t))
    ans = torch.zeros((len(seqs), t))
    rep = torch.zeros((len(seqs), t))
    for i, (ids, w, r) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        ans[i, : len(ids)] = torch.tensor(w, dtype=torch.float32)
        rep[i, : len(ids)] = torch.tensor(r, dtype=torch.float32)
        wt[i, : len(ids)] = 0.05
    wt = torch.maximum(torch.maximum(wt, ans), rep)
    # targets: predict token j+1 at position j; weight/answer flags belong to the target token
    return x[:, :-1], x[:, 1:], wt[:, 1:], ans[:, 1:]


TRAIN_POOLS = corpus.Pools(heldout=False)


def keep_freed_memory():
    """Tells glibc's malloc to keep freed memory instead of returning it to the kernel. Every step
    has a different sequence length, so PyTorch's large activation buffers are freed and allocated
    anew each step; by default each one is a fresh mmap whose pages the kernel must fault in and
    zero (measured: a quarter of the CPU time spent in the kernel, steps ~20% slower)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-4, 0)  # M_MMAP_MAX: serve big blocks from the heap, not from fresh mmaps
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap
    libc.mallopt(-2, 2**26)  # M_TOP_PAD: grow the heap 64 MiB at a time


def train_step(model, opt, x, y, w):
    """One optimizer step on the weighted next-token loss (weights `w` per target token, grad clip
    1.0); returns (logits, per-token nll, loss) for the caller's logging."""
    logits = model(x)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view_as(w)
    loss = (nll * w).sum() / w.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return logits, nll, loss


def answer_exact(logits, y, ans):
    """Per sequence: fraction of answers whose every token (code + <|im_end|>) is argmax."""
    ok = (logits.argmax(-1) == y) | (ans == 0)
    return ok, ans


@torch.no_grad()
def eval_recall(model, prompts, bs=8):
    """Greedy exact-match recall via teacher forcing (equivalent for greedy decoding)."""
    model.eval()
    hits, fails = 0, []
    for i in range(0, len(prompts), bs):
        chunk = prompts[i: i + bs]
        seqs = []
        for p in chunk:
            pr = corpus.encode_prompt(p["messages"][0]["content"])
            tgt = corpus.encode_text(p.get("answer", p["expected"])) + [corpus.IM_END]
            seqs.append((pr, tgt))
        t = max(len(a) + len(b) for a, b in seqs)
        x = torch.full((len(seqs), t), corpus.ENDOFTEXT, dtype=torch.long)
        for j, (a, b) in enumerate(seqs):
            x[j, : len(a) + len(b)] = torch.tensor(a + b)
        pred = model(x).argmax(-1)
        for j, (a, b) in enumerate(seqs):
            got = pred[j, len(a) - 1: len(a) - 1 + len(b)].tolist()
            if got == b:
                hits += 1
            else:
                fails.append((chunk[j]["expected"], bytes(c for c in got if c < 256).decode("utf-8", "replace")))
    model.train()
    return hits / len(prompts), fails


def main():
    global CTX_OVERRIDE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/kvfence-tiny")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "kvfence-tiny"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens-per-step", type=int, default=3072)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--ckpt-every-s", type=float, default=180)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=0, help="stop (saving last.pt) after this many steps of this invocation")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--fixture", default="testing/fixtures/recall-prompts.json")
    ap.add_argument("--ctx-range", default="", help="LO,HI: fixed context bytes instead of the curriculum (pilots)")
    ap.add_argument("--p-dup", type=float, default=0.3)
    ap.add_argument("--positional-init", type=int, default=0, help="1: start layer 0 as previous-token heads")
    ap.add_argument("--p-repeat", type=float, default=0.2)
    args = ap.parse_args()
    global P_DUP, P_REPEAT
    P_DUP = args.p_dup
    P_REPEAT = args.p_repeat
    if args.ctx_range:
        CTX_OVERRIDE = tuple(int(v) for v in args.ctx_range.split(","))

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.work, exist_ok=True)
    model = Llama(CFG)
    if args.positional_init:
        positional_init(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}", flush=True)

    with open(args.fixture) as f:
        fixture = json.load(f)["prompts"]
    if args.eval_only:
        model.load_state_dict(load_safetensors(os.path.join(args.out, "model.safetensors")), strict=False)
        t0 = time.time()
        r, fails = eval_recall(model, fixture)
        print(f"recall {r * 100:.1f}% ({round(r * len(fixture))}/{len(fixture)}) in {time.time() - t0:.0f}s")
        for e, g in fails:
            print(f"  expected {e} got {g!r}")
        return
    # periodic eval slice: a validation set from the held-out pools with another seed (not the fixture)
    val = corpus.make_eval_prompts(seed=args.seed + 777, n=64)

    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    step, best = 0, -1.0
    last_path, best_path = os.path.join(args.work, "last.pt"), os.path.join(args.work, "best.pt")
    if args.resume and os.path.exists(last_path):
        ck = torch.load(last_path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, best = ck["step"], ck["best"]
        torch.set_rng_state(ck["torch_rng"])
        print(f"resumed at step {step} (best {best:.3f})", flush=True)

    def lr_at(s):
        warm = 30
        if s < warm:
            return args.lr * (s + 1) / warm
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (args.steps - warm))))

    def save(path, rec):
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                    "torch_rng": torch.get_rng_state(), "recall": rec, "cfg": CFG}, path + ".tmp")
        os.replace(path + ".tmp", path)

    t_start, t_ck = time.time(), time.time()
    ema_loss, ema_acc = None, None
    first_step = step
    while step < args.steps:
        if args.stop_after and step - first_step >= args.stop_after:
            save(last_path, None)
            print(f"stopped at step {step} (--stop-after); continue with --resume", flush=True)
            return
        x, y, w, ans = make_batch(args.seed, step, args.steps, args.tokens_per_step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits, nll, loss = train_step(model, opt, x, y, w)
        step += 1
        with torch.no_grad():
            n_ans = max(ans.sum().item(), 1.0)
            ans_loss = ((nll * ans).sum() / n_ans).item()
            tok_acc = (((logits.argmax(-1) == y).float() * ans).sum() / n_ans).item()
        ema_loss = ans_loss if ema_loss is None else 0.9 * ema_loss + 0.1 * ans_loss
        ema_acc = tok_acc if ema_acc is None else 0.9 * ema_acc + 0.1 * tok_acc
        if step % 10 == 0:
            el = time.time() - t_start
            print(f"step {step}/{args.steps} T={x.shape[1]} B={x.shape[0]} lr={lr_at(step):.2e} "
                  f"loss {loss.item():.3f} ans_loss {ema_loss:.3f} ans_tok_acc {ema_acc:.3f} {el:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            r, _ = eval_recall(model, val)
            print(f"EVAL step {step} val recall {r * 100:.1f}% (64 held-out prompts, 100-1000 B)", flush=True)
            if r >= best:
                best = r
                save(best_path, r)
                export_hf(model, args.out)
                print(f"  new best {r * 100:.1f}% -> exported to {args.out}", flush=True)
            save(last_path, r)
            t_ck = time.time()
        elif time.time() - t_ck > args.ckpt_every_s:
            save(last_path, None)
            t_ck = time.time()
    print(f"done in {time.time() - t_start:.0f}s; best val recall {best * 100:.1f}%", flush=True)


if __name__ == "__main__":
    main()
