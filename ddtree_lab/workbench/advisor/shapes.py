"""What the cost model needs of a target + DFlash drafter: sizes from configs (dense or MoE, GQA or MLA) and
the bytes they read; the whole deployed models the advisor projects onto several GPUs (FULL_MODELS)."""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ...kernels.moe_layout import expert_bytes, row_height
from ...names import DEFAULT_ROUTING, routing_kind
from .machines import AdvisorError


@dataclass(frozen=True)
class ExpertLoad:
    """Measured routing of an MoE target, per verify size (tokens per forward): the mean distinct experts a
    layer reads, and the mean row blocks the fused kernel runs at its height (`moe_layout.row_height`). Either
    curve interpolates in log tokens; row_blocks may be absent (older files), then estimated."""
    touched: Mapping[int, float]
    row_blocks: Mapping[int, float] | None = None


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a target + DFlash drafter (sizes only)."""
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_layers: int
    draft_intermediate: int
    block_size: int
    draft_features: int          # target layers the drafter reads (its fc is features·H × H)
    num_experts: int = 0         # MoE: experts per MoE layer (0: dense)
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    dtype_bytes: int = 2
    # MLA (DeepSeek-V3): queries through a q_lora_rank projection (0: one projection), keys and values from a cached
    # latent of kv_lora_rank values and one RoPE key shared by the heads; kv_lora_rank 0: GQA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    shared_intermediate: int = 0      # an MoE layer's always-on (shared) experts: their total width
    expert_dtype_bytes: float = 0.0   # bytes an expert weight takes with its scales (0: dtype_bytes)
    draft_heads: int = 0              # the drafter's attention, where it is not the target's (0: the target's)
    draft_kv_heads: int = 0
    draft_head_dim: int = 0
    experts_held: int = 0             # an expert-parallel rank's routed experts (0: all); experts_per_tok is then
                                      # the mean pairs a token sends to them, k · held / E
    census_shape: str = ""            # the random shape whose layers the launch census counted (machines.json
                                      # `layer_census`; "": none, compiled layers then launch the dense profile's)

    @property
    def attn_params(self) -> int:
        """One layer's attention weights. MLA: the down projections (q_a, kv_a) whole, each head's share of
        q_b, kv_b and o; a tensor-parallel rank's shape has its heads only, and the down projections whole."""
        h = self.hidden
        if not self.kv_lora_rank:
            return h * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
        return (q + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.heads * (self.kv_lora_rank * (self.qk_nope_head_dim + self.v_head_dim) + self.v_head_dim * h))

    @property
    def kv_width(self) -> int:
        """Values one layer caches a token: K and V of every KV head, or MLA's latent and its RoPE key."""
        return 2 * self.kv_heads * self.head_dim if not self.kv_lora_rank else self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attn_pair_width(self) -> int:
        """Multiply-adds one head spends on one (query, cached token) pair: scores then values; MLA in the absorbed
        form scores against the latent and its RoPE key and reads values from the latent."""
        return 2 * self.head_dim if not self.kv_lora_rank else 2 * self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_bytes(self) -> float:
        return self.expert_dtype_bytes or self.dtype_bytes

    @property
    def int4_experts(self) -> bool:
        """The routed experts run the fused kernel's INT4 path (under a byte a weight, scales included)."""
        return 0 < self.expert_dtype_bytes < 1

    def moe_block_bytes(self, touched: float) -> float:
        """Weights one MoE block reads: its router [E, H] and the touched experts, at their own bytes (the shared
        experts are with the dense weights)."""
        return (self.num_experts * self.hidden * self.dtype_bytes
                + touched * expert_bytes(self.hidden, self.expert_intermediate, self.expert_bytes))

    @property
    def draft_attention(self) -> tuple[int, int, int]:
        """The drafter's (heads, KV heads, head dim)."""
        return (self.draft_heads or self.heads, self.draft_kv_heads or self.kv_heads,
                self.draft_head_dim or self.head_dim)

    @property
    def draft_attn_params(self) -> int:
        heads, kv, hd = self.draft_attention
        return self.hidden * hd * (2 * heads + 2 * kv)

    def experts_touched(self, tokens: int, load: ExpertLoad | None = None) -> float:
        """Distinct experts one MoE layer reads for `tokens` tokens: measured (`load`) or uniform routing,
        E·(1 − (1 − k/E)^T)."""
        if not self.num_experts:
            return 0.0
        if load and load.touched:
            return _interp_log(load.touched, tokens)
        here = self.experts_held or self.num_experts
        p = self.experts_per_tok / here  # one token's chance of picking a given expert, k / E
        return here * (1 - (1 - p) ** tokens)

    def expert_row_blocks(self, tokens: int, load: ExpertLoad | None = None) -> float:
        """Row blocks one MoE layer runs, Σ_e ceil(n_e / h) at h = row_height(tokens, INT4 experts): measured, else from
        a measured union with the pairs shared equally among its experts, else uniform routing (each expert's
        n_e ~ Binomial(T, k/E), its expectation summed exactly)."""
        if not self.num_experts:
            return 0.0
        h, e, k = row_height(tokens, self.int4_experts), self.experts_held or self.num_experts, self.experts_per_tok
        if load and load.row_blocks:
            return _interp_log(load.row_blocks, tokens)
        if load and load.touched:
            touched = _interp_log(load.touched, tokens)
            return touched * math.ceil(tokens * k / (touched * h))
        p = k / e
        if p >= 1:  # every token reads every expert
            return e * -(-tokens // h)
        from scipy.stats import binom  # slow to import; only uniform routing needs it

        n = np.arange(1, tokens + 1)
        return e * float(np.dot(binom.pmf(n, tokens, p), np.ceil(n / h)))


def _interp_log(curve: Mapping[int, float], x: float) -> float:
    """Linear in log tokens between the measured sizes, flat beyond them."""
    xs, ys = zip(*sorted((float(k), float(v)) for k, v in curve.items()))
    return float(np.interp(math.log(x), np.log(xs), ys))


def shape_from_configs(name: str, tcfg, dcfg, raw: Mapping | None = None) -> ModelShape:
    """From a TargetConfig + DrafterConfig; MoE fields from the config object or its raw HF dict
    (`num_experts` / `num_local_experts` / `n_routed_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `decoder_sparse_step`, `mlp_only_layers`; DeepSeek-V3's sparse layers by the config's own rule), MLA from
    its `mla`, shared experts from `n_shared_experts`, quantized experts' bytes from `quantization_config`."""
    raw = dict(raw or {})

    def get(*keys, default=0):
        for k in keys:
            v = getattr(tcfg, k, None)
            v = raw.get(k) if v is None else v
            if v is not None:
                return v
        return default

    experts = int(get("num_experts", "num_local_experts", "n_routed_experts"))
    layers = tcfg.num_hidden_layers
    moe_layers = 0
    if experts and hasattr(tcfg, "is_moe_layer") and getattr(tcfg, "num_experts", 0):
        moe_layers = sum(1 for i in range(layers) if tcfg.is_moe_layer(i))
    elif experts:
        step = int(get("decoder_sparse_step", default=1)) or 1
        dense = set(get("mlp_only_layers", default=[]) or [])
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    mla = getattr(tcfg, "mla", None)
    width = int(get("moe_intermediate_size"))
    held = len(getattr(tcfg, "experts_held", ()) or ())  # an EP rank shape: its share of the experts
    per_token = int(get("num_experts_per_tok")) * (held / experts if held else 1)
    mla_fields = {} if mla is None else dict(
        q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
    return ModelShape(name=name, layers=layers, hidden=tcfg.hidden_size, intermediate=tcfg.intermediate_size,
                      heads=tcfg.num_attention_heads, kv_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                      vocab=tcfg.vocab_size, draft_layers=dcfg.num_hidden_layers,
                      draft_intermediate=dcfg.intermediate_size, block_size=dcfg.block_size,
                      draft_features=len(dcfg.target_layer_ids), num_experts=experts,
                      experts_per_tok=per_token, expert_intermediate=width, experts_held=held,
                      moe_layers=moe_layers, shared_intermediate=int(get("n_shared_experts")) * width if experts else 0,
                      expert_dtype_bytes=(quantized_weight_bytes(raw.get("quantization_config"))
                                          or int4_weight_bytes(getattr(tcfg, "expert_int4_group", 0))),
                      draft_heads=dcfg.num_attention_heads, draft_kv_heads=dcfg.num_key_value_heads,
                      draft_head_dim=dcfg.head_dim, **mla_fields)


SCALE_BYTES = 2  # a group's scale is bf16


def int4_weight_bytes(group_size: int) -> float:
    """Bytes a weight takes as INT4 in groups of group_size with a bf16 scale (symmetric); 0.0 for group 0."""
    return 4 / 8 + SCALE_BYTES / group_size if group_size else 0.0


def quantized_weight_bytes(qcfg: Mapping | None) -> float:
    """Bytes per weight of a compressed-tensors weight-only group quantization (`pack-quantized`: num_bits per
    weight and one bf16 scale per group_size weights, symmetric, so no zero point), 0.0 for none. It applies to the
    routed experts (the checkpoints keep attention, shared experts and the LM head unquantized)."""
    for group in ((qcfg or {}).get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") and w.get("group_size"):
            return w["num_bits"] / 8 + SCALE_BYTES / w["group_size"]
    return 0.0


# The whole models the advisor projects onto several GPUs: a random shape of the engine's table at the model's
# depth, and what its checkpoint adds (config.json names). Kimi K2.6 ships its routed experts as INT4 in groups of
# 32 with bf16 scales.
FULL_MODELS = {
    "kimi-k2.6": {"shape": "kimi-k2.6@61", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "strategy": "group",
                                                  "symmetric": True, "type": "int"}}}}},
}


