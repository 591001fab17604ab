"""Counting tree build (Triton, kernels/tree_build.py) vs the sorting build (torch): the same tree,
field for field, ties included. Without a GPU the kernels run under the Triton interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.tree import COUNTING_MAX_WIDTH, build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("tokens", "depths", "parents", "scores", "logprobs", "ranks")

# (depths L, vocabulary V, budget, topk): peaked and flat rows, topk below and above the budget,
# a vocabulary smaller than the budget, and the widest beam the kernels take (interpreter time ∝ L·W·K).
CASES = [(15, 50, 16, None), (6, 300, 64, None), (4, 30, 7, 3), (5, 40, 33, 2), (3, 8, 20, None),
         (9, 64, 1, None), (9, 64, 2, None), (2, 200, COUNTING_MAX_WIDTH, None)]


def assert_same_tree(logits, budget, topk):
    want = build_tree(logits, budget, topk, method="sort")
    got = build_tree(logits, budget, topk, method="count")
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f


@pytest.mark.parametrize("L,V,budget,topk", CASES)
def test_counting_build_equals_sorting_build(L, V, budget, topk):
    g = torch.Generator().manual_seed(L * 1000 + budget)
    for scale in (0.5, 4.0):  # flat and peaked draft distributions
        logits = (torch.randn(L, V, generator=g) * scale).to(DEVICE)
        assert_same_tree(logits, budget, topk)


@pytest.mark.parametrize("budget", [3, 10, 40])
def test_exact_ties_break_the_same_way(budget):
    # Few distinct logits: many children tie with each other and with other parents' children; a
    # certain depth (probability 1) makes a child tie its parent; -inf log-probs make empty slots.
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randint(0, 3, (12, 6), generator=g).float()
        logits[seed % 12] = torch.tensor([0.0, -1e9, -1e9, -1e9, -1e9, -1e9])
        logits[(seed + 5) % 12, 3:] = float("-inf")
        assert_same_tree(logits.to(DEVICE), budget, None)


def test_counting_refuses_wide_beams_and_unknown_methods():
    logits = torch.randn(3, 400)
    with pytest.raises(ValueError, match="up to 128 wide"):
        build_tree(logits, COUNTING_MAX_WIDTH + 1, None, method="count")
    with pytest.raises(ValueError, match="not 'sort' or 'count'"):
        build_tree(logits, 8, None, method="heap")
    assert torch.equal(build_tree(logits, 200, None).tokens, build_tree(logits, 200, None, method="sort").tokens)


def test_decoding_with_the_tree_kernels_matches_ar(tiny_dirs, monkeypatch):
    import ddtree_lab as dl
    from ddtree_lab import tree

    monkeypatch.setattr(tree, "TREE_KERNELS", "triton")  # the GPU default (build, masks, walk), interpreted here
    pair = dl.load_pair(target=tiny_dirs[0], drafter=tiny_dirs[1], device=DEVICE)
    prompt = [5, 17, 42, 8, 99, 3]
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=12)
    for budget in (3, 16):
        res = dl.generate(pair, prompt, method="ddtree", budget=budget, max_new_tokens=12)
        assert res.tokens == ar.tokens
        assert all(r.tree is not None and len(r.tree) == budget for r in res.rounds)
