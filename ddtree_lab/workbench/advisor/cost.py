"""First-principles cost of a round per stage: weights, KV and activations, FLOPs, launches."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from ...kernels.moe_layout import ROUTE_IN_ALIGN_MAX_T, expert_bytes, reread_bytes
from .machines import AdvisorError, Calibration, Machine, get_machine, load_calibration
from .shapes import ExpertLoad, ModelShape

PARTS = ("weights", "kv", "flops", "launches", "moe", "attention", "other")
PART_TITLES = {"weights": "weights read", "kv": "KV and activations", "flops": "FLOPs",
               "launches": "kernel launches", "moe": "MoE routing, tiles and INT4 unpacking",
               "attention": "MLA attention beyond its floor", "other": "tree build and commit"}



@dataclass
class Terms:
    """The work of one stage: bytes by kind, FLOPs, kernel launches."""
    weights: float = 0.0
    kv: float = 0.0
    flops: float = 0.0
    launches: float = 0.0
    matmuls: float = 0.0          # eager rounds: their matmul kernels, priced apart from the other launches
    one_row: bool = False         # an AR step's: each kernel handles one token (matmuls are matrix-vector products)
    fixed_seconds: float = 0.0    # tree build / commit
    moe_seconds: float = 0.0      # MoE blocks beyond their bytes and FLOPs: routing, the sort, tile scheduling
    moe_reread: float = 0.0       # bytes: expert weights read again by an expert's second and later row blocks
    int4_bytes: float = 0.0       # bytes of INT4 experts read, which the kernel also unpacks
    int4_blocks: float = 0.0      # row blocks of INT4 experts run (each pays its pipeline's start)
    mla_calls: float = 0.0        # MLA attention calls (one a layer), and their latent bytes and FLOPs
    mla_bytes: float = 0.0
    mla_flops: float = 0.0

    def seconds(self, m: Machine, cal: Calibration) -> dict[str, float]:
        """This stage's time split into PARTS (sums to its total). The weights, KV and FLOPs overlap as one
        roofline (a soft maximum, `cal.p`); MLA's latent bytes and FLOPs overlap only with each other, since its
        kernel runs alone between the projections (calibrate_mla fits its extra time beyond that same core)."""
        bw, fl = m.bandwidth * cal.eta_bw, m.flops * cal.eta_flops
        tw, tk, tc = self.weights / bw, self.kv / bw, self.flops / fl
        mem = tw + tk
        core, share_m = _roofline(mem, tc, cal.p)
        mla_core, mla_share_m = _roofline(self.mla_bytes / bw, self.mla_flops / fl, cal.p)
        out = {"weights": core * share_m * (tw / mem if mem else 0.0),
               "kv": core * share_m * (tk / mem if mem else 0.0) + mla_core * mla_share_m,
               "flops": core * (1 - share_m) + mla_core * (1 - mla_share_m),
               "launches": self.launches * self._launch_seconds(cal) + self.matmuls * self._matmul_seconds(cal),
               "moe": self.moe_seconds + (self.moe_reread / (m.bandwidth * cal.moe_reread_over_bandwidth)
                                          if self.moe_reread else 0.0)
                      + (self.int4_bytes / int4_unpack_rate(m, cal)
                         if self.int4_bytes and cal.moe_int4_unpack_over_bandwidth else 0.0)
                      + self.int4_blocks * cal.moe_int4_block_seconds,
               "attention": (self.mla_calls * cal.mla_call_seconds
                             + (self.mla_bytes / (m.bandwidth * cal.mla_bytes_over_bandwidth)
                                if cal.mla_bytes_over_bandwidth else 0.0)
                             + (self.mla_flops / (m.flops * cal.mla_flops_over_peak)
                                if cal.mla_flops_over_peak else 0.0)),
               "other": self.fixed_seconds}
        return out

    def _launch_seconds(self, cal: Calibration) -> float:
        """A kernel's time: a one-row step's own where fitted (compiled rounds; an eager round's small kernels take
        one time, its one-row matmuls their own)."""
        one_row = self.one_row and cal.launches_from == "profile" and cal.one_row_launch_seconds
        return cal.one_row_launch_seconds if one_row else cal.launch_seconds

    def _matmul_seconds(self, cal: Calibration) -> float:
        return cal.eager_matvec_seconds if self.one_row and cal.eager_matvec_seconds else cal.eager_matmul_seconds


def _roofline(mem: float, compute: float, p: float) -> tuple[float, float]:
    """A kernel's time from its memory and compute times (their p-norm), and the memory's share of it."""
    if not (mem or compute):
        return 0.0, 0.0
    return (mem ** p + compute ** p) ** (1 / p), mem ** p / (mem ** p + compute ** p)


def int4_unpack_rate(m: Machine, cal: Calibration) -> float:
    """Bytes a second of INT4 experts that the kernel unpacks beyond reading them on machine m. Fitted on the
    calibration's machine as a multiple of its bandwidth; elsewhere scaled by the SMs' FP32 rate, since unpacking
    is ALU work (an H100 unpacks a Kimi block about as fast as an H200 with 0.70 × its bandwidth:
    docs/performance.md, "Session 12"); by bandwidth where either machine lacks that figure."""
    ref = _machine(cal.machine)
    return ref.bandwidth * cal.moe_int4_unpack_over_bandwidth * unpack_speed_over(m, ref)


def unpack_speed_over(m: Machine, ref: Machine) -> float:
    """How much faster machine m unpacks INT4 experts than ref: the SMs' FP32 rates, else the bandwidths."""
    if m.fp32_flops and ref.fp32_flops:
        return m.fp32_flops / ref.fp32_flops
    return m.bandwidth / ref.bandwidth