def census_key(shape: str, routing: str | None = None) -> str:
    """Where machines.json's `layer_census` keeps random shape `shape`'s layers counted under `routing` (a name a
    run records): the shape's name for the default routing, `<shape> routing=<kind>` for another kind, whose
    experts other kernels pick (the router's top-k, a trace's lookup)."""
    kind = routing_kind(routing)
    return shape if kind == DEFAULT_ROUTING else f"{shape} routing={kind}"


def model_shape(name: str) -> ModelShape:
    """A pair's shape by name: a whole model of FULL_MODELS (`kimi-k2.6`), `random:<shape>[@<layers>][~<sets>]`, a named
    pair (`lab`, ...) or a directory holding target/ and drafter/ (reads config.json only)."""
    from ...pairs.random import SHAPE_NAMES, shape_configs, shape_entry, split_shape_name

    known = [*FULL_MODELS, *("random:" + s for s in SHAPE_NAMES)]
    if name in FULL_MODELS:
        full = FULL_MODELS[name]
        t, d = shape_configs(full["shape"])
        shape = shape_from_configs(name, t, d, {**shape_entry(full["shape"]), **full})
        return dataclasses.replace(shape, census_shape=split_shape_name(full["shape"])[0])
    if name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape_entry(shape) is None:
            raise AdvisorError(f"unknown model {name!r}; known: {', '.join(known)} (a random shape at another depth: "
                               "random:<shape>@<layers>)")
        t, d = shape_configs(shape)
        return dataclasses.replace(shape_from_configs(name, t, d, shape_entry(shape)),
                                   census_shape=split_shape_name(shape)[0])
    path = Path(name)
    if (path / "target").is_dir():
        tdir, ddir = path / "target", path / "drafter"
    else:
        from ...pairs import PAIRS, resolve
        if name not in PAIRS:
            raise AdvisorError(f"unknown model {name!r}; known: {', '.join(PAIRS)}, {', '.join(known)}")
        try:
            tdir, ddir = resolve(name)
        except ValueError as e:
            raise AdvisorError(f"model {name!r}: {e}") from None
    return shape_from_dirs(tdir, ddir, name)


def shape_from_dirs(target_dir, drafter_dir, name: str | None = None) -> ModelShape:
    """From checkpoint directories' config.json files (weights are not read)."""
    from ...config import drafter_config_from_hf, read_json, target_config_from_hf

    tpath, dpath = Path(target_dir) / "config.json", Path(drafter_dir) / "config.json"
    for p in (tpath, dpath):
        if not p.is_file():
            raise AdvisorError(f"model: no {p}")
    traw = read_json(tpath)
    t = target_config_from_hf(traw, tpath)
    d = drafter_config_from_hf(read_json(dpath), dpath)
    return shape_from_configs(name or str(target_dir), t, d, traw)
