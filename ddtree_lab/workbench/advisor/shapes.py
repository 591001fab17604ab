"""What the cost model needs of a target + DFlash drafter: sizes from configs (dense or MoE)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ...kernels.moe_layout import row_height
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

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def experts_touched(self, tokens: int, load: ExpertLoad | None = None) -> float:
        """Distinct experts one MoE layer reads for `tokens` tokens: measured (`load`) or uniform routing,
        E·(1 − (1 − k/E)^T)."""
        if not self.num_experts:
            return 0.0
        if load and load.touched:
            return _interp_log(load.touched, tokens)
        e, k = self.num_experts, self.experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)

    def expert_row_blocks(self, tokens: int, load: ExpertLoad | None = None) -> float:
        """Row blocks one MoE layer runs, Σ_e ceil(n_e / h) at h = row_height(tokens): measured, else from
        a measured union with the pairs shared equally among its experts, else uniform routing (each expert's
        n_e ~ Binomial(T, k/E), its expectation summed exactly)."""
        if not self.num_experts:
            return 0.0
        h, e, k = row_height(tokens), self.num_experts, self.experts_per_tok
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
    (`num_experts` / `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `decoder_sparse_step`, `mlp_only_layers`)."""
    raw = dict(raw or {})

    def get(*keys, default=0):
        for k in keys:
            v = getattr(tcfg, k, None)
            v = raw.get(k) if v is None else v
            if v is not None:
                return v
        return default

    experts = int(get("num_experts", "num_local_experts"))
    layers = tcfg.num_hidden_layers
    moe_layers = 0
    if experts:
        step = int(get("decoder_sparse_step", default=1)) or 1
        dense = set(get("mlp_only_layers", default=[]) or [])
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return ModelShape(name=name, layers=layers, hidden=tcfg.hidden_size, intermediate=tcfg.intermediate_size,
                      heads=tcfg.num_attention_heads, kv_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                      vocab=tcfg.vocab_size, draft_layers=dcfg.num_hidden_layers,
                      draft_intermediate=dcfg.intermediate_size, block_size=dcfg.block_size,
                      draft_features=len(dcfg.target_layer_ids), num_experts=experts,
                      experts_per_tok=int(get("num_experts_per_tok")),
                      expert_intermediate=int(get("moe_intermediate_size")), moe_layers=moe_layers)


def model_shape(name: str) -> ModelShape:
    """A pair's shape by name: `random:<shape>`, a named pair (`lab`, ...) or a directory holding
    target/ and drafter/ (reads config.json only)."""
    from ...pairs.random import RANDOM_SHAPES, shape_configs

    if name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise AdvisorError(f"unknown model {name!r}; known: "
                               f"{', '.join('random:' + s for s in RANDOM_SHAPES)}")
        t, d = shape_configs(shape)
        return shape_from_configs(name, t, d, RANDOM_SHAPES[shape])
    path = Path(name)
    if (path / "target").is_dir():
        tdir, ddir = path / "target", path / "drafter"
    else:
        from ...pairs import PAIRS, resolve
        if name not in PAIRS:
            raise AdvisorError(f"unknown model {name!r}; known: {', '.join(PAIRS)}, "
                               f"{', '.join('random:' + s for s in RANDOM_SHAPES)}")
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
