"""Model configurations as dataclasses, read from Hugging Face `config.json` files.

Both transformers 4.x keys (`rope_theta`, `rope_scaling`) and 5.x keys (`rope_parameters`) are read.
Every error names the file and the field that is wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_TARGETS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe",
                     "DeepseekV3ForCausalLM": "deepseek_v3"}
# model_type values that name a supported architecture when `architectures` does not (a multimodal wrapper's
# text_config often has none): Kimi K2 checkpoints are DeepSeek-V3 by another name.
SUPPORTED_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
                         "kimi_k2": "deepseek_v3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


class CheckpointError(ValueError):
    """A model directory that cannot be loaded: names the file and tensor."""


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the band between beta_fast and beta_slow rotations (over the original context) is blended between
    # extrapolated and interpolated frequencies; mscale / mscale_all_dim set the cos/sin factor and (MLA) the
    # softmax scale; attention_factor, when given, is the cos/sin factor itself.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's attention factor; 1 for every other type)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V3): queries through an optional low-rank projection (q_lora_rank;
    None = one plain projection), keys and values expanded from one compressed latent a token (kv_lora_rank
    values, RMS-normed) that is what the cache holds, beside one RoPE key shared by every head."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # RoPE pairs are adjacent dims (x0, x1), (x2, x3)… rather than the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values a token caches per layer: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class TargetConfig:
    arch: str = "qwen3"  # qwen3 (q/k RMSNorm) | llama | qwen3_moe (qwen3 with mixture-of-experts MLPs)
    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Mixture of experts (qwen3_moe): a layer is sparse unless listed in mlp_only_layers or off the
    # decoder_sparse_step grid; dense layers keep intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # DeepSeek-V3 (arch deepseek_v3): MLA attention, sigmoid routing with a score-correction bias over groups of
    # experts (the top topk_group of n_group groups, each scored by its best two), weights from the uncorrected
    # scores times routed_scaling_factor, n_shared_experts always-on experts of moe_intermediate_size each, and
    # dense layers below first_k_dense_replace (then every moe_layer_freq-th layer is sparse).
    mla: MlaConfig | None = None
    # Routed experts stored INT4 weight-only (compressed-tensors pack-quantized, ddtree_lab/quant.py): values in
    # groups of expert_int4_group along the input dim (0: the experts are dense), with zero points if asymmetric.
    expert_int4_group: int = 0
    expert_int4_asymmetric: bool = False
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Expert parallelism: the routed experts this model holds, by global index (empty: all of them). Tokens still
    # route over all num_experts; pairs sent to an expert held elsewhere add nothing here (one rank's share).
    experts_held: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention scores: 1/sqrt(head dim), for MLA times yarn's mscale(mscale_all_dim)²."""
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    @property
    def cache_values_per_token(self) -> int:
        """Values one layer's cache holds a token: K and V of every KV head, or MLA's latent and RoPE key."""
        return 2 * self.num_key_value_heads * self.head_dim if self.mla is None else self.mla.cache_width

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates: a whole head, or MLA's RoPE part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def experts_here(self) -> int:
        """Routed experts this model holds a layer: all of them, or its expert-parallel share."""
        return len(self.experts_held) or self.num_experts

    def is_moe_layer(self, i: int) -> bool:
        """Layer i has a sparse MoE block (the rules of Qwen3Moe and of DeepSeek-V3's reference code)."""
        if self.num_experts == 0:
            return False
        if self.arch == "deepseek_v3":
            return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict transformers (4.x and 5.x) reads for this model."""
        arch_name = {v: k for k, v in SUPPORTED_TARGETS.items()}[self.arch]
        rope_scaling = None
        if self.rope.type != "default":
            rope_scaling = {"rope_type": self.rope.type, "factor": self.rope.factor}
            if self.rope.type == "llama3":
                rope_scaling.update(
                    low_freq_factor=self.rope.low_freq_factor,
                    high_freq_factor=self.rope.high_freq_factor,
                    original_max_position_embeddings=self.rope.original_max_position_embeddings,
                )
            if self.rope.type == "yarn":
                r = self.rope
                rope_scaling.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale,
                                    mscale_all_dim=r.mscale_all_dim, truncate=r.truncate,
                                    original_max_position_embeddings=r.original_max_position_embeddings)
                if r.attention_factor is not None:
                    rope_scaling["attention_factor"] = r.attention_factor
        eos = self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)
        moe = {}
        if self.arch == "qwen3_moe":
            moe = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                   "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                   "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}
        elif self.arch == "deepseek_v3":
            moe = {"n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                   "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                   "scoring_func": self.scoring_func, "topk_method": "noaux_tc", "n_group": self.n_group,
                   "topk_group": self.topk_group, "routed_scaling_factor": self.routed_scaling_factor,
                   "n_shared_experts": self.n_shared_experts, "first_k_dense_replace": self.first_k_dense_replace,
                   "moe_layer_freq": self.moe_layer_freq, **asdict(self.mla)}
        return {
            "architectures": [arch_name],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "eos_token_id": eos,
            "bos_token_id": self.bos_token_id,
            "torch_dtype": "float32",
            **moe,
        }


def local_config(cfg: TargetConfig, tp: int) -> TargetConfig:
    """The target's sizes as one of tp processes holds them; a size that does not split is refused."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    if getattr(cfg, "num_experts", 0):
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, size in sizes.items():
        if size % tp:
            raise CheckpointError(f"tp={tp} does not divide the target's {name} ({size})")
    group = getattr(cfg, "expert_int4_group", 0)
    if group and (cfg.moe_intermediate_size // tp) % group:  # groups of G ≥ 8: zero-point words split too
        raise CheckpointError(f"tp={tp} splits the INT4 experts' width {cfg.moe_intermediate_size} into "
                              f"{cfg.moe_intermediate_size // tp} columns, not whole groups of {group}")
    return replace(cfg, **{k: v // tp for k, v in sizes.items()})


def expert_rank_share(num_experts: int, ranks: int, rank: int) -> tuple[int, ...]:
    """Expert parallelism's default placement: expert e on rank e // (num_experts / ranks) -> rank's experts."""
    if ranks < 1 or num_experts % ranks or not 0 <= rank < ranks:
        raise ConfigError(f"{num_experts} experts do not split over {ranks} ranks as rank {rank}'s share")
    n = num_experts // ranks
    return tuple(range(rank * n, (rank + 1) * n))


@dataclass
class DrafterConfig:
    """A DFlash block drafter: Qwen3-sized layers, non-causal over one block."""

    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 1
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    vocab_size: int = 4096
    block_size: int = 16
    num_target_layers: int = 8
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096

    @property
    def rope_dim(self) -> int:
        return self.head_dim

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "rope_theta": self.rope.theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id},
        }


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers spread evenly when a drafter config does not list them: one draft layer takes the middle
    target layer; k layers take round(1 + i·(n − 4)/(k − 1)), i = 0 … k−1, as DFlash checkpoints expect."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    k = num_draft_layers
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


# ----------------------------------------------------------------------------- reading

def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: holds a JSON {type(data).__name__}, expected an object of fields")
    return data


def _need(cfg: dict, key: str, where: Path, kind=(int,)):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: missing field '{key}'")
    value = cfg[key]
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in kind:
        raise ConfigError(f"{where}: field '{key}' should be {'/'.join(k.__name__ for k in kind)}, got {value!r}")
    return value


def _rope_from_hf(cfg: dict, where: Path) -> RopeConfig:
    # transformers 5.x nests everything under rope_parameters; 4.x has rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{where}: field 'rope_theta' should be a number, got {theta!r}")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope type '{rope_type}' (field 'rope_scaling.rope_type') is not supported; "
                          f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings",
                                                        cfg.get("max_position_embeddings", 8192))),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        attention_factor=None if merged.get("attention_factor") is None else float(merged["attention_factor"]),
        truncate=bool(merged.get("truncate", True)),
    )


