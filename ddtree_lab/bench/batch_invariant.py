"""Micro-benchmark of the batch-invariant ops (kernels/batch_invariant.py) against the fast path's, side by side
in one run: the linear against torch's (cuBLAS), per tile choice; the chain attention against the tree
attention kernel. Each invariant result is checked for the property: a row's bits equal its bits alone.

    bench_linear(shapes, rows, tile_variants) -> [{name, N, K, M, tiles, torch_us, invariant_us, ratio, row_bits_equal}]
    bench_attention(heads, trees, pasts)     -> [{T, past, triton_us, invariant_us, one_chunk_us, ratio}]

Time per call: `bench.timing.time_cuda_graph` (captured in a graph, L2 flushed before each), GPU only.

Command line: python -m ddtree_lab.bench.batch_invariant [--ops linear attention] --out batch_invariant.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from ..kernels import batch_invariant as bi
from .timing import time_cuda_graph

# (name, N, K) of the linears of one SmolLM2-135M layer and its LM head, and of the lab target's
SHAPES = [("smollm2 qkv", 960, 576), ("smollm2 o", 576, 576), ("smollm2 gate_up", 3072, 576),
          ("smollm2 down", 576, 1536), ("smollm2 lm_head", 49152, 576),
          ("lab qkv", 768, 384), ("lab gate_up", 1536, 384), ("lab down", 384, 768)]
# the default, never split, always split, narrower tiles
TILE_VARIANTS = [{}, {"K_CHUNK": 0}, {"SPLIT_BELOW_N_TILES": None}, {"BLOCK_N": 32},
                 {"BLOCK_N": 32, "SPLIT_BELOW_N_TILES": None}]


def bench_linear(shapes=SHAPES, rows=(1, 33, 65), tile_variants=TILE_VARIANTS, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, N, K in shapes:
        w = (torch.randn(N, K, generator=gen) / K ** 0.5).to("cuda", dtype)
        x_all = torch.randn(max(rows), K, generator=gen).to("cuda", dtype)
        for M in rows:
            x = x_all[:M].contiguous()
            torch_us = time_cuda_graph(lambda: F.linear(x, w)) * 1000
            for tiles in tile_variants:
                alone = bi.linear(x_all[:1], w, tiles=tiles)
                equal = bool(torch.equal(bi.linear(x, w, tiles=tiles)[:1], alone))
                us = time_cuda_graph(lambda: bi.linear(x, w, tiles=tiles)) * 1000
                out.append(dict(name=name, N=N, K=K, M=M, tiles=tiles, torch_us=round(torch_us, 2),
                                invariant_us=round(us, 2), ratio=round(us / torch_us, 3), row_bits_equal=equal))
                print(out[-1], flush=True)
    return out


def bench_attention(heads=(9, 3, 64), trees=(1, 33, 65), pasts=(200, 1000, 4000), dtype=torch.bfloat16, seed=0):
    from ..kernels.tree_attention import pack_mask, tree_attention
    from ..tree import ancestor_matrix

    Hq, Hkv, D = heads
    gen = torch.Generator().manual_seed(seed)
    out = []
    for T in trees:
        parents = (torch.rand(T, generator=gen) * torch.arange(T)).floor().long()
        parents[0] = 0
        anc = ancestor_matrix(parents).cuda()
        bits, (chain, length) = pack_mask(anc), bi.ancestor_chain(anc)
        for past in pasts:
            q = torch.randn(Hq, T, D, generator=gen).to("cuda", dtype)
            k = torch.randn(Hkv, past + T, D, generator=gen).to("cuda", dtype)
            v = torch.randn(Hkv, past + T, D, generator=gen).to("cuda", dtype)
            p = torch.tensor([past], device="cuda")
            fast = time_cuda_graph(lambda: tree_attention(q, k, v, p, bits, max_past_len=past)) * 1000
            inv = time_cuda_graph(lambda: bi.chain_attention(q, k, v, p, chain, length, max_past=past)) * 1000
            one = time_cuda_graph(lambda: bi.chain_attention(q, k, v, p, chain, length, max_past=past,
                                                             chunk=64 * triton.cdiv(past + T, 64))) * 1000
            out.append(dict(T=T, past=past, heads=list(heads), triton_us=round(fast, 2), invariant_us=round(inv, 2),
                            one_chunk_us=round(one, 2), ratio=round(inv / fast, 3)))
            print(out[-1], flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", nargs="+", choices=["linear", "attention"], default=["linear", "attention"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench batch_invariant times GPU kernels: no CUDA device is visible")
    result = {op: {"linear": bench_linear, "attention": bench_attention}[op]() for op in a.ops}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
