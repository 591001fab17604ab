"""Expert-union arithmetic of MoE routing: how many distinct experts T consecutive tokens touch in a layer,
measured from routed expert ids and under independent uniform routing, overall and per rank of an EP placement.

Pure functions of numpy arrays and numbers (no torch, no engine, no files), the one home of this math: ingest's
routing.json (`routing_dumps`), the report's figure and the advisor's routing models import it.

    ids: int array [tokens, layers, k]   one sequence's routed expert ids per MoE layer, its tokens in order
    window stats: mean over every window of T consecutive tokens (all tokens - T + 1 start positions)
    EP placement: `ranks` ranks, rank r holding experts rank_bounds[r] .. rank_bounds[r + 1] - 1 (E // ranks
                  each when ranks divides E, so expert e on rank e // (E / ranks); else sizes differ by one)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..names import MAX_BUDGET

DEFAULT_EP_RANKS = 8
# Window sizes: the powers of two up to the largest budget, and that budget + its root (a verify round's tokens)
WINDOWS = tuple(2 ** i for i in range(MAX_BUDGET.bit_length())) + (MAX_BUDGET + 1,)
# Values handled at once when the per-rank counts of every window are spread out (bounds memory per layer chunk)
_SPREAD_CELLS = 1 << 24


# ----------------------------------------------------------------------------- placement
def rank_bounds(experts: int, ranks: int) -> np.ndarray:
    """[ranks + 1] first expert of each rank (and E at the end): contiguous blocks, sizes E // ranks or one more."""
    if ranks < 1 or experts < ranks:
        raise ValueError(f"an EP placement of {ranks} ranks needs at least as many experts (have {experts})")
    return (np.arange(ranks + 1, dtype=np.int64) * experts) // ranks