def _eos_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def text_model_config(cfg: dict, where: Path) -> tuple[dict, bool]:
    """The config of the text model: `cfg` itself, or a multimodal wrapper's `text_config` when the wrapper's
    own architecture is not a supported target (the second value says which)."""
    archs = cfg.get("architectures") or []
    if any(a in SUPPORTED_TARGETS for a in archs) or not isinstance(cfg.get("text_config"), dict):
        return cfg, False
    return cfg["text_config"], True


def _architecture(cfg: dict, where: Path, wrapped: bool) -> str:
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_TARGETS[a] for a in archs if a in SUPPORTED_TARGETS), None)
    if arch is None and (wrapped or not archs):
        arch = SUPPORTED_MODEL_TYPES.get(cfg.get("model_type"))
    if arch is None:
        field_name = "text_config.architectures" if wrapped else "architectures"
        raise ConfigError(f"{where}: field '{field_name}' is {archs!r} (model_type {cfg.get('model_type')!r}); "
                          f"supported targets: {', '.join(SUPPORTED_TARGETS)} (model_type "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    return arch


def target_config_from_hf(cfg: dict, where: Path) -> TargetConfig:
    cfg, wrapped = text_model_config(cfg, where)
    if wrapped:
        where = Path(f"{where} (text_config)")
    arch = _architecture(cfg, where, wrapped)
    if arch == "deepseek_v3":
        return _deepseek_from_hf(cfg, where)
    hidden = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    head_dim = cfg.get("head_dim") or hidden // heads
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    layers = _need(cfg, "num_hidden_layers", where)
    moe = _moe_from_hf(cfg, where, layers) if arch == "qwen3_moe" else {}
    all_sparse = bool(moe) and all(TargetConfig(num_hidden_layers=layers, **moe).is_moe_layer(i) for i in range(layers))
    return TargetConfig(
        arch=arch,
        vocab_size=_need(cfg, "vocab_size", where),
        hidden_size=hidden,
        # a model whose every MLP is sparse needs no dense width
        intermediate_size=int(cfg.get("intermediate_size") or 0) if all_sparse else _need(cfg, "intermediate_size", where),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope=_rope_from_hf(cfg, where),
        eos_token_id=_eos_list(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        **moe,
    )


# Router options of other MoE families that this engine does not implement: refused rather than ignored.
UNSUPPORTED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                          "moe_shared_expert_intermediate_size")


def _moe_from_hf(cfg: dict, where: Path, layers: int) -> dict:
    """The MoE fields of a Qwen3Moe config.json (4.x `num_experts`, 5.x `num_local_experts`)."""
    key = "num_local_experts" if cfg.get("num_local_experts") is not None else "num_experts"
    experts = _need(cfg, key, where)
    top_k = _need(cfg, "num_experts_per_tok", where)
    if experts < 1:
        raise ConfigError(f"{where}: field '{key}' is {experts}; a Qwen3Moe target needs at least one expert")
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' is {top_k}; it must be in 1..{experts} ('{key}')")
    for name in UNSUPPORTED_MOE_FIELDS:
        if (cfg.get(name) or 0) > 0:
            raise ConfigError(f"{where}: field '{name}' is {cfg[name]}: shared experts are not supported")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ConfigError(f"{where}: field 'scoring_func' is {scoring!r}; only 'softmax' routing is supported")
    if cfg.get("topk_method") not in (None, "greedy"):
        raise ConfigError(f"{where}: field 'topk_method' is {cfg['topk_method']!r}; only greedy top-k is supported")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ConfigError(f"{where}: field 'decoder_sparse_step' should be an integer ≥ 1, got {step!r}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ConfigError(f"{where}: field 'mlp_only_layers' is {dense!r}; it must list layers in 0..{layers - 1}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_need(cfg, "moe_intermediate_size", where),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), decoder_sparse_step=step,
                mlp_only_layers=list(dense))


