"""budget="auto"'s own rule replayed on a study's traced rounds (the engine's torch form of it, imported when
called), and the most any choice of budgets could gain on the same rounds."""
from __future__ import annotations

from typing import Mapping, Sequence


def _calls(trace_rows: Sequence[Mapping]) -> list[list[Mapping]]:
    """Scored rounds grouped into calls, in order: a call starts at round index 0 or a new prompt."""
    calls: list[list[Mapping]] = []
    last = None
    for r in trace_rows:
        if not (r.get("tree") or {}).get("scores") or r.get("accepted") is None:
            continue
        key = r.get("prompt_id")
        if not calls or r.get("index") == 0 or key != last:
            calls.append([])
        calls[-1].append(r)
        last = key
    return calls


def tau_at(accepted: Sequence[int], budget: int) -> int:
    """A traced round's τ had its tree been the first `budget` nodes (a parent before its children, so the
    accepted nodes' indices grow along the path): the bonus token plus the accepted nodes with index ≤ budget."""
    return 1 + sum(1 for node in list(accepted)[1:] if int(node) <= budget)


def replay_auto(trace_rows: Sequence[Mapping], costs: Mapping[int, float], passes: int = 3,
                lag: int = 1, settings: Mapping | None = None) -> dict | None:
    """budget="auto"'s own rule replayed on the traced rounds of the largest budget, each round priced at its
    candidate's cost (seconds per round of each budget in `costs`, at most 8).

    The engine's update (`AutoState.update` with the torch reference: credit per confidence bin, the host's
    read lag, decay) runs round by round as decoding runs it: a call's round r runs the candidate proposed
    after round r − lag − 1 and is credited with what that candidate's first nodes accept, `tau_at`; calls
    share one table, `passes` times over the rounds (the rule learns across calls, as a server's does). The
    rounds stay the traced ones (a smaller tree's shorter acceptance would shift later contexts), so this is
    an estimate of auto against every fixed budget on the same rounds, exact per round at T = 0. The last
    pass is reported, with each pass's ratio to the best fixed budget. settings: the rule's others (edges,
    explore, weight, memory: `AutoBudget`'s fields), its defaults where absent. None without scored rounds or
    with more than 8 budgets."""
    import torch

    from ...auto_budget import AutoBudget, AutoState, source_round

    calls = _calls(trace_rows)
    budgets = sorted(costs)
    if not calls or not 1 <= len(budgets) <= 8:
        return None
    rounds = [r for c in calls for r in c]
    fixed, best = _fixed_rates([{b: tau_at(r["accepted"], b) for b in budgets} for r in rounds], costs)
    auto = AutoBudget(budgets=tuple(budgets), costs=tuple(float(costs[b]) for b in budgets), **dict(settings or {}))
    depth = max(max(r["tree"].get("depths") or [len(r["accepted"])]) for r in rounds)
    state = AutoState(auto, int(depth), max(len(c) for c in calls) + 1, "cpu")
    history = []
    for _ in range(max(1, passes)):
        tokens, seconds, picks = 0, 0.0, {}
        for call in calls:
            first = state.start(lag, 1)
            for i, r in enumerate(call):
                src = source_round(i, lag, 1)
                j = int(state.proposals[1 + src]) if src >= 0 else first
                accepted = [int(x) for x in r["accepted"]]
                path = torch.zeros(max(len(accepted), 2), dtype=torch.long)
                path[:len(accepted)] = torch.tensor(accepted)
                a = tau_at(accepted, budgets[j])
                scores = torch.tensor(r["tree"]["scores"], dtype=torch.float32)
                state.update(path, torch.tensor([a]), torch.tensor([i]), scores, j)  # round i, not yet counted
                tokens += a
                seconds += costs[budgets[j]]
                picks[budgets[j]] = picks.get(budgets[j], 0) + 1
            state.finish(int(state.proposals[0]))
        history.append((tokens / seconds, picks))
    tps, picks = history[-1]
    return {"rounds": len(rounds), "tokens_per_second": tps, "fixed_tokens_per_second": fixed, "best_fixed": best,
            "vs_best_fixed": tps / fixed[best], "passes_vs_best_fixed": [t / fixed[best] for t, _ in history],
            "budget_share": {b: c / len(rounds) for b, c in sorted(picks.items())}}


