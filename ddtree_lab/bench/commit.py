"""Micro-benchmark of a round's commit after the walk: the KV compaction, the features' gather and the commit
kernel (`kernels/commit.advance_round`), for a fixed budget and for budget="auto" with its update either in
line (one stream, after the walk) or beside (on a forked stream, `AutoState.update_beside`), side by side in
one run; each auto variant's state after a call checked against the in-line one's.

    bench_commit(budgets=(16, 32, 64), block=16, layers=30, kv_heads=3, head_dim=64)
        -> list of dicts {variant, us, over_fixed, same_state}

Time per call: `bench.timing.time_cuda_graph` on a GPU (the calls captured in a graph, as a round's are)
without the L2 flush, since a round's commit finds the walk's outputs in L2; the interpreter elsewhere (a
correctness run). The defaults are SmolLM2-135M's (30 layers, 3 KV heads of 64, 5 × 576 features).

Command line (GPU): python -m ddtree_lab.bench.commit [--layers N --kv-heads H --head-dim D] --out commit.json
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

from ..auto_budget import AutoBudget, AutoState
from ..kernels.commit import advance_round
from ..kernels.kv_compact import compact_kv
from . import write_bench_json
from .timing import time_cuda_graph

VARIANTS = ("fixed", "auto in line", "auto beside")


class CommitInputs:
    """A round's outcome (a tree of `budget` nodes over L = block - 1 depths, `accepted` nodes on the path), the
    target's KV cache and features it compacts, and the decoding state it advances, with room for `calls`
    rounds."""

    def __init__(self, budgets, block: int, accepted: int, layers: int, kv_heads: int, head_dim: int, features: int,
                 device, calls: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.L, T, long = block - 1, 1 + max(budgets), dict(dtype=torch.long, device=device)
        self.tokens = torch.randint(0, 1000, (T,), generator=g).to(device)
        self.choice = torch.randint(0, 1000, (T,), generator=g).to(device)
        path = torch.zeros(self.L + 1, dtype=torch.long)
        step = min(3, (T - 1) // (accepted - 1))           # nodes of growing index along the path, all < T
        path[1:accepted] = torch.arange(1, accepted) * step
        self.path, self.a = path.to(device), torch.tensor([accepted], **long)
        self.scores = (-torch.sort(torch.rand(T - 1, generator=g) * 4).values).to(device)
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        self.kv = torch.randn(layers, 2, kv_heads, self.PAST + T, head_dim, generator=g).to(device, dtype)
        self.hidden = torch.zeros(T, features, device=device, dtype=dtype)   # the drafter's tapped layers', [T, F]
        self.ctx_hidden = torch.zeros(self.L + 1, self.hidden.shape[1], device=device, dtype=dtype)
        self.state = [torch.zeros(1, **long) for _ in range(3)]        # n, bonus, out_len
        self.out = torch.zeros(calls * (self.L + 1) + self.L + 1, **long)
        self.taus, self.round_idx = torch.zeros(calls, **long), torch.zeros(1, **long)
        self.ctx_pos, self.ctx_count = torch.zeros(self.L + 1, **long), torch.zeros(1, **long)
        auto = AutoBudget(budgets=tuple(budgets), costs=tuple(1e-4 * (1 + b / 64) for b in budgets))
        self.auto = AutoState(auto, self.L, calls, device)

    PAST = 256  # committed slots before the tree's

    def written(self) -> list[torch.Tensor]:
        """What a call may write: the decoding state and auto's."""
        return self.state + [self.out, self.taus, self.round_idx, self.ctx_pos, self.ctx_count, *self.auto.tensors()]

    def reset(self) -> None:
        for t in self.written():
            t.zero_()

    def call(self, variant: str) -> None:
        """One commit as RoundProgram.commit runs it after the walk."""
        n, bonus, out_len = self.state
        args = (self.path, self.a, self.round_idx, self.scores, len(self.auto.auto.budgets) - 1)
        if variant == "auto in line":
            self.auto.update(*args)
        with self.auto.update_beside(*args) if variant == "auto beside" else contextlib.nullcontext():
            compact_kv(self.kv, self.PAST, self.path, self.a)  # the same slots every call (a timing replays many)
            torch.gather(self.hidden, 0, self.path[:, None].expand(-1, self.hidden.shape[1]), out=self.ctx_hidden)
        advance_round(self.tokens, self.path, self.a, self.choice, n, bonus, self.out, out_len, self.taus,
                      self.round_idx, self.ctx_pos, self.ctx_count, self.L)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.written()]


def bench_commit(budgets=(16, 32, 64), block: int = 16, accepted: int = 5, layers: int = 30, kv_heads: int = 3,
                 head_dim: int = 64, features: int = 2880, device: str = "cuda", reps: int = 50,
                 calls: int = 3) -> list[dict]:
    """Each variant from the same state: `calls` commits for the state check, then `reps` timed calls."""
    inputs = CommitInputs(budgets, block, accepted, layers, kv_heads, head_dim, features, device)
    states, rows = {}, []
    for variant in VARIANTS:
        inputs.reset()
        for _ in range(calls):
            inputs.call(variant)
        if device == "cuda":
            torch.cuda.synchronize()
        states[variant] = inputs.snapshot()
        inputs.reset()
        us = (time_cuda_graph(lambda: inputs.call(variant), n=reps, flush_bytes=1 << 10) * 1000
              if device == "cuda" else None)
        same = variant == "fixed" or all(torch.equal(x, y) for x, y in zip(states[variant], states["auto in line"]))
        rows.append({"variant": variant, "us": us and round(us, 3), "same_state": same})
    fixed = rows[0]["us"]
    for row in rows:
        row["over_fixed"] = row["us"] / fixed if row["us"] and fixed else None
        print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block", type=int, default=16, help="the drafter's block (L + 1)")
    ap.add_argument("--accepted", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30, help="the target's layers (the KV cache compacted)")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64, choices=(16, 32, 64, 128, 256))
    ap.add_argument("--features", type=int, default=2880, help="the drafter's features per token (gathered)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not 2 <= a.accepted <= min(a.block, 1 + max(a.budgets)):
        ap.error(f"--accepted {a.accepted}: give 2..{min(a.block, 1 + max(a.budgets))} (the root and at least one "
                 "node, at most the block and the largest budget's nodes)")
    if min(a.layers, a.kv_heads, a.features) < 1:
        ap.error("--layers, --kv-heads and --features must be ≥ 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("no CUDA device: time it on a GPU, or set TRITON_INTERPRET=1 for a correctness run on the CPU")
    rows = bench_commit(a.budgets, a.block, a.accepted, a.layers, a.kv_heads, a.head_dim, a.features, device)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv, budgets=a.budgets, block=a.block, accepted=a.accepted,
                         layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, features=a.features)
    return rows


if __name__ == "__main__":
    main()
