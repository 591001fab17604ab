"""Two or more engine choices (options.py) timed side by side on one model in one process: `bench e2e`'s rows for
each choice, the choices alternating within every repeat (rotated, so none always runs first), and per method the
median round of each choice over the repeats with its ratio to the first choice's.

    python -m tools.e2e_ab --model random:qwen3-30b-a3b --budgets 8 64 --prompt-len 512 --rounds 16 --repeats 2 \\
        --choice declared_routing=torch --choice declared_routing=triton --out ab.json
    python -m tools.e2e_ab --model random:kimi-k2.6-ep8-rank --prompt-len 4096 --budgets 8 16 \\
        --choice moe_launch=SPLIT_K_UP:1 --choice moe_launch=SPLIT_K_UP:7 --out split.json

One process, one model: the weights, the GPU and its clocks are the same for every choice; graphs are keyed by
the options (graphs.py), so each choice captures and replays its own.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from ddtree_lab import options
from ddtree_lab.bench import write_bench_json
from ddtree_lab.bench.cli import parse_attn_config, parse_moe_config
from ddtree_lab.bench.e2e import bench_e2e, bench_model, repeat_order
from ddtree_lab.runtime import device_defaults


# a launch table's choice, "KEY:VALUE[;KEY:VALUE…]", read by the bench flag's own parser
LAUNCH_TABLES = {"attention_launch": parse_attn_config, "moe_launch": parse_moe_config}


def parse_choice(text: str) -> dict:
    """"name=value[,name=value…]" -> options.using keywords (a launch table: moe_launch=SPLIT_K_UP:1;BLOCK_N_DOWN:128);
    ValueError naming the part that is not one."""
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if not value or not hasattr(options.current(), name):
            raise ValueError(f"--choice {text!r}: want NAME=VALUE with NAME an engine option (options.py)")
        if name in LAUNCH_TABLES:
            out[name] = LAUNCH_TABLES[name]([item.replace(":", "=", 1) for item in value.split(";")])
        else:
            out[name] = None if value == "none" else value
    with options.using(**out):  # refused here, before a model is built
        pass
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-30b-a3b")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--choice", action="append", required=True, metavar="NAME=VALUE[,…]")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        choices = [parse_choice(c) for c in a.choice]
    except ValueError as e:
        ap.error(str(e))
    defaults = device_defaults(a.device)
    pair = bench_model(a.model, defaults["dtype"], defaults["attention"], a.device)
    runs = {c: [] for c in a.choice}
    for rep in range(a.repeats):
        for i in repeat_order(len(choices), rep):
            with options.using(**choices[i]):
                print(f"repeat {rep}: {a.choice[i]}", file=sys.stderr, flush=True)
                runs[a.choice[i]].append(bench_e2e(pair, budgets=a.budgets, prompt_len=a.prompt_len,
                                                   rounds=a.rounds)["rows"])
    summary = {}
    for c, reps in runs.items():
        for j, row in enumerate(reps[0]):
            label = row["method"] if row["budget"] is None else f"ddtree_{row['budget']}"
            summary.setdefault(label, {})[c] = statistics.median(r[j]["round_seconds"] for r in reps)
    first = a.choice[0]
    for label, by in summary.items():
        by["ratio_to_first"] = {c: by[c] / by[first] for c in a.choice}
        print(f"{label:12s} " + "  ".join(f"{c}: {by[c] * 1e3:8.3f} ms ({by['ratio_to_first'][c]:.3f})"
                                          for c in a.choice))
    rows = [{"run": label, **by} for label, by in summary.items()]
    write_bench_json(a.out, rows, "tools.e2e_ab", argv, model=a.model, budgets=a.budgets,
                     prompt_len=a.prompt_len, rounds=a.rounds, repeats=a.repeats, choices=a.choice, runs=runs)


if __name__ == "__main__":
    main()
