#!/usr/bin/python3
"""Golden fixtures for the forward-pass parity test (src/model/parity.test.ts).

An independent float64 PyTorch implementation of the Llama / Mistral / Qwen2 decoder, reading a
Hugging Face folder directly (config.json + model.safetensors or a sharded
model.safetensors.index.json; F32, BF16 or F16 tensors parsed by hand, no transformers or
safetensors packages). For a fixed set of seeded prompts (token-id lists of lengths 1, 7, 33 and
100 by default) it records the logits at every prompt position and the greedy continuation of 64
tokens, and writes them as JSON with logits as base64 little-endian f32 [positions][vocab].

Run with Debian's torch (1.13):
    /usr/bin/python3 scripts/golden.py models/kvfence-tiny testing/fixtures/golden-kvfence-tiny.json

Other weight formats (docs/weights.md): a folder written by `kvfence quantize IN OUT --type T`
holds bf16/f16 tensors, or Q8_0/Q4_0 blocks as U8 tensors named in the `kvfence.weight_formats`
metadata; this script dequantises those blocks itself (scale f16 d, then 32 int8 q: q*d; or 16
bytes of nibbles, low nibbles elements 0-15: (q-8)*d) and runs the same float64 model on them, so
the fixture is the reference for exactly the weights kvfence reads:
    node dist/src/cli/main.js quantize models/kvfence-tiny /tmp/t-q8 --type q8_0
    /usr/bin/python3 scripts/golden.py /tmp/t-q8 testing/fixtures/golden-kvfence-tiny-q8_0.json \
        --lengths 1,7,33 --continuation 16 --min-margin 0.5 --seed 15
The committed fixtures: kvfence-tiny in bf16 and f16 with --lengths 1,7,33 --continuation 32;
kvfence-tiny in q8_0 and q4_0 as above; tiny-qwen2 in q8_0 and q4_0 with --lengths 1,7,33
--continuation 8 --min-margin 0.2. The wider margins are for the int8-activation kernels, whose
logits move by up to the tolerances in src/model/parity-formats.test.ts.

Nothing here shares code with the TypeScript side: RoPE uses HF's cat(freqs, freqs) tables and
rotate_half, attention a dense causal mask with repeat_interleave over KV heads.
"""

import argparse
import base64
import json
import os
import struct
import sys

import torch

torch.set_num_threads(1)

DTYPES = {"F32": (torch.float32, 4), "BF16": (None, 2), "F16": (torch.float16, 2), "F64": (torch.float64, 8)}


def dequantize_blocks(buf, fmt, shape):
    """llama.cpp's Q8_0 / Q4_0 blocks (32 weights each along a row) as a float64 tensor of `shape`."""
    block = {"q8_0": 34, "q4_0": 18}[fmt]
    raw = torch.frombuffer(buf, dtype=torch.uint8).reshape(-1, block)
    d = raw[:, :2].contiguous().view(torch.float16).to(torch.float64)  # [blocks, 1]
    if fmt == "q8_0":
        q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float64)
    else:
        nib = raw[:, 2:].to(torch.int64)
        q = torch.cat((nib & 0x0F, nib >> 4), dim=1).to(torch.float64) - 8
    return (q * d).reshape(shape)


def read_safetensors(path):
    """All tensors of one .safetensors file as float64 torch tensors."""
    with open(path, "rb") as f:
        raw = f.read()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len].decode("utf-8"))
    base = 8 + header_len
    blocks = json.loads(header.get("__metadata__", {}).get("kvfence.weight_formats", "{}"))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if name in blocks:
            start, end = info["data_offsets"]
            out[name] = dequantize_blocks(bytearray(raw[base + start : base + end]), blocks[name]["dtype"], blocks[name]["shape"])
            continue
        dtype = info["dtype"]
        if dtype not in DTYPES:
            raise SystemExit(f"{path}: tensor {name} has unsupported dtype {dtype}")
        start, end = info["data_offsets"]
        buf = bytearray(raw[base + start : base + end])
        shape = info["shape"]
        if dtype == "BF16":
            # bf16 is the high half of an f32: widen the bits and shift left by 16.
            bits = torch.frombuffer(buf, dtype=torch.int16).to(torch.int32) & 0xFFFF
            t = (bits << 16).view(torch.float32)
        else:
            t = torch.frombuffer(buf, dtype=DTYPES[dtype][0]) if len(buf) else torch.zeros(0)
        out[name] = t.to(torch.float64).reshape(shape)
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(model_dir, name)))
    return tensors


