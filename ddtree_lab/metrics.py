"""Figures computed from acceptance lengths, once for the CLI, run results and notebooks.

A round with acceptance length τ (accepted nodes, root included) reached depth τ-1 of its tree.
"""
from __future__ import annotations

from typing import Iterable


def tau_histogram(taus: Iterable[int], max_tau: int | None = None) -> dict:
    """{"values": [1..max_tau], "counts": rounds with τ == value} (τ above max_tau counts as max_tau)."""
    taus = [int(t) for t in taus]
    if not taus:
        return {"values": [], "counts": []}
    max_tau = max_tau or max(taus)
    counts = [0] * max_tau
    for t in taus:
        counts[min(t, max_tau) - 1] += 1
    return {"values": list(range(1, max_tau + 1)), "counts": counts}


def acceptance_by_depth(taus: Iterable[int], max_depth: int | None = None) -> dict:
    """Depths 1..max_depth: survival = share of rounds whose accepted path reaches depth ≥ d, conditional =
    P(reach d | reach d-1) (None where no round reached d-1), reached = how many rounds reached d."""
    taus = [int(t) for t in taus]
    max_depth = max_depth if max_depth is not None else max([t - 1 for t in taus] + [0])
    rounds = len(taus)
    reached = [sum(1 for t in taus if t - 1 >= d) for d in range(max_depth + 1)]
    depths = range(1, max_depth + 1)
    return {"depth": list(depths), "rounds": rounds, "reached": reached[1:],
            "survival": [reached[d] / rounds if rounds else 0.0 for d in depths],
            "conditional": [reached[d] / reached[d - 1] if reached[d - 1] else None for d in depths]}


def summarize_taus(taus: Iterable[int], max_depth: int | None = None) -> dict:
    """Rounds, mean τ, the τ histogram and acceptance by depth. max_depth: the drafter's L (block_size - 1),
    so every run of a study shares one depth axis."""
    taus = [int(t) for t in taus]
    return {"rounds": len(taus), "mean_tau": sum(taus) / len(taus) if taus else None,
            "tau_histogram": tau_histogram(taus, max_depth + 1 if max_depth else None),
            "acceptance_by_depth": acceptance_by_depth(taus, max_depth)}
