"""`random:<shape>`: real-size targets and their DFlash drafters with random weights, built on the device,
so real costs can be measured without the weights. The sizes are the models' public configs."""
from __future__ import annotations

import dataclasses

from ..config import (DrafterConfig, MlaConfig, RopeConfig, TargetConfig, default_target_layer_ids, expert_rank_share,
                      local_config)
from ..names import DEFAULT_ROUTING

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
    # Kimi K2.6's text model (DeepSeek-V3 architecture, its published config) at full width; the whole 61 layers
    # do not fit one GPU, so the shape keeps KIMI_LAYERS of them (the first dense, as in the model) unless a name
    # asks for another depth: random:kimi-k2.6@12.
    "kimi-k2.6": dict(arch="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                      num_hidden_layers=8, num_attention_heads=64, num_key_value_heads=64, head_dim=192,
                      rms_norm_eps=1e-5, max_position_embeddings=262144, tie_word_embeddings=False,
                      rope=RopeConfig(theta=50000.0, type="yarn", factor=64.0, original_max_position_embeddings=4096,
                                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                      mla=MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128),
                      num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True,
                      scoring_func="sigmoid", n_group=1, topk_group=1, routed_scaling_factor=2.827,
                      n_shared_experts=1, first_k_dense_replace=1, expert_int4_group=32),  # INT4 experts, as shipped
}


@dataclasses.dataclass(frozen=True)
class RankShape:
    """One GPU's share of a shape deployed over `ranks` GPUs at its full depth: what a rank holds and computes
    (the communication between ranks is the advisor's, workbench/layouts.py). `ep`: expert parallelism, attention
    data-parallel (a rank's requests see every head), the routed experts the rank's 1/ranks by the placement
    e // (E / ranks) of rank 0, shared and dense MLPs whole. `tp`: tensor parallelism, 1/ranks of the heads and of
    every MLP's and expert's width (parallel.py's split). The drafter is the shape's, whole, on every rank."""

    shape: str
    layers: int
    layout: str  # ep | tp
    ranks: int


