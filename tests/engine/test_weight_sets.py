"""random:<shape>~<sets> (pairs/random.py: tied_layers, share_weights): every layer keeps its own module, cache and
routing, but only <sets> layers hold weights, which the others read in turn, so a deep shape fits a smaller card
while a step still reads every layer's bytes."""
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.bench.e2e import weight_bytes_per_step
from ddtree_lab.checkpoint import CheckpointError
from ddtree_lab.config import RopeConfig
from ddtree_lab.pairs import random as shapes
from ddtree_lab.testing import TINY_DEEPSEEK

# a Kimi-like shape small enough for the CPU: layer 0 dense, then MoE layers with INT4 experts
TINY_KIMI = dict(arch="deepseek_v3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
                 **{**TINY_DEEPSEEK, "rope": RopeConfig(theta=10000.0)}, expert_int4_group=32)


@pytest.fixture
def tiny_kimi(monkeypatch):
    monkeypatch.setitem(shapes.RANDOM_SHAPES, "tiny-kimi", TINY_KIMI)
    return "random:tiny-kimi"


def load(name):
    return dl.load_pair(name, device="cpu", dtype="float32", attention="sdpa")


def held_bytes(model) -> int:
    """Bytes the model holds: parameters() and buffers() give a shared tensor once."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_each_kind_of_layer_reads_its_kinds_weights_in_turn_and_keeps_its_own_state(tiny_kimi):
    target = load(tiny_kimi + "~3").target
    layers = target.layers
    tied = shapes.tied_layers(target.cfg, 3)
    assert tied == {3: 1, 4: 2, 5: 1}  # layer 0 is the only dense one; MoE layers take layers 1 and 2 in turn
    for i, j in tied.items():
        mine, source = layers[i].state_dict(keep_vars=True), layers[j].state_dict(keep_vars=True)
        assert mine.keys() == source.keys() and all(mine[k] is source[k] for k in mine)  # INT4 buffers too
        assert layers[i].mlp.counts is not layers[j].mlp.counts  # its own expert counts
    assert layers[1].mlp.gate_up.packed is not layers[2].mlp.gate_up.packed  # the sets themselves are distinct
    assert [layers[i].mlp.declared.layer for i in range(1, 6)] == [0, 1, 2, 3, 4]  # each MoE layer routes its own


def test_a_step_reads_every_layers_bytes_and_decodes_losslessly(tiny_kimi):
    tied, whole = load(tiny_kimi + "~3"), load(tiny_kimi)
    assert weight_bytes_per_step(tied.target) == weight_bytes_per_step(whole.target)  # the roofline's bytes
    assert held_bytes(tied.target) < held_bytes(whole.target)
    ar = dl.generate(tied, [3, 1, 4, 1, 5], method="ar", max_new_tokens=12, stop=[])
    tree = dl.generate(tied, [3, 1, 4, 1, 5], budget=8, max_new_tokens=12, stop=[])
    assert tree.tokens == ar.tokens and len(ar.tokens) == 12
    assert torch.isfinite(tied.target.layers[5].mlp.gate_up.scale).all()


def test_weight_sets_that_cannot_serve_the_layers_are_refused_before_loading(tiny_kimi):
    assert shapes.split_shape_name("kimi-k2.6-ep8-rank@40~8") == ("kimi-k2.6-ep8-rank", 40, 8)
    assert shapes.split_shape_name("kimi-k2.6~0") is None
    with pytest.raises(CheckpointError, match="layer 1 is an MoE layer and none of the first 1 is"):
        load(tiny_kimi + "~1")
    with pytest.raises(CheckpointError, match="unknown random shape .*~<sets>"):
        load(tiny_kimi + "@4~5")  # more sets than layers
    with pytest.raises(ValueError, match="loads whole, not split over 2 processes"):
        shapes.random_pair("tiny-kimi~3", device="cpu", dtype="float32", attention="sdpa", tp=2)
