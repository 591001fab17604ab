"""`ddtree-lab bench`: its subcommands and flags; the flags that pick implementations set options.py."""
from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from .. import options
from ..atomic import atomic_write_json
from ..auto_budget import AutoBudget, auto_label_settings, is_auto_label
from ..decode import host_read_lag
from ..environment import environment
from ..names import AUTO, METHODS, budget_arg, int_in, non_negative_int, positive_int, tree_budget_arg
from ..pairs import load_pair
from ..prompts import read_prompt_set
from ..runtime import device_defaults
from . import MLA_CONTEXTS, MLA_HEADS, MLA_TREES
from .timing import device_copy_gbps
from .e2e import attach_census, attach_layer_census, bench_model, bench_prompts, profile_rounds, run_e2e
from .overhead import auto_overhead, auto_rounds, check_budget_span, moe_counting


def _add_routing_arg(p) -> None:
    from ..names import ROUTING_SPEC

    p.add_argument("--routing", default=None, type=_routing_arg, metavar="SPEC",
                   help=f"an MoE target's routing: {ROUTING_SPEC}; default: uniform for random shapes, the "
                        "checkpoint's router otherwise")


def _routing_arg(spec: str):
    """--routing's value as load_pair takes it (a trace:FILE is read now: a bad dump is refused before loading)."""
    import argparse

    from ..workbench.routing_replay import routing_model
    try:
        return routing_model(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_runtime_args(p) -> None:
    """How the models run: the same options for every end-to-end bench."""
    p.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bfloat16 on CUDA, float32 "
                                                 "on the CPU)")
    p.add_argument("--attention", default=None, help="verify attention: sdpa | triton | flex | invariant (default: "
                                                     "triton on CUDA, sdpa on the CPU)")
    p.add_argument("--compile", action="store_true", help="fuse per-layer elementwise work (torch.compile)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel processes for the target (e2e; run under "
                   "torchrun --nproc-per-node N)")
    p.add_argument("--compile-mode", choices=["default", "max-autotune-no-cudagraphs"], default="default",
                   help="with --compile: torch.compile's mode; max-autotune-no-cudagraphs times the compiler's own "
                        "matmul kernels against cuBLAS (compiling takes minutes)")
    _add_option_args(p)


def _add_option_args(p) -> None:
    """The engine's choices that a process can switch between runs (options.py): a bench's own flags, and what
    one of `bench e2e --variants` may change."""
    p.add_argument("--tree-kernels", choices=["auto", "torch", "triton"], default="auto",
                   help="who builds, masks and walks trees: auto (Triton on CUDA), torch, or triton")
    p.add_argument("--tree-build", choices=["auto", "sort", "count", "fused"], default="auto",
                   help="which tree build runs where it takes the beam (sort elsewhere): the torch sort, the "
                        "counting kernels or the one-launch kernel; auto: tree.build_tree's measured choice")
    p.add_argument("--tree-topk", choices=["auto", "torch", "triton"], default="auto",
                   help="the per-depth top-K over the vocabulary: torch (log_softmax, topk) or triton (one launch, "
                        "vocabularies up to kernels/vocab_topk.MAX_VOCAB); auto: torch")
    p.add_argument("--declared-routing", choices=["auto", "torch", "triton"], default="auto",
                   help="who computes a declared MoE routing (--routing uniform or trace:FILE): torch or triton "
                        "(one launch); auto: Triton where the tree kernels run")
    p.add_argument("--dense-products", choices=["auto", "torch", "skinny"], default="auto",
                   help="who multiplies a few rows (an AR step, a small tree) by a dense weight on CUDA: torch's "
                        "matmul or skinny (kernels/skinny_gemm.py, up to 16 rows; elsewhere torch's); auto: torch")
    p.add_argument("--host-read-lag", type=non_negative_int, default=None,
                   help="host reads in flight before it waits (default: 1 on CUDA, the next round stays queued; "
                        "0 elsewhere); 0 reads after each round")
    p.add_argument("--attn-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Triton attention launch choices for the whole run (kernels/tree_attention.py: "
                        "launch_config), e.g. min_chunk=128 waves=4 num_splits=8")
    p.add_argument("--moe-config", nargs="*", default=[], metavar="KEY=INT",
                   help="fused-MoE launch choices for every MoE block of the run (kernels/fused_moe.py: "
                        "launch_config), e.g. SPLIT_K_UP=1 BLOCK_N_DOWN=128")
    p.add_argument("--overlap-shared", action=argparse.BooleanOptionalAction, default=None,
                   help="an MoE layer's shared expert on a CUDA stream of its own, beside the routed experts "
                        "(DeepSeek-V3 targets; the default), or after them (--no-overlap-shared)")
    p.add_argument("--pdl", action="store_true",
                   help="launch the MoE block's and MLA's Triton kernels as programmatic dependents of the kernel "
                        "before each (Hopper and later; kernels/pdl.py)")


