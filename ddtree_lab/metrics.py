"""Figures computed from acceptance lengths: τ histogram and acceptance by depth.

A round with acceptance length τ reached depth τ-1 of its tree (the root is depth 0).
"""
from __future__ import annotations


def tau_histogram(acceptance_lengths: list[int], max_tau: int | None = None) -> list[int]:
    """counts[t-1] = rounds with τ == t, for t = 1..max_tau."""
    max_tau = max_tau or max(acceptance_lengths, default=1)
    counts = [0] * max_tau
    for t in acceptance_lengths:
        counts[min(t, max_tau) - 1] += 1
    return counts


def acceptance_by_depth(acceptance_lengths: list[int], max_depth: int) -> dict[str, list[float]]:
    """survival[d-1] = share of rounds reaching depth ≥ d; conditional[d-1] = P(reach d | reach d-1)."""
    rounds = len(acceptance_lengths)
    reached = [sum(1 for t in acceptance_lengths if t - 1 >= d) for d in range(max_depth + 1)]
    survival = [reached[d] / rounds if rounds else 0.0 for d in range(1, max_depth + 1)]
    conditional = [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, max_depth + 1)]
    return {"depth": list(range(1, max_depth + 1)), "survival": survival, "conditional": conditional}


def summarize(acceptance_lengths: list[int], max_depth: int) -> dict:
    n = len(acceptance_lengths)
    return {
        "rounds": n,
        "mean_tau": sum(acceptance_lengths) / n if n else 0.0,
        "tau_histogram": tau_histogram(acceptance_lengths, max_depth + 1),
        "acceptance_by_depth": acceptance_by_depth(acceptance_lengths, max_depth),
    }
