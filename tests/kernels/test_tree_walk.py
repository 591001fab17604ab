"""Tree-walk kernels (kernels/tree_walk.py) vs their torch references: the ancestor masks (dense and
packed) and the accepted path. Without a GPU the kernels run under the Triton interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab import tree  # noqa: E402
from ddtree_lab.kernels import tree_walk as tw  # noqa: E402
from ddtree_lab.kernels.tree_attention import pack_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_tree(T: int, L: int, gen: torch.Generator):
    """parents [T] (root 0, its own parent, parents[i] < i), depths [T] ≤ L; bushy or path-like."""
    parents, depths = [0], [0]
    for i in range(1, T):
        cands = [j for j in range(i) if depths[j] < L]
        p = cands[int(torch.randint(len(cands), (1,), generator=gen))]
        parents.append(p)
        depths.append(depths[p] + 1)
    return torch.tensor(parents, device=DEVICE), torch.tensor(depths, device=DEVICE)


@pytest.mark.parametrize("T,L", [(1, 15), (2, 1), (17, 15), (33, 4), (65, 15), (300, 15), (1025, 15)])
def test_masks_equal_ancestor_matrix_and_pack(T, L):
    parents, depths = random_tree(T, L, torch.Generator().manual_seed(T))
    anc, bits = tw.tree_masks(parents, L)
    want = tree.ancestor_matrix(parents, L)
    assert torch.equal(anc, want)
    assert torch.equal(bits, pack_mask(want))


@pytest.mark.parametrize("T,L", [(1, 15), (16, 15), (40, 6), (129, 15)])
def test_accepted_path_equals_torch_walk(T, L, monkeypatch, use_options):
    use_options(tree_kernels="torch")
    g = torch.Generator().manual_seed(T)
    for trial in range(6):
        parents, depths = random_tree(T, L, g)
        tokens = torch.randint(0, 4, (T,), generator=g).to(DEVICE)  # few tokens: many matches and near-misses
        choice = torch.randint(0, 4, (T,), generator=g).to(DEVICE)
        if trial == 0:
            choice = tokens[torch.arange(T, device=DEVICE)]  # choices that accept whole chains
        anc = tree.ancestor_matrix(parents, L)
        want_path, want_a = tree.accept_path(tokens, parents, depths, choice, anc, L)
        path, a = tw.accept_path(tokens, parents, depths, choice, L)
        assert torch.equal(a, want_a) and torch.equal(path, want_path)
        # the path is a root path of a nodes: depths 0 … a-1, each the parent of the next
        k = int(a)
        assert depths[path[:k]].tolist() == list(range(k))
        assert all(int(parents[path[i + 1]]) == int(path[i]) for i in range(k - 1))


@pytest.fixture(scope="module")
def device_pair(tiny_dirs):
    import ddtree_lab as dl

    return dl.load_pair(target=tiny_dirs[0], drafter=tiny_dirs[1], device=DEVICE)  # kernels need its device


@pytest.mark.parametrize("auto_budgets", [None, (4,), (4, 8, 12)])
def test_advance_round_equals_torch_bookkeeping(device_pair, monkeypatch, use_options, auto_budgets):
    """The commit kernel vs RoundProgram.advance_reference on random round outcomes; with budget="auto"'s
    update in the same launch, vs the reference advance followed by the torch update, round after round."""
    from ddtree_lab.auto_budget import AutoBudget, AutoState
    from ddtree_lab.decode import RoundProgram
    from ddtree_lab.kernels.commit import advance_round

    use_options(tree_kernels="torch")
    prog = RoundProgram(device_pair, "ddtree", 12, None, 0.0, out_capacity=80, max_rounds=20)
    L, T = prog.L, prog.T
    autos = {}
    if auto_budgets:
        auto = AutoBudget(budgets=auto_budgets, costs=tuple(1e-3 * (1 + b / 8) for b in auto_budgets), edges=(1.5,),
                          memory=8)
        autos = {name: AutoState(auto, L, 20, DEVICE) for name in ("ref", "kernel")}
        for st in autos.values():
            st.schedule.copy_(torch.tensor([0, 1]))  # each round credits the bin of the round before
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        parents, depths = random_tree(T, L, g)
        prog.tokens = torch.randint(0, 50, (T,), generator=g).to(DEVICE)
        choice = torch.randint(0, 50, (T,), generator=g).to(DEVICE)
        anc = tree.ancestor_matrix(parents, L)
        prog.path, prog.a = tree.accept_path(prog.tokens, parents, depths, choice, anc, L)
        scores = -torch.sort(torch.rand(T - 1, generator=g) * 4).values.to(DEVICE)
        j = trial % len(auto_budgets or (0,))
        start = [torch.tensor([10 + trial]), torch.tensor([7]), torch.tensor([3 + 2 * trial]), torch.tensor([trial])]
        state = {}
        for name in ("ref", "kernel"):
            for t, v in zip((prog.n, prog.bonus, prog.out_len, prog.round_idx), start):
                t.copy_(v.to(DEVICE))
            for t in (prog.out, prog.taus, prog.ctx_pos, prog.ctx_count):
                t.zero_()
            if name == "ref":
                prog.advance_reference(choice)
                if autos:
                    autos[name].update(prog.path, prog.a, prog.round_idx, scores, j)
            else:
                advance_round(prog.tokens, prog.path, prog.a, choice, prog.n, prog.bonus, prog.out, prog.out_len,
                              prog.taus, prog.round_idx, prog.ctx_pos, prog.ctx_count, L,
                              autos[name].update_args(scores, j) if autos else None)
            state[name] = [t.clone() for t in (prog.n, prog.bonus, prog.out, prog.out_len, prog.taus,
                                               prog.round_idx, prog.ctx_pos, prog.ctx_count)]
            if autos:
                state[name] += [t.clone() for t in autos[name].tensors()]
        assert all(torch.allclose(x, y) if x.is_floating_point() else torch.equal(x, y)
                   for x, y in zip(state["ref"], state["kernel"]))
    if autos:  # the update ran: every round is in the ring, its bin and proposal among the real ones
        assert int(autos["kernel"].table_count.sum()) > 0 and int(autos["kernel"].bin_ring[4]) >= 1


def test_commit_bench_checks_each_version_against_this_one(tmp_path):
    """bench/commit.py: fixed and auto launches side by side; a baseline copy of the kernel file (its
    auto_budget.py beside it) reaches this kernel's state, and a version that writes another τ is caught."""
    import shutil
    import types

    from ddtree_lab.bench import commit as bench_commit
    from ddtree_lab.kernels import auto_budget, commit

    for f in (commit.__file__, auto_budget.__file__):
        shutil.copy(f, tmp_path)
    copy = bench_commit.load_baseline(str(tmp_path / "commit.py"))
    rows = bench_commit.bench_commit(budgets=(4, 8), block=6, accepted=3, baseline=copy, device=DEVICE, reps=3)
    assert [r["variant"] for r in rows] == ["fixed", "auto", "baseline fixed", "baseline auto"]
    assert all(r["same_state"] for r in rows)
    assert all(r["us"] > 0 and r["over_fixed"] > 0 if DEVICE == "cuda" else r["us"] is None for r in rows)

    def off_by_one(*args):  # the same launch, then τ written one higher
        commit.advance_round(*args)
        args[8][0] += 1
    rows = bench_commit.bench_commit(budgets=(4, 8), block=6, accepted=3, device=DEVICE, reps=3,
                                     baseline=types.SimpleNamespace(advance_round=off_by_one))
    assert [r["same_state"] for r in rows] == [True, True, False, False]
    with pytest.raises(SystemExit):
        bench_commit.main(["--baseline", str(tmp_path / "missing.py")])
    for bad in (["--accepted", "1"], ["--budgets", "4", "--accepted", "6"]):
        with pytest.raises(SystemExit):
            bench_commit.main(bad)
