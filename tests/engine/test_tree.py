"""build_tree against a plain best-first heap over rank prefixes (the tree-building stage)."""
import heapq

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.tree import ancestor_matrix, build_tree


def heap_tree(logp: torch.Tensor, budget: int, topk):
    """The paper's formulation: pop the best prefix, push its first child and its next sibling."""
    L, V = logp.shape
    K = min(topk or budget, budget, V)
    top_lp, top_tok = logp.topk(K, dim=-1)
    top_lp = top_lp.double().tolist()
    nodes = []  # (score, ranks)
    heap = [(-top_lp[0][0], (0,))]
    while heap and len(nodes) < budget:
        neg, ranks = heapq.heappop(heap)
        nodes.append((-neg, ranks))
        d = len(ranks)
        if ranks[-1] + 1 < K:  # next sibling
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (neg + top_lp[d - 1][ranks[-1]] - top_lp[d - 1][ranks[-1] + 1], sib))
        if d < L:  # first child
            heapq.heappush(heap, (neg - top_lp[d][0], ranks + (0,)))
    return nodes, top_tok


def rank_prefixes(tree: dl.DraftTree):
    out = []
    for i in range(len(tree)):
        ranks, j = [], i + 1
        while j != 0:
            ranks.append(int(tree.ranks[j - 1]))
            j = int(tree.parents[j - 1])
        out.append(tuple(reversed(ranks)))
    return out


def random_logits(L, V, peaked, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, V, generator=g)
    return x * (6.0 if peaked else 0.5)


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 64, 257, 1024])
@pytest.mark.parametrize("topk", [None, 1, 3, 16])
@pytest.mark.parametrize("peaked", [True, False])
def test_tree_matches_best_first_heap(budget, topk, peaked):
    for seed in range(3):
        L, V = 15, 50 + 37 * seed
        logits = random_logits(L, V, peaked, seed * 100 + budget)
        tree = dl.build_tree(logits, budget, topk)
        want, _ = heap_tree(torch.log_softmax(logits, -1), budget, topk)
        got = rank_prefixes(tree)
        assert set(got) == {r for _, r in want}
        assert len(got) == len(want)
        # descending score order, parents before children, scores consistent with log-probs
        assert torch.all(tree.scores[:-1] >= tree.scores[1:])
        assert torch.all(tree.parents < torch.arange(1, len(tree) + 1))
        parent_scores = torch.cat([torch.zeros(1), tree.scores])[tree.parents]
        assert torch.allclose(tree.scores, parent_scores + tree.logprobs, atol=1e-5)
        depth_of_parent = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])[tree.parents]
        assert torch.equal(tree.depths, depth_of_parent + 1)
        logp = torch.log_softmax(logits, -1)
        assert torch.allclose(tree.logprobs, logp[tree.depths - 1, tree.tokens], atol=1e-6)


@pytest.mark.parametrize("budget", [3, 10, 40])
def test_exact_ties_stay_prefix_closed(budget):
    # Many exact ties: few distinct logit values, including probability-1 positions (child == parent).
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randint(0, 3, (12, 6), generator=g).float()
        logits[seed % 12] = torch.tensor([0.0, -1e9, -1e9, -1e9, -1e9, -1e9])  # a certain depth
        tree = dl.build_tree(logits, budget, None)
        want, _ = heap_tree(torch.log_softmax(logits, -1), budget, None)
        got = rank_prefixes(tree)
        assert sorted(round(float(s), 4) for s in tree.scores) == sorted(round(s, 4) for s, _ in want)
        prefixes = set(got)
        assert all(p[:-1] in prefixes or len(p) == 1 for p in got)  # prefix-closed
        assert torch.all(tree.parents < torch.arange(1, len(tree) + 1))
        again = dl.build_tree(logits, budget, None)
        assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


def test_tree_smaller_than_budget_when_prefixes_run_out():
    logits = torch.randn(5, 30)
    assert len(dl.build_tree(logits, 64, topk=1)) == 5            # a single path
    assert len(dl.build_tree(torch.randn(2, 3), 64, None)) == 3 + 9  # every prefix of a tiny space


def test_ancestor_matrix_paths():
    tree = dl.build_tree(random_logits(15, 40, False, 1), 200, None)
    parents = torch.cat([torch.zeros(1, dtype=torch.long), tree.parents])
    anc = ancestor_matrix(parents, 15)
    for i in range(0, len(parents), 7):
        path, j = {0, i}, i
        while j != 0:
            j = int(parents[j])
            path.add(j)
        assert set(anc[i].nonzero().flatten().tolist()) == path


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.5, True])
def test_budget_out_of_range(bad):
    with pytest.raises(ValueError, match="budget"):
        dl.build_tree(torch.randn(3, 10), bad)


def test_topk_invalid():
    with pytest.raises(ValueError, match="topk"):
        dl.build_tree(torch.randn(3, 10), 8, topk=0)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_logits_refused(poison):
    logits = torch.randn(4, 50)
    logits[2, 7] = poison
    with pytest.raises(ValueError, match="row 2 .depth 3. holds NaN"):
        build_tree(logits, 16)
    masked = torch.randn(4, 50)
    masked[:, 10:] = float("-inf")  # masked tokens are fine: no NaN follows
    tree = build_tree(masked, 16)
    assert torch.isfinite(tree.scores).all() and int(tree.tokens.max()) < 10
    masked[1] = float("-inf")  # a row with nothing left
    with pytest.raises(ValueError, match="row 1"):
        build_tree(masked, 16)
    assert torch.isnan(build_tree(logits, 16, check_finite=False).scores).any()  # what the check keeps out


def test_dense_mask_follows_an_int_past_len():
    """A TreeMask reused without fresh() must not hand out the dense mask of another past_len."""
    from ddtree_lab.attention import TreeMask

    m = TreeMask.causal(2, "cpu")
    a, b = m.dense(3, 10, None).clone(), m.dense(5, 10, None)
    assert not torch.equal(a, b)
    assert torch.equal(b, TreeMask.causal(2, "cpu").dense(5, 10, None))
