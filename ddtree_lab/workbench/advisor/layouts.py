"""8-GPU layouts of a target: what one rank holds and reads (its shape, priced by the round cost model) and what
the layout sends between the GPUs per forward, each collective a latency + bytes ÷ bandwidth term.

    tp8  every layer's attention and MLP (every expert at 1/8 width) split over 8 ranks, 8 of 64 heads a rank;
         two all-reduces a layer of the forward's T × hidden activations (the engine's parallel.py)
    ep8  a rank holds E/8 experts at full width; each MoE layer dispatches each token's top_k copies of its hidden
         activations to its experts' ranks and combines them back. Attention `tp`: heads split, the attention's
         partial sums reduce-scattered so each rank owns T/8 tokens (its dense and shared MLPs whole on them),
         all-gathered before the next attention; `dp`: one rank runs the sequence's attention and its dense and
         shared MLPs whole and dispatches all T tokens

The rank whose experts are busiest sets an ep8 round: under uniform routing each of its E/8 experts is hit with
probability p = 1 − ((E − k)/E)^T, and the round reads the expected largest count over the 8 ranks
(`expected_max_touched`). Pure and torch-free; shapes from shapes.py, links from machines.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..routing import uniform_rank_max, uniform_union
from .machines import AdvisorError, Interconnect
from .shapes import ExpertLoad, ModelShape

RANKS = 8
LAYOUTS = ("tp8", "ep8")
ATTENTION_LAYOUTS = ("tp", "dp")   # ep8's attention: split over the ranks, or whole on the sequence's rank


@dataclass(frozen=True)
class Layout:
    name: str                # tp8 | ep8
    attention: str = "tp"    # tp | dp (ep8 only)
    ranks: int = RANKS

    @property
    def title(self) -> str:
        return self.name if self.name == "tp8" else f"{self.name} (attention {self.attention})"


def get_layout(name: str, attention: str | None = None) -> Layout:
    """A layout by name; refused in one line when unknown or when tp8 is asked for data-parallel attention."""
    if name not in LAYOUTS:
        raise AdvisorError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    if attention is not None and attention not in ATTENTION_LAYOUTS:
        raise AdvisorError(f"unknown attention layout {attention!r}; known: {', '.join(ATTENTION_LAYOUTS)}")
    if name == "tp8" and attention == "dp":
        raise AdvisorError("--attention-layout dp is an ep8 choice: tp8 splits every layer, attention included")
    return Layout(name, attention or "tp")


def _split(full: ModelShape, what: str, size: int, ranks: int) -> int:
    if size % ranks:
        raise AdvisorError(f"{full.name}: {what} ({size}) does not split over {ranks} ranks")
    return size // ranks


def _kv_heads(full: ModelShape, ranks: int) -> int:
    """GQA KV heads a rank holds: its share, or one replicated head when there are fewer heads than ranks."""
    if full.kv_lora_rank or full.kv_heads % ranks == 0:
        return full.kv_heads // ranks if not full.kv_lora_rank else full.kv_heads
    if ranks % full.kv_heads == 0:
        return 1
    raise AdvisorError(f"{full.name}: its {full.kv_heads} KV heads neither split over nor replicate onto {ranks} ranks")


def rank_shape(full: ModelShape, lay: Layout) -> ModelShape:
    """What one rank holds and reads of the whole model. The drafter, embedding, router, norms and LM head are
    whole on every rank (parallel.py); MLA's latent cache and down projections are whole on every rank. ep8:
    `experts_per_tok` becomes the mean routed pairs a rank serves per token (k/8); the experts it reads come
    from `rank_load`."""
    r = lay.ranks
    draft = dict(draft_heads=full.draft_attention[0], draft_kv_heads=full.draft_attention[1],
                 draft_head_dim=full.draft_attention[2])
    heads = dict(heads=_split(full, "attention heads", full.heads, r), kv_heads=_kv_heads(full, r))
    name = f"{full.name} ({lay.title} rank)"
    if lay.name == "tp8":
        moe = {} if not full.num_experts else dict(
            expert_intermediate=_split(full, "expert width", full.expert_intermediate, r),
            shared_intermediate=_split(full, "shared expert width", full.shared_intermediate, r))
        return dataclasses.replace(full, name=name, **heads, **draft, **moe,
                                   intermediate=_split(full, "MLP width", full.intermediate, r))
    if not full.num_experts or not full.moe_layers:
        raise AdvisorError(f"{full.name} is dense: ep8 places experts, give --layout tp8")
    _split(full, "routed experts", full.num_experts, r)
    attention = heads if lay.attention == "tp" else {}
    return dataclasses.replace(full, name=name, **attention, **draft, experts_per_tok=full.experts_per_tok / r)


def hit_probability(experts: int, top_k: int, tokens: int) -> float:
    """The chance one expert is among T tokens' top-k picks under uniform routing (routing.uniform_union / E)."""
    return uniform_union(experts, top_k, tokens) / experts


