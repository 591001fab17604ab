"""What a study's traced rounds say beside their τ: the tokens a round verified, the measured MoE routing
(experts touched and row blocks per verify size) and how far the draft's confidence predicts acceptance."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from ...kernels.moe_layout import at_kernel_height
from .shapes import ExpertLoad


def verify_tokens(row: Mapping) -> int:
    """The tokens a traced round's target forward verified: `verify_tokens`, else the tree's nodes + the root
    (an AR row: 1)."""
    return int(row.get("verify_tokens") or len(((row.get("tree") or {}).get("tokens")) or []) + 1)


def row_blocks_at_height(row: Mapping) -> list[int] | None:
    """A traced round's row blocks per MoE layer at the kernel's height for its verify tokens (and its experts'
    INT4-ness, `expert_int4`); None without."""
    return at_kernel_height(row.get("expert_row_blocks"), verify_tokens(row), bool(row.get("expert_int4")))


def expert_load(trace_rows: Sequence[Mapping]) -> ExpertLoad | None:
    """The measured routing {verify tokens: mean per MoE layer} from trace rows carrying `experts_touched`
    (one count per MoE layer for that round's verify forward) and `expert_row_blocks` (per row-block height).
    None for a dense target."""
    touched: dict[int, list[float]] = {}
    blocks: dict[int, list[float]] = {}
    for r in trace_rows:
        if not r.get("experts_touched"):
            continue
        t = verify_tokens(r)
        touched.setdefault(t, []).append(sum(r["experts_touched"]) / len(r["experts_touched"]))
        if per_layer := row_blocks_at_height(r):
            blocks.setdefault(t, []).append(sum(per_layer) / len(per_layer))
    if not touched:
        return None
    return ExpertLoad(_means(touched), _means(blocks) or None)


def _means(per_size: Mapping[int, Sequence[float]]) -> dict[int, float]:
    return {t: sum(v) / len(v) for t, v in sorted(per_size.items())}


def tau_calibration(trace_rows: Sequence[Mapping]) -> float | None:
    """How far the draft's confidence predicts acceptance: measured Σ(τ − 1) over the rounds divided by
    Σ of each round's tree path probabilities (exp of its node scores): 1 for a calibrated drafter, below 1
    for an over-confident one. None without scored trees."""
    got = pred = 0.0
    for r in trace_rows:
        scores = (r.get("tree") or {}).get("scores")
        if not scores or r.get("acceptance_length") is None:
            continue
        got += r["acceptance_length"] - 1
        pred += sum(math.exp(x) for x in scores)
    return got / pred if pred else None