def rank_of(ids: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The rank holding each expert id (same shape as ids)."""
    return np.searchsorted(bounds, ids, side="right") - 1


# ----------------------------------------------------------------------------- measured: windows
@dataclass
class WindowSums:
    """Sums over the windows of one sequence (add them across sequences, then divide by `windows`)."""
    windows: int                       # windows of T tokens in the sequence: max(0, tokens - T + 1)
    touched: np.ndarray                # [layers] Σ over windows of the distinct experts the layer touched
    rank_max: np.ndarray | None        # [layers] Σ over windows of the most distinct experts one rank holds


def window_sums(ids: np.ndarray, windows: Sequence[int] = WINDOWS,
                bounds: np.ndarray | None = None) -> dict[int, WindowSums]:
    """Per window size T, the sums over all windows of T consecutive tokens of `ids` [tokens, layers, k]; the
    per-rank maxima too when `bounds` (rank_bounds) is given. An expert is in a window when one of its tokens
    is: for each (layer, expert) the windows holding it form the union of the intervals [p - T + 1, p] over its
    token positions p, so the sum over windows of the distinct count is the total length of those unions, and
    spreading the same pieces over the window starts per rank gives each window's per-rank counts."""
    ids = _check_ids(ids)
    n, layers, _ = ids.shape
    out = {T: WindowSums(max(0, n - T + 1), np.zeros(layers), None if bounds is None else np.zeros(layers))
           for T in windows}
    live = [T for T in windows if n - T + 1 > 0]
    if not live or not layers:
        return out
    pos = np.repeat(np.arange(n, dtype=np.int64), ids.shape[2])
    for layer in range(layers):
        keys = np.unique(ids[:, layer, :].reshape(-1).astype(np.int64) * n + pos)  # by expert, then position
        expert, p = keys // n, keys % n
        first = np.ones(len(keys), dtype=bool)
        first[1:] = expert[1:] != expert[:-1]
        for T in live:
            w = n - T + 1
            a, b = np.maximum(0, p - T + 1), np.minimum(p, w - 1)
            prev = np.empty_like(b)
            prev[0], prev[1:] = -1, b[:-1]
            start = np.where(first, a, np.maximum(a, prev + 1))  # what an earlier token of the expert did not cover
            keep = start <= b
            out[T].touched[layer] = float(np.sum(b[keep] - start[keep] + 1))
            if bounds is not None:
                out[T].rank_max[layer] = _rank_max_sum(start[keep], b[keep], rank_of(expert[keep], bounds),
                                                       len(bounds) - 1, w)
    return out


def _rank_max_sum(start: np.ndarray, end: np.ndarray, rank: np.ndarray, ranks: int, w: int) -> float:
    """Σ over window starts 0..w-1 of max over ranks of the experts whose pieces [start, end] cover it."""
    total = 0.0
    step = max(1, _SPREAD_CELLS // (ranks + 1))
    for lo in range(0, w, step):  # window starts in chunks: ranks × chunk counters at a time
        hi = min(w, lo + step)
        s, e = np.maximum(start, lo), np.minimum(end, hi - 1)
        m = s <= e
        width = hi - lo + 1
        cells = ranks * width
        diff = (np.bincount(rank[m] * width + s[m] - lo, minlength=cells)
                - np.bincount(rank[m] * width + e[m] - lo + 1, minlength=cells)).reshape(ranks, width)
        total += float(np.cumsum(diff, axis=1)[:, : hi - lo].max(axis=0).sum())
    return total


def windows_union(ids: np.ndarray, T: int) -> np.ndarray:
    """[layers] mean over the windows of T consecutive tokens of the distinct experts each layer touches (NaN
    when the sequence is shorter than T)."""
    s = window_sums(ids, (T,))[T]
    return s.touched / s.windows if s.windows else np.full(len(s.touched), np.nan)


def windows_rank_max(ids: np.ndarray, T: int, experts: int, ranks: int = DEFAULT_EP_RANKS) -> np.ndarray:
    """[layers] mean over the windows of T tokens of the most distinct experts one rank of the placement holds."""
    s = window_sums(ids, (T,), rank_bounds(experts, ranks))[T]
    return s.rank_max / s.windows if s.windows else np.full(len(s.touched), np.nan)


def _check_ids(ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"routed expert ids must be [tokens, layers, k], got {ids.ndim} dimensions")
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0):
        raise ValueError("routed expert ids must be integers ≥ 0")
    return ids


# ----------------------------------------------------------------------------- measured: one forward
def forward_touched(ids: np.ndarray, bounds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The tokens of one forward together (`ids` [tokens, layers, k]) -> ([layers] distinct experts, [layers] the
    most one rank holds, or None without bounds)."""
    ids = _check_ids(ids)
    touched = np.array([len(np.unique(ids[:, l, :])) for l in range(ids.shape[1])], dtype=float)
    if bounds is None:
        return touched, None
    per_rank = [np.bincount(rank_of(np.unique(ids[:, l, :]), bounds), minlength=len(bounds) - 1)
                for l in range(ids.shape[1])]
    return touched, np.array([float(c.max()) if len(c) else 0.0 for c in per_rank])


def counts_touched(counts: np.ndarray, bounds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-expert token counts of one forward (`counts` [layers, E]) -> ([layers] distinct experts touched,
    [layers] the most one rank holds, or None without bounds)."""
    hit = np.asarray(counts) > 0
    touched = hit.sum(axis=1).astype(float)
    if bounds is None:
        return touched, None
    per_rank = np.add.reduceat(hit, bounds[:-1], axis=1) if hit.shape[1] else np.zeros((hit.shape[0], 1))
    return touched, per_rank.max(axis=1).astype(float)


# ----------------------------------------------------------------------------- independent uniform routing
def uniform_union(experts: int, k: int, T: int) -> float:
    """Expected distinct experts of T independent uniform k-subsets of E: E·(1 − ((E − k)/E)^T) (an expert is
    missed by one token with probability (E − k)/E)."""
    _check_uniform(experts, k)
    return experts * (1.0 - ((experts - k) / experts) ** T)


def uniform_rank_mean(experts: int, k: int, T: int, ranks: int = DEFAULT_EP_RANKS) -> float:
    """Expected distinct experts a rank holds, averaged over the ranks: the union shared among them."""
    rank_bounds(experts, ranks)
    return uniform_union(experts, k, T) / ranks


def uniform_rank_max(experts: int, k: int, T: int, ranks: int = DEFAULT_EP_RANKS) -> float:
    """Expected most distinct experts one rank holds under independent uniform routing, exactly: the touched set
    has size n with probability union_size_pmf, and given n it is a uniform n-subset (routing treats experts
    alike), whose largest count over the ranks' blocks `max_given_size` gives."""
    return uniform_rank_max_many(experts, k, (T,), ranks)[T]


def uniform_rank_max_many(experts: int, k: int, windows: Sequence[int],
                          ranks: int = DEFAULT_EP_RANKS) -> dict[int, float]:
    """uniform_rank_max for several T at once (one chain over the union's size)."""
    most = _max_given_size(int(experts), int(ranks))
    return {T: float(p @ most) for T, p in union_size_pmf(experts, k, windows).items()}


def union_size_pmf(experts: int, k: int, windows: Sequence[int]) -> dict[int, np.ndarray]:
    """Per T, [E + 1] the probability that T independent uniform k-subsets of E touch exactly n experts: a chain
    on the distinct count j, one token adding i new experts with probability C(E − j, i)·C(j, k − i) / C(E, k)."""
    _check_uniform(experts, k)
    E, lf = experts, _log_factorials(experts)
    j = np.arange(E + 1)
    step = np.zeros((k + 1, E + 1))  # step[i, j]: from j distinct, i new ones
    for i in range(k + 1):
        ok = (E - j >= i) & (j >= k - i)
        step[i, ok] = np.exp(_log_comb(lf, E - j[ok], i) + _log_comb(lf, j[ok], k - i) - _log_comb(lf, E, k))
    step /= step.sum(axis=0)  # each column sums to 1 (Vandermonde); keep rounding from drifting over T steps
    p = np.zeros(E + 1)
    p[0] = 1.0
    want, out, t = sorted(set(windows)), {}, 0
    for T in want:
        for _ in range(T - t):
            nxt = np.zeros(E + 1)
            for i in range(k + 1):
                nxt[i:] += (p * step[i])[: E + 1 - i]
            p = nxt
        t = T
        out[T] = p.copy()
    return out


def max_given_size(experts: int, ranks: int) -> np.ndarray:
    """[E + 1] for a uniform n-subset of E experts, the expected largest count over the ranks' blocks
    (rank_bounds): Σ_x P(max > x), with P(every block ≤ x) built block by block from hypergeometric terms."""
    return _max_given_size(int(experts), int(ranks)).copy()


@lru_cache(maxsize=64)
def _max_given_size(experts: int, ranks: int) -> np.ndarray:
    sizes = [int(s) for s in np.diff(rank_bounds(experts, ranks))]
    lf = _log_factorials(experts)
    out = np.zeros(experts + 1)
    for x in range(max(sizes)):
        q, seen = np.ones(1), 0  # q[j]: a uniform j-subset of the blocks so far has every block's count ≤ x
        for s in sizes:
            j = np.arange(seen + s + 1)[:, None]
            c = np.arange(min(s, x) + 1)[None, :]           # of the j, c fall in this block
            ok = (j - c >= 0) & (j - c <= seen)
            jc, cc = np.where(ok, j - c, 0), np.broadcast_to(c, ok.shape)
            h = np.where(ok, np.exp(_log_comb(lf, seen, jc) + _log_comb(lf, s, cc) - _log_comb(lf, seen + s, j)), 0.0)
            q, seen = (q[jc] * h).sum(axis=1), seen + s
        out += 1.0 - q
    return out


def _check_uniform(experts: int, k: int) -> None:
    if not (isinstance(experts, (int, np.integer)) and isinstance(k, (int, np.integer)) and 1 <= k <= experts):
        raise ValueError(f"uniform routing needs 1 ≤ k ≤ E (got k = {k}, E = {experts})")


def _log_factorials(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=float)))])


def _log_comb(lf: np.ndarray, n, r):
    return lf[n] - lf[r] - lf[np.asarray(n) - np.asarray(r)]
