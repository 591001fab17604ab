"""Random tiny checkpoints in the real on-disk formats, for tests and quick experiments."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .attention import TreeMask
from .checkpoint import save_drafter, save_target
from .config import DrafterConfig, MlaConfig, RopeConfig, TargetConfig
from .drafter import Drafter
from .model import Target

TINY_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i * i)\n"
)


# arch="qwen3_moe": 8 experts of width 32, top-2, renormalised; layer 1 keeps a dense MLP (mlp_only_layers)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[1])


# arch="deepseek_v3": MLA with a q LoRA, yarn RoPE, 8 experts in 4 groups (2 open) top-2 with sigmoid scores and a
# correction bias, one shared expert, layer 0 dense
TINY_DEEPSEEK = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
                     first_k_dense_replace=1, num_key_value_heads=4, head_dim=32,
                     mla=MlaConfig(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                   v_head_dim=24),
                     rope=RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=128,
                                     mscale=1.0, mscale_all_dim=1.0))


def tiny_target_config(arch: str = "qwen3", vocab_size: int = 300, **overrides) -> TargetConfig:
    cfg = dict(arch=arch, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
               tie_word_embeddings=arch == "qwen3", rope=RopeConfig(theta=10000.0), eos_token_id=[])
    if arch == "qwen3_moe":
        cfg.update(TINY_MOE)
    if arch == "deepseek_v3":
        cfg.update(TINY_DEEPSEEK)
    cfg.update(overrides)
    return TargetConfig(**cfg)


def tiny_drafter_config(target: TargetConfig, **overrides) -> DrafterConfig:
    cfg = dict(hidden_size=target.hidden_size, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=target.vocab_size,
               block_size=8, num_target_layers=target.num_hidden_layers, target_layer_ids=[0, 2],
               mask_token_id=target.vocab_size - 1, rope=RopeConfig(theta=10000.0))
    cfg.update(overrides)
    return DrafterConfig(**cfg)


def random_init(module: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("router.weight"):  # sharper routing, so tokens spread over the experts
                p.copy_(4 * std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def write_tiny_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE with <|endoftext|> and <|mask|>, trained on a few lines of code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TINY_TEXT] * 4, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "mask_token": "<|mask|>", "model_max_length": 2048}, indent=2))


def make_tiny_pair(directory, arch: str = "qwen3", vocab_size: int = 300, seed: int = 0,
                   tokenizer: bool = True, dtype=torch.float32, **target_overrides) -> tuple[Path, Path]:
    """Write a random target + DFlash drafter (+ tokenizer) under `directory`; return their dirs.
    arch="qwen3_moe" writes a mixture-of-experts target (TINY_MOE, overridable) with a dense drafter;
    arch="deepseek_v3" a DeepSeek-V3 one (TINY_DEEPSEEK)."""
    directory = Path(directory)
    tcfg = tiny_target_config(arch, vocab_size, **target_overrides)
    dcfg = tiny_drafter_config(tcfg)
    target, drafter = Target(tcfg), Drafter(dcfg)
    random_init(target, seed)
    random_init(drafter, seed + 1)
    tdir, ddir = directory / "target", directory / "drafter"
    tok_dir = None
    if tokenizer:
        tok_dir = directory / "tokenizer"
        write_tiny_tokenizer(tok_dir, vocab_size)
    save_target(target, tdir, dtype=dtype, tokenizer_dir=tok_dir)
    save_drafter(drafter, ddir, dtype=dtype)
    return tdir, ddir


def exact_first_tokens(pair, prompt: list[int]):
    """The target's P(t1, t2) [V, V] and marginal P(t3) [V] at T = 1 after `prompt`, by enumeration (fp64):
    the reference the sampling tests compare DDTree's and DFlash's samples against."""
    target, V = pair.target, pair.target.cfg.vocab_size

    def probs(seq):
        target.setup_cache(len(seq))
        logits, _ = target(torch.tensor(seq), torch.arange(len(seq)), 0, TreeMask.causal(len(seq), "cpu"))
        return torch.softmax(logits[-1].double(), -1)

    p1 = probs(prompt)
    joint = torch.stack([p1[a] * probs(prompt + [a]) for a in range(V)])  # [V, V]
    p3 = sum(joint[a, b] * probs(prompt + [a, b]) for a in range(V) for b in range(V))
    return joint, p3


def assert_replays_equal(fn, want: torch.Tensor, replays: int = 3) -> None:
    """fn() on a CUDA device, warmed up, captured once as a CUDA graph and replayed `replays` times: each replay's
    output equals `want` bit for bit (a kernel that reads what the one before it writes, replayed)."""
    fn()  # compiled and its workspaces sized before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