def auto_ceiling(trace_rows: Sequence[Mapping], costs: Mapping[int, float], lag: int = 1,
                 edges: Sequence[float] | None = None) -> dict | None:
    """What any choice among `costs`' budgets could gain on these traced rounds (of the largest budget), as
    tokens/s ÷ the best fixed budget's, each round priced at its budget's cost:
    - `per_round`: every round at its best budget in hindsight (a perfect predictor of acceptance);
    - `per_bin`: one budget per confidence bin of the round whose proposal the host has read (round
      r − lag − 1, as `source_round`), the most a rule binned as budget="auto"'s can reach; `per_bin_choice`;
    - `same_round`: one budget per bin of the round's own confidence (a choice with no read lag).
    The bins and the confidence are the rule's (`AutoBudget.edges`; Σ exp(score) over the smallest budget's
    nodes). Each figure is the exact maximum of Σ τ / Σ cost over its choices (Dinkelbach's iteration on λ).
    None without scored rounds."""
    import torch

    from ...auto_budget import AutoBudget, confidence_bin, source_round

    calls = _calls(trace_rows)
    budgets = sorted(costs)
    if not calls or not budgets:
        return None
    edges = list(AutoBudget().edges if edges is None else edges)
    edge_t = torch.tensor(edges, dtype=torch.float32)

    def bin_of(row) -> int:  # the engine's own bin (float32, as on the device)
        return int(confidence_bin(torch.tensor(row["tree"]["scores"], dtype=torch.float32), budgets[0], edge_t))

    rounds, lagged, own = [], [], []
    for call in calls:
        bins = [bin_of(r) for r in call]
        for i, r in enumerate(call):
            rounds.append({b: tau_at(r["accepted"], b) for b in budgets})
            src = source_round(i, lag, 1)
            lagged.append(bins[src] if src >= 0 else 0)
            own.append(bins[i])
    fixed, best = _fixed_rates(rounds, costs)

    def over_fixed(groups):  # the best fixed budget is one of the choices: ≥ 1 exactly, not to the last bit
        tps, choice = best_grouped_choice(rounds, groups, costs)
        return max(tps / fixed[best], 1.0), choice

    (per_round, _), (per_bin, choice), (same_round, _) = map(over_fixed, (range(len(rounds)), lagged, own))
    return {"rounds": len(rounds), "best_fixed": best, "fixed_tokens_per_second": fixed, "lag": lag, "edges": edges,
            "per_round": per_round, "per_bin": per_bin, "same_round": same_round,
            "per_bin_choice": dict(sorted(choice.items()))}


def _fixed_rates(rounds: Sequence[Mapping[int, int]], costs: Mapping[int, float]) -> tuple[dict, int]:
    """Tokens/s of each fixed budget over the rounds ({budget: τ} each), and the best (ties: the smaller)."""
    fixed = {b: sum(t[b] for t in rounds) / (len(rounds) * costs[b]) for b in sorted(costs)}
    return fixed, max(fixed, key=lambda b: (fixed[b], -b))


def best_grouped_choice(rounds: Sequence[Mapping[int, int]], groups: Sequence, costs: Mapping[int, float]):
    """max over one budget per group of Σ τ / Σ cost (rounds[i]: {budget: τ}, groups[i]: round i's group) ->
    (that tokens/s, {group: budget}). At a fixed λ the best choice of each group is its own argmax of
    Σ (τ − λ·cost), and λ ← the choice's tokens/s rises until the choice repeats: the maximum (Dinkelbach)."""
    budgets = sorted(costs)
    members: dict = {}
    for t, g in zip(rounds, groups):
        members.setdefault(g, []).append(t)
    sums = {g: {b: sum(t[b] for t in ts) for b in budgets} for g, ts in members.items()}
    count = {g: len(ts) for g, ts in members.items()}

    def rate(choice):
        return sum(sums[g][b] for g, b in choice.items()) / sum(count[g] * costs[b] for g, b in choice.items())

    choice = {g: budgets[0] for g in members}
    lam = rate(choice)
    while True:
        new = {g: max(budgets, key=lambda b: (sums[g][b] - lam * count[g] * costs[b], -b)) for g in members}
        if new == choice or rate(new) <= lam:
            return lam, choice
        choice, lam = new, rate(new)
