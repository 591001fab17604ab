"""Building the draft tree from the drafter's per-depth distributions (a round's second stage).

A node is a rank prefix (r_1 … r_d) with score Σ log q_i[r_i]. The tree is the `budget` best prefixes.
A child never outscores its parent, so the best `budget` nodes at depth d all hang below the best
`budget` nodes at depth d-1: a beam of width `budget` per depth holds every candidate, and one
global top-`budget` over the L beams gives the tree. All of it is fixed-shape tensor work with no
host synchronisation, so the same code runs on the CPU and inside a CUDA graph.

Ties: candidates are laid out depth-major and ranks ascending, and every selection is a stable
descending sort, so an exact tie goes to the shallower node (a parent before its equal-scoring child)
and then to the lower rank. The result is deterministic and always prefix-closed.

Each depth step sorts few candidates: the beam and the ranks are both sorted, so child (slot i, rank r)
is preceded by every (i' ≤ i, r' ≤ r); it can make the top W only if (i+1)(r+1) ≤ W. That leaves about
W·ln W candidates (≈280 for W = 64, ≈7,300 for 1024) instead of W·K, with the same result.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import options
from .names import MAX_BUDGET, is_budget, topk_width


@dataclass
class DraftTree:
    """Nodes 1..n in descending score order (parents precede children); node 0 is the root."""

    tokens: torch.Tensor    # [n] token ids
    depths: torch.Tensor    # [n] 1..L
    parents: torch.Tensor   # [n] parent index in 0..n-1+1 (0 = root)
    scores: torch.Tensor    # [n] cumulative draft log-probability
    logprobs: torch.Tensor  # [n] the node's own draft log-probability at its depth
    ranks: torch.Tensor     # [n] the node's rank among its depth's top-K tokens (0 = most likely)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device) -> "DraftTree":
        return DraftTree(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def to_json(self) -> dict:
        return {f: getattr(self, f).tolist() for f in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: dict) -> "DraftTree":
        kinds = {"scores": torch.float32, "logprobs": torch.float32}
        return cls(**{f: torch.tensor(d[f], dtype=kinds.get(f, torch.long)) for f in cls.__dataclass_fields__})


def check_budget(budget: int, topk: int | None) -> None:
    if not is_budget(budget):
        raise ValueError(f"budget={budget!r} is out of range: it must be an integer in 1..{MAX_BUDGET}")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"topk={topk!r} must be a positive integer or None")


def tree_size(depth: int, k: int, budget: int) -> int:
    """How many nodes the tree holds: the budget, unless fewer rank prefixes exist (e.g. topk=1)."""
    total, level = 0, 1
    for _ in range(depth):
        level = min(level * k, budget)
        total += level
        if total >= budget:
            return budget
    return total


_CANDIDATES: dict = {}


def beam_candidates(W: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, rank) pairs with (slot+1)(rank+1) ≤ W, slot-major then rank (the full set's flat order).
    Constant per shape; cached so that graph capture (after an eager warm-up) makes no host copies."""
    key = (W, K, str(device))
    if key not in _CANDIDATES:
        slots = [i for i in range(W) for _ in range(min(K, W // (i + 1)))]
        ranks = [r for i in range(W) for r in range(min(K, W // (i + 1)))]
        _CANDIDATES[key] = (torch.tensor(slots, device=device), torch.tensor(ranks, device=device))
    return _CANDIDATES[key]


COUNTING_MAX_WIDTH = 128  # kernels/tree_build.py: its cost grows with W·K per child
FUSED_MAX_WIDTH = 256     # kernels/tree_build.py: one program sorts all L·W beam entries in registers


def use_triton(device: torch.device) -> bool:
    """Whether the Triton tree kernels run here: options.tree_kernels, else on CUDA devices with Triton."""
    choice = options.current().tree_kernels
    if choice is not None:
        return choice == "triton"
    return torch.device(device).type == "cuda" and _have_triton()


def depth_topk(draft_logits: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [L, V] -> (log-probabilities [L, K] fp32, token ids [L, K]), each row descending."""
    if options.current().tree_topk == "triton" and use_triton(draft_logits.device):
        from .kernels.vocab_topk import MAX_VOCAB, vocab_topk

        if draft_logits.shape[1] <= MAX_VOCAB:
            return vocab_topk(draft_logits, K)
    return torch.log_softmax(draft_logits.float(), dim=-1).topk(K, dim=-1)


def check_logits(draft_logits: torch.Tensor) -> None:
    """ValueError naming the first depth whose logits are NaN, +inf or all -inf."""
    x = draft_logits.detach()  # [L, V]
    bad = torch.isnan(x).any(-1) | (x == float("inf")).any(-1) | (x == float("-inf")).all(-1)  # [L]
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"build_tree: draft_logits row {row} (depth {row + 1}) holds NaN or +inf or is all "
                         "-inf: a tree of NaN scores would follow")


def build_tree(draft_logits: torch.Tensor, budget: int, topk: int | None = None,
               method: str | None = None, check_finite: bool = True) -> DraftTree:
    """draft_logits [L, V] (depths 1..L) -> the `budget` most likely rank prefixes as a DraftTree.

    method: "sort" (torch, this function, any size), "count" (kernels/tree_build.py, beams up to 128
    wide: the same tree in L + 1 launches) or "fused" (the same, one launch, beams up to 256 wide).
    Default: options.tree_build if set (the sort where that build does not take the beam); else "fused"
    where `use_triton` says so and the beam fits, else "sort" (the fused build was timed fastest,
    docs/performance.md).

    check_finite: refuse logits holding NaN or +inf, or a row that is all -inf (they would give a tree
    of NaN scores). It reads a flag back to the host, so the round program, which must not sync,
    passes False."""
    check_budget(budget, topk)
    if check_finite:
        check_logits(draft_logits)
    L, V = draft_logits.shape
    K = topk_width(topk, budget, V)
    n = tree_size(L, K, budget)
    device = draft_logits.device
    top_lp, top_tok = depth_topk(draft_logits, K)  # [L, K] each, ranks ascending

    # Beam per depth: W slots (score, parent slot in the previous beam, rank). -inf marks empty slots.
    W = min(budget, n)
    cand_slot, cand_rank = beam_candidates(W, K, device)  # [M] each, M ≈ W ln W
    widest = {"count": COUNTING_MAX_WIDTH, "fused": FUSED_MAX_WIDTH}
    fits = {m: W <= w and K <= w for m, w in widest.items()}
    if method is None:
        chosen = options.current().tree_build
        if chosen is not None:
            method = chosen if fits.get(chosen, True) else "sort"
        else:
            method = "fused" if fits["fused"] and use_triton(device) else "sort"
    if method in widest:
        if not fits[method]:
            raise ValueError(f"build_tree(method={method!r}) takes beams up to {widest[method]} wide, not {W}")
        from .kernels import tree_build

        build = tree_build.beam_tree if method == "count" else tree_build.fused_tree
        fields = build(top_lp, top_tok, W, n, cand_slot, cand_rank)
        return DraftTree(**dict(zip(("tokens", "depths", "parents", "scores", "logprobs", "ranks"), fields)))
    if method != "sort":
        raise ValueError(f"build_tree: method={method!r} is not 'sort', 'count' or 'fused'")

    # Rows are collected in lists and stacked once: fewer small kernels than row-by-row writes.
    first = min(K, W)
    pad = W - first
    scores = [torch.cat([top_lp[0, :first], top_lp.new_full((pad,), float("-inf"))])]
    slots = [torch.arange(W, device=device).clamp(max=first - 1)]  # depth 1: slot i holds rank i
    cand_flat = cand_slot * K + cand_rank                 # index in the full parent-major W*K layout
    for d in range(1, L):
        # the children of the beam at depth d-1 that can reach the top W
        child = scores[-1][cand_slot] + top_lp[d][cand_rank]  # [M]
        best, order = child.sort(descending=True, stable=True)
        scores.append(best[:W])
        slots.append(cand_flat[order[:W]])
    beam_score = torch.stack(scores)                        # [L, W]
    order = torch.stack(slots[1:]) if L > 1 else None       # [L-1, W]: flat child index at depths 2..L
    beam_parent = torch.cat([slots[0].new_zeros(1, W)] + ([order // K] if L > 1 else []))  # [L, W]
    beam_rank = torch.cat([slots[0][None]] + ([order % K] if L > 1 else []))      # [L, W]

    # Global selection over all depths, depth-major so ties favour shallower nodes.
    flat = beam_score.flatten()  # [L*W], index = d*W + slot
    chosen = flat.sort(descending=True, stable=True).indices[:n]  # [n]
    depth0 = chosen // W  # 0-based depth
    slot = chosen % W
    # Node index (1..n) of each chosen candidate, to translate parent slots into node indices.
    node_of = torch.zeros(L * W, dtype=torch.long, device=device)
    node_of[chosen] = torch.arange(1, n + 1, device=device)
    parent_flat = (depth0 - 1).clamp(min=0) * W + beam_parent[depth0, slot]
    parents = torch.where(depth0 == 0, torch.zeros_like(chosen), node_of[parent_flat])
    ranks = beam_rank[depth0, slot]
    return DraftTree(
        tokens=top_tok[depth0, ranks],
        depths=depth0 + 1,
        parents=parents,
        scores=flat[chosen],
        logprobs=top_lp[depth0, ranks],
        ranks=ranks,
    )


@functools.cache
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tree_masks(parents_with_root: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (anc bool [T, T], its rows packed as the verify kernel's bits, or None to pack them later).
    One Triton launch where `use_triton` says so; else ancestor_matrix."""
    if use_triton(parents_with_root.device):
        from .kernels.tree_walk import tree_masks as walk_masks

        return walk_masks(parents_with_root, max_depth)
    return ancestor_matrix(parents_with_root, max_depth), None


def accept_path(tokens, parents, depths, choice, anc, max_depth: int):
    """The round's outcome, all [T] with the root at 0 (its own parent): a node is accepted when every
    node on its root path, the root aside, carries its parent's target choice. -> (path [max_depth+1]:
    the root … the deepest accepted node, then T-1 as filler; a [1]: how many nodes the path holds)."""
    if use_triton(tokens.device):
        from .kernels.tree_walk import accept_path as walk_path

        return walk_path(tokens, parents, depths, choice, max_depth)
    T = tokens.shape[0]
    ids = torch.arange(T, device=tokens.device)
    matched = (tokens == choice[parents]) | (ids == 0)                       # the root is given
    accepted = ~(anc & ~matched[None, :]).any(dim=1)                          # [T]
    # index_select with a [1] tensor, not t[0-dim tensor] (which would read the index on the host)
    deepest = torch.where(accepted, depths, -1).argmax().view(1)
    # the deepest node's ancestor j goes to slot depths[j]; other nodes go to a spare slot
    slot = torch.where(anc.index_select(0, deepest)[0], depths, max_depth + 1)  # [T]
    path = ids.new_full((max_depth + 2,), T - 1).scatter_(0, slot, ids)[: max_depth + 1]
    return path, depths.index_select(0, deepest) + 1


def ancestor_matrix(parents_with_root: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parents_with_root [T] (entry 0 = root, its own parent, or -1; parents[i] < i) -> anc [T, T]
    bool, anc[i, j] = j is on i's root path (i included). max_depth: the deepest node's depth, if
    known (default T - 1, any tree).

    Pointer doubling: after step k each row holds the ancestors at distance < 2^k, so
    ceil(log2(max_depth + 1)) steps cover every path. Fixed step count, no host sync.
    """
    T = parents_with_root.shape[0]
    max_depth = T - 1 if max_depth is None else max_depth
    anc = torch.eye(T, dtype=torch.bool, device=parents_with_root.device)
    jump = parents_with_root.long().clamp(min=0)  # [T]: the 2^k-th ancestor (the root points to itself)
    for _ in range(max(1, math.ceil(math.log2(max_depth + 1)))):
        anc = anc | anc[jump]
        jump = jump[jump]
    return anc