@functools.cache
def _machine(name: str) -> Machine:
    return get_machine(name)


MLP_KERNELS = 3  # a dense MLP's kernels in a captured layer (gate-up GEMM, activation, down GEMM)


@dataclass(frozen=True)
class LaunchCensus:
    """What eager rounds launch, counted (bench/census.py) rather than scaled from a compiled profile: per
    (stage, tokens) — ("ar", 1), ("verify", T), ("draft", block size) — the kernels the launch time prices (the
    fused MoE's and MLA's own are priced by their terms), how many of them are matmuls, and the activation bytes
    the eager ops move."""
    stages: Mapping[tuple[str, int], tuple[float, float, float]]

    def at(self, stage: str, tokens: int) -> tuple[float, float, float]:
        try:
            return self.stages[(stage, tokens)]
        except KeyError:
            raise AdvisorError(f"the launch census has no {stage} of {tokens} tokens "
                               f"(it counted {sorted(self.stages)})") from None


def _kernels(cal: Calibration, stage: str, layers: int, per_layer: float | None = None) -> float:
    """A stage's kernels: per layer (the profiles', unless given) × layers + the profiles' fixed part."""
    profiled, fixed = cal.kernels.get(stage, (0.0, 0.0))
    return (profiled if per_layer is None else per_layer) * layers + fixed


def counted_layer_kernels(s: ModelShape, cal: Calibration, stage: str) -> float | None:
    """Compiled kernels a layer of s in an AR step ("ar") or verify, from its launch census where machines.json
    holds one: the kernels compile leaves alone, and kernels_per_fused_run for each run of ops it fuses (the MoE
    block's and MLA's own kernels apart: their terms price them). None: no census for s."""
    counted = cal.layer_census.get(s.census_shape, {}).get(stage)
    rate = cal.kernels_per_fused_run.get(stage)
    if not (counted and rate):
        return None
    extern, runs = counted
    return extern + rate * runs


def verify_terms(s: ModelShape, tokens: int, ctx: int, cal: Calibration, stage: str = "verify",
                 load: ExpertLoad | None = None, census: LaunchCensus | None = None) -> Terms:
    """The target forward over `tokens` tokens after `ctx` cached ones (`load`: measured MoE routing; `census`:
    eager layers' counted kernels and activation bytes, instead of the compiled profile's and the estimate)."""
    b, h = s.dtype_bytes, s.hidden
    dense_layers = s.layers - s.moe_layers
    touched = s.experts_touched(tokens, load)
    expert, shared = 3 * h * s.expert_intermediate, 3 * h * s.shared_intermediate
    dense = s.layers * s.attn_params + dense_layers * 3 * h * s.intermediate + s.moe_layers * shared + s.vocab * h
    weights = dense * b + s.moe_layers * s.moe_block_bytes(touched)
    used = dense + s.moe_layers * (h * s.num_experts + s.experts_per_tok * expert)
    attn_flops = 2 * s.layers * s.heads * s.attn_pair_width * tokens * (ctx + tokens)
    flops = 2 * tokens * used + attn_flops
    inter = (s.intermediate if not s.moe_layers
             else s.experts_per_tok * s.expert_intermediate + s.shared_intermediate)
    cache = s.layers * s.kv_width * (ctx + tokens) * b                               # cache read + new rows
    per_layer = None if census else counted_layer_kernels(s, cal, stage)
    kernels, matmuls, activations = census.at(stage, tokens) if census else (
        _kernels(cal, stage, s.layers, per_layer), 0.0,
        tokens * s.layers * (6 * h + 2 * s.heads * s.head_dim + 3 * inter) * b + tokens * s.vocab * 4)  # + logits
    # Per MoE block, what the fused-MoE kernel bench measures beyond its bytes and FLOPs: a fixed part, one per
    # routed token-expert pair, the sort's own launches past ROUTE_IN_ALIGN_MAX_T tokens, and an expert's weights
    # read again (from L2) by each of its row blocks after the first; less the dense MLP's kernels the dense
    # profile's launch count holds (a census counts the block's kernels apart: nothing to take off).
    sort = cal.moe_sort_seconds if tokens > ROUTE_IN_ALIGN_MAX_T else 0.0
    counted = 0.0 if census or per_layer is not None else MLP_KERNELS * cal.launch_seconds
    moe = s.moe_layers * max(0.0, cal.moe_block_seconds - counted + sort
                             + cal.moe_pair_seconds * tokens * s.experts_per_tok)
    reread = s.moe_layers * reread_bytes(s.expert_row_blocks(tokens, load), touched, h, s.expert_intermediate,
                                         s.expert_bytes)
    # INT4 experts are unpacked as they are read: the kernel bench's time beyond their bytes, per byte and per row
    # block
    int4 = s.moe_layers * touched * expert_bytes(h, s.expert_intermediate, s.expert_bytes) if s.int4_experts else 0.0
    int4_blocks = s.moe_layers * s.expert_row_blocks(tokens, load) if s.int4_experts else 0.0
    # MLA: its kernel, a layer at a time: the latent's bytes and the attention FLOPs on their own roofline, and its
    # time beyond them (the MLA bench)
    mla = {}
    if s.kv_lora_rank:
        mla = dict(mla_calls=s.layers, mla_bytes=cache, mla_flops=attn_flops)
        cache, flops = 0.0, flops - attn_flops
    return Terms(weights=weights, kv=cache + activations, flops=flops, launches=kernels - matmuls, matmuls=matmuls,
                 one_row=tokens == 1, moe_seconds=moe,
                 moe_reread=reread, int4_bytes=int4, int4_blocks=int4_blocks, **mla)


