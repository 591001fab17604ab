"""Declared routing (ddtree_lab/declared_routing.py): uniform routing is uniform, independent and a function of the
token alone (so DDTree == AR holds); a replayed trace routes each forward's tokens as the dump's next window."""

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.attention import TreeMask
from ddtree_lab.declared_routing import RoutingTrace, token_keys
from ddtree_lab.kernels.moe_layout import uniform_ids_reference as uniform_ids
from ddtree_lab.testing import make_tiny_pair


def test_uniform_ids_are_distinct_uniform_and_independent():
    E, k, N = 64, 4, 20000
    keys = token_keys(torch.randint(0, 5000, (N,)), torch.randint(0, 4096, (N,)))
    ids = uniform_ids(keys, layer=3, experts=E, top_k=k)
    assert ids.shape == (N, k) and all(len(set(r)) == k for r in ids[:500].tolist())
    share = torch.bincount(ids.flatten(), minlength=E).float() / (N * k)
    assert (share - 1 / E).abs().max() < 0.25 / E  # every expert about equally often
    for T in (1, 4, 16, 64):  # T tokens touch what independent draws would: E·(1 − ((E−k)/E)^T)
        windows = ids[: (N // T) * T].reshape(-1, T * k)
        touched = torch.tensor([len(set(w)) for w in windows[:300].tolist()], dtype=torch.float).mean()
        assert touched == pytest.approx(E * (1 - ((E - k) / E) ** T), rel=0.03), T
    other = uniform_ids(keys, layer=4, experts=E, top_k=k)  # another layer routes otherwise
    assert (other != ids).any(1).float().mean() > 0.9


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_uniform_routing_keeps_ddtree_equal_to_ar_and_is_recorded(tmp_path, arch):
    t, d = make_tiny_pair(tmp_path, arch=arch, seed=3, tokenizer=False, num_experts=16, num_experts_per_tok=2)
    pair = dl.load_pair(target=t, drafter=d, routing="uniform")
    assert pair.describe()["routing"] == "uniform"
    ar = dl.generate(pair, [5, 9, 2, 7], method="ar", max_new_tokens=24, stop=[])
    for budget in (4, 32):
        assert dl.generate(pair, [5, 9, 2, 7], budget=budget, max_new_tokens=24, stop=[]).tokens == ar.tokens
    assert dl.load_pair(target=t, drafter=d).describe()["routing"] == "router"  # a checkpoint's own by default


def test_a_trace_routes_each_forward_as_the_dumps_next_window(tmp_path):
    t, d = make_tiny_pair(tmp_path, arch="qwen3_moe", seed=3, tokenizer=False, num_experts=16, num_experts_per_tok=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(50 * 3)]).view(50, 3, 2)  # [N, L, k]
    pair = dl.load_pair(target=t, drafter=d, routing=RoutingTrace(ids, "dump.json"))
    assert pair.describe()["routing"] == "trace:dump.json"
    target = pair.target
    target.setup_cache(64)
    start = 0
    for T in (7, 20, 30):  # the third forward wraps around the dump's 50 tokens
        target(torch.arange(T), torch.arange(T), 0, TreeMask.causal(T, "cpu"))
        rows = [(start + i) % 50 for i in range(T)]
        for layer, m in enumerate(target._moe()):
            src = layer * 3 // len(target._moe())
            want = torch.bincount(ids[rows, src].flatten(), minlength=16)
            assert torch.equal(m.counts.long(), want)  # the experts touched are the window's union, with its loads
        start += T


def test_routing_refusals(tmp_path):
    t, d = make_tiny_pair(tmp_path / "moe", arch="qwen3_moe", seed=3, tokenizer=False)
    with pytest.raises(ValueError, match="routing='zipf' is not one of router, uniform"):
        dl.load_pair(target=t, drafter=d, routing="zipf")
    with pytest.raises(ValueError, match="routes each token to 3 experts; the target takes top-2"):
        dl.load_pair(target=t, drafter=d, routing=RoutingTrace(torch.zeros(4, 2, 3, dtype=torch.long), "a"))
    with pytest.raises(ValueError, match="names experts 0..8; the target has 8"):
        dl.load_pair(target=t, drafter=d, routing=RoutingTrace(torch.full((4, 2, 2), 8).tril(), "b"))
    dense_t, dense_d = make_tiny_pair(tmp_path / "dense", seed=3, tokenizer=False)
    with pytest.raises(ValueError, match="needs an MoE target"):
        dl.load_pair(target=dense_t, drafter=dense_d, routing="uniform")
