"""Micro-benchmark of the one-launch tree build (`tree_build.fused_tree`) across beam widths and warp
counts, each tree checked against the torch sorting build (`ddtree_lab.tree.build_tree(method="sort")`).

    bench_fused_tree(widths=(64, 128, 256), warps=(4, 8, 16, 32), depth=15, vocab=151936)
        -> list of dicts {width, num_warps, us, same_as_sort}

Time per build: `bench.timing.time_cuda_graph` on a GPU (launches captured in a graph, L2 flushed before each), the
wall clock elsewhere (Triton's interpreter: a correctness run, not a timing). Budget = width, top-k = width, as `build_tree` calls it.

Command line (GPU): python -m ddtree_lab.bench.tree_build --out tree_build.json
"""
from __future__ import annotations

import argparse
import time

import torch

from ..kernels import tree_build
from ..tree import beam_candidates, build_tree, tree_size
from . import write_bench_json
from .timing import time_cuda_graph


def bench_fused_tree(widths=(64, 128, 256), warps=(4, 8, 16, 32), depth: int = 15, vocab: int = 151936,
                     device: str = "cuda", reps: int = 50, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for W in widths:
        logits = (torch.randn(depth, vocab, generator=gen) * 3).to(device)  # [L, V]
        top_lp, top_tok = torch.log_softmax(logits, -1).topk(W, dim=-1)   # [L, W] each
        n = tree_size(depth, W, W)
        cand_slot, cand_rank = beam_candidates(W, W, device)
        ref = build_tree(logits, W, method="sort")
        for nw in warps:
            def run():
                return tree_build.fused_tree(top_lp, top_tok, W, n, cand_slot, cand_rank, num_warps=nw)
            out = run()
            same = all(torch.equal(a, b) for a, b in zip(out, (ref.tokens, ref.depths, ref.parents, ref.scores,
                                                                ref.logprobs, ref.ranks)))
            if device == "cuda":
                us = time_cuda_graph(run, n=reps) * 1000
            else:
                t0 = time.perf_counter()
                run()
                us = (time.perf_counter() - t0) * 1e6
            rows.append(dict(width=W, num_warps=nw, us=round(us, 1), same_as_sort=same))
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = bench_fused_tree(a.widths, a.warps)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv)
    return rows


if __name__ == "__main__":
    main()
