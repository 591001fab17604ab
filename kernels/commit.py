"""Commit bookkeeping in one launch: a round's outcome into the decoding state.

After the walk (`tree_walk.accept_path`) and the KV compaction, a DDTree round emits the accepted
chain and the next bonus token and advances its counters. In torch that is ~15 small kernels; here it
is one program. Reference: `ddtree_lab.decode.RoundProgram.advance_reference`. Under budget="auto" the
choice's update is a launch of its own (`kernels/auto_budget.py`) on a stream forked after the walk, so it
runs beside the KV compaction and this launch instead of after them (`AutoState.update_beside`).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _advance_kernel(Tokens, Path, A, Choice, N, Bonus, Out, OutLen, Taus, RoundIdx, CtxPos, CtxCount, L,
                    BLOCK: tl.constexpr):
    # path [L+1] root first, a accepted nodes; emit path[1..a-1]'s tokens then the bonus (the target's
    # choice at the deepest accepted node) at out[out_len …]; the drafter gets positions n … n+L.
    a = tl.load(A)
    n = tl.load(N)
    out_len = tl.load(OutLen)
    r = tl.load(RoundIdx)
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
    tl.store(Taus + r, a)
    tl.store(RoundIdx, r + 1)


def advance_round(tokens, path, a, choice, n, bonus, out, out_len, taus, round_idx, ctx_pos, ctx_count, L: int):
    """All device tensors; the eight from n on are the round state, updated in place."""
    _advance_kernel[(1,)](tokens, path, a, choice, n, bonus, out, out_len, taus, round_idx, ctx_pos, ctx_count, L,
                          BLOCK=max(16, triton.next_power_of_2(L + 1)), num_warps=1)
