"""kernels/declared_route.py (a declared routing in one launch) vs its torch references: uniform routing's experts
exactly, the weights to rounding, across token counts, expert counts, top-k, layers, scorings and given experts;
and the engine routes through it where the Triton kernels run. Without a GPU the kernel runs under the
interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.declared_routing import token_keys  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ddtree_lab.kernels.declared_route import (MAX_EXPERTS, _mod_prime, declared_route,  # noqa: E402
                                               declared_weights_reference, grouped_route, uniform_ids_reference)
from ddtree_lab.kernels.moe_layout import UNIFORM_PRIME, route_grouped_reference  # noqa: E402
from ddtree_lab.testing import make_tiny_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [torch.float16])


def inputs(T, E, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # keys as the engine makes them: a vocabulary of 160k tokens at positions up to a million
    keys = token_keys(torch.randint(0, 163_840, (T,), generator=g), torch.randint(0, 1 << 20, (T,), generator=g))
    logits = (torch.randn(T, E, generator=g) * 3).to(dtype)
    return keys.to(DEVICE), logits.to(DEVICE)


@pytest.mark.parametrize("T,E,k", [(1, 8, 1), (5, 16, 2), (33, 128, 8), (70, 384, 8), (300, 48, 6), (9, 1000, 3)])
@pytest.mark.parametrize("layer", [0, 60])
def test_uniform_experts_exactly_and_weights_to_rounding(T, E, k, layer):
    keys, logits = inputs(T, E, T * 31 + E)
    scoring, renorm, scaling = ("sigmoid", True, 2.5) if layer else ("softmax", False, 1.0)
    weights, ids = declared_route(logits, k, scoring, renorm, scaling, keys=keys, layer=layer)
    want_ids = uniform_ids_reference(keys, layer, E, k)
    assert ids.dtype == want_ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    want = declared_weights_reference(logits, want_ids, scoring, renorm, scaling)
    assert weights.dtype == torch.float32 and torch.allclose(weights, want, rtol=1e-5, atol=1e-7)


@triton.jit
def _mod_prime_kernel(X, Y, N, PRIME: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, _mod_prime(tl.load(X + i, mask=i < N, other=0), PRIME), mask=i < N)


def test_the_hash_modulo_without_a_division_equals_torchs():
    P = UNIFORM_PRIME
    edges = [0, 1, P - 1, P, P + 1, 2 * P - 1, 2 * P, 1 << 31, (1 << 31) + 1, P * (P - 1), P * P - 1, (1 << 62) - 1]
    x = torch.cat([torch.tensor(edges), torch.randint(0, 1 << 62, (500,), generator=torch.Generator().manual_seed(0))])
    y = torch.empty_like(x).to(DEVICE)
    _mod_prime_kernel[(1,)](x.to(DEVICE), y, x.numel(), PRIME=P, BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(y.cpu(), x % P)


def test_the_most_experts_and_ties_of_the_packed_top_k():
    # MAX_EXPERTS: every index fits the bits packed under the score; top_k = E: the whole order, each index once
    keys, logits = inputs(2, MAX_EXPERTS, 5)
    weights, ids = declared_route(logits, 16, "softmax", False, keys=keys, layer=3)
    assert torch.equal(ids, uniform_ids_reference(keys, 3, MAX_EXPERTS, 16))
    keys, logits = inputs(3, 12, 6)
    _, ids = declared_route(logits, 12, "sigmoid", True, keys=keys, layer=1)
    assert torch.equal(ids, uniform_ids_reference(keys, 1, 12, 12))
    assert torch.equal(ids.sort(-1).values, torch.arange(12, device=ids.device).expand(3, 12))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring,renorm", [("softmax", True), ("sigmoid", False)])
def test_given_experts_take_their_scores(dtype, scoring, renorm):
    T, E, k = 12, 64, 4
    _, logits = inputs(T, E, 7, dtype)
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:k] for i in range(T)])
    ids = ids.to(DEVICE)
    weights, got = declared_route(logits, k, scoring, renorm, 1.0, ids=ids)
    assert torch.equal(got, ids)
    want = declared_weights_reference(logits, ids, scoring, renorm, 1.0)
    assert torch.allclose(weights, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("given", [False, True])
def test_an_expert_parallel_ranks_places_come_from_the_same_launch(given):
    """local_index maps the ids the kernel returns (an EP8 rank of 48 of 384 experts: its places 0..47, 48 for an
    expert held elsewhere), in the dtype asked for; the weights stay those of the experts routed to."""
    T, E, k = 9, 384, 8
    keys, logits = inputs(T, E, 11)
    held = torch.arange(96, 144)  # rank 2's experts
    local = torch.full((E,), len(held), dtype=torch.int64)
    local[held] = torch.arange(len(held))
    local = local.to(DEVICE)
    experts = uniform_ids_reference(keys, 7, E, k)
    route = dict(ids=experts) if given else dict(keys=keys, layer=7)
    weights, ids = declared_route(logits, k, "sigmoid", True, 2.5, local_index=local, ids_dtype=torch.int32, **route)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), local[experts])
    assert ((ids < len(held)) == ((experts >= 96) & (experts < 144))).all()
    want = declared_weights_reference(logits, experts, "sigmoid", True, 2.5)
    assert torch.allclose(weights, want, rtol=1e-5, atol=1e-7)
    given_ids = experts.contiguous()
    _, same = declared_route(logits, k, "sigmoid", True, 2.5, ids=given_ids)
    assert same is given_ids  # given ids, neither mapped nor converted, come back as they were (nothing written)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("mode", ["uniform", "given", "grouped"])
@pytest.mark.parametrize("places", [False, True])
def test_the_routing_launch_sorts_its_pairs_as_moe_align_does(T, mode, places):
    """`routed=` (AR's few tokens): the same launch leaves the sort of the ids it returns, equal to
    fused_moe.align_reference's, over an EP8 rank's 48 places plus the bucket of experts held elsewhere (places)
    or over all 384 experts; the weights and ids are those of the launch without it."""
    from ddtree_lab.kernels.fused_moe import align_outputs, align_reference

    E, k = 384, 8
    keys, logits = inputs(T, E, 5 + T)
    local = None
    if places:
        local = torch.full((E,), 48, dtype=torch.int64)
        local[torch.arange(96, 144)] = torch.arange(48)
        local = local.to(DEVICE)
    sorted_experts = 49 if places else E
    if mode == "grouped":
        logits, bias = separated_choices(T, E, 3 + T)
        call = lambda **kw: grouped_route(logits, bias, k, 1, 1, "sigmoid", True, 2.827, local_index=local,  # noqa: E731
                                          ids_dtype=torch.int32, **kw)
    else:
        route = dict(keys=keys, layer=4) if mode == "uniform" else dict(ids=uniform_ids_reference(keys, 4, E, k))
        call = lambda **kw: declared_route(logits, k, "sigmoid", True, 2.5, local_index=local,  # noqa: E731
                                           ids_dtype=torch.int32, **route, **kw)
    want_w, want_ids = call()
    routed = align_outputs(T * k, sorted_experts, DEVICE)
    for t in routed:
        t.fill_(-7)  # garbage where the launch must write
    weights, ids = call(routed=routed)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    want = align_reference(ids, sorted_experts)
    valid = want[1] >= 0  # a slot's start means something where the slot holds an expert
    assert torch.equal(routed[0], want[0]) and torch.equal(routed[1], want[1]) and torch.equal(routed[3], want[3])
    assert torch.equal(routed[2][valid], want[2][valid])


def test_the_routing_launch_sorts_only_a_few_tokens():
    from ddtree_lab.kernels.fused_moe import align_outputs

    keys, logits = inputs(3, 16, 2)
    with pytest.raises(AssertionError, match="up to 2 tokens"):
        declared_route(logits, 2, "softmax", True, keys=keys, routed=align_outputs(6, 16, DEVICE))
    empty = align_outputs(0, 16, DEVICE)
    empty[0].fill_(5)
    declared_route(logits[:0], 2, "softmax", True, keys=keys[:0], routed=empty)
    assert not empty[0].any()  # no pairs: every count 0


def separated_choices(T, E, seed):
    """Sigmoid logits [T, E] and a correction bias [E] whose corrected scores sit about 1e-3 apart, each token in
    its own order, so that a rounding of the sigmoid cannot reorder two experts (nor two groups' sums)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randint(-48, 49, (E,), generator=g) / 256                       # exact in fp32, within ±0.19
    order = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).double()
    choice = 0.3 + 0.4 * (order + 0.5 * torch.rand(T, E, generator=g, dtype=torch.float64)) / E  # [T, E] in (0.3, 0.7)
    score = choice - bias.double()                                                # in (0.1, 0.9)
    return (score / (1 - score)).log().float().to(DEVICE), bias.float().to(DEVICE)


@pytest.mark.parametrize("T,E,k,n_group,topk_group", [(1, 384, 8, 1, 1), (33, 384, 8, 1, 1), (9, 256, 8, 8, 4),
                                                      (70, 256, 8, 8, 4), (5, 16, 3, 4, 2), (4, 64, 6, 8, 1)])
def test_a_grouped_routers_choice_in_one_launch(T, E, k, n_group, topk_group):
    """DeepSeek-V3's grouped router (Kimi K2: 384 experts in one group; DeepSeek-V3: 256 in 8 groups, 4 open):
    the experts equal the reference's, best first, the weights to rounding; with local_index, an EP rank's
    places."""
    logits, bias = separated_choices(T, E, T * 7 + E + n_group)
    want_w, want_ids = route_grouped_reference(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.827)
    weights, ids = grouped_route(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.827)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w, rtol=1e-5, atol=1e-7)
    local = torch.randperm(E, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _, places = grouped_route(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.827, local_index=local,
                              ids_dtype=torch.int32)
    assert places.dtype == torch.int32 and torch.equal(places.long(), local[want_ids])


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's GPU sigmoid; the CPU twin keeps the scores apart (above)")
@pytest.mark.parametrize("E,n_group,topk_group", [(384, 1, 1), (256, 8, 4)])
def test_on_a_gpu_a_grouped_routers_experts_are_torchs_bit_for_bit(E, n_group, topk_group):
    """Random logits, near ties and all: the kernel's sigmoid rounds as torch's, so 4,096 tokens route alike."""
    g = torch.Generator().manual_seed(E)
    logits = (torch.randn(4096, E, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    want_w, want_ids = route_grouped_reference(logits, bias, 8, n_group, topk_group, "sigmoid", True, 2.827)
    weights, ids = grouped_route(logits, bias, 8, n_group, topk_group, "sigmoid", True, 2.827)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-5, atol=1e-7)


def test_a_grouped_router_with_softmax_scores_and_no_renormalisation():
    T, E = 6, 64
    _, logits = inputs(T, E, 3)
    bias = torch.zeros(E, device=DEVICE)
    want_w, want_ids = route_grouped_reference(logits, bias, 4, 4, 2, "softmax", False, 1.0)
    weights, ids = grouped_route(logits, bias, 4, 4, 2, "softmax", False)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-5, atol=1e-7)
    with pytest.raises(AssertionError, match="groups"):
        grouped_route(logits, bias, 4, 3, 1, "softmax", False)  # 64 experts in 3 groups
    with pytest.raises(AssertionError, match="fewer than top_k"):
        grouped_route(logits, bias, 20, 4, 1, "softmax", False)  # one open group of 16 for 20 picks


def test_no_tokens_and_bad_arguments():
    keys, logits = inputs(3, 8, 1)
    w, ids = declared_route(logits[:0], 2, "softmax", True, keys=keys[:0])
    assert w.shape == ids.shape == (0, 2)
    for kwargs in (dict(keys=keys, ids=torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)), {}):
        with pytest.raises(AssertionError, match="one of them"):
            declared_route(logits, 2, "softmax", True, **kwargs)
    with pytest.raises(AssertionError, match="scoring"):
        declared_route(logits, 2, "relu", True, keys=keys)
    with pytest.raises(AssertionError):
        declared_route(logits, 9, "softmax", True, keys=keys)  # more picks than experts


