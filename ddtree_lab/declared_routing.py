"""Declared routing for MoE targets: which experts a token goes to is a named model, recorded with every figure.

Random router weights send nearly every token to the same few experts, so a random shape's rounds would read far
fewer experts than a trained model's. A random shape therefore routes by a declared model (`Target.set_routing`):

    router      the weights' own router (checkpoints, and exactness tests)
    uniform     each token's top-k drawn independently and uniformly, as a hash of (token, position, layer): a token
                routes alike in a prefill, an AR step and any tree, so DDTree == AR still holds (the default of
                random shapes)
    trace       replayed from a routing dump, ids [N, L, k]: each forward of T tokens takes the dump's next T
                tokens (a window of a real sequence, the quantity routing.json measures), the dump's layers spread
                over the target's; a token's experts then depend on the forward it is in, so DDTree's tokens need
                not equal AR's (the run records it)

Only which experts is declared: the weights of the chosen ones are the router's own scores at them, normalised as
the model does, so the block's arithmetic stays that of the model. Fixed shapes, no host sync (graph-safe).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import options
from .kernels.moe_layout import declared_weights_reference, uniform_ids_reference
from .names import ROUTING_MODELS
from .tree import use_triton


@dataclass(frozen=True)
class RoutingTrace:
    """A replayed routing: ids [N, L, k] int (N tokens of a real run, L MoE layers, top-k each) and where it came from."""

    ids: torch.Tensor
    source: str

    def __post_init__(self):
        if self.ids.dim() != 3 or self.ids.shape[0] < 1:
            raise ValueError(f"routing trace {self.source}: ids must be [tokens, layers, top_k], got {tuple(self.ids.shape)}")


def routing_name(model) -> str:
    """The name a run records: router, uniform or trace:<source>."""
    return f"trace:{model.source}" if isinstance(model, RoutingTrace) else model


def check_routing(model, experts: int, top_k: int) -> None:
    """ValueError naming what is wrong with a declared routing for a target of `experts` experts, top-k."""
    if isinstance(model, RoutingTrace):
        ids = model.ids
        if ids.shape[2] != top_k:
            raise ValueError(f"routing trace {model.source} routes each token to {ids.shape[2]} experts; the target "
                             f"takes top-{top_k}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= experts:
            raise ValueError(f"routing trace {model.source} names experts {lo}..{hi}; the target has {experts}")
        return
    if model not in ROUTING_MODELS:
        raise ValueError(f"routing={model!r} is not one of {', '.join(ROUTING_MODELS)} or a routing trace")


class DeclaredRouting(torch.nn.Module):
    """One MoE layer's declared routing: `uniform` (from the forward's token keys) or a trace's ids for this layer,
    with a cursor [1] that each forward advances by its token count (in place: a captured graph advances it too)."""

    def __init__(self, model, layer: int, num_layers: int):
        super().__init__()
        self.model, self.layer = model, layer
        self.keys: torch.Tensor | None = None  # [T] int64, set by the target before each forward
        if isinstance(model, RoutingTrace):
            src = min(model.ids.shape[1] - 1, layer * model.ids.shape[1] // num_layers)  # dump layers spread over ours
            self.register_buffer("table", model.ids[:, src].to(torch.int64).contiguous(), persistent=False)
            self.register_buffer("cursor", torch.zeros(1, dtype=torch.int64), persistent=False)

    def ids(self, T: int, experts: int, top_k: int, device) -> torch.Tensor:
        """The forward's [T, top_k] expert ids."""
        if self.model == "uniform":  # a hash of (key, layer, expert): kernels/moe_layout.uniform_ids_reference
            return uniform_ids_reference(self.keys, self.layer, experts, top_k)
        rows = (self.cursor + torch.arange(T, device=device)) % self.table.shape[0]              # [T]
        self.cursor.add_(T)
        return self.table[rows]

    def route(self, logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, scaling: float,
              local_index: torch.Tensor | None = None, ids_dtype: torch.dtype = torch.int64,
              routed: tuple[torch.Tensor, ...] | None = None,
              pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [T, E] -> (weights [T, k] fp32, ids [T, k] ids_dtype): the declared experts, weighted
        by the router's scores at them (moe_layout.declared_weights_reference), the ids mapped through
        `local_index` when given (an expert-parallel rank's places). One launch where `routing_kernel_runs`
        (kernels/declared_route.py), a trace's ids looked up first; `routed` (there only) is filled with the pairs'
        sort in the same launch (declared_route's); `pdl`: that launch a programmatic dependent (kernels/pdl.py)."""
        T, E = logits.shape
        if routing_kernel_runs(E, logits.device):
            from .kernels import declared_route

            given = None if self.model == "uniform" else self.ids(T, E, top_k, logits.device)
            return declared_route.declared_route(logits, top_k, scoring, renormalize, scaling,
                                                 keys=self.keys if given is None else None, layer=self.layer,
                                                 ids=given, local_index=local_index, ids_dtype=ids_dtype,
                                                 routed=routed, pdl=pdl)
        if routed is not None:
            raise ValueError("routed= sorts the pairs in the routing kernel's launch, which does not run here")
        ids = self.ids(T, E, top_k, logits.device)
        weights = declared_weights_reference(logits, ids, scoring, renormalize, scaling)
        return weights, (ids if local_index is None else local_index[ids]).to(ids_dtype)


def routing_kernel_runs(experts: int, device) -> bool:
    """Whether a declared routing, or a grouped router, over `experts` experts runs as kernels/declared_route.py's
    one launch rather than in torch: options.declared_routing chooses, else wherever the Triton kernels run."""
    choice = options.current().declared_routing
    if not (choice == "triton" or (choice is None and use_triton(device))):
        return False
    from .kernels.declared_route import MAX_EXPERTS

    return experts <= MAX_EXPERTS


def token_keys(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T] int64 keys of (token id, position): what uniform routing hashes."""
    return tokens.to(torch.int64) * 1_000_003 + positions.to(torch.int64)
