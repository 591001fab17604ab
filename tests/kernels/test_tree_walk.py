"""Tree-walk kernels (kernels/tree_walk.py) vs their torch references: the ancestor masks (dense and
packed) and the accepted path. Without a GPU the kernels run under the Triton interpreter."""
import contextlib
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


def test_advance_round_equals_torch_bookkeeping(device_pair, use_options):
    """The commit kernel vs RoundProgram.advance_reference on random round outcomes."""
    from ddtree_lab.decode import RoundProgram
    from ddtree_lab.kernels.commit import advance_round

    use_options(tree_kernels="torch")
    prog = RoundProgram(device_pair, "ddtree", 12, None, 0.0, out_capacity=80, max_rounds=20)
    L, T = prog.L, prog.T
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        parents, depths = random_tree(T, L, g)
        prog.tokens = torch.randint(0, 50, (T,), generator=g).to(DEVICE)
        choice = torch.randint(0, 50, (T,), generator=g).to(DEVICE)
        anc = tree.ancestor_matrix(parents, L)
        prog.path, prog.a = tree.accept_path(prog.tokens, parents, depths, choice, anc, L)
        start = [torch.tensor([10 + trial]), torch.tensor([7]), torch.tensor([3 + 2 * trial]), torch.tensor([trial])]
        state = {}
        for name in ("ref", "kernel"):
            for t, v in zip((prog.n, prog.bonus, prog.out_len, prog.round_idx), start):
                t.copy_(v.to(DEVICE))
            for t in (prog.out, prog.taus, prog.ctx_pos, prog.ctx_count):
                t.zero_()
            if name == "ref":
                prog.advance_reference(choice)
            else:
                advance_round(prog.tokens, prog.path, prog.a, choice, prog.n, prog.bonus, prog.out, prog.out_len,
                              prog.taus, prog.round_idx, prog.ctx_pos, prog.ctx_count, L)
            state[name] = [t.clone() for t in (prog.n, prog.bonus, prog.out, prog.out_len, prog.taus,
                                               prog.round_idx, prog.ctx_pos, prog.ctx_count)]
        assert all(torch.equal(x, y) for x, y in zip(state["ref"], state["kernel"]))


def test_commit_bench_checks_each_auto_variant_against_the_in_line_one(monkeypatch):
    """bench/commit.py: the commit fixed, with auto's update in line and beside, side by side; the auto variants
    reach the same state, and one whose update writes another table is caught."""
    from ddtree_lab.auto_budget import AutoState
    from ddtree_lab.bench import commit as bench_commit

    kw = dict(budgets=(4, 8), block=6, accepted=3, layers=2, kv_heads=1, head_dim=16, features=8, device=DEVICE,
              reps=3)
    rows = bench_commit.bench_commit(**kw)
    assert [r["variant"] for r in rows] == list(bench_commit.VARIANTS)
    assert all(r["same_state"] for r in rows)
    assert all(r["us"] > 0 and r["over_fixed"] > 0 if DEVICE == "cuda" else r["us"] is None for r in rows)

    update = AutoState.update_beside

    @contextlib.contextmanager
    def off_by_one(self, *args):  # the same update, then one more round counted in the table
        with update(self, *args):
            yield
        self.table_count[1, 0] += 1
    monkeypatch.setattr(AutoState, "update_beside", off_by_one)
    rows = bench_commit.bench_commit(**kw)
    assert [r["same_state"] for r in rows] == [True, True, False]
    for bad in (["--accepted", "1"], ["--budgets", "4", "--accepted", "6"], ["--layers", "0"]):
        with pytest.raises(SystemExit):
            bench_commit.main(bad)
    if DEVICE == "cpu":  # nothing to time on, and no interpreter asked for: refused, not a traceback
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(SystemExit):
            bench_commit.main(["--layers", "2"])