@pytest.mark.parametrize("arch,routing,kernel", [("qwen3_moe", "uniform", "declared_route"),
                                                 ("deepseek_v3", "uniform", "declared_route"),
                                                 ("deepseek_v3", "router", "grouped_route")])
def test_the_engine_routes_through_the_kernel_where_triton_runs(tmp_path, use_options, monkeypatch, arch, routing,
                                                                kernel):
    """Where the Triton kernels run (a GPU; tree_kernels="triton" on the CPU) declared uniform routing, and a
    DeepSeek-V3 checkpoint's own grouped router (routing="router": 16 experts in 4 groups, 2 open), go through the
    routing kernel (counted), each call asking for the int32 places the expert kernels take; DDTree == AR holds
    (every forward routes a token alike, whatever shares it), and torch's references give the same tokens."""
    from ddtree_lab.kernels import declared_route as kernel_module

    t, d = make_tiny_pair(tmp_path, arch=arch, seed=3, tokenizer=False, num_experts=16, num_experts_per_tok=2)
    pair = dl.load_pair(target=t, drafter=d, routing=routing, device=DEVICE, dtype="float32")
    calls, launch = [], getattr(kernel_module, kernel)
    monkeypatch.setattr(kernel_module, kernel, lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    if DEVICE == "cpu":
        use_options(tree_kernels="triton")  # the GPU's path, under the interpreter
    ar = dl.generate(pair, [5, 9, 2, 7], method="ar", max_new_tokens=12, stop=[])
    assert dl.generate(pair, [5, 9, 2, 7], budget=8, max_new_tokens=12, stop=[]).tokens == ar.tokens
    assert calls and all(kw["ids_dtype"] == torch.int32 for kw in calls)
    if routing == "uniform":
        assert all(kw["keys"] is not None and kw["ids"] is None for kw in calls)
    # AR's steps (one token) have their pairs sorted in the routing launch; a prompt or a tree's do not
    assert any(kw["routed"] is not None for kw in calls) and any(kw["routed"] is None for kw in calls)
    use_options(moe_launch=(("fuse_route", 0),))  # the sort in its own launches instead: the same tokens
    before = len(calls)
    assert dl.generate(pair, [5, 9, 2, 7], method="ar", max_new_tokens=12, stop=[]).tokens == ar.tokens
    assert len(calls) > before and all(kw["routed"] is None for kw in calls[before:])
    use_options(moe_launch=())
    seen = len(calls)
    use_options(declared_routing="torch")  # the references instead, for a side-by-side timing: the same tokens
    assert dl.generate(pair, [5, 9, 2, 7], budget=8, max_new_tokens=12, stop=[]).tokens == ar.tokens
    assert len(calls) == seen


def test_the_bench_times_kernel_and_torch_on_the_same_routing_and_a_baseline_side_by_side(tmp_path, capsys):
    """`python -m ddtree_lab.bench.declared_route --smoke`: every row checked against torch's experts, a baseline
    kernel file (here this checkout's own) timed on the same inputs and found equal; refusals in one line."""
    import json
    from pathlib import Path

    from ddtree_lab.bench import declared_route as bench
    from ddtree_lab.kernels import declared_route as kernel_file

    out = tmp_path / "declared_route.json"
    rows = bench.main(["--smoke", "--tokens", "1", "6", "--baseline", kernel_file.__file__, "--out", str(out)])
    assert [r["T"] for r in rows] == [1, 6]
    for r in rows:
        assert r["triton_us"] > 0 and r["torch_us"] > 0 and r["baseline_us"] > 0
        assert r["equal_to_baseline"] is True and r["max_abs_diff_weights"] < 1e-5
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["baseline"] == kernel_file.__file__ and saved["smoke"] is True
    for argv, words in ((["--smoke", "--baseline", str(Path(tmp_path) / "none.py")], "no such file"),
                        (["--smoke", "--tokens", "0"], "each at least 1")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert words in capsys.readouterr().err


def test_the_bench_times_the_sort_in_the_routings_launch_against_its_own_launch(tmp_path, capsys):
    """`--sort`: AR's steps, the routing that sorts its pairs (over a rank's places and the bucket of experts held
    elsewhere) against the routing then moe_align, the sorts found equal first; refusals in one line."""
    import json

    from ddtree_lab.bench import declared_route as bench

    out = tmp_path / "sorted.json"
    rows = bench.main(["--smoke", "--sort", "--out", str(out)])
    assert [r["T"] for r in rows] == [1, 2]
    assert all(r["sorted_experts"] == 7 and r["sorted_us"] > 0 and r["then_align_us"] > 0 for r in rows)
    assert json.loads(out.read_text())["sort"] is True
    for argv, words in ((["--smoke", "--sort", "--tokens", "3"], "up to 2 tokens"),
                        (["--smoke", "--sort", "--router"], "leave out --router"),
                        (["--smoke", "--warps", "3"], "a power of two")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert words in capsys.readouterr().err


def test_warps_are_a_launch_choice_that_changes_no_expert():
    """num_warps overrides routing_warps(E) (one warp up to 128 experts, twice as many for twice the experts, at
    most 8: four for a Kimi layer's 384); any count routes to the same experts and the weights agree to rounding."""
    from ddtree_lab.kernels.declared_route import routing_warps

    assert [routing_warps(E) for E in (8, 128, 129, 384, 512, 513, 1024, 4096)] == [1, 1, 2, 4, 4, 8, 8, 8]
    keys, logits = inputs(3, 384, 9)
    want_w, want_ids = declared_route(logits, 8, "sigmoid", True, 2.5, keys=keys, layer=2)
    for w in (1, 2, 8):
        weights, ids = declared_route(logits, 8, "sigmoid", True, 2.5, keys=keys, layer=2, num_warps=w)
        assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, rtol=1e-6, atol=1e-7)
    with pytest.raises(AssertionError, match="power of two"):
        declared_route(logits, 8, "sigmoid", True, keys=keys, num_warps=3)


def test_the_bench_times_a_grouped_routers_choice_both_ways(tmp_path, capsys):
    """`--router`: the shape's own grouped router, the kernel against torch's reference on the same logits."""
    import json

    from ddtree_lab.bench import declared_route as bench

    out = tmp_path / "grouped.json"
    rows = bench.main(["--smoke", "--router", "--tokens", "1", "6", "--warps", "2", "--out", str(out)])
    assert [r["T"] for r in rows] == [1, 6] and all(r["triton_us"] > 0 and r["torch_us"] > 0 for r in rows)
    assert all(list(r["warps_us"]) == ["2"] and r["warps_us"]["2"] > 0 for r in rows)  # timed, experts checked
    assert all(r["max_abs_diff_weights"] < 1e-5 for r in rows)
    assert json.loads(out.read_text())["routing"] == "router"
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--router", "--baseline", bench.__file__])
    assert "--router times the grouped router's" in capsys.readouterr().err


def test_the_bench_reads_a_rank_shapes_whole_router():
    from ddtree_lab.bench.declared_route import router_shape

    ep8 = router_shape("kimi-k2.6-ep8-rank")
    assert (ep8["experts"], ep8["top_k"], ep8["scoring"], ep8["layers"]) == (384, 8, "sigmoid", 60)
    assert (ep8["n_group"], ep8["topk_group"]) == (1, 1)  # Kimi K2: one group of all its experts
    with pytest.raises(ValueError, match="not an MoE shape"):
        router_shape("qwen3-8b")
