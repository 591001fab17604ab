"""Expert parallelism's share (TargetConfig.experts_held, moe.SparseMoE(held=…)): a rank holding some experts
routes over all of them and computes only its pairs, so the ranks' blocks sum to the whole block; the rank shapes
of random.py (`random:kimi-k2.6-ep8-rank`, `-tp8-rank`) hold what one of 8 GPUs holds."""
import dataclasses

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.config import ConfigError, expert_rank_share
from ddtree_lab.model import Target
from ddtree_lab.moe import SparseMoE
from ddtree_lab.pairs.random import KIMI_DEPTH, RANK_SHAPES, shape_configs, unknown_shape_message
from ddtree_lab.testing import make_tiny_pair

RANKS = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rank_copy(target: Target, held: tuple[int, ...]) -> Target:
    """A Target holding `held` of target's experts (same weights otherwise), as a rank of an EP deployment."""
    first = next(target.parameters())
    local = Target(dataclasses.replace(target.cfg, experts_held=held)).to(first.device, first.dtype)
    state = {k: v[list(held)] if k.endswith(("mlp.gate_up", "mlp.down")) else v
             for k, v in target.state_dict().items()}
    local.load_state_dict(state, strict=True)
    local.rotary = target.rotary
    return local.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    t, d = make_tiny_pair(tmp_path_factory.mktemp("ep"), arch="deepseek_v3", seed=5, tokenizer=False,
                          num_experts=16, num_experts_per_tok=4)
    return dl.load_pair(target=t, drafter=d, device=DEVICE)


