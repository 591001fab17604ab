"""What budget="auto" costs beyond the rounds it runs, on a GPU: a fixed budget against auto over that one
budget (the same rounds plus the choice's kernel and reads), over it and one more priced equal (so it runs the
larger, through a shared state), and over a wide set (learning). Same prompts, interleaved repeats.

    python tools/auto_overhead.py --pair lab --prompts lab:code --n-prompts 8 --budget 64 --out auto_overhead.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import ddtree_lab as dl
from ddtree_lab.environment import environment
from ddtree_lab.prompts import read_prompt_set


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="lab")
    ap.add_argument("--prompts", default="lab:code")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="auto_overhead.json")
    args = ap.parse_args()
    pair = dl.load_pair(args.pair, device="cuda", dtype="bfloat16", attention="triton", compile=True)
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    b = args.budget
    runs = {f"fixed {b}": b, f"auto over ({b},)": dl.AutoBudget(budgets=(b,)),
            f"auto over ({b // 2}, {b}) priced equal": dl.AutoBudget(budgets=(b // 2, b), costs=(1e-3, 1e-3)),
            "auto over 16..256": dl.AutoBudget(budgets=(16, 32, 64, 128, 256))}
    out = {name: {"tokens_per_second_per_repeat": []} for name in runs}
    for budget in runs.values():  # untimed: compile, capture, a first pass of learning
        for p in prompts:
            dl.generate(pair, p, budget=budget, max_new_tokens=args.max_new_tokens, trace=False, stop=[])
    for _ in range(args.repeats):
        for name, budget in runs.items():
            tokens = rounds = 0
            seconds, stages, share = 0.0, {}, {}
            for p in prompts:
                r = dl.generate(pair, p, budget=budget, max_new_tokens=args.max_new_tokens, trace=False, stop=[])
                tokens, seconds, rounds = tokens + len(r.tokens), seconds + r.wall_seconds, rounds + len(r.acceptance_lengths)
                for s, v in r.stage_seconds.items():
                    stages[s] = stages.get(s, 0.0) + v
                for x in r.round_budgets:
                    share[x] = share.get(x, 0) + 1
            row = out[name]
            row["tokens_per_second_per_repeat"].append(tokens / seconds)
            row.update(tokens_per_round=tokens / rounds, budget_rounds=share,
                       stage_us_per_round={s: v / rounds * 1e6 for s, v in stages.items()})
    for name, row in out.items():
        row["tokens_per_second"] = statistics.median(row["tokens_per_second_per_repeat"])
        print(f"{name:32s} {row['tokens_per_second']:8.0f} tok/s  {row['tokens_per_round']:.2f} tokens/round  "
              f"{row['budget_rounds']}")
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "pair": args.pair, "prompts": args.prompts, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
