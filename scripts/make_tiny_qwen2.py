#!/usr/bin/python3
"""Build models/tiny-qwen2: a tiny random-weight Qwen2-style model for loader tests.

    /usr/bin/python3 scripts/make_tiny_qwen2.py [--out models/tiny-qwen2] [--seed 7]

Qwen2ForCausalLM layout: q/k/v projections with biases, o_proj without, GQA (4 heads, 2 KV heads),
untied embeddings (a separate lm_head.weight), rope_theta 1e6, no sliding window. Hidden 64,
2 layers, intermediate 128, the same byte-level ChatML tokenizer as kvfence-tiny. Weights are
N(0, 0.15) (norm weights 1 + N(0, 0.1)) so logits differ clearly between tokens; stored as bf16
(round to nearest even) and sharded into two safetensors files with model.safetensors.index.json,
so the sharded and bf16 load paths are exercised. Deterministic for a given seed.
"""

import argparse
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_files  # noqa: E402

CFG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 264,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
    "attention_dropout": 0.0, "initializer_range": 0.15, "torch_dtype": "bfloat16",
    "bos_token_id": 256, "eos_token_id": [258, 256], "pad_token_id": 256, "use_cache": True,
}


def bf16_bytes(t):
    """f32 tensor -> little-endian bf16 bytes, round to nearest even."""
    bits = t.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return bits.numpy().astype("<u2").tobytes()


def write_shard(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors:
        raw = bf16_bytes(t)
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return off


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/tiny-qwen2")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    c = CFG
    g = torch.Generator().manual_seed(args.seed)
    d, hd, nh, nkv, inter = (c["hidden_size"], c["head_dim"], c["num_attention_heads"],
                             c["num_key_value_heads"], c["intermediate_size"])

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    def norm():
        return 1.0 + torch.randn(d, generator=g) * 0.1

    tensors = [("model.embed_tokens.weight", w(c["vocab_size"], d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", norm()),
            (p + "self_attn.q_proj.weight", w(nh * hd, d)), (p + "self_attn.q_proj.bias", w(nh * hd)),
            (p + "self_attn.k_proj.weight", w(nkv * hd, d)), (p + "self_attn.k_proj.bias", w(nkv * hd)),
            (p + "self_attn.v_proj.weight", w(nkv * hd, d)), (p + "self_attn.v_proj.bias", w(nkv * hd)),
            (p + "self_attn.o_proj.weight", w(d, nh * hd)),
            (p + "post_attention_layernorm.weight", norm()),
            (p + "mlp.gate_proj.weight", w(inter, d)), (p + "mlp.up_proj.weight", w(inter, d)),
            (p + "mlp.down_proj.weight", w(d, inter)),
        ]
    tensors += [("model.norm.weight", norm()), ("lm_head.weight", w(c["vocab_size"], d))]

    os.makedirs(args.out, exist_ok=True)
    half = len(tensors) // 2
    shards = [("model-00001-of-00002.safetensors", tensors[:half]),
              ("model-00002-of-00002.safetensors", tensors[half:])]
    weight_map, total = {}, 0
    for fname, ts in shards:
        total += write_shard(os.path.join(args.out, fname), ts)
        weight_map.update({n: fname for n, _ in ts})
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    tokenizer_files.write(args.out, model_max_length=c["max_position_embeddings"])
    print(f"wrote {args.out}: {sum(t.numel() for _, t in tensors):,} params, {total:,} bytes bf16")


if __name__ == "__main__":
    main()
