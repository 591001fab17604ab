"""Replaying a user's routing dump in the engine (`routing=trace:FILE`: bench e2e/profile --routing, a study's
models.routing): `read_trace` takes a dump's per-token routing, its sequences end to end, in the formats ingest
reads (routing_formats.py); `routing_model` turns a routing spec into what load_pair takes, a trace into a
declared_routing.RoutingTrace (which replays it window by window, one forward's tokens at a time).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .routing_formats import SNIFF_BYTES, RoutingOptions, is_candidate, read_items

def read_trace(path: Path, options: RoutingOptions = RoutingOptions()) -> np.ndarray:
    """A dump's per-token routing for replay: every sequence (and every forward given as ids) end to end, in file
    order, the dense layers' zero placeholders left out -> ids [tokens, MoE layers, k] int64. ValueError naming
    what is wrong: no per-token routing (counts only, or our traces' unions), or items that disagree in shape."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"routing trace {path}: no such file")
    with open(path, "rb") as f:
        kind = is_candidate(f.read(SNIFF_BYTES))
    if kind is None:
        raise ValueError(f"routing trace {path}: no routed_experts field in its first {SNIFF_BYTES >> 20} MiB: not a "
                         "routing dump")
    parts, refused = [], []

    def keep(item):
        if item.problem is None and item.ids is not None and len(item.ids):
            if parts and item.ids.shape[1:] != parts[0].shape[1:]:
                refused.append(f"{item.where}: [layers, k] {tuple(item.ids.shape[1:])} where the first routing has "
                               f"{tuple(parts[0].shape[1:])}")
            else:
                parts.append(item.ids)
        elif item.problem is not None:
            refused.append(f"{item.where}: {item.problem}")

    read_items(path, kind, options, keep, lambda where, error, cut: None)
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ValueError(f"routing trace {path}: {refused[0]}{more}")
    if not parts:
        raise ValueError(f"routing trace {path}: no per-token routing to replay (expert counts or unions only)")
    ids = np.concatenate(parts).astype(np.int64)
    live = (ids != 0).any(axis=(0, 2)) if ids.shape[2] > 1 else np.ones(ids.shape[1], dtype=bool)
    return ids[:, live] if live.any() else ids


def routing_model(spec: str, base: Path | None = None):
    """A routing spec as the engine takes it (load_pair(routing=…)): "router", "uniform", or for trace:FILE the
    dump read as a RoutingTrace (FILE relative to `base`). ValueError naming what is wrong."""
    from ..names import ROUTING_MODELS, ROUTING_SPEC

    if spec in ROUTING_MODELS:
        return spec
    kind, _, file = spec.partition(":")
    if kind != "trace" or not file:
        raise ValueError(f"routing {spec!r} must be {ROUTING_SPEC}")
    path = Path(file) if base is None or Path(file).is_absolute() else Path(base) / file
    ids = read_trace(path)
    import torch

    from ..declared_routing import RoutingTrace
    return RoutingTrace(torch.from_numpy(ids), source=path.name)
