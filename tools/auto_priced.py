"""budget="auto" against fixed budgets on the same text, priced with a GPU's per-round costs.

On the CPU in float32 every budget emits the target's own tokens, so each budget's τ comes from the same
text (bf16 numerics on a GPU can send budgets down different text, docs/performance.md). Each round is priced
at its budget's cost per round as measured on the GPU (`bench prompts`: wall seconds / rounds), so
tokens/s = Σ τ / Σ cost for the fixed budgets and for auto, which is given those costs. A projection of the
choice's quality on that GPU, not a GPU timing.

    python tools/auto_priced.py --pair lab --prompts lab:code --n-prompts 8 --max-new-tokens 96 \
        --costs-from docs/bench/prompts_lab_code_auto.json --passes 3
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

import ddtree_lab as dl
from ddtree_lab.atomic import atomic_write_json
from ddtree_lab.prompts import read_prompt_set


def gpu_costs(path: str) -> dict[int, float]:
    """Seconds per round of each fixed DDTree budget of a `bench prompts` JSON (median repeat); a file that is
    not one is refused with a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)["rows"]
        out = {r["budget"]: r["seconds"] / (r["tokens"] / r["mean_tau"]) for r in rows
               if r["method"] == "ddtree" and isinstance(r["budget"], int)}
    except OSError as e:
        raise ValueError(f"--costs-from {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        raise ValueError(f"--costs-from {path}: not a `ddtree-lab bench prompts` JSON") from None
    if not out:
        raise ValueError(f"--costs-from {path}: no fixed DDTree budget in its rows")
    return out


def costs_or_exit(ap: argparse.ArgumentParser, path: str) -> dict[int, float]:
    """gpu_costs, a bad file refused in one line by the tool's parser."""
    try:
        return gpu_costs(path)
    except ValueError as e:
        ap.error(str(e))


def command_line(tool: str) -> str:
    """How this run was started, for its JSON."""
    return shlex.join(["python", f"tools/{tool}", *sys.argv[1:]])


def priced_args(description: str, passes: int) -> argparse.ArgumentParser:
    """The options of a tool that prices auto's rounds at a GPU's costs (this one and auto_replay.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--pair", default="lab")
    ap.add_argument("--prompts", default="lab:code")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--costs-from", required=True, help="a bench prompts JSON measured on the GPU")
    ap.add_argument("--passes", type=int, default=passes, help="auto's passes over the prompts (it learns across them)")
    ap.add_argument("--out", default=None)
    return ap


def main() -> None:
    ap = priced_args(__doc__.splitlines()[0], passes=3)
    args = ap.parse_args()
    costs = costs_or_exit(ap, args.costs_from)
    pair = dl.load_pair(args.pair)
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    kw = dict(max_new_tokens=args.max_new_tokens, trace=False, stop=[])
    fixed = {}
    for b in sorted(costs):
        taus = [t for p in prompts for t in dl.generate(pair, p, budget=b, **kw).acceptance_lengths]
        fixed[b] = sum(taus) / (len(taus) * costs[b])
    best = max(fixed, key=fixed.get)
    print("fixed, tokens/s at the GPU's costs:", {b: round(v) for b, v in fixed.items()}, "best", best)
    auto = dl.AutoBudget(budgets=tuple(sorted(costs)), costs=tuple(costs[b] for b in sorted(costs)))
    passes = []
    for i in range(args.passes):
        tau = cost = 0.0
        share: dict[int, int] = {}
        for p in prompts:
            r = dl.generate(pair, p, budget=auto, **kw)
            tau += sum(r.acceptance_lengths)
            cost += sum(costs[b] for b in r.round_budgets)
            for b in r.round_budgets:
                share[b] = share.get(b, 0) + 1
        passes.append({"tokens_per_second": tau / cost, "vs_best_fixed": tau / cost / fixed[best], "rounds": share})
        print(f"auto pass {i}: {tau / cost:.0f} tokens/s, {tau / cost / fixed[best]:.3f} of budget {best}; rounds {share}")
    if args.out:
        atomic_write_json(args.out, {"command": command_line("auto_priced.py"), "pair": args.pair,
                                     "prompts": args.prompts, "costs_from": args.costs_from, "costs": costs,
                                     "fixed": fixed, "best": best, "auto": passes})


if __name__ == "__main__":
    main()
