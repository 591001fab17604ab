"""Routing dumps for `ddtree-lab ingest`: each file's two passes (what it holds and what is refused; then the
window and forward sums) and its entry of routing.json (docs/workbench.md, "Routing dumps and routing.json").
The formats are read in `routing_formats`, the math is `routing`'s. No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .routing import (WINDOWS, counts_touched, forward_touched, rank_bounds, uniform_rank_max_many, uniform_rank_mean,
                      uniform_union, window_sums)
from .routing_formats import TRACES, Forward, RoutingOptions, RoutingRefusal, Sequence, read_items

SCHEMA = 1
ROUTING_FILE = "routing.json"


# ----------------------------------------------------------------------------- the two passes
@dataclass
class _Scan:
    """Pass 1 over a file: what it holds, what is refused, the sizes the stats need."""
    formats: list = field(default_factory=list)
    model: str | None = None
    refused: list = field(default_factory=list)     # {"where", "reason"}
    bad: set = field(default_factory=set)           # indices of refused items
    layers: int | None = None
    k: int | None = None
    k_inferred: bool = False
    max_id: int = -1
    live_layers: np.ndarray | None = None           # a layer holding some id other than 0
    experts_in_file: int | None = None
    sequences: int = 0
    tokens: int = 0
    forwards: int = 0
    dense_rows: int = 0
    truncated: list = field(default_factory=list)
    index: int = 0


def read_routing_file(path: Path, kind: str, options: RoutingOptions) -> dict | None:
    """One file -> its routing.json entry, or None when it holds no routing after all. Raises RoutingRefusal
    for a file that is a routing dump but cannot be read."""
    scan = _Scan()

    def note(where, error, cut):
        if cut:
            scan.truncated.append(where)
        else:
            scan.refused.append({"where": where, "reason": f"not JSON ({error})"})

    def first(item):
        _check(scan, item, options)
        scan.index += 1

    if not read_items(path, kind, options, first, note):
        return None
    if scan.index == 0 and scan.truncated:
        raise RoutingRefusal(f"cut off ({scan.truncated[0]}) before its first complete routing")
    if scan.index == 0:  # a field name, but no routing
        return None
    experts, experts_source = _experts(scan, options)
    bounds = rank_bounds(experts, options.ep_ranks) if experts and experts >= options.ep_ranks else None
    sums, seen = _Sums(), [0]

    def second(item):
        if seen[0] not in scan.bad:
            sums.add(item, bounds)
        seen[0] += 1

    read_items(path, kind, options, second, lambda *a: None)  # the same items, in the same order
    return _entry(path, scan, sums, experts, experts_source, bounds, options)


def _check(scan: _Scan, item, options: RoutingOptions) -> None:
    """Pass 1 on one item: refuse it (one line per reason) or take its sizes."""
    why, ids = item.problem, item.ids
    counts, touched = getattr(item, "counts", None), getattr(item, "touched", None)
    if isinstance(item, Forward) and why == "dense":
        scan.dense_rows += 1
        scan.bad.add(scan.index)
        return
    known = options.experts or getattr(item, "experts", None) or scan.experts_in_file
    layers = k = None
    if why is None and ids is not None:
        layers, k = ids.shape[1], ids.shape[2]
        if ids.size and ids.min() < 0:
            why = f"negative expert id {int(ids.min())}"
        elif known and ids.size and ids.max() >= known:
            source = " (--experts)" if options.experts else ""
            why = f"expert id {int(ids.max())} out of range: the layer has {known} experts{source}"
    elif why is None and counts is not None:
        layers = counts.shape[0]
    elif why is None and touched is not None:
        layers = len(touched)
        if known and max(touched, default=0) > known:
            why = f"touches {max(touched)} experts in a layer, more than its {known} (--experts)"
    elif why is None:
        why = "no routing in this value"
    if why is None and scan.layers is not None and layers != scan.layers:
        why = f"{layers} layers where the file's first routing has {scan.layers}"
    if why is None and k is not None and scan.k is not None and k != scan.k:
        why = f"top_k {k} where the file's first routing has {scan.k}"
    if why is not None:
        scan.refused.append({"where": item.where, "reason": why})
        scan.bad.add(scan.index)
        return
    if item.format not in scan.formats:
        scan.formats.append(item.format)
    scan.model = scan.model or getattr(item, "model", None)
    scan.layers = layers
    scan.experts_in_file = scan.experts_in_file or getattr(item, "experts", None)
    live = None
    if ids is not None:
        scan.k = k
        scan.k_inferred = scan.k_inferred or getattr(item, "k_inferred", False)
        if ids.size:
            scan.max_id = max(scan.max_id, int(ids.max()))
            live = (ids != 0).any(axis=(0, 2))
    elif counts is not None:
        live = counts[:, 1:].sum(axis=1) > 0
    if live is not None:
        scan.live_layers = live if scan.live_layers is None else scan.live_layers | live
    if isinstance(item, Sequence):
        scan.sequences += 1
        scan.tokens += len(ids)
    else:
        scan.forwards += 1


def _experts(scan: _Scan, options: RoutingOptions) -> tuple[int | None, str | None]:
    if scan.experts_in_file:
        return scan.experts_in_file, "file"
    if options.experts:
        return options.experts, "--experts"
    if scan.max_id >= 0:
        return scan.max_id + 1, "inferred"
    return None, None


class _Sums:
    """Pass 2: window and forward sums over a file's accepted items."""

    def __init__(self):
        self.windows: dict = {}    # T -> [windows, touched [L], rank_max [L] | None]
        self.forwards: dict = {}   # tokens -> [forwards, touched [L], rank_max [L] | None]

    def add(self, item, bounds) -> None:
        if isinstance(item, Sequence):
            for T, s in window_sums(item.ids, WINDOWS, bounds).items():
                _accumulate(self.windows, T, s.windows, s.touched, s.rank_max)
            return
        if item.tokens is None:
            return
        if item.ids is not None:
            touched, rank_max = forward_touched(item.ids, bounds)
        elif item.counts is not None:
            touched, rank_max = counts_touched(item.counts, bounds)
        else:
            touched, rank_max = np.asarray(item.touched, dtype=float), None
        _accumulate(self.forwards, item.tokens, 1, touched, rank_max)