def add_bench_args(p) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    k = sub.add_parser("kernels", help="verify attention: triton vs sdpa (dense mask) vs flex")
    k.add_argument("--trees", type=tree_budget_arg, nargs="+", default=[16, 64, 256, 1024], help="tree sizes (budgets)")
    k.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 8192, 32768], help="past tokens in the cache")
    k.add_argument("--backends", nargs="+", choices=["triton", "sdpa", "flex"], default=["triton", "sdpa", "flex"],
                   help="backends timed side by side")
    k.add_argument("--out", default="outputs/bench/kernels.json", help="JSON written here")
    la = sub.add_parser("mla", help="MLA verify attention in the absorbed form (kernels/mla_attention.py): triton vs "
                                    "sdpa (dense mask, one KV head)")
    la.add_argument("--trees", type=positive_int, nargs="+", default=list(MLA_TREES),
                    help="verify sizes T (tree nodes with the root; 1 is an AR step)")
    la.add_argument("--contexts", type=positive_int, nargs="+", default=list(MLA_CONTEXTS),
                    help="past tokens in the cache")
    la.add_argument("--heads", type=positive_int, nargs="+", default=list(MLA_HEADS),
                    help="query heads on the GPU (Kimi K2: 64 on one, 8 on a TP8 rank)")
    la.add_argument("--latent", type=positive_int, default=512, help="latent values a cache row (kv_lora_rank)")
    la.add_argument("--rope", type=positive_int, default=64, help="RoPE key values a cache row (qk_rope_head_dim)")
    la.add_argument("--backends", nargs="+", choices=["triton", "sdpa"], default=["triton", "sdpa"],
                    help="backends timed side by side")
    la.add_argument("--out", default="outputs/bench/mla.json", help="JSON written here")
    e = sub.add_parser("e2e", help="end-to-end rounds: AR, DFlash, DDTree at several budgets")
    e.add_argument("--model", default="random:qwen3-8b",
                   help="random:<shape> (random:qwen3-8b, random:qwen3-30b-a3b, random:kimi-k2.6-ep8-rank, …; "
                        "@<layers> another depth, ~<sets> every layer on <sets> layers' weights) | a pair name | a "
                        "dir holding target/ and drafter/")
    e.add_argument("--budgets", type=tree_budget_arg, nargs="+", default=[16, 64, 256, 1024], help="DDTree budgets")
    e.add_argument("--prompt-len", type=positive_int, default=512, help="random prompt tokens")
    e.add_argument("--rounds", type=int_in(2, what="--rounds"), default=24,
                   help="new tokens per method, at least 2 (the prompt's forward gives the first, the rounds the rest)")
    e.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods timed (a long-context run in pieces: the ratios to AR need ar among them)")
    _add_routing_arg(e)
    _add_runtime_args(e)
    e.add_argument("--variants", type=variant_arg, nargs="+", default=[], metavar="'FLAGS'",
                   help="also time each run under these engine choices, one quoted set of this bench's option flags "
                        "each, without their dashes (e.g. pdl 'moe-config LAST_SPLIT_SUMS=1'), on the same model in "
                        "the same process, the variants taking turns in rotated order each repeat; rows: the run's "
                        "own choices")
    e.add_argument("--repeats", type=positive_int, default=1,
                   help="timed runs of each method (and variant), the median kept (default 1)")
    e.add_argument("--out", default="outputs/bench/e2e.json", help="JSON written here")
    r = sub.add_parser("prompts", help="tokens/s and speedup on a pair's shipped prompts")
    _add_prompt_set_args(r, repeats=3)
    r.add_argument("--budgets", type=bench_budget_arg, nargs="+", default=[16, 32, 64, 128, 256],
                   help="DDTree budgets; 'auto' adds budget='auto' choosing among the others, and "
                        "'auto:memory=8192,explore=0.5' another auto with those settings, side by side")
    _add_runtime_args(r)
    r.add_argument("--out", default="outputs/bench/prompts.json", help="JSON written here")
    f = sub.add_parser("profile", help="kernels and GPU time per stage of eager rounds (torch.profiler)")
    f.add_argument("--model", default="random:qwen3-8b", help="as for e2e")
    f.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods profiled")
    f.add_argument("--budgets", type=tree_budget_arg, nargs="+", default=[64], help="DDTree budgets")
    f.add_argument("--prompt-len", type=positive_int, default=512, help="random prompt tokens")
    f.add_argument("--rounds", type=positive_int, default=8, help="rounds profiled per method")
    _add_routing_arg(f)
    _add_runtime_args(f)
    f.add_argument("--out", default="outputs/bench/profile.json", help="JSON written here")
    o = sub.add_parser("auto-overhead", help="what budget='auto' costs beyond its rounds: fixed B against autos "
                                             "over B (bench/overhead.py)")
    _add_prompt_set_args(o, repeats=3)
    o.add_argument("--budget", type=tree_budget_arg, default=64,
                   help="B: fixed B and 2B; auto over (B,), over (B, 8B) and (B, 2B) with the larger priced out, over "
                        "(B/2, B) priced equal, and over 16..256")
    o.add_argument("--pools", action="store_true",
                   help="also run each auto with one memory pool for all its candidates' graphs")
    _add_runtime_args(o)
    o.add_argument("--out", default="outputs/bench/auto_overhead.json", help="JSON written here")
    a = sub.add_parser("auto-rounds", help="per-round stage times of fixed budgets and auto, by the budget each "
                                           "round ran at, and the captures in timed passes (bench/overhead.py)")
    _add_prompt_set_args(a, repeats=4)
    a.add_argument("--budget", type=tree_budget_arg, default=32,
                   help="B: fixed B/2, B and 2B; auto over the three, over (B,), over (B, 2B) with 2B priced out")
    _add_runtime_args(a)
    a.add_argument("--out", default="outputs/bench/auto_rounds.json", help="JSON written here")
    c = sub.add_parser("census", help="kernels and activation bytes one eager round launches, per stage and op, "
                                      "counted on the CPU without a GPU (bench/census.py)")
    c.add_argument("--model", default="random:qwen3-8b",
                   help="random:<shape>[@<layers>], a pair name or a dir holding target/ and drafter/ (config.json "
                        "only: no weights are read)")
    c.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods counted")
    c.add_argument("--budgets", type=tree_budget_arg, nargs="+", default=[16, 64, 256, 1024], help="DDTree budgets")
    c.add_argument("--prompt-len", type=positive_int, default=512, help="committed tokens before the round")
    c.add_argument("--attention", choices=["triton", "sdpa"], default="triton", help="the attention backend")
    c.add_argument("--declared-routing", choices=["auto", "torch", "triton"], default="auto",
                   help="who computes a declared MoE routing (auto: Triton, as on a GPU)")
    _add_routing_arg(c)
    c.add_argument("--out", default="outputs/bench/census.json", help="JSON written here")
    c.add_argument("--annotate", nargs="+", default=None, metavar="E2E_JSON",
                   help="instead: count each row of these bench e2e JSONs (eager layers) under the file's own "
                        "settings and write the counts into its rows (`census`), or for compiled layers of a random "
                        "shape a layer's kernels (`layer_census`), which the advisor then prices")
    c.set_defaults(device="meta", dtype="bfloat16")  # shapes only: a GPU's kernels, counted on any machine
    m = sub.add_parser("moe-counting", help="what a traced round's read of the MoE expert counts costs, against the "
                                            "round (bench/overhead.py)")
    m.add_argument("--model", default="random:qwen3-30b-a3b", help="an MoE target: as for e2e")
    m.add_argument("--budget", type=tree_budget_arg, default=64, help="DDTree budget")
    m.add_argument("--prompt-len", type=positive_int, default=512, help="random prompt tokens")
    m.add_argument("--max-new-tokens", type=positive_int, default=48, help="new tokens per traced call")
    m.add_argument("--repeats", type=positive_int, default=3, help="traced calls timed, each with its reads")
    m.add_argument("--reads", type=positive_int, default=50, help="reads of the counts timed per repeat")
    _add_runtime_args(m)
    m.add_argument("--out", default="outputs/bench/moe_counting.json", help="JSON written here")


