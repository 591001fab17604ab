"""attention="invariant": the target gives a token the same logits, bit for bit, in any tree, in a prefill
and in an AR step, so every budget emits AR's text (kernels/batch_invariant.py; the ops' own tests are in
tests/kernels/test_batch_invariant.py). On the CPU its kernels run under the interpreter (conftest)."""
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.attention import TreeMask
from ddtree_lab.model import Target
from ddtree_lab.testing import random_init, tiny_target_config
from ddtree_lab.tree import ancestor_matrix

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_target(dtype, **overrides):
    target = Target(tiny_target_config("qwen3", **overrides))
    random_init(target, seed=2)
    target = target.to(DEVICE, dtype)
    target.set_attention("invariant")
    return target


def logits_after(target, tokens, past_tokens, step_by_step):
    """Fresh cache, a prefill of `past_tokens`, then `tokens` either one AR step at a time or in one
    causal forward -> the logits of the last token [V]."""
    target.setup_cache(64)
    P = len(past_tokens)
    target(torch.tensor(past_tokens, device=DEVICE), torch.arange(P, device=DEVICE), 0,
           TreeMask.causal(P, DEVICE))
    if step_by_step:
        for d, tok in enumerate(tokens):
            logits, _ = target(torch.tensor([tok], device=DEVICE), torch.tensor([P + d], device=DEVICE), P + d,
                               TreeMask.causal(1, DEVICE))
        return logits[-1]
    logits, _ = target(torch.tensor(tokens, device=DEVICE), P + torch.arange(len(tokens), device=DEVICE), P,
                       TreeMask.causal(len(tokens), DEVICE))
    return logits[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_tree_logits_equal_ar_logits_bit_for_bit(dtype):
    target = tiny_target(dtype)
    V = target.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (9,), generator=g).tolist()
    parents = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 10])  # a tree of 12, root first, depths up to 5
    tokens = torch.randint(0, V, (12,), generator=g)
    depths = torch.zeros(12, dtype=torch.long)
    for i in range(1, 12):
        depths[i] = depths[parents[i]] + 1
    anc = ancestor_matrix(parents)
    target.setup_cache(64)
    P = len(prompt)
    target(torch.tensor(prompt, device=DEVICE), torch.arange(P, device=DEVICE), 0, TreeMask.causal(P, DEVICE))
    tree_logits, _ = target(tokens.to(DEVICE), (P + depths).to(DEVICE), torch.tensor([P], device=DEVICE),
                            TreeMask(anc.to(DEVICE)))
    for i in (0, 4, 10, 11):
        path = [int(j) for j in torch.nonzero(anc[i]).flatten()]  # root … i: index order is depth order
        path_tokens = tokens[path].tolist()
        assert torch.equal(logits_after(target, path_tokens, prompt, step_by_step=True), tree_logits[i]), i
        assert torch.equal(logits_after(target, path_tokens, prompt, step_by_step=False), tree_logits[i]), i


def test_every_budget_emits_ar_text(tiny_dirs):
    t, d = tiny_dirs
    pair = dl.load_pair(target=t, drafter=d, device=DEVICE, attention="invariant")
    assert (pair.target.attention, pair.drafter.attention) == ("invariant", "triton")
    if DEVICE == "cpu":
        pair.drafter.set_attention("sdpa")  # the interpreter's attention is slow, and a draft decides no token
    budgets = (3, 8, "auto") if DEVICE == "cuda" else (3, 8)
    ar = dl.generate(pair, "def add(a, b):", method="ar", max_new_tokens=8)
    for budget in budgets:
        out = dl.generate(pair, "def add(a, b):", method="ddtree", budget=budget, max_new_tokens=8)
        assert out.tokens == ar.tokens, budget


def test_switching_back_restores_torchs_layers():
    target = tiny_target(torch.float32)
    flags = [m.batch_invariant for m in target.modules() if hasattr(m, "batch_invariant")]
    assert flags and all(flags)
    target.set_attention("sdpa")
    assert not any(m.batch_invariant for m in target.modules() if hasattr(m, "batch_invariant"))


def test_tensor_parallel_over_more_than_two_processes_is_refused():
    target = Target(tiny_target_config("qwen3"))
    target.tp = 4  # what parallel.make_parallel sets on a rank's share
    with pytest.raises(ValueError, match="takes tp ≤ 2"):
        target.set_attention("invariant")
    target.tp = 2
    target.set_attention("invariant")
    assert target.attention == "invariant"


def test_an_moe_target_is_refused_by_name():
    target = Target(tiny_target_config("qwen3_moe"))
    with pytest.raises(ValueError, match="covers dense targets; this one has MoE layers"):
        target.set_attention("invariant")
    assert target.attention == "sdpa"