def _accumulate(table: dict, key: int, n: int, touched, rank_max) -> None:
    if n <= 0:
        return
    if key not in table:
        table[key] = [0, np.zeros(len(touched)), None if rank_max is None else np.zeros(len(touched))]
    row = table[key]
    row[0] += n
    row[1] += touched
    if row[2] is not None and rank_max is not None:
        row[2] += rank_max


def _entry(path: Path, scan: _Scan, sums: _Sums, experts, experts_source, bounds, options: RoutingOptions) -> dict:
    layers = scan.layers or 0
    live = scan.live_layers if scan.live_layers is not None else np.ones(layers, dtype=bool)
    if scan.k is not None and scan.k < 2:
        live = np.ones(layers, dtype=bool)  # with one pick per token, expert 0 alone may be real routing
    keep = np.flatnonzero(live) if live.any() else np.arange(layers)
    k, k_source = scan.k, ("inferred" if scan.k_inferred else "file") if scan.k is not None else None
    if k is None and options.top_k:
        k, k_source = options.top_k, "--top-k"
    if k is None and scan.formats == [TRACES]:
        k = _k_from_single_tokens(sums.forwards, keep)
        k_source = "inferred" if k else None
    ranks = len(bounds) - 1 if bounds is not None else None
    uniform_ok = bool(experts and k and k <= experts)

    def rows(table, count_name):
        most = uniform_rank_max_many(experts, k, list(table), ranks) if uniform_ok and ranks and table else {}
        out = []
        for t, (n, touched, rank_max) in sorted(table.items()):
            per_layer = touched[keep] / n
            mean = _num(per_layer.mean()) if len(per_layer) else None
            most_here = _num((rank_max[keep] / n).mean()) if ranks and rank_max is not None and len(per_layer) else None
            out.append({"tokens": t, count_name: n, "touched": mean, "per_layer": [_num(x) for x in per_layer],
                        "uniform": _num(uniform_union(experts, k, t)) if uniform_ok else None,
                        "rank_mean": _num(mean / ranks) if ranks and mean is not None else None,
                        "rank_max": most_here,
                        "uniform_rank_mean": _num(uniform_rank_mean(experts, k, t, ranks))
                        if ranks and uniform_ok else None,
                        "uniform_rank_max": _num(most[t]) if t in most else None})
        return out

    notes = []
    if scan.dense_rows and not (sums.forwards or sums.windows):
        notes.append("traces of a dense target: no MoE routing recorded")
    if experts is None:
        notes.append("experts per layer unknown: give --experts for the uniform and EP figures")
    elif bounds is None:
        notes.append(f"{experts} experts: fewer than the {options.ep_ranks} EP ranks, no per-rank figures")
    if options.experts and experts_source == "file" and options.experts != experts:
        notes.append(f"the file says {experts} experts; --experts {options.experts} is not used")
    return {"file": str(path), "format": ", ".join(scan.formats) or None,
            "kind": "+".join(x for x, t in (("windows", sums.windows), ("forwards", sums.forwards)) if t) or None,
            "model": scan.model, "sequences": scan.sequences, "tokens": scan.tokens, "forwards": scan.forwards,
            "layers": layers, "moe_layers": len(keep), "dense_layers": [int(i) for i in np.flatnonzero(~live)],
            "experts": experts, "experts_source": experts_source, "top_k": k, "top_k_source": k_source,
            "ep_ranks": ranks, "truncated": bool(scan.truncated), "cut": list(scan.truncated),
            "refused": _grouped(scan.refused), "notes": notes,
            "windows": rows(sums.windows, "windows"), "forward_passes": rows(sums.forwards, "forwards")}


