"""budget="auto": the per-round rule (pure functions the engine mirrors on the device), the draft
confidence's calibration and the expert-union curve from traces, and a replay of the rule on traces."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .machines import AdvisorError


def expected_tau_from_scores(node_probs: Sequence[float], budgets: Sequence[int],
                             calibration: float = 1.0) -> dict[int, float]:
    """E[τ(B)] of the trees of each candidate budget from the draft's own confidence.

    node_probs: every candidate node's path probability (the product of the draft's probabilities
    along its path), in the order DDTree adds nodes (best first). A tree accepts the node on the
    target's path at each depth it covers, so E[accepted nodes] = Σ over its nodes of P(that node's path
    is the target's) and E[τ(B)] = 1 + calibration · (sum of the first B path probabilities); the 1 is
    the target's bonus token. calibration < 1 corrects an over-confident drafter (fit it on traces)."""
    out, acc, n = {}, 0.0, 0
    for b in sorted(budgets):
        while n < min(b, len(node_probs)):
            acc += float(node_probs[n])
            n += 1
        out[b] = 1.0 + calibration * acc
    return out


def union_curve(trace_rows: Sequence[Mapping]) -> dict[int, float]:
    """The measured expert-union curve {verify tokens: mean distinct experts per MoE layer} from trace
    rows carrying `experts_touched` (one count per MoE layer for that round's verify forward) and, for
    the tokens verified, `verify_tokens` or else the tree's nodes + the root (an AR row: 1). Empty for dense."""
    sums: dict[int, list[float]] = {}
    for r in trace_rows:
        per_layer = r.get("experts_touched")
        if not per_layer:
            continue
        nodes = ((r.get("tree") or {}).get("tokens")) or []
        t = int(r.get("verify_tokens") or len(nodes) + 1)  # the root and the tree's nodes (AR: one token)
        acc = sums.setdefault(t, [0.0, 0])
        acc[0] += sum(per_layer) / len(per_layer)
        acc[1] += 1
    return {t: v / n for t, (v, n) in sorted(sums.items())}


def tau_calibration(trace_rows: Sequence[Mapping]) -> float | None:
    """How far the draft's confidence predicts acceptance: measured Σ(τ − 1) over the rounds divided by
    Σ of each round's tree path probabilities (exp of its node scores); the `calibration` of
    expected_tau_from_scores. None without scored trees."""
    got = pred = 0.0
    for r in trace_rows:
        scores = (r.get("tree") or {}).get("scores")
        if not scores or r.get("acceptance_length") is None:
            continue
        got += r["acceptance_length"] - 1
        pred += sum(math.exp(x) for x in scores)
    return got / pred if pred else None


def choose_budget(costs: Mapping[int, float], expected_tau: Mapping[int, float]) -> int:
    """The captured budget with the highest E[τ(B)] / cost(B); ties go to the smaller budget."""
    common = sorted(set(costs) & set(expected_tau))
    if not common:
        raise AdvisorError("choose_budget: no budget has both a cost and an expected τ")
    return max(common, key=lambda b: (expected_tau[b] / costs[b], -b))


def replay_auto(trace_rows: Sequence[Mapping], costs: Mapping[int, float], calibration: float = 1.0) -> dict | None:
    """`choose_budget` replayed on the traced rounds of the largest budget: each round picks its budget
    from its own node scores, and its τ at a smaller budget B is 1 + the accepted nodes with index ≤ B
    (the tree of B is the first B nodes, a parent before its children; exact per round at T = 0).
    Rounds are taken as independent (a shorter acceptance would change later contexts), so this is an
    estimate of `auto` against the fixed budgets on the same rounds. None without scored trees."""
    budgets = sorted(costs)
    got = {b: 0.0 for b in budgets}
    auto_tau = auto_cost = 0.0
    picks = {b: 0 for b in budgets}
    n = 0
    for r in trace_rows:
        tree, acc = r.get("tree") or {}, r.get("accepted")
        if not tree.get("scores") or acc is None:
            continue
        path = [int(i) for i in acc[1:]]  # node indices (1-based; 0 is the root)

        def tau_at(b):
            k = 0
            while k < len(path) and path[k] <= b:
                k += 1
            return 1 + k

        for b in budgets:
            got[b] += tau_at(b)
        exp_tau = expected_tau_from_scores([math.exp(x) for x in tree["scores"]], budgets, calibration)
        pick = choose_budget(costs, exp_tau)
        picks[pick] += 1
        auto_tau += tau_at(pick)
        auto_cost += costs[pick]
        n += 1
    if not n:
        return None
    fixed = {b: got[b] / (n * costs[b]) for b in budgets}
    best = max(fixed, key=lambda b: (fixed[b], -b))
    auto = auto_tau / auto_cost
    return {"rounds": n, "tokens_per_second": auto, "fixed_tokens_per_second": fixed, "best_fixed": best,
            "vs_best_fixed": auto / fixed[best], "budget_share": {b: c / n for b, c in picks.items() if c}}