def expected_max_touched(experts: int, top_k: int, ranks: int, tokens: int) -> float:
    """The expected largest number of distinct experts any of `ranks` ranks (E/ranks experts each) serves for T
    tokens under uniform routing: routing.uniform_rank_max, exact."""
    return uniform_rank_max(experts, top_k, tokens, ranks) if tokens > 0 else 0.0


def rank_load(full: ModelShape, lay: Layout, tokens: Iterable[int],
              max_touched: Mapping[int, float] | None = None) -> ExpertLoad | None:
    """The experts an ep8 round's slowest rank reads, per forward size T: the measured largest count over ranks
    when given ({T: experts}), else expected_max_touched under uniform routing; its row blocks as many per touched
    expert as the whole model's. None for tp8 (a rank reads the whole union at 1/8 width: the shape's own)."""
    if lay.name != "ep8":
        return None
    touched, blocks = {}, {}
    for t in sorted(set(int(t) for t in tokens)):
        m = (full.experts_touched(t, ExpertLoad(max_touched)) if max_touched
             else expected_max_touched(full.num_experts, full.experts_per_tok, lay.ranks, t))
        touched[t], blocks[t] = m, m * full.expert_row_blocks(t) / full.experts_touched(t)
    return ExpertLoad(touched, blocks)


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a forward: how many, the bytes each moves over a GPU's link (each way, the
    busiest GPU's), the algorithm and its seconds (latency + bytes ÷ bandwidth)."""
    kind: str          # all_reduce | reduce_scatter | all_gather | dispatch | combine
    count: int
    bytes: float
    algorithm: str
    seconds: float     # each

    @property
    def total(self) -> float:
        return self.count * self.seconds


def all_reduce(message: float, link: Interconnect, ranks: int = RANKS) -> tuple[str, float, float]:
    """(algorithm, bytes each way, seconds) of an all-reduce of `message` bytes: a ring sends and receives
    2·(R − 1)/R of it; NVLS (the switch reduces) sends it once and receives the sum once; the faster is used."""
    ring_bytes = 2 * (ranks - 1) / ranks * message
    best = ("ring", ring_bytes, link.all_reduce_latency + ring_bytes / link.bandwidth)
    if link.nvls and link.nvls_latency is not None:
        nvls = ("nvls", message, link.nvls_latency + message / link.bandwidth)
        best = min(best, nvls, key=lambda a: a[2])
    return best


def forward_collectives(full: ModelShape, lay: Layout, link: Interconnect, tokens: int) -> list[Collective]:
    """What one target forward over `tokens` tokens sends (bf16 activations of the model's dtype). The draft, tree
    build and commit are local to each rank (the drafter and LM head are whole on every rank)."""
    r, act = lay.ranks, full.hidden * full.dtype_bytes
    message = tokens * act                                      # T × hidden activations
    if lay.name == "tp8":
        alg, nbytes, sec = all_reduce(message, link, r)
        return [Collective("all_reduce", 2 * full.layers, nbytes, alg, sec)]
    owned = tokens if lay.attention == "dp" else math.ceil(tokens / r)   # the busiest rank's tokens
    copies = owned * full.experts_per_tok * (r - 1) / r                  # of their top_k copies, those sent away
    moved = copies * act
    out = [Collective(kind, full.moe_layers, moved, "all-to-all", link.all_to_all_latency + moved / link.bandwidth)
           for kind in ("dispatch", "combine")]
    if lay.attention == "tp":  # each rank's share of the attention sums, then every token back to every rank
        share = (r - 1) / r * message
        out += [Collective(kind, full.layers, share, "ring", link.all_to_all_latency + share / link.bandwidth)
                for kind in ("reduce_scatter", "all_gather")]
    return out


def comm_seconds(collectives: Iterable[Collective]) -> float:
    return sum(c.total for c in collectives)
