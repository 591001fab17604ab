"""The MoE block's training path (moe.moe_torch_dense): the sparse block's function, differentiable, counted."""
import pytest
import torch

from ddtree_lab.kernels.moe_layout import route_grouped_reference
from ddtree_lab.model import Target
from ddtree_lab.moe import moe_torch_dense, moe_torch_routed
from ddtree_lab.testing import random_init, tiny_target_config


@pytest.mark.parametrize("T,E,k,H,I", [(1, 4, 1, 8, 4), (7, 8, 2, 16, 8), (33, 16, 4, 32, 16)])
def test_dense_path_equals_the_routed_path(T, E, k, H, I):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    w_gu, w_d = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g)
    weights, ids = route_grouped_reference(logits, torch.zeros(E), k, 2 if E >= 4 * k else 1, 1 if E >= 4 * k else 1,
                                           "sigmoid", True, 1.5)
    c_dense, c_routed = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    dense = moe_torch_dense(x, weights, ids, w_gu, w_d, counts=c_dense)
    routed = moe_torch_routed(x, weights, ids, w_gu, w_d, counts=c_routed)
    torch.testing.assert_close(dense, routed, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_dense, c_routed) and int(c_dense.sum()) == T * k


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_training_forward_takes_the_dense_path_and_trains_router_and_experts(arch):
    t = Target(tiny_target_config(arch, vocab_size=64))
    random_init(t, 0)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, _ = t.forward_train(tokens)  # the inference path: no gradients wanted
    logits, _ = t.forward_train(tokens)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    logits.square().mean().backward()
    moe = [m for m in t.modules() if m.__class__.__name__ == "SparseMoE"]
    assert moe
    for m in moe:
        assert m.gate_up.grad.abs().sum() > 0 and m.down.grad.abs().sum() > 0 and m.router.weight.grad.abs().sum() > 0
        assert int(m.counts.sum()) == tokens.numel() * m.top_k  # the last forward's load, per expert