def _add_prompt_set_args(p, repeats: int) -> None:
    """A pair and prompts from one of its sets, as the benches over real prompts take them."""
    p.add_argument("--pair", default="lab", help="a named pair")
    p.add_argument("--prompts", default="lab:code", help="prompt set, e.g. lab:code or a .jsonl path")
    p.add_argument("--n-prompts", type=positive_int, default=8, help="prompts from the set")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="new tokens per prompt")
    p.add_argument("--repeats", type=positive_int, default=repeats,
                   help="interleaved passes over all runs, each in an order rotated by one; tok/s is the median")


ATTN_CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "num_splits", "split_target", "waves",
                    "min_chunk")


def parse_attn_config(items: list[str]) -> dict:
    """['min_chunk=128', 'waves=4'] -> {'min_chunk': 128, 'waves': 4.0}; unknown keys are refused."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in ATTN_CONFIG_KEYS or not value:
            raise ValueError(f"--attn-config {item!r}: expected KEY=VALUE with KEY one of {', '.join(ATTN_CONFIG_KEYS)}")
        try:
            out[key] = float(value) if key == "waves" else int(value)
        except ValueError:
            raise ValueError(f"--attn-config {item!r}: {key} takes {'a number' if key == 'waves' else 'an integer'}") from None
    return out


def bench_budget_arg(text: str):
    """A budget, "auto", or "auto:key=value,…" (AutoBudget's explore, weight, memory), written canonically."""
    if not (isinstance(text, str) and text.strip().lower().startswith(AUTO + ":")):
        return budget_arg(text)
    label = text.strip().lower()
    try:
        settings = auto_label_settings(label)
        AutoBudget(**settings)  # values out of range are refused here, before anything runs
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return ":".join([AUTO, ",".join(f"{k}={v}" for k, v in settings.items())]) if settings else AUTO


@functools.cache
def _negatable() -> frozenset[str]:
    """The engine choices a --no- flag turns off (on by default): their --X/--no-X pairs in _add_option_args."""
    vp = argparse.ArgumentParser(add_help=False)
    _add_option_args(vp)
    return frozenset(a.dest for a in vp._actions if isinstance(a, argparse.BooleanOptionalAction))


def variant_arg(flags: str) -> dict:
    """One `--variants` entry, e.g. "pdl moe-config SPLIT_K_UP=1" -> {"label": the flags, "options": the choices
    it makes (options.py names)}. Flags may drop their leading dashes (a value that starts with them would be
    read as a flag of the bench itself); anything but this bench's option flags is refused in one line."""
    vp = argparse.ArgumentParser(prog="--variants", add_help=False, exit_on_error=False)
    _add_option_args(vp)
    known = {f[2:] for f in vp._option_string_actions if f.startswith("--")}
    words = [f"--{w}" if w in known else w for w in shlex.split(flags)]
    try:
        parsed, extra = vp.parse_known_args(words)
        if extra:
            raise ValueError(f"not an engine choice: {' '.join(extra)}")
        chosen = run_options(parsed)
    except (argparse.ArgumentError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{flags!r}: {e}") from None
    if not chosen:
        raise argparse.ArgumentTypeError(f"{flags!r} changes no engine choice (one of: pdl, moe-config, "
                                         "attn-config, dense-products, tree-build, …)")
    return {"label": shlex.join(w[2:] if w[2:] in known else w for w in words), "options": chosen}


def run_options(args) -> dict:
    """The process-wide choices (options.py) that a bench command's flags ask for."""
    chosen = {}
    for name in ("tree_kernels", "tree_build", "tree_topk", "declared_routing", "dense_products"):
        value = getattr(args, name, "auto")
        if value != "auto":
            chosen[name] = value
    if getattr(args, "host_read_lag", None) is not None:
        chosen["host_read_lag"] = args.host_read_lag
    compile_mode = getattr(args, "compile_mode", "default")
    if compile_mode != "default":
        chosen["compile_options"] = {"mode": compile_mode}
    attn_config = parse_attn_config(getattr(args, "attn_config", []))
    if attn_config:
        chosen["attention_launch"] = attn_config
    moe_config = parse_moe_config(getattr(args, "moe_config", []))
    if moe_config:
        chosen["moe_launch"] = moe_config
    if getattr(args, "pdl", False):
        chosen["launch_pdl"] = True
    if getattr(args, "overlap_shared", None) is not None:
        chosen["overlap_shared"] = args.overlap_shared
    return chosen


def parse_moe_config(items: list[str]) -> dict:
    """['SPLIT_K_UP=1', 'BLOCK_N_DOWN=128'] -> fused-MoE launch overrides (bench/fused_moe.py's --config keys)."""
    from .fused_moe import parse_overrides

    try:
        return parse_overrides(items)
    except ValueError as e:
        raise ValueError(f"--moe-config {e}") from None


def command_line(args) -> str:
    """The bench as a command that runs it again, every option spelled out (defaults included): a JSON's
    `command`."""
    parts = ["ddtree-lab", "bench", args.bench]
    for key, value in vars(args).items():
        if key in _negatable() and value is False:  # a default of on, turned off
            parts.append("--no-" + key.replace("_", "-"))
        if key in ("command", "func", "bench") or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "variants":  # each as typed: its flags, quoted as one argument
            value = [v["label"] for v in value]
        parts += [flag] if value is True else [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return shlex.join(parts)


def bench_kernels(args) -> dict:
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU")
    from .attention import bench_tree_attention, summary_table

    rows = bench_tree_attention(args.trees, args.contexts, tuple(args.backends), progress=True)
    print(summary_table(rows), file=sys.stderr)
    return {"copy_gbps": device_copy_gbps(), "rows": rows}


def bench_mla(args) -> dict:
    if not torch.cuda.is_available():
        raise ValueError("bench mla needs a CUDA GPU")
    from .attention import bench_mla_attention, mla_summary_table

    rows = bench_mla_attention(args.trees, args.contexts, args.heads, args.latent, args.rope, tuple(args.backends),
                               progress=True)
    print(mla_summary_table(rows), file=sys.stderr)
    return {"copy_gbps": device_copy_gbps(), "rows": rows}


def load_bench_pair(args):
    """The named pair a bench over prompts runs, as its runtime flags ask."""
    return load_pair(args.pair, device=args.device, dtype=args.dtype, attention=args.attention, compile=args.compile)


def prompt_set(args) -> dict:
    """What the JSON of a bench over prompts says of them, with the prompts (popped by the caller)."""
    prompts = [p["prompt"] for p in read_prompt_set(args.prompts, args.n_prompts)]
    return {"prompt_set": args.prompts, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "prompts": prompts}


def bench_prompts_cli(args) -> dict:
    if all(is_auto_label(b) for b in args.budgets):
        raise ValueError("--budgets auto: give fixed budgets beside it; auto chooses among them")
    pair = load_bench_pair(args)
    chosen = prompt_set(args)
    prompts = chosen.pop("prompts")
    return {"pair": pair.describe(), "compile": args.compile, "tree_kernels": args.tree_kernels, **chosen,
            **bench_prompts(pair, prompts, args.budgets, args.max_new_tokens, repeats=args.repeats)}


def bench_auto_overhead(args) -> dict:
    check_budget_span(args.budget, 8, "auto-overhead")  # before the pair loads
    pair = load_bench_pair(args)
    chosen = prompt_set(args)
    prompts = chosen.pop("prompts")
    return {"pair": pair.describe(), "compile": args.compile, "attention": args.attention, "dtype": args.dtype,
            **chosen, **auto_overhead(pair, prompts, args.budget, args.max_new_tokens, args.repeats, args.pools)}


def bench_auto_rounds(args) -> dict:
    check_budget_span(args.budget, 2, "auto-rounds")
    pair = load_bench_pair(args)
    chosen = prompt_set(args)
    prompts = chosen.pop("prompts")
    return {"pair": pair.describe(), "compile": args.compile, "attention": args.attention, "dtype": args.dtype,
            **chosen, **auto_rounds(pair, prompts, args.budget, args.max_new_tokens, args.repeats)}


def bench_moe_counting(args) -> dict:
    pair = bench_model(args.model, args.dtype, args.attention, args.device, args.compile)
    return {"model": args.model, "dtype": args.dtype, "attention": args.attention, "compile": args.compile,
            **moe_counting(pair, args.budget, args.prompt_len, args.max_new_tokens, args.repeats, args.reads)}


def bench_profile(args) -> dict:
    pair = bench_model(args.model, args.dtype, args.attention, args.device, args.compile, routing=args.routing)
    runs = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [None])]
    rows = []
    for method, budget in runs:
        row = profile_rounds(pair, method, budget, args.prompt_len, args.rounds)
        rows.append(row)
        print(f"  {method:6s} budget={budget!s:5s} {row['kernels_per_round']:6.0f} kernels "
              f"{row['us_per_round']:9.1f} us/round  " + " ".join(
                  f"{s}={v['kernels_per_round']:.0f}k/{v['us_per_round']:.0f}us"
                  for s, v in row["stages"].items()), file=sys.stderr, flush=True)
    out = {"model": args.model, "dtype": args.dtype, "attention": args.attention, "compile": args.compile,
           "prompt_len": args.prompt_len, "tree_kernels": args.tree_kernels,
           "routing": pair.describe().get("routing"), "rows": rows}
    if not args.compile and pair.device.type == "cuda":  # the GPU's own counts beside the census's (bench census)
        attach_census(out)
    return out


def bench_census(args) -> dict:
    from .census import census_layers, census_rows, e2e_census

    if args.annotate:
        from ..environment import git_commit

        commit = git_commit()  # before the first file is written
        for path in map(Path, args.annotate):
            try:
                bench = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"--annotate {path}: not a readable JSON file ({e.__class__.__name__})") from None
            if not isinstance(bench, dict) or bench.get("kind") != "e2e":
                raise ValueError(f"--annotate {path}: not a 'bench e2e' JSON")
            if bench.get("compile"):  # compiled layers: a layer's kernels, counted on this code
                attach_layer_census(bench, commit)
                if "layer_census_skipped" in bench:
                    raise ValueError(f"--annotate {path}: {bench['layer_census_skipped']}")
                atomic_write_json(path, bench, indent=2)
                print(f"  counted a layer of {path}", file=sys.stderr)
                continue
            for row, census in zip(bench["rows"], e2e_census(bench)):
                if census is not None:
                    row["census"] = census
            atomic_write_json(path, bench, indent=2)
            print(f"  counted {sum('census' in r for r in bench['rows'])} rows of {path}", file=sys.stderr)
        return {"annotated": [str(p) for p in args.annotate]}

    declared = None if args.declared_routing == "auto" else args.declared_routing
    rows = census_rows(args.model, args.methods, args.budgets, args.prompt_len, args.attention, args.routing, declared)
    for row in rows:
        print(f"  {row['method']:6s} budget={row['budget']!s:5s} {row['kernels_per_round']:6d} kernels, verify "
              f"{row['verify_kernels_per_layer']:.1f} a layer  " + " ".join(
                  f"{s}={v['kernels'] + sum(v['priced_kernels'].values())}" for s, v in row["stages"].items()),
              file=sys.stderr, flush=True)
    first = rows[0]  # where its verify's kernels go, a layer at a time: the ops that launch most
    layers = census_layers(args.model, args.attention, args.routing)
    ops = first["stages"]["verify"]["by_op"]
    print(f"  {first['method']} verify, kernels ÷ {layers:.0f} layers by op: " + ", ".join(
        f"{op} {n / layers:.1f}" for op, n in list(ops.items())[:12]), file=sys.stderr, flush=True)
    from ..declared_routing import routing_name
    return {"model": args.model, "attention": args.attention, "compile": False, "prompt_len": args.prompt_len,
            "routing": None if args.routing is None else routing_name(args.routing), "rows": rows}


