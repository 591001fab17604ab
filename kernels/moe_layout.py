"""The fused-MoE kernel's layout facts, in one place for the kernel, the engine's torch path, the benchmarks
and the cost model: imports neither Triton nor torch (tensor code calls tensor methods only), so the advisor,
which runs without torch, reads the same facts the kernel launches with.

    row_height(T, int4)        BLOCK_M: rows of one expert a program takes, one of ROW_HEIGHTS
    ROUTE_IN_ALIGN_MAX_T       up to this many tokens one program routes and sorts them
    row_blocks(P, S, h)        the grid's bound on row blocks, for any routing
    blocks_at_height(counts, h)  the row blocks a routing runs, Σ_e ceil(n_e / h)
    route_reference(...)       the routing in torch: the kernel's ground truth and the engine's torch path
    route_grouped_reference(...)  DeepSeek-V3's grouped sigmoid routing (the engine computes it for the kernel)
    uniform_ids_reference(...)  declared uniform routing's experts, a hash per (token, layer, expert)
    declared_weights_reference(...)  a declared routing's weights: the router's scores at the declared experts
                               (both in one launch: declared_route.py)
    routing_stats(counts)      experts touched, the busiest expert's tokens, row blocks per height
    moe_weight_bytes, reread_bytes, gather_bytes   bytes a block reads, re-reads, or gathers in torch
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

ROW_HEIGHTS = (16, 32, 64)  # the heights row_height picks from; telemetry counts blocks at each
WIDE_ROWS_FROM_T = 257  # from this many tokens a row block holds 64 tokens
ROUTE_IN_ALIGN_MAX_T = 2  # up to this many tokens one program routes and sorts them (docs/kernels.md: measured)
SORT_IN_ROUTING_MAX_T = 1  # up to this many tokens the engine has the routing kernel sort its pairs (measured)
GATHER_LIMIT_BYTES = 4 << 30  # the most the torch path's per-token gather may take: the engine refuses past it,
                              # the benchmark skips that path


def row_height(T: int, int4: bool = False) -> int:
    """BLOCK_M on a GPU: 16 up to 16 tokens; from WIDE_ROWS_FROM_T, 64; between, the height of 32 or 64 that pads
    a crowded expert's T tokens (a tree routes alike, so one expert may get them all) least, the taller on a
    tie, which runs fewer blocks: 33 tokens take one block of 64, not two of 32 (measured end to end on the
    H200, docs/kernels.md). INT4 experts (`int4`) always take 16: a block unpacks its expert's weights whatever
    its height, and a taller one cost about twice as much on the H200 (Kimi K2.6's block, T = 17 … 129,
    docs/performance.md), so it pays only where an expert gets over 32 of a call's tokens."""
    if T <= 16 or int4:
        return 16
    if T >= WIDE_ROWS_FROM_T:
        return 64
    return min((64, 32), key=lambda h: -(-T // h) * h - T)


def at_kernel_height(per_height: Mapping[str, object] | None, tokens: int, int4: bool = False):
    """Of a record counted at each row height ({"16": …, "32": …, "64": …}), the value at the height the
    kernel runs `tokens` tokens with (INT4 experts: `int4`); None without one."""
    return (per_height or {}).get(str(row_height(tokens, int4)))


def row_blocks(P: int, S: int, block_m: int) -> int:
    """The most row blocks P routed pairs can need over at most S experts: Σ ceil(n_e / BLOCK_M) ≤
    (P + S·(BLOCK_M − 1)) / BLOCK_M, and never more than P (a block holds a pair at least). The grid's
    first axis, fixed by the shape; blocks past the routing's own count exit at once."""
    return max(1, min(P, (P + S * (block_m - 1)) // block_m))


def blocks_at_height(counts: torch.Tensor, height: int) -> torch.Tensor:
    """counts [..., E] tokens per expert -> [...] the fused kernel's row blocks at that height, Σ_e ceil(n_e / h)."""
    return (counts.long() + height - 1).div(height, rounding_mode="floor").sum(-1)


def routing_stats(counts: torch.Tensor) -> dict[str, object]:
    """counts [..., E] tokens per expert (one call's, or one row per MoE layer) -> the distinct experts routed
    to, the most tokens any one expert got (the busiest expert's load), and for each row height h the blocks
    the fused kernel runs, Σ_e ceil(n_e / h) (each re-reads its expert's weights): Python numbers, [...]-shaped.
    One host read."""
    counts = counts.long()
    stats = counts.new_empty((2 + len(ROW_HEIGHTS), *counts.shape[:-1]))   # [fields, ...]
    stats[0] = counts.gt(0).sum(-1)
    stats[1] = counts.amax(-1)
    for i, h in enumerate(ROW_HEIGHTS):
        stats[2 + i] = blocks_at_height(counts, h)
    touched, busiest, *blocks = stats.tolist()
    return {"experts_touched": touched, "expert_tokens_max": busiest,
            "expert_row_blocks": {str(h): b for h, b in zip(ROW_HEIGHTS, blocks)}}


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    """logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64), best first: softmax in fp32,
    then the top_k with ties to the lower expert (a stable descending sort: torch.topk leaves the order of ties
    unspecified), divided by their sum when `renormalize`."""
    probs = logits.float().softmax(-1)                                        # [T, E]
    vals, ids = probs.sort(dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k], ids[:, :top_k]
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    return vals, ids


def route_grouped_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                            scoring: str, renormalize: bool, scaling: float):
    """DeepSeek-V3's routing. logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int64), best first.
    Scores are sigmoid (or softmax) of the fp32 logits; the choice uses them plus the correction bias [E]: each of
    n_group groups is scored by the sum of its best two corrected scores, the top topk_group groups stay open and
    the top_k corrected scores among their experts win. Weights are the uncorrected scores of the winners (the bias
    steers load, never the output), divided by their sum when `renormalize`, times `scaling`. Ties go to the
    lower index (stable descending sorts), as in route_reference."""
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(-1)   # [T, E]
    choice = scores + bias.float()
    T, E = choice.shape
    if n_group > 1:
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)       # [T, G]
        groups = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :topk_group]  # [T, g]
        open_ = group_scores.new_zeros(group_scores.shape).bool().scatter_(1, groups, True)
        choice = choice.masked_fill(~open_.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]                   # [T, k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


UNIFORM_PRIME = 2_147_483_647  # 2^31 − 1: products of two residues stay below 2^62, exact in int64
UNIFORM_MIX = (1_103_515_245, 2_654_435_761 % UNIFORM_PRIME, 40_503, 1_597_334_677)


def uniform_ids_reference(keys: torch.Tensor, layer: int, experts: int, top_k: int) -> torch.Tensor:
    """keys [T] int64 (≥ 0, one per token) -> ids [T, top_k] int64: the top_k of hash(key, layer, e) over the
    experts e, best first, ties to the smaller index; uniform and independent across distinct keys and layers."""
    import torch  # only here: the advisor reads this module without torch

    P, M = UNIFORM_PRIME, UNIFORM_MIX
    e = torch.arange(experts, device=keys.device, dtype=torch.int64)
    x = (keys[:, None] % P * M[0] + (layer + 1) * M[1] + e[None] * M[2]) % P   # [T, E]
    x = (x ^ (x >> 13)) * M[3] % P
    x = (x ^ (x >> 7)) * M[0] % P
    return x.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]