DEEPSEEK_TOPK_METHODS = (None, "noaux_tc")  # grouped top-k on bias-corrected scores (the V2 methods are refused)


def _int_field(cfg: dict, key: str, where: Path, default: int, low: int = 0) -> int:
    value = cfg.get(key, default)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{where}: field '{key}' should be an integer ≥ {low}, got {value!r}")
    return value


def _mla_from_hf(cfg: dict, where: Path) -> MlaConfig:
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora < 1):
        raise ConfigError(f"{where}: field 'q_lora_rank' should be a positive integer or null, got {q_lora!r}")
    mla = MlaConfig(q_lora_rank=q_lora, kv_lora_rank=_need(cfg, "kv_lora_rank", where),
                    qk_nope_head_dim=_need(cfg, "qk_nope_head_dim", where),
                    qk_rope_head_dim=_need(cfg, "qk_rope_head_dim", where),
                    v_head_dim=_need(cfg, "v_head_dim", where),
                    rope_interleave=bool(cfg.get("rope_interleave", True)))
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(mla, key) < 1 or key == "qk_rope_head_dim" and mla.qk_rope_head_dim % 2:
            raise ConfigError(f"{where}: field '{key}' is {getattr(mla, key)}; it must be positive "
                              f"{'and even ' if key == 'qk_rope_head_dim' else ''}")
    return mla