class Model:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.layers = cfg["num_hidden_layers"]
        self.eps = float(cfg["rms_norm_eps"])
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.vocab = cfg["vocab_size"]
        self.max_pos = cfg["max_position_embeddings"]
        if cfg.get("rope_scaling"):
            raise SystemExit("rope_scaling is not implemented")
        w = load_weights(model_dir)
        self.w = w
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight")
        if cfg.get("tie_word_embeddings", False) or self.lm_head is None:
            self.lm_head = self.embed
        self.final_norm = w["model.norm.weight"]

    def rmsnorm(self, x, weight):
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + self.eps))

    def rope(self, n):
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def linear(self, x, prefix, name):
        y = x @ self.w[f"{prefix}.{name}.weight"].T
        b = self.w.get(f"{prefix}.{name}.bias")
        return y if b is None else y + b

    def forward(self, ids):
        """Logits [n][vocab] (float64) for every position of the token list `ids`."""
        n = len(ids)
        x = self.embed[torch.tensor(ids, dtype=torch.long)]
        cos, sin = self.rope(n)
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        group = self.heads // self.kv_heads
        for layer in range(self.layers):
            p = f"model.layers.{layer}"
            h = self.rmsnorm(x, self.w[f"{p}.input_layernorm.weight"])
            q = self.linear(h, p, "self_attn.q_proj").view(n, self.heads, self.head_dim).transpose(0, 1)
            k = self.linear(h, p, "self_attn.k_proj").view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            v = self.linear(h, p, "self_attn.v_proj").view(n, self.kv_heads, self.head_dim).transpose(0, 1)
            q = q * cos + self.rotate_half(q) * sin
            k = k * cos + self.rotate_half(k) * sin
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
            scores = (q @ k.transpose(1, 2)) / (self.head_dim**0.5) + mask
            attn = torch.softmax(scores, dim=-1) @ v
            attn = attn.transpose(0, 1).reshape(n, self.heads * self.head_dim)
            x = x + self.linear(attn, p, "self_attn.o_proj")
            h = self.rmsnorm(x, self.w[f"{p}.post_attention_layernorm.weight"])
            gate = self.linear(h, p, "mlp.gate_proj")
            up = self.linear(h, p, "mlp.up_proj")
            x = x + self.linear(torch.nn.functional.silu(gate) * up, p, "mlp.down_proj")
        return self.rmsnorm(x, self.final_norm) @ self.lm_head.T


def greedy_path(model, ids, count):
    """(logits of every prompt position, greedy continuation, smallest top-2 logit gap on the way)."""
    logits = model.forward(ids)
    seq = list(ids)
    greedy = []
    min_margin = float("inf")
    last = logits[-1]
    for step in range(count):
        top2 = torch.topk(last, 2).values
        min_margin = min(min_margin, float(top2[0] - top2[1]))
        token = int(torch.argmax(last))
        greedy.append(token)
        seq.append(token)
        if step + 1 < count:
            last = model.forward(seq)[-1]
    return logits, greedy, min_margin


def b64_f32(t):
    return base64.b64encode(t.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode("ascii")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--lengths", default="1,7,33,100", help="prompt lengths, comma-separated")
    ap.add_argument("--continuation", type=int, default=64, help="greedy tokens after each prompt")
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--min-margin", type=float, default=1e-3, help="redraw prompts with closer greedy ties")
    args = ap.parse_args()

    model = Model(args.model_dir)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = []
    for length in [int(s) for s in args.lengths.split(",")]:
        if length + args.continuation > model.max_pos:
            raise SystemExit(f"prompt {length} + {args.continuation} exceeds max_position_embeddings {model.max_pos}")
        # Redraw a prompt whose greedy path has a near-tie (top-1 minus top-2 below --min-margin):
        # there an f32 implementation may legitimately pick the other token.
        for attempt in range(50):
            ids = torch.randint(0, model.vocab, (length,), generator=gen).tolist()
            logits, greedy, min_margin = greedy_path(model, ids, args.continuation)
            if min_margin >= args.min_margin:
                break
            print(f"prompt {length}: redrawn (greedy margin {min_margin:.3g})", file=sys.stderr)
        else:
            raise SystemExit(f"no prompt of length {length} with a greedy margin >= {args.min_margin}")
        prompts.append(
            {
                "tokens": ids,
                "logits": b64_f32(logits),
                "greedy": greedy,
                # Smallest top-1 minus top-2 logit gap along the greedy path: a gap far below the
                # parity tolerance would make an f32 implementation legitimately diverge.
                "minGreedyMargin": min_margin,
            }
        )
        print(f"prompt {length}: greedy {greedy[:8]}... min margin {min_margin:.3g}", file=sys.stderr)

    fixture = {
        "model": os.path.basename(os.path.normpath(args.model_dir)),
        "generator": "scripts/golden.py (float64 PyTorch reference; logits stored as base64 little-endian f32)",
        "vocabSize": model.vocab,
        "continuation": args.continuation,
        "prompts": prompts,
    }
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
