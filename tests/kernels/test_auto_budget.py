"""kernels/auto_budget.py (budget="auto"'s credit-and-propose step in one launch) against its torch reference
over sequences of rounds, candidate counts, bins and read schedules; and the rule's own behaviour. Without a
GPU the kernel runs under the interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.auto_budget import AutoBudget, AutoState, auto_update_reference, source_round  # noqa: E402
from ddtree_lab.kernels.auto_budget import auto_update  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L = 15


def _round(g, budget):
    """A random accepted path in a tree of `budget` nodes (indices grow along it) and descending scores."""
    a = int(torch.randint(1, min(L, budget) + 2, (1,), generator=g))
    nodes = torch.sort(torch.randperm(budget, generator=g)[: a - 1] + 1).values
    path = torch.zeros(L + 1, dtype=torch.long)
    path[1:a] = nodes
    scores = -torch.sort(torch.rand(budget, generator=g) * 6).values
    return path.to(DEVICE), torch.tensor([a], device=DEVICE), scores.to(DEVICE)


def _run(fn, budgets, edges, lag, every, rounds, seed):
    auto = AutoBudget(budgets=budgets, costs=tuple(1e-3 * (1 + b / 64) for b in budgets), edges=edges, memory=50)
    state = AutoState(auto, L, rounds, DEVICE)
    state.schedule.copy_(torch.tensor([lag, every]))
    round_idx = torch.zeros(1, dtype=torch.long, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    for r in range(rounds):
        j = int(torch.randint(0, len(budgets), (1,), generator=g))
        path, a, scores = _round(g, budgets[j])
        fn(path, a, round_idx, scores, j, state.budgets, state.costs, state.edges, state.table_sum,
           state.table_count, state.totals, state.bin_ring, state.proposals, state.schedule,
           min(budgets[0], budgets[j]), auto.explore, auto.weight, state.decay, float(L + 1))
        round_idx += 1  # the commit counts the round after the update
    return state


@pytest.mark.parametrize("budgets,edges", [((16,), ()), ((4, 16, 64), (1.5, 3.0)), ((8, 16, 32, 64, 128, 256, 512, 1024),
                                                                                     (0.5, 1, 2, 3, 4, 6, 8))])
@pytest.mark.parametrize("lag,every", [(0, 1), (1, 1), (1, 3)])
def test_kernel_matches_reference(budgets, edges, lag, every):
    want = _run(auto_update_reference, budgets, edges, lag, every, 40, seed=len(budgets) * 10 + lag + every)
    got = _run(auto_update, budgets, edges, lag, every, 40, seed=len(budgets) * 10 + lag + every)
    torch.testing.assert_close(got.table_sum, want.table_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.table_count, want.table_count, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.totals, want.totals, rtol=1e-5, atol=1e-9)
    assert torch.equal(got.bin_ring, want.bin_ring) and torch.equal(got.proposals, want.proposals)
    assert int(want.bin_ring.max()) <= len(edges) + 1 and int(want.proposals.max()) < len(budgets)


def test_credit_goes_to_the_source_rounds_bin_and_every_smaller_budget():
    budgets = (4, 16, 64)
    state = AutoState(AutoBudget(budgets=budgets, costs=(1.0, 1.0, 1.0), edges=(1.5,), memory=10 ** 9), L, 8, DEVICE)
    state.schedule.copy_(torch.tensor([1, 1]))
    state.bin_ring[0] = 2   # round 0 was confident
    round_idx = torch.tensor([2], device=DEVICE)  # this is round 2 (not yet counted); the host chose it from round 0
    path = torch.zeros(L + 1, dtype=torch.long, device=DEVICE)
    path[1:4] = torch.tensor([2, 9, 30])          # accepted nodes 2, 9, 30: τ = 2 at budget 4, 3 at 16, 4 at 64
    scores = torch.full((16,), -20.0, device=DEVICE)  # an unconfident draft: bin 1
    auto_update(path, torch.tensor([4], device=DEVICE), round_idx, scores, 1, state.budgets, state.costs,
                state.edges, state.table_sum, state.table_count, state.totals, state.bin_ring, state.proposals,
                state.schedule, 4, 0.5, 2.0, state.decay, 16.0)
    assert source_round(2, 1, 1) == 0
    assert state.table_sum[2].tolist() == [2.0, 1.0, 0.0]   # τ at 4, the gain at 16; 64 was not run: no credit
    assert state.table_count[2].tolist() == [1.0, 1.0, 0.0]
    assert state.table_sum[0].sum() == 0 and state.table_sum[1].sum() == 0
    assert int(state.bin_ring[2]) == 1
    assert state.totals.tolist() == [4.0, 1.0]


@pytest.mark.parametrize("fn", [auto_update, auto_update_reference])
def test_proposal_follows_the_cost(fn):
    """The same outcomes, two cost tables: a budget whose rounds cost 10× is not proposed; equal costs
    propose the budget with the higher τ."""
    budgets = (16, 64)
    for costs, want in (((1e-3, 1e-2), 0), ((1e-3, 1e-3), 1)):
        state = AutoState(AutoBudget(budgets=budgets, costs=costs, edges=()), L, 64, DEVICE)
        round_idx = torch.zeros(1, dtype=torch.long, device=DEVICE)
        for r in range(64):
            j = r % 2
            path = torch.zeros(L + 1, dtype=torch.long, device=DEVICE)
            path[1:4] = torch.tensor([1, 3, 40 if j == 1 else 5])   # budget 64 accepts one node more
            fn(path, torch.tensor([4], device=DEVICE), round_idx, torch.zeros(budgets[j], device=DEVICE), j,
               state.budgets, state.costs, state.edges, state.table_sum, state.table_count, state.totals,
               state.bin_ring, state.proposals, state.schedule, 16, 0.5, 2.0, state.decay, 16.0)
            round_idx += 1
        assert int(state.proposals[1 + 63]) == want == int(state.proposals[0])  # bin 0 alone: the same


def test_auto_budget_refuses_bad_settings():
    for bad in (dict(budgets=()), dict(budgets=(16, 16)), dict(budgets=(0, 16)), dict(budgets=tuple(range(1, 10))),
                dict(budgets=(16, 32), costs=(1.0,)), dict(budgets=(16,), costs=(float("nan"),)),
                dict(edges=(3.0, 1.0))):
        with pytest.raises(ValueError):
            AutoBudget(**bad)
    assert AutoBudget(budgets=(64, 16), costs=(2.0, 1.0)).costs == (1.0, 2.0)  # sorted with their budgets
