"""Micro-benchmark of the commit kernel (`kernels/commit.advance_round`): a fixed budget's launch against
budget="auto"'s (the same launch with the choice's update), side by side in one run, optionally beside the
kernel of another commit, each version's state after a call checked against this one's.

    bench_commit(budgets=(16, 32, 64), block=16) -> list of dicts {variant, us, over_fixed, same_state}

Time per call: `bench.attention.time_cuda_graph` on a GPU (launches captured in a graph) without the L2 flush,
since a round's commit finds the walk's outputs in L2; the interpreter elsewhere (a correctness run).

Command line (GPU): python -m ddtree_lab.bench.commit [--baseline old_commit.py] --out commit.json
    (git show REV:kernels/commit.py > old_commit.py; git show REV:kernels/auto_budget.py > auto_budget.py beside it)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..auto_budget import AutoBudget, AutoState
from ..kernels import commit as this_commit
from . import load_kernel_file, write_bench_json
from .attention import time_cuda_graph


class CommitInputs:
    """A round's outcome (a tree of `budget` nodes over L = block - 1 depths, `accepted` nodes on the path) and
    the decoding state it advances, with room for `calls` rounds."""

    def __init__(self, budgets, block: int, accepted: int, device, calls: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.L, T, long = block - 1, 1 + max(budgets), dict(dtype=torch.long, device=device)
        self.tokens = torch.randint(0, 1000, (T,), generator=g).to(device)
        self.choice = torch.randint(0, 1000, (T,), generator=g).to(device)
        path = torch.zeros(self.L + 1, dtype=torch.long)
        step = min(3, (T - 1) // (accepted - 1))           # nodes of growing index along the path, all < T
        path[1:accepted] = torch.arange(1, accepted) * step
        self.path, self.a = path.to(device), torch.tensor([accepted], **long)
        self.scores = (-torch.sort(torch.rand(T - 1, generator=g) * 4).values).to(device)
        self.state = [torch.zeros(1, **long) for _ in range(3)]        # n, bonus, out_len
        self.out = torch.zeros(calls * (self.L + 1) + self.L + 1, **long)
        self.taus, self.round_idx = torch.zeros(calls, **long), torch.zeros(1, **long)
        self.ctx_pos, self.ctx_count = torch.zeros(self.L + 1, **long), torch.zeros(1, **long)
        auto = AutoBudget(budgets=tuple(budgets), costs=tuple(1e-4 * (1 + b / 64) for b in budgets))
        self.auto = AutoState(auto, self.L, calls, device)

    def written(self) -> list[torch.Tensor]:
        """What a call may write: the decoding state and auto's."""
        return self.state + [self.out, self.taus, self.round_idx, self.ctx_pos, self.ctx_count, *self.auto.tensors()]

    def reset(self) -> None:
        for t in self.written():
            t.zero_()

    def call(self, module, auto: bool) -> None:
        n, bonus, out_len = self.state
        module.advance_round(self.tokens, self.path, self.a, self.choice, n, bonus, self.out, out_len, self.taus,
                             self.round_idx, self.ctx_pos, self.ctx_count, self.L,
                             self.auto.update_args(self.scores, len(self.auto.auto.budgets) - 1) if auto else None)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.written()]


def bench_commit(budgets=(16, 32, 64), block: int = 16, accepted: int = 5, baseline=None, device: str = "cuda",
                 reps: int = 50) -> list[dict]:
    """`baseline`: another commit module (`load_baseline(PATH)`), timed in the same run on the same inputs."""
    inputs = CommitInputs(budgets, block, accepted, device)
    modules = {"": this_commit} | ({"baseline ": baseline} if baseline is not None else {})
    states, rows = {}, []
    for prefix, module in modules.items():
        for auto in (False, True):
            inputs.reset()
            inputs.call(module, auto)
            states[prefix, auto] = inputs.snapshot()
            inputs.reset()
            us = (time_cuda_graph(lambda: inputs.call(module, auto), n=reps, flush_bytes=1 << 10) * 1000
                  if device == "cuda" else None)
            rows.append({"variant": prefix + ("auto" if auto else "fixed"), "us": us and round(us, 3),
                         "same_state": all(torch.equal(x, y) for x, y in zip(states[prefix, auto], states["", auto]))})
    fixed = rows[0]["us"]
    for row in rows:
        row["over_fixed"] = row["us"] / fixed if row["us"] and fixed else None
        print(row, flush=True)
    return rows


def load_baseline(path: str):
    """A commit.py from elsewhere as a module of its own; its `from auto_budget import …` finds the file beside it."""
    return load_kernel_file(path, "commit_baseline")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block", type=int, default=16, help="the drafter's block (L + 1)")
    ap.add_argument("--accepted", type=int, default=5)
    ap.add_argument("--baseline", default=None, metavar="FILE", help="another version of kernels/commit.py")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.baseline and not Path(a.baseline).is_file():
        ap.error(f"--baseline {a.baseline}: no such file")
    if not 2 <= a.accepted <= min(a.block, 1 + max(a.budgets)):
        ap.error(f"--accepted {a.accepted}: give 2..{min(a.block, 1 + max(a.budgets))} (the root and at least one "
                 "node, at most the block and the largest budget's nodes)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench_commit(a.budgets, a.block, a.accepted, load_baseline(a.baseline) if a.baseline else None, device)
    if a.out:
        write_bench_json(a.out, rows, budgets=a.budgets, block=a.block, accepted=a.accepted, baseline=a.baseline)
    return rows


if __name__ == "__main__":
    main()
