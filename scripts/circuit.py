#!/usr/bin/python3
"""A copy circuit written into kvfence-tiny's weights before training (used by `train_recall.py`).

Why: three one-hour runs from random weights learned *where* in a record the next code byte sits,
but not reliably *which* record (docs/kvfence-tiny.md: ~97% of wrong code bytes were the same byte
of another record's code). The lookup that is missing is an n-gram induction head: "find the
earlier place whose 8 preceding bytes equal my last 8 bytes, and predict the byte that followed
it". After "account 4821 is " those 8 bytes are "4821 is ", so the head finds the record of account
4821 and reads its code byte by byte. This module writes that head into the weights; training then
learns everything else (the answer's wording, copying the asked account's digits from the
question, where to stop), with the written weights held fixed by gradient masks.

The residual stream (hidden 256) is split into named parts:

    ID      [0, 48)     token identity: every token a fixed unit-RMS vector, the first 12 dims its
                        "code" (the 10 digits orthogonal there); written by the embedding
    ONE     48          a constant 1 for every token (queries and keys of the offset heads read it)
    SLOT m  [49 + 12(m-1), 49 + 12m), m = 1..8: the code of the token m positions back
    OUT     [145, 193)  the identity of the token the induction head predicts; the LM head reads it
    FREE    [193, 256)  what the trained layers write

Layer 0: eight offset heads (query head h looks h+1 tokens back). RoPE with rope_theta 1e20 and
head_dim 128 gives pairs whose frequencies run from 1 rad/token down to 1e-18; on the ten fastest
pairs, a query and key built from ONE score sum_p A cos(theta_p (i - j - m)), which peaks at distance
m: 9.8 logits above the next distance (99.99% of the weight) and 50 above any distance more than 3
away, up to 2,048. The value is the token's code, and head h writes it to SLOT h+1. Layer 0's MLP
is zero.

Layer 1, query head 0 with KV head 0: the induction head. Its key is SLOT 1..8 (the 8 bytes before
a position), its query is the token's code and SLOT 1..7 (the last 8 bytes up to and including
it), both on the 48 slowest RoPE pairs (at most 0.02 rad of rotation over 2,048 positions, so the
score is a plain dot product of codes). The value is the attended token's identity, written to
OUT; the LM head's OUT columns hold each token's identity, so the head's vote is a logit. Query
heads 1-3 share that key and value with their own (trained) queries; heads 4-7 and KV head 1, the
MLP of layers 1-2 and all of layer 2 are trained, and write only FREE.

The three scales below are as small as the job allows: attention scores of a few hundred make
float32 logits drift from the float64 reference by more than the parity tests' 1e-4 (measured with
1.6 / 24 / 0.5: 2.7e-4 on the WebAssembly kernels; with these: 4.5e-5).
"""
import math

import torch

HIDDEN, HEAD_DIM, N_HEADS, N_KV = 256, 128, 8, 2
ROPE_THETA = 1e20
N_ID, N_CODE, N_SLOTS = 48, 12, 8
ONE = N_ID
SLOT0 = ONE + 1
OUT = SLOT0 + N_SLOTS * N_CODE
FREE = OUT + N_ID
POS_PAIRS = range(0, 10)  # fast RoPE pairs: offset heads
CONTENT_PAIRS = range(16, 64)  # slow RoPE pairs: content matching (theta <= 1e-5)

SHAPE = dict(hidden_size=HIDDEN, num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM,
             intermediate_size=512, num_hidden_layers=3, rope_theta=ROPE_THETA, tie_word_embeddings=False)

OFFSET_LOGIT = 16.0  # score of an offset head per fast pair, before the softmax
MATCH_LOGIT = 1.0  # induction score per matching slot-dimension unit (a code has 12 units)
VOTE_LOGIT = 0.3  # LM head weight on OUT


def slot(m):
    return slice(SLOT0 + (m - 1) * N_CODE, SLOT0 + m * N_CODE)