def draft_terms(s: ModelShape, ctx: int, cal: Calibration, census: LaunchCensus | None = None) -> Terms:
    """The DFlash drafter over one block, then the target's LM head on its block_size − 1 positions (`census`: as
    for verify_terms)."""
    b, h, q = s.dtype_bytes, s.hidden, s.block_size
    heads, kv_heads, head_dim = s.draft_attention
    layer = s.draft_attn_params + 3 * h * s.draft_intermediate
    params = s.draft_layers * layer + s.draft_features * h * h
    flops = (2 * q * params + 2 * (q - 1) * s.vocab * h
             + 4 * s.draft_layers * heads * head_dim * q * (ctx + q))
    cache = s.draft_layers * 2 * kv_heads * head_dim * (ctx + q) * b
    kernels, matmuls, activations = census.at("draft", q) if census else (
        _kernels(cal, "draft", s.draft_layers), 0.0,
        q * s.draft_layers * (6 * h + 3 * s.draft_intermediate) * b + (q - 1) * s.vocab * 4)
    return Terms(weights=(params + s.vocab * h) * b, kv=cache + activations, flops=flops, launches=kernels - matmuls,
                 matmuls=matmuls)


@dataclass
class RoundCost:
    method: str
    budget: int | None
    stages: dict[str, float]     # seconds per stage
    parts: dict[str, float]      # seconds per PARTS entry

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


def round_cost(shape: ModelShape, machine: Machine, method: str, budget: int | None = None, ctx: int = 512,
               cal: Calibration | None = None, load: ExpertLoad | None = None,
               census: LaunchCensus | None = None) -> RoundCost:
    """First-principles cost of one round (AR: one step). budget: DDTree nodes beyond the root."""
    cal = cal or load_calibration()
    if method == "ar":
        terms = {"verify": verify_terms(shape, 1, ctx, cal, "ar", load, census)}
    else:
        nodes = shape.block_size - 1 if method == "dflash" else int(budget or 0)
        if nodes < 1:
            raise AdvisorError(f"a {method} round needs a budget ≥ 1, got {budget!r}")
        terms = {"draft": draft_terms(shape, ctx, cal, census),
                 "tree_build": Terms(launches=_kernels(cal, "tree_build", 0),
                                     fixed_seconds=cal.tree_node_seconds * nodes
                                     + cal.tree_vocab_seconds * (shape.block_size - 1) * shape.vocab),
                 "verify": verify_terms(shape, nodes + 1, ctx, cal, "verify", load, census),
                 "commit": Terms(launches=_kernels(cal, "commit", 0),
                                 fixed_seconds=cal.commit_node_seconds * (nodes + 1))}
    split = {k: t.seconds(machine, cal) for k, t in terms.items()}
    parts = {p: sum(v[p] for v in split.values()) for p in PARTS}
    return RoundCost(method, budget if method == "ddtree" else None, {k: sum(v.values()) for k, v in split.items()},
                     parts)
