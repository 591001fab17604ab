"""budget="auto"'s own rule replayed over one text: its choices and tokens/s, free of bf16 text divergence.

Each prompt is traced once on the CPU in float32 at the largest candidate. A tree of budget b is the first b
nodes of any larger tree (tree.py's order), so every round's τ at every candidate is known from that one trace.
`advisor.replay_auto` then runs the engine's update (`ddtree_lab.auto_budget.auto_update_reference`: the
credit, the confidence bins, the host's read lag, the decay) over those rounds pass after pass, each round
priced at its candidate's GPU cost per round. The text stays the same whatever the rule picks, so the gap to
the best fixed budget is the rule's own. The rounds are the traced ones, each credited with what its chosen
candidate would have accepted: a per-round estimate of tokens/s (a smaller tree would have taken more,
shorter rounds over the same text). `tools/auto_priced.py` runs the real decoding instead (slower: every
budget and every pass decodes).

    python tools/auto_replay.py --pair smollm2 --prompts smollm2:all --n-prompts 12 --max-new-tokens 128 \\
        --costs-from docs/bench/prompts_smollm2_all_auto.json --passes 6

`--explore` and `--memory` take several values: the rule's settings replayed on the one trace, each pair in turn.
The output's `ceiling` (`advisor.auto_ceiling`) is what any choice could reach on the same rounds: each round at
its best budget in hindsight, and one budget per confidence bin, at the host's read lag and without it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import ddtree_lab as dl
from ddtree_lab.atomic import atomic_write_json
from ddtree_lab.prompts import read_prompt_set
from ddtree_lab.workbench import advisor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package: the sibling tool's reader
from auto_priced import command_line, costs_or_exit, priced_args  # noqa: E402


def traced_rows(pair, prompts, budget: int, max_new_tokens: int) -> list[dict]:
    """Every round of every prompt at `budget`, as a study's trace rows."""
    rows = []
    for i, p in enumerate(prompts):
        res = dl.generate(pair, p, budget=budget, max_new_tokens=max_new_tokens, trace=True, stop=[])
        rows += [{**r.to_json(), "prompt_id": f"p{i}"} for r in res.rounds]
    return rows


def main() -> None:
    ap = priced_args(__doc__.splitlines()[0], passes=6)
    ap.add_argument("--lag", type=int, default=1, help="host reads in flight (the GPU's default: 1)")
    ap.add_argument("--explore", type=float, nargs="+", default=[None],
                    help="AutoBudget.explore values to replay on the same trace (default: the rule's own)")
    ap.add_argument("--memory", type=int, nargs="+", default=[None],
                    help="AutoBudget.memory values to replay on the same trace (default: the rule's own)")
    args = ap.parse_args()
    costs = costs_or_exit(ap, args.costs_from)
    grid = [{k: v for k, v in (("explore", e), ("memory", m)) if v is not None}
            for e in args.explore for m in args.memory]
    for settings in grid:  # refused before the trace is taken
        try:
            dl.AutoBudget(budgets=tuple(sorted(costs)), **settings)
        except ValueError as e:
            ap.error(str(e))
    pair = dl.load_pair(args.pair)
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    rows = traced_rows(pair, prompts, max(costs), args.max_new_tokens)
    runs = []
    for settings in grid:
        rep = advisor.replay_auto(rows, costs, passes=args.passes, lag=args.lag, settings=settings)
        best = rep["best_fixed"]
        if settings:
            print("settings:", settings)
        print("fixed, tokens/s at the GPU's costs:", {b: round(v) for b, v in rep["fixed_tokens_per_second"].items()},
              "best", best)
        for i, ratio in enumerate(rep["passes_vs_best_fixed"]):
            tps = ratio * rep["fixed_tokens_per_second"][best]
            print(f"pass {i}: {tps:.0f} tokens/s, {ratio:.4f} of budget {best}")
        print("last pass's rounds:", {b: f"{100 * v:.0f} %" for b, v in rep["budget_share"].items()})
        runs.append({"settings": settings, **rep})
    ceiling = advisor.auto_ceiling(rows, costs, lag=args.lag)
    print(f"ceiling on these rounds, ÷ budget {ceiling['best_fixed']}: each round's best budget "
          f"{ceiling['per_round']:.4f}; one per confidence bin at the read lag {ceiling['per_bin']:.4f} "
          f"({ceiling['per_bin_choice']}), on the round's own confidence {ceiling['same_round']:.4f}")
    if args.out:
        head = {"command": command_line("auto_replay.py"), "pair": args.pair, "prompts": args.prompts,
                "costs_from": args.costs_from, "costs": costs, "lag": args.lag, "ceiling": ceiling}
        atomic_write_json(args.out, {**head, **runs[0]} if len(runs) == 1 and not runs[0]["settings"] else
                          {**head, "runs": runs})


if __name__ == "__main__":
    main()
