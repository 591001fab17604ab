"""Commit bookkeeping in one launch: a round's outcome into the decoding state.

After the walk (`tree_walk.accept_path`) and the KV compaction, a DDTree round emits the accepted
chain and the next bonus token and advances its counters. In torch that is ~15 small kernels; here it
is one program. Reference: `ddtree_lab.decode.RoundProgram.advance_reference`. Under budget="auto" the
launch has a second program, beside the first: it counts the round (τ, the round index) and runs the choice's
update (`auto_budget.auto_round`), which would otherwise be a launch of its own every round. The two share no
state written in the launch (the second alone reads and writes the round index), so neither waits for the
other, and the update adds no time to a round whose commit lasts as long (measured, docs/performance.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

try:
    from .auto_budget import auto_round, launch_sizes
except ImportError:  # loaded as a lone file beside auto_budget.py (tests/kernels/test_compile.py)
    from auto_budget import auto_round, launch_sizes


@triton.jit
def _advance_kernel(Tokens, Path, A, Choice, N, Bonus, Out, OutLen, Taus, RoundIdx, CtxPos, CtxCount, L,
                    Scores, Budgets, Costs, Edges, TableSum, TableCount, Totals, BinRing, Proposals, Schedule,
                    j, n_conf, explore, weight, decay, max_tau,
                    BLOCK: tl.constexpr, AUTO: tl.constexpr, J: tl.constexpr, NB: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    # path [L+1] root first, a accepted nodes; emit path[1..a-1]'s tokens then the bonus (the target's
    # choice at the deepest accepted node) at out[out_len …]; the drafter gets positions n … n+L.
    a = tl.load(A)
    r = tl.load(RoundIdx)  # under auto the second program's alone: the first reads it early but never uses it
    if tl.program_id(0) == 0:
        n = tl.load(N)
        out_len = tl.load(OutLen)
        k = tl.arange(0, BLOCK)
        live = k < L + 1
        bonus = tl.load(Choice + tl.load(Path + a - 1))
        chain = tl.load(Tokens + tl.load(Path + k + 1, mask=k < L, other=0), mask=k < L, other=0)
        emit = tl.where(k == a - 1, bonus, chain)
        # n, out_len and round_idx are read above and written below: every thread reads before any writes
        tl.debug_barrier()
        tl.store(Out + out_len + k, emit, mask=live)
        tl.store(CtxPos + k, n + k, mask=live)
        tl.store(CtxCount, a)
        tl.store(Bonus, bonus)
        tl.store(N, n + a)
        tl.store(OutLen, out_len + a)
        if not AUTO:
            tl.store(Taus + r, a)
            tl.store(RoundIdx, r + 1)
    if AUTO:
        if tl.program_id(0) == 1:  # the round's count and the choice: reads none of the first program's writes
            tl.debug_barrier()
            tl.store(Taus + r, a)
            tl.store(RoundIdx, r + 1)
            auto_round(r, Path, A, Scores, Budgets, Costs, Edges, TableSum, TableCount, Totals, BinRing, Proposals,
                       Schedule, j, n_conf, explore, weight, decay, max_tau, J, NB, BLOCK_P, BLOCK_C, BLOCK_J,
                       BLOCK_R)


def advance_round(tokens, path, a, choice, n, bonus, out, out_len, taus, round_idx, ctx_pos, ctx_count, L: int,
                  auto: tuple | None = None):
    """All device tensors; the eight from n on are the round state, updated in place. auto: budget="auto"'s
    update arguments after the round's (path, a, round_idx) (`AutoState.update_args`), run in this launch's
    second program."""
    if auto is None:  # the choice's arguments are never read: any tensor stands in
        pointers, scalars = (a,) * 10, (0, 0, 0.0, 0.0, 0.0, 0.0)
        sizes = dict(J=1, NB=1, BLOCK_P=16, BLOCK_C=16, BLOCK_J=16, BLOCK_R=2)
    else:
        (scores, j, budgets, costs, edges, table_sum, table_count, totals, bin_ring, proposals, schedule, n_conf,
         explore, weight, decay, max_tau) = auto
        pointers = (scores, budgets, costs, edges, table_sum, table_count, totals, bin_ring, proposals, schedule)
        scalars = (j, n_conf, explore, weight, decay, max_tau)
        sizes = launch_sizes(path, budgets, edges, n_conf)
    _advance_kernel[(1 + (auto is not None),)](tokens, path, a, choice, n, bonus, out, out_len, taus, round_idx, ctx_pos, ctx_count, L,
                          *pointers, *scalars, BLOCK=max(16, triton.next_power_of_2(L + 1)), AUTO=auto is not None,
                          **sizes, num_warps=1)
