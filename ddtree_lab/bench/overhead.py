"""What budget="auto" and the MoE telemetry cost beyond the rounds they run (`ddtree-lab bench auto-overhead`,
`auto-rounds`, `moe-counting`), timed on the passes of `e2e.timed_passes`.

  auto-overhead  a fixed budget B against auto over B alone (the same rounds plus the choice's update and
                 reads), over B and a larger budget priced out (the same rounds again, a larger cache and a second
                 candidate's graphs), over B/2 and B priced equal (it runs B, through a shared state), and over a
                 wide set (learning); with `pools`, each auto also with one memory pool for all its candidates
                 (options.candidate_pools)
  auto-rounds    each round's stage times (the events between the stages) for fixed budgets and for auto, grouped
                 by the budget the round ran at, as medians over every round of every repeat, and the programs
                 captured in timed passes (each one a program made again, whose first replays run cold): a call's
                 total hides a difference of a few microseconds a round under the spread between passes, medians
                 over thousands of rounds do not
  moe-counting   what a traced round's read of the MoE blocks' expert counts costs, against the round's time
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from ..auto_budget import AutoBudget
from ..checkpoint import Pair
from ..names import MAX_BUDGET, STAGES
from .e2e import Pass, Run, median_repeat, random_prompt, timed_passes


def check_budget_span(budget: int, largest: int, bench: str) -> None:
    """A bench over B/2 … largest·B refuses a B whose runs would leave 1..MAX_BUDGET, naming --budget."""
    if not 2 <= budget <= MAX_BUDGET // largest:
        raise ValueError(f"--budget {budget}: bench {bench} also runs {budget // 2} and {largest * budget}; give "
                         f"2..{MAX_BUDGET // largest}")


def overhead_runs(b: int, pools: bool) -> list[Run]:
    """Fixed B and 2B, then the autos (each also with one pool for its candidates when `pools`)."""
    autos = {f"auto over ({b},)": AutoBudget(budgets=(b,)),
             f"auto over ({b}, {8 * b}), {8 * b} priced out": AutoBudget(budgets=(b, 8 * b), costs=(1e-4, 1.0)),
             f"auto over ({b}, {2 * b}), {2 * b} priced out": AutoBudget(budgets=(b, 2 * b), costs=(1e-4, 1.0)),
             f"auto over ({b // 2}, {b}) priced equal": AutoBudget(budgets=(b // 2, b), costs=(1e-3, 1e-3)),
             "auto over 16..256": AutoBudget(budgets=(16, 32, 64, 128, 256))}
    runs = [Run(f"fixed {b}", budget=b), Run(f"fixed {2 * b}", budget=2 * b)]
    for name, auto in autos.items():
        runs.append(Run(name, budget=auto))
        if pools:
            runs.append(Run(f"{name}, one pool", budget=auto, options=(("candidate_pools", "shared"),)))
    return runs


def auto_overhead(pair: Pair, prompts: list, budget: int = 64, max_new_tokens: int = 96, repeats: int = 3,
                  pools: bool = False, cuda_graphs: bool | None = None, progress: bool = True) -> dict:
    """Per run: tokens/s and µs per round of each repeat, and ÷ fixed B repeat by repeat (repeats paired); the
    last repeat's tokens per round, rounds per budget, stage µs per round, and its prompts whose tokens equal
    fixed B's first timed pass."""
    check_budget_span(budget, 8, "auto-overhead")
    runs = overhead_runs(budget, pools)
    passes, orders = timed_passes(pair, prompts, runs, repeats, max_new_tokens, cuda_graphs)
    reference = [r.tokens for r in passes[0][0].results]  # fixed B runs first in the first repeat
    base, _, _ = median_repeat(passes[0])
    out = {}
    for run, run_passes in zip(runs, passes):
        per_repeat, median, _ = median_repeat(run_passes)
        last = run_passes[-1]
        vs_fixed = [x / y for x, y in zip(per_repeat, base)]
        out[run.name] = row = {
            "tokens_per_second_per_repeat": per_repeat,
            "us_per_round_per_repeat": [p.seconds / p.rounds * 1e6 for p in run_passes],
            "tokens_per_round": last.tokens / last.rounds, "budget_rounds": rounds_per_budget(last),
            "prompts_alike_first_run": sum(r.tokens == ref for r, ref in zip(last.results, reference)),
            "stage_us_per_round": {s: v / last.rounds * 1e6 for s, v in last.stage_seconds.items()},
            "tokens_per_second": median, "vs_fixed_per_repeat": vs_fixed, "vs_fixed": statistics.median(vs_fixed)}
        if progress:
            print(f"{run.name:44s} {median:8.0f} tok/s  ÷ fixed {budget}: {row['vs_fixed']:.4f}  "
                  f"{row['tokens_per_round']:.3f} tokens/round  {row['prompts_alike_first_run']} alike  "
                  f"{row['budget_rounds']}", file=sys.stderr, flush=True)
    return {"budget": budget, "runs": out, "order_per_repeat": [[runs[i].name for i in o] for o in orders]}