KIMI_DEPTH = 61  # Kimi K2.6's published depth (its random shape keeps fewer layers, to fit one GPU whole)
RANK_SHAPES = {
    "kimi-k2.6-ep8-rank": RankShape("kimi-k2.6", KIMI_DEPTH, "ep", 8),
    "kimi-k2.6-tp8-rank": RankShape("kimi-k2.6", KIMI_DEPTH, "tp", 8),
}
SHAPE_NAMES = (*RANDOM_SHAPES, *RANK_SHAPES)  # every name random:<name> takes
INT4_VALUE_STD = (255 / 12) ** 0.5  # the spread of a uniform 4-bit value (-8 … 7): random nibbles over it
DEPTH_SEPARATOR = "@"  # random:<shape>@<layers>: the shape at another depth (its drafter taps spread over it)
# random:<shape>~<sets>: every layer its own module and cache, but the weights of only <sets> layers, read by the
# others in turn (tied_layers): a deep shape on a smaller card. A step reads as many bytes and launches the same
# kernels, so its time is a distinct-weight model's wherever one layer's weights outgrow the L2 cache (a Kimi
# rank's layer: hundreds of MB against tens).
WEIGHT_SETS_SEPARATOR = "~"
DRAFT_LAYERS = 5  # the public block-16 drafters of these targets have five layers
# The drafters' sizes where they are not the target's attention and dense MLP sizes (a drafter is dense: an MoE
# target's expert width is never its size). Kimi's published DFlash drafter: six layers of 64 query and 8 KV
# heads of 128, its MLP the target's dense width.
DRAFTER_OVERRIDES = {
    "qwen3-30b-a3b": dict(intermediate_size=6144),
    "kimi-k2.6": dict(num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}


def split_shape_name(shape: str) -> tuple[str, int | None, int | None] | None:
    """'<shape>[@<layers>][~<sets>]' -> (shape, layers, weight sets), None for a part not given; None where a
    number is not in 1..256."""
    rest, sets_sep, sets = shape.partition(WEIGHT_SETS_SEPARATOR)
    base, depth_sep, depth = rest.partition(DEPTH_SEPARATOR)
    numbers = []
    for sep, text in ((depth_sep, depth), (sets_sep, sets)):
        if sep and not (text.isdigit() and 1 <= int(text) <= 256):
            return None
        numbers.append(int(text) if sep else None)
    return base, numbers[0], numbers[1]


def _model_entry(shape: str) -> tuple[str, dict] | None:
    """(the model shape's name, its sizes at the name's depth) of a shape name, rank shapes included."""
    parts = split_shape_name(shape)
    if parts is None:
        return None
    base, depth, sets = parts
    rank = RANK_SHAPES.get(base)
    model = rank.shape if rank else base
    entry = RANDOM_SHAPES.get(model)
    if entry is None:
        return None
    if rank:
        entry = {**entry, "num_hidden_layers": rank.layers}
    if depth is not None:
        entry = {**entry, "num_hidden_layers": depth}
    if sets is not None and sets > entry["num_hidden_layers"]:
        return None
    return model, entry


def shape_entry(shape: str) -> dict | None:
    """The sizes of a random shape name (`qwen3-8b`, `kimi-k2.6@12`, `kimi-k2.6-ep8-rank`: what one rank holds),
    None when unknown (torch-free)."""
    found = _model_entry(shape)
    if found is None:
        return None
    entry = found[1]
    rank = RANK_SHAPES.get(split_shape_name(shape)[0])
    if rank is None:
        return entry
    if rank.layout == "ep":
        return {**entry, "experts_held": expert_rank_share(entry["num_experts"], rank.ranks, 0)}
    share = local_config(TargetConfig(**entry), rank.ranks)
    return {f.name: getattr(share, f.name) for f in dataclasses.fields(share)}


def weight_sets_problem(shape: str) -> str | None:
    """Why a known shape name's weight sets (`~<sets>`) cannot serve its layers (tied_layers), or None
    (torch-free)."""
    sets = split_shape_name(shape)[2]
    try:
        tied_layers(TargetConfig(**shape_entry(shape)), sets)
    except ValueError as e:
        return f"random:{shape}: {e}"
    return None


def unknown_shape_message(shape: str) -> str:
    return (f"unknown random shape {shape!r}; known: {', '.join('random:' + s for s in SHAPE_NAMES)} "
            f"(any of them at another depth: random:<shape>{DEPTH_SEPARATOR}<layers>, 1..256; its layers on fewer "
            f"weight sets, up to one a layer: random:<shape>{WEIGHT_SETS_SEPARATOR}<sets>)")


def shape_configs(shape: str) -> tuple[TargetConfig, DrafterConfig]:
    """The target and drafter configs of a random shape (nothing allocated). A rank shape's drafter is its
    model's, whole."""
    found = _model_entry(shape)
    if found is None:
        raise ValueError(unknown_shape_message(shape))
    model, entry = found
    tcfg = TargetConfig(**entry)  # the whole model: the drafter's sizes
    drafter = dict(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                   num_hidden_layers=DRAFT_LAYERS, num_attention_heads=tcfg.num_attention_heads,
                   num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                   vocab_size=tcfg.vocab_size, block_size=16, num_target_layers=tcfg.num_hidden_layers,
                   mask_token_id=tcfg.vocab_size - 1, rope=dataclasses.replace(tcfg.rope),
                   max_position_embeddings=tcfg.max_position_embeddings)
    drafter.update(DRAFTER_OVERRIDES.get(model, {}))
    layers, taps = tcfg.num_hidden_layers, drafter["num_hidden_layers"]
    spread = default_target_layer_ids(layers, taps)
    if len(set(spread)) < taps or not 0 <= min(spread) <= max(spread) < layers:  # too shallow for the spread
        drafter["target_layer_ids"] = list(range(min(layers, taps)))            # rule: each layer once
    return TargetConfig(**shape_entry(shape)), DrafterConfig(**drafter)


def tied_layers(cfg: TargetConfig, sets: int | None) -> dict[int, int]:
    """Layer i >= sets -> the layer < sets whose weights it reads ({} for None). Each kind of layer (dense or MoE:
    Kimi's leading dense block, its MoE blocks) takes the layers of its kind among the first `sets` in turn, so
    neighbouring layers read different weights. ValueError where a kind has none there."""
    if sets is None:
        return {}
    kind = cfg.is_moe_layer
    distinct: dict[bool, list[int]] = {}
    for i in range(min(sets, cfg.num_hidden_layers)):
        distinct.setdefault(kind(i), []).append(i)
    tied, taken = {}, {}
    for i in range(sets, cfg.num_hidden_layers):
        own = distinct.get(kind(i))
        if not own:
            raise ValueError(f"layer {i} is {'an MoE' if kind(i) else 'a dense'} layer and none of the first {sets} "
                             f"is, so it has no weights to read; give more weight sets "
                             f"({WEIGHT_SETS_SEPARATOR}{sets + 1} or more)")
        n = taken.get(kind(i), 0)
        tied[i], taken[kind(i)] = own[n % len(own)], n + 1
    return tied


def share_weights(layer, source) -> None:
    """`layer` reads `source`'s weights from now on: each parameter and persistent buffer (INT4 experts) becomes
    the same tensor; its own state (expert counts, routing tables) stays its own."""
    for mod, src in zip(layer.modules(), source.modules(), strict=True):
        for name in mod._parameters:
            mod._parameters[name] = src._parameters[name]
        for name in mod._buffers:
            if name not in mod._non_persistent_buffers_set:
                mod._buffers[name] = src._buffers[name]


def random_pair(shape: str, device="cuda", dtype="bfloat16", attention="triton", seed=0, compile: bool = False,
                tp: int = 1, routing=None):
    """A real-size target + DFlash drafter with random weights (N(0, 0.02) matrices, unit norms). With tp=N,
    every process draws the same full weights and keeps its share (ddtree_lab/parallel.py). An MoE target routes
    by `routing` (declared_routing.py: "uniform" unless told; "router" is the random weights' own)."""
    # torch and the models load here, not at import: study files are checked against RANDOM_SHAPES torch-free
    import torch
    import torch.nn as nn

    from .. import parallel
    from ..checkpoint import Pair, torch_dtype
    from ..drafter import Drafter
    from ..model import Target
    from ..moe import Float32Router, Int4Experts, SparseMoE

    if shape_entry(shape) is None:
        raise ValueError(unknown_shape_message(shape))
    sets = split_shape_name(shape)[2]
    if sets is not None and tp != 1:
        raise ValueError(f"random:{shape}: a shape on fewer weight sets ({WEIGHT_SETS_SEPARATOR}{sets}) loads "
                         f"whole, not split over {tp} processes")
    dtype = torch_dtype(dtype)
    rank = 0
    if tp != 1:
        rank, rank_device = parallel.init(tp)
        device = rank_device if rank_device is not None and torch.device(device).type == "cuda" else device
    torch.manual_seed(seed)
    models = []
    for cls, cfg in zip((Target, Drafter), shape_configs(shape)):
        with torch.device("meta"):
            m = cls(cfg).to(dtype)  # allocated in its dtype at once: a wide shape has no room for an fp32 copy
        tied = tied_layers(cfg, sets) if cls is Target else {}
        later = {i: m.layers[i] for i in tied}
        for i in tied:
            m.layers[i] = nn.Module()  # allocated below, one at a time, its weights then dropped for its source's
        m = m.to_empty(device=device)
        for i, j in tied.items():
            m.layers[i] = later[i].to_empty(device=device)
            share_weights(m.layers[i], m.layers[j])
        with torch.no_grad():
            for _, p in m.named_parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
            for block in (b for b in m.modules() if isinstance(b, SparseMoE)):  # buffers to_empty left unset
                block.fill_local_index()
                if isinstance(block.router, Float32Router):  # in bf16, as checkpoints store it (still fp32 sums)
                    block.router.keep_bf16()
            for experts in (e for e in m.modules() if isinstance(e, Int4Experts)):  # random nibbles, about N(0, 0.02)
                experts.packed.random_(-2**31, 2**31 - 1)
                experts.scale.fill_(0.02 / INT4_VALUE_STD)
                if experts.zero is not None:
                    experts.zero.fill_(0x88888888 - 2**32)  # every zero point at the offset: symmetric values
        for i, j in tied.items():  # again: keep_bf16 gave each router a weight of its own
            share_weights(m.layers[i], m.layers[j])
        m.rotary = type(m.rotary)(cfg.rope_dim, cfg.rope, m.rotary.max_positions).to(device)
        models.append(m.eval().requires_grad_(False))
    target, drafter = models
    if tp != 1:
        target = parallel.make_parallel(target, tp, rank).eval().requires_grad_(False)
        models[0] = target
    # declared: random router weights would send nearly every token to the same experts (a dense target takes
    # only "router": another routing given for it is refused)
    target.set_routing(routing if routing is not None else DEFAULT_ROUTING if target.cfg.is_moe else "router")
    for m in models:
        m.set_attention(attention)
        if compile:
            m.compile_layers()
    ident = {"path": f"random:{shape}", "kind": target.cfg.arch}
    return Pair(target=target, drafter=drafter, tokenizer=None, name=f"random:{shape}", target_id=ident,
                drafter_id={"path": f"random:{shape}-dflash", "kind": "dflash"}, device=torch.device(device),
                dtype=dtype, eos_token_ids=[])
