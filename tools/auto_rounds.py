"""Where budget="auto"'s time goes, round by round: each round's stage times (the CUDA events between stages)
for fixed budgets and for auto, grouped by the budget the round ran at, as medians over every round of every
repeat (a call's first round, which holds its start-up, left out), and the graph captures made in timed passes
(each one is a round program made again: its first replays run cold). A call's total hides a difference of a
few microseconds a round under the spread between passes; medians over thousands of rounds do not.

    python tools/auto_rounds.py --pair lab --prompts lab:code --n-prompts 32 --budget 32 --repeats 6 \\
        --out auto_rounds.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import ddtree_lab as dl
from ddtree_lab import graphs, trace
from ddtree_lab.bench.e2e import grow_caches, repeat_order
from ddtree_lab.environment import environment
from ddtree_lab.prompts import read_prompt_set

STAGES = ("draft", "tree_build", "verify", "commit", "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="lab")
    ap.add_argument("--prompts", default="lab:code")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=32, help="B: fixed B/2, B, 2B, auto over them, over (B,) alone, "
                                                           "over (B, 2B) with 2B priced out")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--attention", default="invariant")
    ap.add_argument("--out", default="auto_rounds.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("auto_rounds: it times captured CUDA graph rounds, and no CUDA device is visible here")
    pair = dl.load_pair(args.pair, device="cuda", dtype="bfloat16", attention=args.attention, compile=True)
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    b = args.budget
    runs = {f"fixed {b}": b, f"fixed {2 * b}": 2 * b, f"fixed {b // 2}": b // 2,
            f"auto over ({b // 2}, {b}, {2 * b})": dl.AutoBudget(budgets=(b // 2, b, 2 * b)),
            f"auto over ({b},)": dl.AutoBudget(budgets=(b,)),
            f"auto over ({b}, {2 * b}), {2 * b} priced out": dl.AutoBudget(budgets=(b, 2 * b), costs=(1e-4, 1.0))}

    per_round = {}  # the last call's {round: {stage: seconds}}, as the clock resolved it
    resolve = trace.StageClock.resolve

    def keep(clock):
        totals, rounds = resolve(clock)
        per_round.update(rounds=rounds)
        return totals, rounds

    trace.StageClock.resolve = keep
    captures = [0]
    capture = graphs.GraphRunner.capture

    def counted(runner):
        captures[0] += 1
        capture(runner)

    graphs.GraphRunner.capture = counted

    def call(name, prompt):
        return dl.generate(pair, prompt, budget=runs[name], max_new_tokens=args.max_new_tokens, trace=False, stop=[])

    # untimed: the caches grown to the run's size, every shape compiled, every program captured, a pass of learning
    grow_caches(pair, prompts, list(runs.values()), args.max_new_tokens)
    for name in runs:
        for p in prompts:
            call(name, p)
    names = list(runs)
    rounds = {name: {} for name in names}
    timed_captures = {name: 0 for name in names}
    for rep in range(args.repeats):
        for name in (names[i] for i in repeat_order(len(names), rep)):
            before = captures[0]
            for p in prompts:
                res = call(name, p)
                budgets = res.round_budgets or [runs[name]] * len(res.acceptance_lengths)
                for k in range(1, len(res.acceptance_lengths)):
                    spent = per_round["rounds"].get(k, {})
                    rounds[name].setdefault(budgets[k], []).append([spent.get(s, 0.0) for s in STAGES])
            timed_captures[name] += captures[0] - before
    out = {}
    for name in names:
        out[name] = {"captures_in_timed_passes": timed_captures[name], "by_budget": {}}
        for budget, rows in sorted(rounds[name].items()):
            med = {s: statistics.median(r[i] for r in rows) * 1e6 for i, s in enumerate(STAGES)}
            out[name]["by_budget"][budget] = {"rounds": len(rows), "us_median": med,
                                              "us_median_of_the_four_stages": statistics.median(
                                                  sum(r[:4]) for r in rows) * 1e6}
        print(f"{name:40s} captures in timed passes {timed_captures[name]:3d}  " + "  ".join(
            f"{budget}: {v['rounds']} rounds, {v['us_median_of_the_four_stages']:.1f} µs"
            for budget, v in out[name]["by_budget"].items()), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python tools/auto_rounds.py", *sys.argv[1:]]), "environment": environment(),
                   "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