def resumable_rows(path: Path, header: dict) -> list[dict]:
    """The rows of a bench e2e cut short at `path` by the same command, on the same code and device: what this run
    takes over and does not time again (a long run resumes where it stopped). [] for anything else."""
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    env, old_env = header["environment"], old.get("environment") or {}
    same = (old.get("incomplete") and old.get("command") == header["command"]
            and all(old_env.get(k) == env.get(k) for k in ("source_sha256", "device")))
    return list(old.get("rows") or []) if same else []


def bench_e2e_cli(args) -> dict:
    start = time.perf_counter()
    header = result_header(args)

    def keep(partial: dict) -> None:  # each run's row on disk as it ends: a bench cut short keeps what it measured
        write_result(args, {**header, **partial, "tree_kernels": args.tree_kernels, **run_settings(args)})

    own = options.current()  # the run's own choices (run_bench_cli set them)
    for variant in args.variants:
        with options.using(**variant["options"]):
            if options.current() == own:
                raise ValueError(f"--variants {variant['label']!r} changes nothing: the run makes those choices "
                                 "already (the engine's defaults and its own flags)")
    done = resumable_rows(args.out, header)
    if done:
        print(f"  resuming {args.out}: {len(done)} runs already measured by this command", file=sys.stderr)
    result = run_e2e(args.model, args.budgets, args.prompt_len, args.rounds, args.dtype, args.attention, args.device,
                     args.compile, args.tp, routing=args.routing, on_partial=keep, methods=tuple(args.methods),
                     done_rows=done, variants=args.variants, repeats=args.repeats)
    return {**result, "tree_kernels": args.tree_kernels, "bench_seconds": time.perf_counter() - start}