def _deepseek_moe_from_hf(cfg: dict, where: Path, layers: int) -> dict:
    """The routed and shared experts of a DeepSeek-V3 config, every field that changes the math read or refused."""
    key = "n_routed_experts" if cfg.get("n_routed_experts") is not None else "num_local_experts"
    experts = _need(cfg, key, where)
    top_k = _need(cfg, "num_experts_per_tok", where)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' is {top_k} with {experts} experts ('{key}'); "
                          f"it must be in 1..{experts}")
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring not in ("sigmoid", "softmax"):
        raise ConfigError(f"{where}: field 'scoring_func' is {scoring!r}; supported: 'sigmoid', 'softmax'")
    method = cfg.get("topk_method")
    if method not in DEEPSEEK_TOPK_METHODS:
        raise ConfigError(f"{where}: field 'topk_method' is {method!r}; only 'noaux_tc' (grouped top-k on "
                          "bias-corrected scores) is supported")
    n_group = _int_field(cfg, "n_group", where, 1, low=1)
    topk_group = _int_field(cfg, "topk_group", where, 1, low=1)
    if experts % n_group:
        raise ConfigError(f"{where}: field 'n_group' is {n_group}; it must divide the {experts} experts")
    if topk_group > n_group:
        raise ConfigError(f"{where}: field 'topk_group' is {topk_group}; it must be at most n_group ({n_group})")
    if n_group > 1 and experts // n_group < 2:
        raise ConfigError(f"{where}: field 'n_group' is {n_group}: a group is scored by its best two experts, "
                          f"so it needs at least two ({experts} experts)")
    if top_k > topk_group * (experts // n_group):
        raise ConfigError(f"{where}: field 'num_experts_per_tok' is {top_k}, more than the {topk_group} groups "
                          f"of {experts // n_group} experts routing may pick from")
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ConfigError(f"{where}: field 'routed_scaling_factor' should be a positive number, got {scaling!r}")
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_need(cfg, "moe_intermediate_size", where),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), scoring_func=scoring, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=float(scaling),
                n_shared_experts=_int_field(cfg, "n_shared_experts", where, 0),
                first_k_dense_replace=_int_field(cfg, "first_k_dense_replace", where, 0),
                moe_layer_freq=_int_field(cfg, "moe_layer_freq", where, 1, low=1))