def _grouped(refused: list[dict], shown: int = 5) -> list[dict]:
    """Refusals by reason: {"reason", "count", "where": the first few}; one line each for the CLI."""
    out: dict[str, dict] = {}
    for r in refused:
        g = out.setdefault(r["reason"], {"reason": r["reason"], "count": 0, "where": []})
        g["count"] += 1
        if len(g["where"]) < shown:
            g["where"].append(r["where"])
    return list(out.values())


def _k_from_single_tokens(forwards: dict, keep) -> int | None:
    """Our traces: a one-token round (an AR step) touches exactly k experts in every MoE layer."""
    if 1 not in forwards:
        return None
    n, touched, _ = forwards[1]
    per_layer = touched[keep] / n
    k = int(round(per_layer.mean())) if len(per_layer) else 0
    return k if k >= 1 and np.allclose(per_layer, k) else None


def _num(x) -> float | None:
    x = float(x)
    return round(x, 6) if math.isfinite(x) else None


# ----------------------------------------------------------------------------- the document
def routing_document(entries: list[dict], unread: list[dict], options: RoutingOptions) -> dict:
    return {"schema": SCHEMA, "ep_ranks": options.ep_ranks, "windows": list(WINDOWS),
            "files": entries, "unread": unread}


def places(refusal: dict) -> str:
    """Where a grouped refusal happened: its first places, and how many more."""
    more = refusal["count"] - len(refusal["where"])
    return ", ".join(refusal["where"]) + (f" and {more} more" if more > 0 else "")


def problem_lines(doc: dict) -> list[str]:
    """What the CLI prints of routing.json: one line per refused sequence, cut or unread file."""
    out = []
    for e in doc.get("files") or []:
        for r in e.get("refused") or []:
            out.append(f"{e['file']}: {places(r)}: {r['reason']}")
        out += [f"{e['file']}: {c}: cut off here (what came before is kept)" for c in e.get("cut") or []]
        out += [f"{e['file']}: {n}" for n in e.get("notes") or []]
    out += [f"{u['file']}: {u['reason']}" for u in doc.get("unread") or []]
    return out

