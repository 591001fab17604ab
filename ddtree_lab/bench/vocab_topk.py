"""Micro-benchmark of the one-launch per-depth top-K (`vocab_topk.vocab_topk`) against torch's log_softmax +
topk, side by side in one run, each result checked against torch's.

    bench_vocab_topk(vocabs=(4096, 16384, 49152), ks=(16, 64, 256), depth=15) -> list of dicts
        {vocab, k, torch_us, triton_us (None where V > MAX_VOCAB), speedup, same_tokens}

Time per call: `bench.timing.time_cuda_graph` on a GPU (launches captured in a graph, L2 flushed before each); the
interpreter elsewhere (a correctness run: keep the vocabularies small there).

Command line (GPU): python -m ddtree_lab.bench.vocab_topk --out vocab_topk.json
"""
from __future__ import annotations

import argparse

import torch

from ..kernels.vocab_topk import MAX_VOCAB, vocab_topk, vocab_topk_reference
from . import write_bench_json
from .timing import time_cuda_graph


def bench_vocab_topk(vocabs=(4096, 16384, 49152), ks=(16, 64, 256), depth: int = 15, device: str = "cuda",
                     reps: int = 50, seed: int = 0, dtype=torch.bfloat16) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for V in vocabs:
        logits = (torch.randn(depth, V, generator=gen) * 3).to(device, dtype)  # [L, V], as the drafter's LM head
        for K in (k for k in ks if k <= V):
            def ref():
                return vocab_topk_reference(logits, K)

            def ours():
                return vocab_topk(logits, K)
            want_lp, want_tok = ref()
            fits = V <= MAX_VOCAB
            same = None
            if fits:
                lp, tok = ours()
                same = bool(torch.allclose(lp, want_lp, rtol=1e-5, atol=1e-5))
            timed = device == "cuda"
            torch_us = time_cuda_graph(ref, n=reps) * 1000 if timed else None
            triton_us = time_cuda_graph(ours, n=reps) * 1000 if timed and fits else None
            rows.append(dict(vocab=V, k=K, torch_us=torch_us and round(torch_us, 1),
                             triton_us=triton_us and round(triton_us, 1),
                             speedup=round(torch_us / triton_us, 2) if torch_us and triton_us else None,
                             same_logprobs=same))
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[4096, 16384, 49152])
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench_vocab_topk(a.vocabs, a.ks, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv)
    return rows


if __name__ == "__main__":
    main()
