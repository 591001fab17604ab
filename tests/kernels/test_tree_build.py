"""The Triton tree builds (kernels/tree_build.py: counting, and one launch with in-register sorts) vs the
sorting build (torch): the same tree, field for field, ties included. Without a GPU the kernels run
under the Triton interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.tree import COUNTING_MAX_WIDTH, FUSED_MAX_WIDTH, build_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("tokens", "depths", "parents", "scores", "logprobs", "ranks")

# (depths L, vocabulary V, budget, topk): peaked and flat rows, topk below and above the budget,
# a vocabulary smaller than the budget, and the widest beam each build takes (interpreter time ∝ L·W·K).
SHAPES = [(15, 50, 16, None), (6, 300, 64, None), (4, 30, 7, 3), (5, 40, 33, 2), (3, 8, 20, None),
          (9, 64, 1, None), (9, 64, 2, None)]
CASES = ([("count", *s) for s in SHAPES + [(2, 200, COUNTING_MAX_WIDTH, None)]]
         + [("fused", *s) for s in SHAPES + [(2, 300, FUSED_MAX_WIDTH, None)]])


def assert_same_tree(logits, budget, topk, method):
    want = build_tree(logits, budget, topk, method="sort")
    got = build_tree(logits, budget, topk, method=method)
    for f in FIELDS:
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f


@pytest.mark.parametrize("method,L,V,budget,topk", CASES)
def test_triton_build_equals_sorting_build(method, L, V, budget, topk):
    g = torch.Generator().manual_seed(L * 1000 + budget)
    for scale in (0.5, 4.0):  # flat and peaked draft distributions
        logits = (torch.randn(L, V, generator=g) * scale).to(DEVICE)
        assert_same_tree(logits, budget, topk, method)


@pytest.mark.parametrize("method", ["count", "fused"])
@pytest.mark.parametrize("budget", [3, 10, 40])
def test_exact_ties_break_the_same_way(budget, method):
    # Few distinct logits: many children tie with each other and with other parents' children; a
    # certain depth (probability 1) makes a child tie its parent; -inf log-probs make empty slots.
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randint(0, 3, (12, 6), generator=g).float()
        logits[seed % 12] = torch.tensor([0.0, -1e9, -1e9, -1e9, -1e9, -1e9])
        logits[(seed + 5) % 12, 3:] = float("-inf")
        assert_same_tree(logits.to(DEVICE), budget, None, method)


def test_kernels_refuse_wide_beams_and_unknown_methods():
    logits = torch.randn(3, 400)
    with pytest.raises(ValueError, match="up to 128 wide"):
        build_tree(logits, COUNTING_MAX_WIDTH + 1, None, method="count")
    with pytest.raises(ValueError, match="up to 256 wide"):
        build_tree(logits, FUSED_MAX_WIDTH + 1, None, method="fused")
    with pytest.raises(ValueError, match="not 'sort', 'count' or 'fused'"):
        build_tree(logits, 8, None, method="heap")
    assert torch.equal(build_tree(logits, 200, None).tokens, build_tree(logits, 200, None, method="sort").tokens)


def test_tree_build_setting_picks_the_build_where_it_fits(monkeypatch, use_options):
    from ddtree_lab.kernels import tree_build

    used = []
    for name in ("beam_tree", "fused_tree"):
        real = getattr(tree_build, name)
        monkeypatch.setattr(tree_build, name, lambda *a, _real=real, _name=name: used.append(_name) or _real(*a))
    logits = torch.randn(3, 400).to(DEVICE)
    use_options(tree_build="fused")
    build_tree(logits, 8, None)
    build_tree(logits, FUSED_MAX_WIDTH + 1, None)  # too wide for it: the sort
    use_options(tree_build="count")
    build_tree(logits, 8, None)
    assert used == ["fused_tree", "beam_tree"]


@pytest.mark.parametrize("build", [None, "fused"])
def test_decoding_with_the_tree_kernels_matches_ar(tiny_dirs, monkeypatch, build, use_options):
    import ddtree_lab as dl

    use_options(tree_kernels="triton")  # the GPU default (build, masks, walk), interpreted here
    use_options(tree_build=build)
    pair = dl.load_pair(target=tiny_dirs[0], drafter=tiny_dirs[1], device=DEVICE)
    prompt = [5, 17, 42, 8, 99, 3]
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=12)
    for budget in (3, 16):
        res = dl.generate(pair, prompt, method="ddtree", budget=budget, max_new_tokens=12)
        assert res.tokens == ar.tokens
        assert all(r.tree is not None and len(r.tree) == budget for r in res.rounds)


def test_fused_build_benchmark_checks_every_warp_count():
    # The benchmark's own check: the tree must not depend on num_warps (interpreted here, timed on a GPU).
    from ddtree_lab.bench.tree_build import bench_fused_tree
    from ddtree_lab.kernels.tree_build import fused_num_warps

    rows = bench_fused_tree(widths=(8, 16), warps=(4, 8), depth=4, vocab=300, device=DEVICE, reps=2)
    assert [(r["width"], r["num_warps"]) for r in rows] == [(8, 4), (8, 8), (16, 4), (16, 8)]
    assert all(r["same_as_sort"] and r["us"] > 0 for r in rows)
    assert [fused_num_warps(b) for b in (16, 1024, 2048, 4096)] == [8, 8, 16, 32]
