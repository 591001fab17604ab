"""kernels/uniform_route.py (declared uniform routing's experts in one launch) vs its torch reference, exactly,
across token counts, expert counts, top-k and layers; and the engine routes through it where the Triton kernels
run. Without a GPU the kernel runs under the interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.declared_routing import token_keys, uniform_ids  # noqa: E402
from ddtree_lab.kernels.uniform_route import uniform_ids as uniform_ids_kernel  # noqa: E402
from ddtree_lab.kernels.uniform_route import uniform_ids_reference  # noqa: E402
from ddtree_lab.testing import make_tiny_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,E,k", [(1, 8, 1), (5, 16, 2), (33, 128, 8), (70, 384, 8), (300, 48, 6), (9, 1000, 3)])
@pytest.mark.parametrize("layer", [0, 60])
def test_kernel_equals_reference(T, E, k, layer):
    g = torch.Generator().manual_seed(T * 31 + E)
    # keys as the engine makes them: a vocabulary of 160k tokens at positions up to a million
    keys = token_keys(torch.randint(0, 163_840, (T,), generator=g), torch.randint(0, 1 << 20, (T,), generator=g))
    keys = keys.to(DEVICE)
    got, want = uniform_ids_kernel(keys, layer, E, k), uniform_ids_reference(keys, layer, E, k)
    assert got.dtype == want.dtype == torch.int64 and got.shape == (T, k)
    assert torch.equal(got, want)


def test_no_tokens_and_bad_arguments():
    assert uniform_ids_kernel(torch.zeros(0, dtype=torch.int64, device=DEVICE), 0, 8, 2).shape == (0, 2)
    with pytest.raises(AssertionError):
        uniform_ids_kernel(torch.zeros(3, dtype=torch.int64, device=DEVICE), 0, 4, 5)  # more picks than experts


def test_the_engine_routes_through_the_kernel_where_triton_runs(tmp_path, use_options, monkeypatch):
    """tree_kernels="triton" sends declared uniform routing through the kernel (counted), with the tokens of the
    torch path: the same experts, so the same text."""
    from ddtree_lab.kernels import uniform_route

    t, d = make_tiny_pair(tmp_path, arch="qwen3_moe", seed=3, tokenizer=False, num_experts=16, num_experts_per_tok=2)
    pair = dl.load_pair(target=t, drafter=d, routing="uniform")
    torch_tokens = dl.generate(pair, [5, 9, 2, 7], budget=8, max_new_tokens=8, stop=[]).tokens
    calls = []
    monkeypatch.setattr(uniform_route, "uniform_ids", lambda *a: calls.append(a) or uniform_ids_kernel(*a))
    use_options(tree_kernels="triton")
    assert dl.generate(pair, [5, 9, 2, 7], budget=8, max_new_tokens=8, stop=[]).tokens == torch_tokens
    assert calls and all(a[2:] == (16, 2) for a in calls)
    keys = token_keys(torch.arange(6), torch.arange(6))
    assert torch.equal(uniform_ids(keys, 1, 16, 2), uniform_ids_reference(keys, 1, 16, 2))