BENCHES = {"kernels": bench_kernels, "mla": bench_mla, "e2e": bench_e2e_cli, "prompts": bench_prompts_cli,
           "profile": bench_profile, "auto-overhead": bench_auto_overhead, "auto-rounds": bench_auto_rounds,
           "moe-counting": bench_moe_counting, "census": bench_census}


def run_bench_cli(args) -> int:
    if hasattr(args, "device"):  # the end-to-end benches: what --dtype and --attention mean on this device
        for key, value in device_defaults(args.device).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    options.replace(**run_options(args))  # for this process: the CLI runs one bench and exits
    result = {**result_header(args), **BENCHES[args.bench](args), **run_settings(args)}
    if write_result(args, result):
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def result_header(args) -> dict:
    """What opens every bench JSON: the bench, the command that runs it again, the machine and code."""
    return {"kind": args.bench, "command": command_line(args), "environment": environment()}


def run_settings(args) -> dict:
    """The process-wide choices a bench ran under, as its JSON records them."""
    return {"tree_build": getattr(args, "tree_build", "auto"), "tree_topk": getattr(args, "tree_topk", "auto"),
            "declared_routing": getattr(args, "declared_routing", "auto"),
            "dense_products": getattr(args, "dense_products", "auto"),
            "attn_config": dict(options.current().attention_launch),
            "moe_config": dict(options.current().moe_launch), "pdl": options.current().launch_pdl,
            "overlap_shared": options.current().overlap_shared,
            "compile_mode": getattr(args, "compile_mode", "default"),
            "host_read_lag": host_read_lag(getattr(args, "device", "cuda"))}


def write_result(args, result: dict) -> bool:
    """The bench's JSON at --out, written whole (atomically); under tensor parallelism rank 0 writes. -> written"""
    if getattr(args, "tp", 1) == 1 or torch.distributed.get_rank() == 0:
        atomic_write_json(Path(args.out), result, indent=2)
        return True
    return False
