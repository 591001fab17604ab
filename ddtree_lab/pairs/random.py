"""`random:<shape>`: real-size targets and their DFlash drafters with random weights, built on the device,
so real costs can be measured without the weights. The sizes are the models' public configs."""
from __future__ import annotations

from ..config import DrafterConfig, RopeConfig, TargetConfig

RANDOM_SHAPES = {
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=False, rope=RopeConfig(theta=1e6)),
    "qwen3-4b": dict(arch="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=True, rope=RopeConfig(theta=1e6)),
    "llama3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        rope=RopeConfig(theta=5e5, type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, tie_word_embeddings=False, rope=RopeConfig(theta=1e6),
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}
DRAFT_LAYERS = 5  # the public block-16 drafters of these targets have five layers
# The drafters' MLP width where it is not the target's dense width. A drafter is dense: an MoE target's
# expert width is never its size.
DRAFT_INTERMEDIATE = {"qwen3-30b-a3b": 6144}


def shape_configs(shape: str) -> tuple[TargetConfig, DrafterConfig]:
    """The target and drafter configs of a random shape (nothing allocated)."""
    tcfg = TargetConfig(**RANDOM_SHAPES[shape])
    dcfg = DrafterConfig(hidden_size=tcfg.hidden_size,
                         intermediate_size=DRAFT_INTERMEDIATE.get(shape, tcfg.intermediate_size),
                         num_hidden_layers=DRAFT_LAYERS, num_attention_heads=tcfg.num_attention_heads,
                         num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                         vocab_size=tcfg.vocab_size, block_size=16, num_target_layers=tcfg.num_hidden_layers,
                         mask_token_id=tcfg.vocab_size - 1, rope=tcfg.rope,
                         max_position_embeddings=tcfg.max_position_embeddings)
    return tcfg, dcfg


def random_pair(shape: str, device="cuda", dtype="bfloat16", attention="triton", seed=0, compile: bool = False):
    """A real-size target + DFlash drafter with random weights (N(0, 0.02) matrices, unit norms)."""
    # torch and the models load here, not at import: study files are checked against RANDOM_SHAPES torch-free
    import torch

    from ..checkpoint import Pair, torch_dtype
    from ..drafter import Drafter
    from ..model import Target

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    dtype = torch_dtype(dtype)
    torch.manual_seed(seed)
    models = []
    for cls, cfg in zip((Target, Drafter), shape_configs(shape)):
        with torch.device("meta"):
            m = cls(cfg)
        m = m.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for _, p in m.named_parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        m.rotary = type(m.rotary)(cfg.head_dim, cfg.rope, m.rotary.max_positions).to(device)
        models.append(m.eval().requires_grad_(False))
    target, drafter = models
    for m in models:
        m.set_attention(attention)
        if compile:
            m.compile_layers()
    ident = {"path": f"random:{shape}", "kind": target.cfg.arch}
    return Pair(target=target, drafter=drafter, tokenizer=None, name=f"random:{shape}", target_id=ident,
                drafter_id={"path": f"random:{shape}-dflash", "kind": "dflash"}, device=torch.device(device),
                dtype=dtype, eos_token_ids=[])
