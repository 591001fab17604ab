"""One MLA layer's attention over a prompt, the absorbed form against the expanded form (mla.py), side by side
in one process: queries and cache rows, attention, output projection, each timed in a CUDA graph
(bench.timing.time_cuda_graph), with the largest difference of the two outputs.

    python -m tools.mla_prompt_ab --shape kimi-k2.6-ep8-rank --prompts 4096 32768 --out mla_prompt.json

The absorbed form runs the verify kernel (`triton`) with a causal mask, as every prompt did before the expanded
form; one layer's time × the target's layers is the prompt's attention share of a prefill.
"""
from __future__ import annotations

import argparse

import torch

from ddtree_lab.attention import TreeMask, mla_attention
from ddtree_lab.bench import write_bench_json
from ddtree_lab.bench.timing import time_cuda_graph
from ddtree_lab.layers import ROPE_SLACK, Rotary
from ddtree_lab.mla import MlaAttention
from ddtree_lab.pairs.random import shape_configs


def layer_attention(shape: str, seed: int = 0):
    """(an MLA attention module of `shape`, bf16 on the GPU with small random weights; its config)."""
    cfg, _ = shape_configs(shape)
    if cfg.mla is None:
        raise SystemExit(f"{shape}: not an MLA shape")
    torch.manual_seed(seed)
    attn = MlaAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.mla, cfg.attention_scale)
    attn = attn.to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return attn, cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="kimi-k2.6-ep8-rank")
    ap.add_argument("--prompts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    attn, cfg = layer_attention(a.shape)
    rotary = Rotary(cfg.rope_dim, cfg.rope, cfg.max_position_embeddings + ROPE_SLACK).to("cuda")
    rows_out = []
    for T in a.prompts:
        h = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        cos, sin = rotary(torch.arange(T, device="cuda"), h.dtype)
        mask = TreeMask.causal(T, "cuda")
        mask.bits  # packed outside the timed graph

        def absorbed():
            q, rows = attn.queries_and_cache_rows(h, cos, sin)
            att = mla_attention(q[0], rows[0], 0, mask, "triton", cfg.mla.kv_lora_rank, attn.scale)
            return attn.output(att[None])

        def expanded():
            q, rows = attn.queries_and_cache_rows(h, cos, sin, expanded=True)
            return attn.output(attn.expanded_attention(q[0], rows[0], mask)[None], expanded=True)

        with torch.no_grad():
            diff = (absorbed().float() - expanded().float()).abs().max().item()
            ms = {name: time_cuda_graph(fn, n=2, reps=3) for name, fn in
                  (("absorbed", absorbed), ("expanded", expanded), ("absorbed_again", absorbed))}
        row = {"T": T, "heads": cfg.num_attention_heads, "absorbed_ms": min(ms["absorbed"], ms["absorbed_again"]),
               "expanded_ms": ms["expanded"], "max_abs_diff": diff}
        row["expanded_over_absorbed"] = row["expanded_ms"] / row["absorbed_ms"]
        rows_out.append(row)
        print(row, flush=True)
        del h, cos, sin, mask
        torch.cuda.empty_cache()
    write_bench_json(a.out, rows_out, "tools.mla_prompt_ab", argv, shape=a.shape, layers=cfg.num_hidden_layers)


if __name__ == "__main__":
    main()
