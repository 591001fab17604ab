"""budget="auto" bookkeeping in one launch: credit a round's outcome, propose the next budget.

Contract: after round r ran at candidate j, with τ_i = 1 + #(accepted nodes with index ≤ budget_i), add τ_0
and each gain τ_i − τ_{i-1} (0 < i ≤ j) to the table row of the confidence bin the host's choice for round r
came from; then propose a budget for the rounds chosen from round r: argmax_i m_i − λ·cost_i over this round's
bin, m_i = mean τ_0 + the mean gains up to i, λ the achieved tokens per second. τ_i is known for i ≤ j because
a tree of budget b is the first b nodes of any larger one (tree.py's order) and node indices grow along a path;
gains are measured on the same rounds, so m_i never falls below m_{i-1}. An untried gain counts as `explore`
tokens, so a larger budget is tried only while it could pay. In torch this is ~40 small kernels (a visible share
of a small pair's round on a GPU); here it is one program, launched on a stream forked after the walk
(`AutoState.update_beside`), so it runs beside the KV compaction and the commit's own launch and a round waits
for it only where it outlasts them. It reads the round index before the commit counts the round. Reference: the
rule itself, `ddtree_lab.auto_budget.auto_update_reference` (torch only, so budget="auto" runs where Triton is
absent).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from ..names import AUTO_MAX_CANDIDATES
except ImportError:  # loaded as a lone file (tests/kernels/test_compile.py): the installed package's vocabulary
    from ddtree_lab.names import AUTO_MAX_CANDIDATES

FAR = 2 ** 30  # a node index beyond every budget (masked path slots)
_FAR = tl.constexpr(FAR)


@triton.jit
def _propose(s, n, rows, jj, cost, bin_, lam, explore, weight, max_tau, J: tl.constexpr):
    """argmax_i m_i − λ·cost_i in one bin's row of the table (see propose_reference)."""
    s_row = tl.sum(tl.where(rows == bin_, s, 0.0), axis=0)                  # [BLOCK_J]
    n_row = tl.sum(tl.where(rows == bin_, n, 0.0), axis=0)
    m = weight / (tl.sum(tl.where(jj == 0, n_row, 0.0)) + weight)   # τ_0's prior: the bonus token alone
    best = tl.full((), -float("inf"), tl.float32)
    pick = tl.full((), 0, tl.int64)
    for i in tl.static_range(J):
        si = tl.sum(tl.where(jj == i, s_row, 0.0))
        ni = tl.sum(tl.where(jj == i, n_row, 0.0))
        ci = tl.sum(tl.where(jj == i, cost, 0.0))
        m = tl.minimum(m + (si + weight * explore) / (ni + weight), max_tau)
        score = m - lam * ci
        take = score > best                                                  # ties keep the smaller budget
        best = tl.where(take, score, best)
        pick = tl.where(take, i, pick)
    return pick


@triton.jit
def _auto_kernel(Path, A, RoundIdx, Scores, Budgets, Costs, Edges, TableSum, TableCount, Totals, BinRing, Proposals,
                 Schedule, j, n_conf, explore, weight, decay, max_tau,
                 J: tl.constexpr, NB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.load(RoundIdx)                           # this round (the commit counts it after, on its own stream)
    lag = tl.load(Schedule)
    every = tl.load(Schedule + 1)
    src = (r // every - lag) * every - 1            # the round whose proposal the host used for round r
    src_bin = tl.where(src >= 0, tl.load(BinRing + tl.maximum(src, 0)), 0)
    a = tl.load(A)
    k = tl.arange(0, BLOCK_P)
    node = tl.load(Path + k, mask=(k >= 1) & (k < a), other=_FAR)          # accepted nodes past the root
    jj = tl.arange(0, BLOCK_J)
    live_j = jj < J
    budget = tl.load(Budgets + jj, mask=live_j, other=0)
    below = tl.load(Budgets + jj - 1, mask=live_j & (jj >= 1), other=0)     # the next smaller candidate
    inside = (node[None, :] > below[:, None]) & (node[None, :] <= budget[:, None])
    gain = tl.sum(inside.to(tl.float32), axis=1) + tl.where(jj == 0, 1.0, 0.0)   # [BLOCK_J]: τ_0, then τ_i − τ_{i-1}
    rows = tl.arange(0, BLOCK_R)[:, None]
    cell = rows * J + jj[None, :]
    live = (rows < NB + 1) & live_j[None, :]
    s = tl.load(TableSum + cell, mask=live, other=0.0) * decay
    n = tl.load(TableCount + cell, mask=live, other=0.0) * decay
    credit = (rows == src_bin) & (jj[None, :] <= j)
    s += tl.where(credit, gain[None, :], 0.0)
    n += tl.where(credit, 1.0, 0.0)
    tot_tau = tl.load(Totals) * decay + a.to(tl.float32)
    tot_cost = tl.load(Totals + 1) * decay + tl.load(Costs + j)
    # this round's confidence: the draft's expected accepted nodes among the smallest candidate's tree
    c = tl.arange(0, BLOCK_C)
    conf = tl.sum(tl.where(c < n_conf, tl.exp(tl.load(Scores + c, mask=c < n_conf, other=0.0)), 0.0))
    e = tl.arange(0, BLOCK_J)
    edge = tl.load(Edges + e, mask=e < NB - 1, other=float("inf"))
    bin_ = 1 + tl.sum((conf >= edge).to(tl.int64))
    lam = tl.where(tot_cost > 0, tot_tau / tot_cost, 0.0)
    cost = tl.load(Costs + jj, mask=live_j, other=0.0)
    pick = _propose(s, n, rows, jj, cost, bin_, lam, explore, weight, max_tau, J)
    first = _propose(s, n, rows, jj, cost, 0, lam, explore, weight, max_tau, J)   # for the next call's first rounds
    tl.debug_barrier()
    tl.store(TableSum + cell, s, mask=live)
    tl.store(TableCount + cell, n, mask=live)
    tl.store(Totals, tot_tau)
    tl.store(Totals + 1, tot_cost)
    tl.store(BinRing + r, bin_)
    tl.store(Proposals + 1 + r, pick)
    tl.store(Proposals, first)


def launch_sizes(path, budgets, edges, n_conf: int) -> dict:
    """_auto_kernel's compile-time sizes."""
    NB = edges.shape[0] + 1
    return dict(J=budgets.shape[0], NB=NB, BLOCK_P=max(16, triton.next_power_of_2(path.shape[0])),
                BLOCK_C=max(16, triton.next_power_of_2(n_conf)), BLOCK_J=AUTO_MAX_CANDIDATES,
                BLOCK_R=max(2, triton.next_power_of_2(NB + 1)))


def auto_update(path, a, round_idx, scores, j: int, budgets, costs, edges, table_sum, table_count, totals, bin_ring,
                proposals, schedule, n_conf: int, explore: float, weight: float, decay: float, max_tau: float) -> None:
    """All tensors on one device; round_idx [1] is round r's index (read, not advanced); table_sum/table_count
    [bins + 1, J], totals [2], bin_ring [R] and proposals [1 + R] (bin 0's proposal, for rounds before any read,
    then round r's at 1 + r) are updated."""
    _auto_kernel[(1,)](path, a, round_idx, scores, budgets, costs, edges, table_sum, table_count, totals, bin_ring,
                       proposals, schedule, j, n_conf, explore, weight, decay, max_tau,
                       **launch_sizes(path, budgets, edges, n_conf), num_warps=1)