def rounds_per_budget(one_pass: Pass) -> dict[int, int]:
    """How many of a pass's rounds ran at each budget."""
    share: dict[int, int] = {}
    for b in (b for r in one_pass.results for b in r.round_budgets):
        share[b] = share.get(b, 0) + 1
    return share


def rounds_runs(b: int) -> list[Run]:
    """Fixed B, 2B and B/2; auto over the three, over B alone, and over B and 2B with 2B priced out."""
    return [Run(f"fixed {b}", budget=b), Run(f"fixed {2 * b}", budget=2 * b), Run(f"fixed {b // 2}", budget=b // 2),
            Run(f"auto over ({b // 2}, {b}, {2 * b})", budget=AutoBudget(budgets=(b // 2, b, 2 * b))),
            Run(f"auto over ({b},)", budget=AutoBudget(budgets=(b,))),
            Run(f"auto over ({b}, {2 * b}), {2 * b} priced out",
                budget=AutoBudget(budgets=(b, 2 * b), costs=(1e-4, 1.0)))]


def auto_rounds(pair: Pair, prompts: list, budget: int = 32, max_new_tokens: int = 96, repeats: int = 4,
                cuda_graphs: bool | None = None, progress: bool = True) -> dict:
    """Per run and per budget its rounds ran at: the rounds, each stage's median µs and the median of the four
    stages' sum (a call's first round, which holds its start-up, left out); the captures in its timed passes."""
    check_budget_span(budget, 2, "auto-rounds")
    runs = rounds_runs(budget)
    passes, orders = timed_passes(pair, prompts, runs, repeats, max_new_tokens, cuda_graphs, round_times=True)
    out = {}
    for run, run_passes in zip(runs, passes):
        by_budget: dict[int, list[dict]] = {}
        for res in (r for p in run_passes for r in p.results):
            budgets = res.round_budgets or [run.budget] * len(res.acceptance_lengths)
            for k in range(1, len(res.acceptance_lengths)):
                by_budget.setdefault(budgets[k], []).append(res.round_stage_seconds[k])
        out[run.name] = row = {
            "captures_in_timed_passes": sum(p.captures["round"] for p in run_passes),
            "prefill_captures_in_timed_passes": sum(p.captures["prefill"] for p in run_passes),
            "by_budget": {b: {"rounds": len(rounds),
                              "us_median": {s: statistics.median(r[s] for r in rounds) * 1e6 for s in STAGES},
                              "us_median_of_the_four_stages": statistics.median(
                                  sum(r[s] for s in STAGES if s != "other") for r in rounds) * 1e6}
                          for b, rounds in sorted(by_budget.items())}}
        if progress:
            print(f"{run.name:40s} captures in timed passes {row['captures_in_timed_passes']:3d}  " + "  ".join(
                f"{b}: {v['rounds']} rounds, {v['us_median_of_the_four_stages']:.1f} µs"
                for b, v in row["by_budget"].items()), file=sys.stderr, flush=True)
    return {"budget": budget, "runs": out, "order_per_repeat": [[runs[i].name for i in o] for o in orders]}


def seconds_per_routing_read(pair: Pair, reads: int) -> float:
    """One read of every MoE block's expert counts (what a traced round adds), timed over `reads` reads."""
    if pair.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reads):
        pair.target.expert_routing()
    return (time.perf_counter() - start) / reads


def moe_counting(pair: Pair, budget: int = 64, prompt_len: int = 512, max_new_tokens: int = 48, repeats: int = 3,
                 reads: int = 50, progress: bool = True) -> dict:
    """Per repeat: a traced DDTree round's time (its stages), one read of the expert counts, and their ratio."""
    if not pair.target.cfg.is_moe:
        raise ValueError("bench moe-counting: this target has no MoE layer to read (try random:qwen3-30b-a3b)")
    passes, _ = timed_passes(pair, [random_prompt(pair, prompt_len)], [Run(f"ddtree {budget}", budget=budget)],
                             repeats, max_new_tokens, trace=True)
    rows = []
    for one_pass in passes[0]:
        round_s = sum(v for k, v in one_pass.stage_seconds.items() if k != "other") / one_pass.rounds
        count_s = seconds_per_routing_read(pair, reads)
        rows.append({"round_ms": round_s * 1e3, "count_ms": count_s * 1e3, "share": count_s / round_s})
    median = statistics.median(r["share"] for r in rows)
    if progress:
        print(f"  a read of the expert counts: {median:.2%} of a traced round (median of {len(rows)})",
              file=sys.stderr, flush=True)
    return {"budget": budget, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "rows": rows,
            "median_share": median}
