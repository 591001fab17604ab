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
def test_accepted_path_equals_torch_walk(T, L, monkeypatch):
    monkeypatch.setattr(tree, "TREE_KERNELS", "torch")
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