def declared_weights_reference(logits: torch.Tensor, ids: torch.Tensor, scoring: str, renormalize: bool,
                               scaling: float) -> torch.Tensor:
    """A declared routing's weights: the router's own scores (softmax or sigmoid of the fp32 logits [T, E]) at the
    declared experts ids [T, k], divided by their sum when `renormalize`, times `scaling` -> [T, k] fp32."""
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(-1)   # [T, E]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling


def expert_bytes(hidden: int, width: int, dtype_bytes: int) -> int:
    """One expert's weights: its gate, up and down rows, 3·H·I values."""
    return 3 * hidden * width * dtype_bytes


def moe_weight_bytes(touched: float, experts: int, hidden: int, width: int, dtype_bytes: int) -> float:
    """Weights one MoE block reads: its router [E, H] and the experts its tokens touched (a forward reads the
    union of its tokens' experts, each once while its tokens fit one row block)."""
    return experts * hidden * dtype_bytes + touched * expert_bytes(hidden, width, dtype_bytes)


def reread_bytes(blocks: float, touched: float, hidden: int, width: int, dtype_bytes: int) -> float:
    """Expert weights one MoE block reads again: every row block after an expert's first reads its gate, up
    and down rows once more."""
    return max(0.0, blocks - touched) * expert_bytes(hidden, width, dtype_bytes)


def gather_bytes(T: int, top_k: int, hidden: int, width: int, dtype_bytes: int) -> int:
    """What the torch path's per-token gather (no grouped matmul) allocates: each (token, expert) pair's own
    copy of the expert's weights, [T, k, 2I, H] and [T, k, H, I]."""
    return T * top_k * expert_bytes(hidden, width, dtype_bytes)