def _deepseek_from_hf(cfg: dict, where: Path) -> TargetConfig:
    """A DeepSeek-V3 (or Kimi K2) text model: MLA attention and DeepSeek's MoE."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: field 'attention_bias' is true; MLA projections with biases are not supported")
    layers = _need(cfg, "num_hidden_layers", where)
    heads = _need(cfg, "num_attention_heads", where)
    mla = _mla_from_hf(cfg, where)
    moe = _deepseek_moe_from_hf(cfg, where, layers) if (cfg.get("n_routed_experts") or cfg.get("num_local_experts")) else {}
    probe = TargetConfig(arch="deepseek_v3", num_hidden_layers=layers, **moe)
    dense_layers = [i for i in range(layers) if not probe.is_moe_layer(i)]
    rope = _rope_from_hf(cfg, where)
    return TargetConfig(
        arch="deepseek_v3",
        vocab_size=_need(cfg, "vocab_size", where),
        hidden_size=_need(cfg, "hidden_size", where),
        intermediate_size=_need(cfg, "intermediate_size", where) if dense_layers else int(cfg.get("intermediate_size") or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,  # every head has its own keys, expanded from the shared latent
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=rope,
        eos_token_id=_eos_list(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
        mla=mla,
        **moe,
    )


def drafter_config_from_hf(cfg: dict, where: Path) -> DrafterConfig:
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise ConfigError(f"{where}: field 'architectures' is {archs!r}; a drafter must be 'DFlashDraftModel'")
    hidden = _need(cfg, "hidden_size", where)
    heads = _need(cfg, "num_attention_heads", where)
    layers = _need(cfg, "num_hidden_layers", where)
    dflash = cfg.get("dflash_config") or {}
    if "mask_token_id" not in dflash and "mask_token_id" not in cfg:
        raise ConfigError(f"{where}: missing field 'dflash_config.mask_token_id'")
    num_target_layers = _need(cfg, "num_target_layers", where)
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=_need(cfg, "intermediate_size", where),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=_need(cfg, "vocab_size", where),
        block_size=_need(cfg, "block_size", where),
        num_target_layers=num_target_layers,
        target_layer_ids=[int(i) for i in (dflash.get("target_layer_ids") or [])]
        or default_target_layer_ids(num_target_layers, layers),
        mask_token_id=int(dflash.get("mask_token_id", cfg.get("mask_token_id"))),
        rope=_rope_from_hf(cfg, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


def check_pair(target: TargetConfig, drafter: DrafterConfig, where: str = "drafter") -> None:
    """Refuse a drafter that cannot read this target's features or share its head."""
    if drafter.hidden_size != target.hidden_size:
        raise ValueError(f"{where}: hidden_size {drafter.hidden_size} does not match the target's "
                         f"{target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: vocab_size {drafter.vocab_size} does not match the target's "
                         f"{target.vocab_size}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"{where}: target_layer_ids {bad} are outside the target's "
                         f"{target.num_hidden_layers} layers")
    twice = sorted({i for i in drafter.target_layer_ids if drafter.target_layer_ids.count(i) > 1})
    if twice:  # each tapped layer is one block of the drafter's context features
        raise ValueError(f"{where}: target_layer_ids lists layer(s) {twice} more than once")
    if drafter.num_target_layers != target.num_hidden_layers:
        raise ValueError(f"{where}: num_target_layers {drafter.num_target_layers} does not match the "
                         f"target's num_hidden_layers {target.num_hidden_layers}")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ValueError(f"{where}: mask_token_id {drafter.mask_token_id} is outside the vocabulary")
    if drafter.block_size < 2:
        raise ValueError(f"{where}: block_size {drafter.block_size} must be at least 2")


def as_dict(cfg) -> dict:
    return asdict(cfg)


def rope_inv_freq(head_dim: int, rope: RopeConfig):
    """Inverse frequencies [head_dim/2], with linear or llama3 scaling applied."""
    import torch

    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    elif rope.type == "yarn":
        inv = _yarn_inv_freq(head_dim, rope)
    return inv.float()


def _yarn_inv_freq(dim: int, rope: RopeConfig):
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times kept, a linear ramp between (computed in
    fp32, as the reference does, so the tables agree bit for bit)."""
    import torch

    def correction_dim(rotations):  # the dim index whose frequency turns `rotations` times over the context
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
