"""What budget="auto" costs beyond the rounds it runs, on a GPU: a fixed budget against auto over that one
budget (the same rounds plus the choice's update and reads), over it and a larger one priced out (the same
rounds again, a larger cache and a second candidate's graphs), over it and one more priced equal (so it runs the
larger, through a shared state), and over a wide set (learning). Each candidate's graphs keep a memory pool of
their own; with --pools each auto run also runs with one pool for all its candidates (they never run at once),
the arrangement 85f45d8 tried and 1d80cb8's file measured. Same prompts, interleaved repeats
(each in an order rotated by one, as `bench prompts` runs them).

    python tools/auto_overhead.py --pair lab --prompts lab:code --n-prompts 32 --budget 32 --attention invariant \
        --pools --repeats 6 --out auto_overhead.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import ddtree_lab as dl
from ddtree_lab import decode, graphs
from ddtree_lab.bench.e2e import grow_caches, repeat_order
from ddtree_lab.runtime import check_runtime
from ddtree_lab.environment import environment
from ddtree_lab.prompts import read_prompt_set


class OnePoolRunner(graphs.GraphRunner):
    """A runner whose graphs go into the pool of the first runner captured for the same auto state."""

    pools: dict = {}

    def capture(self) -> None:
        key = id(self.program.auto)
        self.pool = self.pools.get(key)
        super().capture()
        self.pools[key] = self.pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="lab")
    ap.add_argument("--prompts", default="lab:code")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (no graphs, no pools)")
    ap.add_argument("--pools", action="store_true", help="also run each auto with one memory pool for its candidates")
    ap.add_argument("--out", default="auto_overhead.json")
    args = ap.parse_args()
    try:
        check_runtime(args.device, args.attention)  # the CLI's refusal, in one line
    except ValueError as err:
        raise SystemExit(f"auto_overhead: {err}") from None
    pair = dl.load_pair(args.pair, device=args.device, dtype=args.dtype, attention=args.attention,
                       compile=args.device == "cuda")
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    b = args.budget
    autos = {f"auto over ({b},)": dl.AutoBudget(budgets=(b,)),
             f"auto over ({b}, {8 * b}), {8 * b} priced out": dl.AutoBudget(budgets=(b, 8 * b), costs=(1e-4, 1.0)),
             f"auto over ({b}, {2 * b}), {2 * b} priced out": dl.AutoBudget(budgets=(b, 2 * b), costs=(1e-4, 1.0)),
             f"auto over ({b // 2}, {b}) priced equal": dl.AutoBudget(budgets=(b // 2, b), costs=(1e-3, 1e-3)),
             "auto over 16..256": dl.AutoBudget(budgets=(16, 32, 64, 128, 256))}
    runs = {f"fixed {b}": (b, None), f"fixed {2 * b}": (2 * b, None)}
    for name, auto in autos.items():
        runs[name] = (auto, "a pool each")
        if args.pools:
            runs[name + ", one pool"] = (auto, "one pool")
    kept = {"one pool": {}, "a pool each": {}}  # each way's captured programs, swapped in before its calls
    runner_of = {"a pool each": decode.GraphRunner, "one pool": OnePoolRunner}

    def call(name, prompt):
        budget, pools = runs[name]
        if pools is not None:
            decode.GraphRunner = runner_of[pools]
            pair.__dict__["_auto_programs"] = kept[pools]
        return dl.generate(pair, prompt, budget=budget, max_new_tokens=args.max_new_tokens, trace=False, stop=[])

    grow_caches(pair, prompts, [budget for budget, _ in runs.values()], args.max_new_tokens)
    for p in prompts:  # every prompt length once: a compiled model specialises on shapes
        dl.generate(pair, p, method="ar", max_new_tokens=2, trace=False, stop=[])
    for name in runs:  # untimed: compile, capture, a first pass of learning
        for p in prompts:
            call(name, p)
    out = {name: {"tokens_per_second_per_repeat": [], "us_per_round_per_repeat": []} for name in runs}
    reference = {}
    names = list(runs)
    for rep in range(args.repeats):
        for name in (names[i] for i in repeat_order(len(names), rep)):
            tokens = rounds = alike = 0
            seconds, stages, share = 0.0, {}, {}
            for i, p in enumerate(prompts):
                r = call(name, p)
                tokens, seconds, rounds = tokens + len(r.tokens), seconds + r.wall_seconds, rounds + len(r.acceptance_lengths)
                for s, v in r.stage_seconds.items():
                    stages[s] = stages.get(s, 0.0) + v
                for x in r.round_budgets:
                    share[x] = share.get(x, 0) + 1
                alike += r.tokens == reference.setdefault(i, r.tokens)
            row = out[name]
            row["tokens_per_second_per_repeat"].append(tokens / seconds)
            row["us_per_round_per_repeat"].append(seconds / rounds * 1e6)
            row.update(tokens_per_round=tokens / rounds, budget_rounds=share, prompts_alike_first_run=alike,
                       stage_us_per_round={s: v / rounds * 1e6 for s, v in stages.items()})
    base = out[f"fixed {b}"]["tokens_per_second_per_repeat"]
    for name, row in out.items():
        row["tokens_per_second"] = statistics.median(row["tokens_per_second_per_repeat"])
        row["vs_fixed_per_repeat"] = [x / y for x, y in zip(row["tokens_per_second_per_repeat"], base)]
        row["vs_fixed"] = statistics.median(row["vs_fixed_per_repeat"])
        print(f"{name:44s} {row['tokens_per_second']:8.0f} tok/s  ÷ fixed {b}: {row['vs_fixed']:.4f}  "
              f"{row['tokens_per_round']:.3f} tokens/round  {row['prompts_alike_first_run']} alike  "
              f"{row['budget_rounds']}")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python tools/auto_overhead.py", *sys.argv[1:]]),
                   "environment": environment(), "pair": args.pair, "prompts": args.prompts, "n_prompts": args.n_prompts,
                   "attention": args.attention, "dtype": args.dtype, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