@pytest.mark.parametrize("routing", ["router", "uniform"])
@pytest.mark.parametrize("tokens,kernels", [(9, "torch"), (9, "triton"), (1, "triton")])
def test_the_ranks_blocks_sum_to_the_whole_block(pair, use_options, routing, tokens, kernels):
    """Each rank's share of the block, summed, is the whole block: in torch, and in the kernels (the GPU's path,
    here under the interpreter), where one token's pairs are sorted in the routing kernel's own launch."""
    use_options(tree_kernels=kernels)
    full = pair.target
    E, k = full.cfg.num_experts, full.cfg.num_experts_per_tok
    ranks = [rank_copy(full, expert_rank_share(E, RANKS, r)) for r in range(RANKS)]
    for m in (full, *ranks):
        m.set_routing(routing)
    x = torch.randn(1, tokens, full.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    keys = torch.arange(tokens, device=DEVICE) * 7919
    blocks = [[blk for blk in m.modules() if isinstance(blk, SparseMoE)] for m in (full, *ranks)]
    for layer, (whole, *shares) in enumerate(zip(*blocks)):
        for b in (whole, *shares):
            if b.declared is not None:
                b.declared.keys = keys
        with torch.no_grad():
            want = whole(x)
            outs = [b(x) for b in shares]
            shared = whole.shared(x)
        got = sum(outs) - (RANKS - 1) * shared  # each rank adds the shared expert; the routed parts add up
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (layer, (got - want).abs().max())
        for r, b in enumerate(shares):  # a rank's counts: the whole block's at its experts, then the pairs sent away
            held = list(expert_rank_share(E, RANKS, r))
            assert torch.equal(b.counts_here(), whole.counts[held])
            assert int(b.counts[-1]) == tokens * k - int(whole.counts[held].sum())


def test_a_rank_decodes_losslessly_and_traces_its_own_experts(pair):
    rank = rank_copy(pair.target, expert_rank_share(16, RANKS, 1))
    rank.set_routing("uniform")
    ep = dataclasses.replace(pair, target=rank)
    ar = dl.generate(ep, [3, 1, 4, 1, 5], method="ar", max_new_tokens=20, stop=[])
    tree = dl.generate(ep, [3, 1, 4, 1, 5], budget=16, max_new_tokens=20, stop=[], trace=True)
    assert tree.tokens == ar.tokens
    touched = [n for r in tree.rounds if r.experts_touched for n in r.experts_touched]
    assert touched and max(touched) <= 16 // RANKS  # experts touched on this rank, never more than it holds


def test_rank_shapes_hold_one_gpus_share():
    ep, _ = shape_configs("kimi-k2.6-ep8-rank")
    tp, drafter = shape_configs("kimi-k2.6-tp8-rank")
    whole, whole_drafter = shape_configs(f"kimi-k2.6@{KIMI_DEPTH}")
    assert ep.num_hidden_layers == tp.num_hidden_layers == KIMI_DEPTH
    assert ep.experts_held == tuple(range(48)) and ep.experts_here == 48 and ep.num_experts == 384
    assert ep.num_attention_heads == 64 and ep.moe_intermediate_size == 2048  # attention whole, experts full width
    assert tp.experts_here == 384 and tp.num_attention_heads == 8 and tp.moe_intermediate_size == 256
    assert tp.intermediate_size == whole.intermediate_size // 8 and tp.expert_int4_group == 32
    assert drafter == whole_drafter  # the drafter is the model's, whole, on every rank
    assert all(f"random:{name}" in unknown_shape_message("x") for name in RANK_SHAPES)
    with torch.device("meta"):  # the EP rank's stacks: 48 experts, INT4 at full width; the AR step reads k/8 of them
        target = Target(dataclasses.replace(ep, num_hidden_layers=3))
    from ddtree_lab.bench.e2e import weight_bytes_per_step
    from ddtree_lab.kernels.moe_layout import expert_bytes
    moe = [m for m in target.modules() if isinstance(m, SparseMoE)]
    assert len(moe) == 2 and moe[0].gate_up.shape == (48, 4096, 7168)
    everything = weight_bytes_per_step(target, [48, 48])
    one = expert_bytes(7168, 2048, moe[0].gate_up.element_size())
    assert weight_bytes_per_step(target) == pytest.approx(everything - 2 * (48 - 8 * 48 / 384) * one, rel=1e-9)


def test_expert_share_refusals():
    with pytest.raises(ConfigError, match="384 experts do not split over 7 ranks"):
        expert_rank_share(384, 7, 0)
    with pytest.raises(ValueError, match="held experts .* distinct indices in 0..7"):
        SparseMoE(16, 8, 8, 2, True, held=(1, 9))


def test_a_share_built_on_the_meta_device_gets_its_expert_table_back():
    """random_pair builds on the meta device and moves with to_empty, which leaves buffers unset: the share's
    global -> local table is filled again (fill_local_index), as a share built in place has it."""
    made = SparseMoE(16, 8, 8, 2, True, held=(2, 5, 6))
    with torch.device("meta"):
        moved = SparseMoE(16, 8, 8, 2, True, held=(2, 5, 6))
    moved = moved.to_empty(device="cpu")
    moved.local_index.fill_(-7)  # what an unset buffer may hold
    moved.fill_local_index()
    assert torch.equal(moved.local_index, made.local_index)
    assert made.local_index.tolist() == [3, 3, 0, 3, 3, 1, 2, 3]


def test_a_rank_decodes_the_same_under_every_launch_choice(pair, use_options, monkeypatch):
    """The kernels' launch choices change no token of an EP rank's decode (the GPU's path, here under the
    interpreter): its gate-up split in two with the last split summing (the arrival counts used), the down's own
    stage count, and the launches as programmatic dependents (dropped on the CPU) against the default launches."""
    from ddtree_lab.kernels import fused_moe as fm

    rank = rank_copy(pair.target, expert_rank_share(16, RANKS, 2))
    rank.set_routing("uniform")
    ep = dataclasses.replace(pair, target=rank)
    use_options(tree_kernels="triton")
    want = dl.generate(ep, [2, 7, 1, 8], budget=8, max_new_tokens=8, stop=[]).tokens
    counted = []
    arrivals = fm._arrivals
    monkeypatch.setattr(fm, "_arrivals", lambda *a: counted.append(a) or arrivals(*a))
    use_options(moe_launch={"BLOCK_K_UP": 16, "SPLIT_K_UP": 2, "LAST_SPLIT_SUMS": 1, "STAGES_DOWN": 2},
                launch_pdl=True)
    assert dl.generate(ep, [2, 7, 1, 8], budget=8, max_new_tokens=8, stop=[]).tokens == want
    assert counted  # the AR steps' gate-ups did split, and their last splits summed