def identities(vocab, seed=20261130):
    """Per token a 48-dim identity of RMS 1 whose first 12 dims (its code) have norm sqrt(12);
    the ten digit codes are orthonormal directions (times sqrt(12)), so accounts differing in one
    digit differ by a whole code in the match."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randn(vocab, N_ID, generator=g)
    q, _ = torch.linalg.qr(torch.randn(N_CODE, N_CODE, generator=g))
    for d in range(10):
        ids[ord("0") + d, :N_CODE] = q[d]
    ids[:, :N_CODE] *= math.sqrt(N_CODE) / ids[:, :N_CODE].norm(dim=1, keepdim=True)
    ids[:, N_CODE:] *= math.sqrt(N_ID - N_CODE) / ids[:, N_CODE:].norm(dim=1, keepdim=True)
    return ids


def content_dims():
    """The 96 head dims of the slow RoPE pairs, in slot order."""
    out = []
    for p in CONTENT_PAIRS:
        out += [p, p + HEAD_DIM // 2]
    return out


@torch.no_grad()
def build(model):
    """Writes the circuit into a fresh `train_tiny.Llama` of SHAPE; returns {parameter name: mask}
    with 1 where training may change the weight and 0 where the circuit fixes it."""
    c = model.c
    assert c["hidden_size"] == HIDDEN and c["head_dim"] == HEAD_DIM and c["num_attention_heads"] == N_HEADS
    vocab = c["vocab_size"]
    inv = model.inv_freq
    sd = dict(model.named_parameters())
    masks = {n: torch.ones_like(p) for n, p in sd.items()}

    def fix(name, value=None, index=(slice(None),)):
        p = sd[name]
        if value is not None:
            p[index] = value
        masks[name][index] = 0.0

    ident = identities(vocab)
    emb = torch.zeros(vocab, HIDDEN)
    emb[:, :N_ID] = ident
    emb[:, ONE] = 1.0
    fix("model.embed_tokens.weight", emb)
    # after RMSNorm the embedding is scaled by 1/rms: the same for every token
    x0 = 1.0 / emb.pow(2).mean(-1).sqrt()[0].item()

    # ---- layer 0: offset heads ---------------------------------------------------------------
    a0 = "model.layers.0.self_attn."
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        fix(a0 + n + ".weight", 0.0)
    for n in ("gate_proj", "up_proj", "down_proj"):
        fix(f"model.layers.0.mlp.{n}.weight", 0.0)
    fix("model.layers.0.input_layernorm.weight", 1.0)
    fix("model.layers.0.post_attention_layernorm.weight", 1.0)
    amp = math.sqrt(OFFSET_LOGIT * math.sqrt(HEAD_DIM)) / x0
    q, k, v, o = (sd[a0 + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    half = HEAD_DIM // 2
    for g in range(N_KV):
        for p in POS_PAIRS:
            k[g * HEAD_DIM + p, ONE] = amp
        for d in range(N_CODE):
            v[g * HEAD_DIM + d, d] = 1.0 / x0
    for h in range(N_HEADS):
        m = h + 1
        for p in POS_PAIRS:
            th = inv[p].item()
            q[h * HEAD_DIM + p, ONE] = amp * math.cos(m * th)
            q[h * HEAD_DIM + p + half, ONE] = -amp * math.sin(m * th)
        for d in range(N_CODE):
            o[slot(m).start + d, h * HEAD_DIM + d] = 1.0

    # ---- layer 1, KV head 0 / query head 0: the induction head -------------------------------
    a1 = "model.layers.1.self_attn."
    fix("model.layers.1.input_layernorm.weight", 1.0)
    q, k, v, o = (sd[a1 + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    kv0 = slice(0, HEAD_DIM)
    fix(a1 + "k_proj.weight", 0.0, (kv0,))
    fix(a1 + "v_proj.weight", 0.0, (kv0,))
    fix(a1 + "q_proj.weight", 0.0, (slice(0, HEAD_DIM),))
    # residual at layer 1: ID, ONE and the slots; its RMS is the same at every position
    x1 = 1.0 / math.sqrt((N_ID + 1 + N_SLOTS * N_CODE) / HIDDEN)
    s = math.sqrt(MATCH_LOGIT * math.sqrt(HEAD_DIM)) / x1
    dims = content_dims()
    for m in range(N_SLOTS):
        for d in range(N_CODE):
            hd = dims[m * N_CODE + d]
            k[hd, slot(m + 1).start + d] = s
            q[hd, (slot(m).start if m > 0 else 0) + d] = s
    for d in range(N_ID):
        v[d, d] = 1.0 / x1
    # head 0 writes OUT only; the other heads' outputs (and every trained layer's) write FREE only
    fix(a1 + "o_proj.weight", 0.0, (slice(0, FREE),))
    fix(a1 + "o_proj.weight", 0.0, (slice(None), slice(0, HEAD_DIM)))
    for d in range(N_ID):
        o[OUT + d, d] = 1.0
    for layer in (1, 2):
        fix(f"model.layers.{layer}.mlp.down_proj.weight", 0.0, (slice(0, FREE),))
    fix("model.layers.2.self_attn.o_proj.weight", 0.0, (slice(0, FREE),))

    # ---- the LM head reads OUT as identities; the final norm keeps OUT's scale --------------
    fix("lm_head.weight", ident * VOTE_LOGIT, (slice(None), slice(OUT, FREE)))
    fix("model.norm.weight", 1.0, (slice(0, FREE),))
    return masks


def apply_masks(model, masks):
    """Zeroes the gradient of every fixed weight (AdamW without weight decay then never moves it)."""
    for n, p in model.named_parameters():
        m = masks[n]
        if m.min() < 1:
            p.register_hook(lambda g, m=m: g * m)
