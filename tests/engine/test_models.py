"""Our Qwen3 / Llama targets against transformers' implementations on random tiny checkpoints (fp32)."""
import json

import pytest
import torch

from ddtree_lab.attention import TreeMask
from ddtree_lab.checkpoint import load_target
from ddtree_lab.config import target_config_from_hf

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6)

CASES = {
    "qwen3-tied": ("Qwen3", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3-untied": ("Qwen3", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama": ("Llama", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "llama3.1-rope": ("Llama", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
}


def hf_model(kind, extra, seed):
    cfg_cls = getattr(transformers, f"{kind}Config")
    model_cls = getattr(transformers, f"{kind}ForCausalLM")
    torch.manual_seed(seed)
    cfg = cfg_cls(**BASE, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random norms too, so a missed norm weight shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_hidden_match_transformers(case, tmp_path):
    kind, extra = CASES[case]
    ref = hf_model(kind, extra, seed=len(case))
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_target(tmp_path)
    T = 200  # longer than original_max_position_embeddings for the llama3 case
    tokens = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens[None], output_hidden_states=True)
        ours.setup_cache(T)
        logits, hidden = ours(tokens, torch.arange(T), 0, TreeMask.causal(T, "cpu"), hidden_layers=[0, 2])
    assert torch.allclose(logits, want.logits[0], atol=2e-4, rtol=1e-4), (logits - want.logits[0]).abs().max()
    H = BASE["hidden_size"]
    assert torch.allclose(hidden[:, :H], want.hidden_states[1][0], atol=1e-4)
    # the last layer's output is normed in transformers' hidden_states[-1]; compare an inner layer only
    train_logits, _ = ours.forward_train(tokens[None])
    assert torch.allclose(train_logits[0], want.logits[0], atol=2e-4, rtol=1e-4)


def test_incremental_decode_matches_full_forward(tmp_path):
    kind, extra = CASES["qwen3-untied"]
    hf_model(kind, extra, seed=7).save_pretrained(tmp_path, safe_serialization=True)
    ours = load_target(tmp_path)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours.setup_cache(64)
        full, _ = ours(tokens, torch.arange(40), 0, TreeMask.causal(40, "cpu"))
        ours.setup_cache(64)
        first, _ = ours(tokens[:30], torch.arange(30), 0, TreeMask.causal(30, "cpu"))
        rest = [ours(tokens[i:i + 1], torch.tensor([i]), i, TreeMask.causal(1, "cpu"))[0] for i in range(30, 40)]
    assert torch.allclose(torch.cat([first, *rest]), full, atol=1e-4)


def test_tree_mask_equals_separate_paths(tmp_path):
    """A tree's verify forward gives each node the logits of its own root path run causally."""
    kind, extra = CASES["qwen3-tied"]
    hf_model(kind, extra, seed=9).save_pretrained(tmp_path, safe_serialization=True)
    ours = load_target(tmp_path)
    from ddtree_lab.tree import ancestor_matrix

    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3))
    parents = torch.tensor([0, 0, 0, 1, 1, 2, 3, 5])  # root, two children, grandchildren …
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3])
    toks = torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(4))
    anc = ancestor_matrix(parents, 4)
    with torch.no_grad():
        ours.setup_cache(40)
        ours(prompt, torch.arange(12), 0, TreeMask.causal(12, "cpu"))
        tree_logits, _ = ours(toks, 12 + depths, 12, TreeMask(anc))
        for i in range(8):
            path = anc[i].nonzero().flatten()
            seq = torch.cat([prompt, toks[path]])
            ours.setup_cache(40)
            ref, _ = ours(seq, torch.arange(len(seq)), 0, TreeMask.causal(len(seq), "cpu"))
            assert torch.allclose(tree_logits[i], ref[-1], atol=1e-4)


def test_reads_transformers_4_and_5_rope_keys(tmp_path):
    old = {"architectures": ["LlamaForCausalLM"], **BASE, "rope_theta": 5e5,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    new = {"architectures": ["LlamaForCausalLM"], **BASE,
           "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    a, b = target_config_from_hf(old, tmp_path), target_config_from_hf(new, tmp_path)
    assert a.rope == b.rope and a.rope.type == "llama3" and a.rope.theta == 5e5
    bad = dict(new, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="longrope"):
        target_config_from_hf(bad, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(old))


def test_rotary_table_rows_equal_computed_rows():
    from ddtree_lab.config import RopeConfig
    from ddtree_lab.layers import Rotary

    rope = Rotary(16, RopeConfig(theta=10000.0), max_positions=300)
    pos = torch.tensor([[0, 5, 299], [17, 17, 1]])
    for dtype in (torch.float32, torch.float16):
        got, want = rope(pos, dtype), rope.compute(pos, dtype)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and got[0].shape == (2, 3, 16)


def test_decoding_to_the_last_position_of_the_context(tmp_path):
    # a full context: the last round's tree sits past max_position_embeddings (inside the RoPE slack)
    import ddtree_lab as dl
    from ddtree_lab.testing import make_tiny_pair

    t, d = make_tiny_pair(tmp_path, max_position_embeddings=48)
    pair = dl.load_pair(target=t, drafter=d)
    prompt = list(range(3, 35))
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=16, stop=[])
    tree = dl.generate(pair, prompt, method="ddtree", budget=16, max_new_tokens=16, stop=[])
    assert tree.tokens == ar.tokens and len(ar.tokens) == 16
