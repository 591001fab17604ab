"""budget="auto"'s own rule replayed over one text: its choices and tokens/s, free of bf16 text divergence.

Each prompt is traced once on the CPU in float32 at the largest candidate. A tree of budget b is the first b
nodes of any larger tree (tree.py's order), so every round's τ at every candidate is known from that one trace.
The engine's update (`ddtree_lab.auto_budget.auto_update_reference`: the credit, the confidence bins, the host's
read lag, the decay) then runs over those rounds pass after pass, each round priced at its candidate's GPU cost
per round. The text stays the same whatever the rule picks, so the gap to the best fixed budget is the rule's
own. The rounds are the traced ones, each credited with what its chosen candidate would have accepted: a
per-round estimate of tokens/s (a smaller tree would have taken more, shorter rounds over the same text).
`tools/auto_priced.py` runs the real decoding instead (slower: every budget and every pass decodes).

    python tools/auto_replay.py --pair smollm2 --prompts smollm2:all --n-prompts 12 --max-new-tokens 128 \
        --costs-from docs/bench/prompts_smollm2_all_auto.json --passes 6
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ddtree_lab as dl
from ddtree_lab.auto_budget import AutoState, auto_update_reference, source_round
from ddtree_lab.prompts import read_prompt_set

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: the sibling tool's reader
from auto_priced import gpu_costs, priced_args  # noqa: E402


def traced_rounds(pair, prompts, budget: int, max_new_tokens: int) -> list[list[tuple]]:
    """Per prompt, per round: (accepted node indices, the tree's scores), at `budget`."""
    calls = []
    for p in prompts:
        res = dl.generate(pair, p, budget=budget, max_new_tokens=max_new_tokens, trace=True, stop=[])
        calls.append([(list(r.accepted), r.tree.scores.float().clone()) for r in res.rounds])
    return calls


def tau_at(accepted: list[int], budget: int) -> int:
    """τ of the round had its tree been the first `budget` nodes: the bonus token plus the accepted prefix."""
    return 1 + sum(1 for node in accepted[1:] if node <= budget)


def replay(calls, auto: dl.AutoBudget, L: int, lag: int, passes: int) -> list[dict]:
    max_rounds = max(len(c) for c in calls) + 1
    state = AutoState(auto, L, max_rounds, "cpu")
    state.timing["capture"] = list(auto.costs)  # given costs: nothing is timed
    out = []
    for _ in range(passes):
        tokens, seconds, share = 0, 0.0, {}
        for rounds in calls:
            first = state.start(lag, 1)
            for r, (accepted, scores) in enumerate(rounds):
                src = source_round(r, lag, 1)
                j = int(state.proposals[1 + src]) if src >= 0 else first
                path = torch.full((L + 2,), 0, dtype=torch.long)
                path[:len(accepted)] = torch.tensor(accepted)
                a = torch.tensor([len(accepted)])
                # the round ran at candidate j: its τ is what the first budgets[j] nodes accept
                a_j = tau_at(accepted, auto.budgets[j])
                auto_update_reference(path, torch.tensor([a_j]), scores, j, state.budgets, state.costs,
                                      state.edges, state.table_sum, state.table_count, state.totals,
                                      state.bin_ring, state.proposals, torch.tensor([r + 1]), state.schedule,
                                      min(auto.budgets[0], scores.shape[0]), auto.explore, auto.weight,
                                      state.decay, state.max_tau)
                tokens += a_j
                seconds += auto.costs[j]
                share[auto.budgets[j]] = share.get(auto.budgets[j], 0) + 1
            state.finish(int(state.proposals[0]))
        out.append({"tokens_per_second": tokens / seconds, "rounds": share})
    return out


def main() -> None:
    ap = priced_args(__doc__.splitlines()[0], passes=6)
    ap.add_argument("--lag", type=int, default=1, help="host reads in flight (the GPU's default: 1)")
    args = ap.parse_args()
    costs = gpu_costs(args.costs_from)
    budgets = tuple(sorted(costs))
    pair = dl.load_pair(args.pair)
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    calls = traced_rounds(pair, prompts, budgets[-1], args.max_new_tokens)
    fixed = {b: sum(tau_at(acc, b) for c in calls for acc, _ in c) / (sum(len(c) for c in calls) * costs[b])
             for b in budgets}
    best = max(fixed, key=fixed.get)
    print("fixed, tokens/s at the GPU's costs:", {b: round(v) for b, v in fixed.items()}, "best", best)
    auto = dl.AutoBudget(budgets=budgets, costs=tuple(costs[b] for b in budgets))
    passes = replay(calls, auto, pair.drafter.cfg.block_size - 1, args.lag, args.passes)
    for i, p in enumerate(passes):
        p["vs_best_fixed"] = p["tokens_per_second"] / fixed[best]
        print(f"pass {i}: {p['tokens_per_second']:.0f} tokens/s, {p['vs_best_fixed']:.4f} of budget {best}; "
              f"rounds {p['rounds']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"pair": args.pair, "prompts": args.prompts, "costs_from": args.costs_from, "costs": costs,
                       "fixed": fixed, "best": best, "auto": passes}, f, indent=1)


if __name__ == "__main__":
    main()
