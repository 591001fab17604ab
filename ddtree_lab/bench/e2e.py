"""End-to-end benchmarks of the engine: rounds, prompts, profiles (run by `ddtree-lab bench`, bench/cli.py).

  e2e      per-round stage times, rounds/s and tokens/s for AR, DFlash and DDTree at several budgets, for a
           checkpoint, a named pair, or a random-weight real-size shape (`random:qwen3-8b`, the MoE
           `random:qwen3-30b-a3b`, pairs/random.py), and
           the AR step's roofline (weight bytes ÷ copy bandwidth, same run)
  prompts  tokens/s and speedup of AR, DFlash and DDTree on a pair's shipped prompts, on `timed_passes`: the
           passes every timing bench over prompts runs (warm-up, repeats in rotated orders; bench/overhead.py too)
  profile  where a round's time goes: kernels launched and GPU time per stage, and the top kernels
           (eager rounds under torch.profiler: a graph replay hides its kernels from the profiler)
"""
from __future__ import annotations

import bisect
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import options
from ..auto_budget import AutoBudget, auto_label_settings, is_auto_label
from ..checkpoint import Pair
from ..decode import generate
from ..graphs import captures, release_kept
from ..kernels.moe_layout import expert_bytes
from ..model import Target
from ..names import STAGES
from ..pairs import load_pair
from ..prompts import encode_prompt
from ..stats import band, bootstrap
from .timing import device_copy_gbps

def weight_bytes_per_step(target: Target, experts_touched: list[float] | None = None) -> int:
    """Bytes of weights one decoding step reads: every matrix, but one row of an untied embedding, and of
    an MoE block the router and the touched experts: `experts_touched[l]` of MoE layer l's experts held (default:
    what one token reads, its top-k, of which an expert-parallel share holds its part on average), e.g. a verify
    forward's counts from a traced round."""
    from ..moe import SparseMoE

    moe = [m for m in target.modules() if isinstance(m, SparseMoE)]
    touched = ([m.top_k * m.experts_here / m.num_experts for m in moe] if experts_touched is None
               else experts_touched)
    total = 0
    for m, n in zip(moe, touched, strict=True):
        E, two_i, H = m.gate_up.shape  # the local width under tensor parallelism
        # the touched experts as stored (INT4: packed values, scales and zero points, buffers rather than
        # parameters); the router and shared experts are counted whole below
        total += n * expert_bytes(H, two_i // 2, m.gate_up.element_size())
    experts = {id(w) for m in moe for w in (m.gate_up, m.down)}
    # every layer's, shared ones too (random:<shape>~<sets>): each layer reads its weights again
    for name, p in target.named_parameters(remove_duplicate=False):
        if name == "embed_tokens.weight" and target.lm_head is not None:
            continue  # untied: the step reads one row, not the table
        if id(p) not in experts:
            total += p.numel() * p.element_size()
    return int(round(total))


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + written), the roofline's denominator."""
    return device_copy_gbps(nbytes) * 1e9


def random_prompt(pair: Pair, length: int) -> list[int]:
    """`length` token ids drawn from a fixed seed: the same prompt for every run of a bench."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, pair.target.cfg.vocab_size - 2, (length,), generator=g).tolist()


def bench_e2e(pair: Pair, budgets=(16, 64, 256, 1024), prompt_len: int = 512, rounds: int = 24,
              methods=("ar", "dflash", "ddtree"), cuda_graphs: bool | None = None, progress=True,
              on_row=None, done_rows=(), repeats: int = 1, trace_experts: bool = True, label: str = "") -> dict:
    """Per method/budget: stage seconds per round, round time, rounds/s, tokens/s (same prompt). `on_row(rows,
    runs)` is called after each run with the rows so far and the number of runs in all (to keep what a cut bench
    measured). `done_rows`: rows a cut run of the same bench already measured, taken as they are (not run again).
    `rounds` is the new tokens a run generates: at least 2, since the prompt's forward gives the first. `repeats`:
    timed runs of each, the row the one of median round time (all of them in `round_seconds_repeats`).
    `trace_experts`: an MoE target's rows also count the experts a few traced rounds touched."""
    if rounds < 2:
        raise ValueError(f"rounds={rounds}: a run needs at least 2 new tokens (the prompt's forward gives the first, "
                         "the timed rounds the rest)")
    prompt = random_prompt(pair, prompt_len)
    runs = [("ar", None)] if "ar" in methods else []
    runs += [("dflash", None)] if "dflash" in methods else []
    runs += [("ddtree", b) for b in budgets] if "ddtree" in methods else []
    rows = []
    done = {(r["method"], r["budget"]): r for r in done_rows}
    for method, budget in runs:
        if (method, budget) in done:
            rows.append(done[(method, budget)])
            continue
        kw = dict(method=method, budget=budget, max_new_tokens=rounds, trace=False, stop=[],
                  cuda_graphs=cuda_graphs)
        generate(pair, prompt, **kw)  # warm-up: compiles kernels and captures graphs
        row = median_row([timed_row(method, budget, generate(pair, prompt, **kw)) for _ in range(repeats)])
        forward_s, per_round = row["round_seconds"], row["stage_seconds_per_round"]
        if pair.target.cfg.is_moe and trace_experts:  # a few traced rounds: the experts each MoE layer's verify touched
            traced = generate(pair, prompt, **{**kw, "trace": True, "max_new_tokens": min(rounds, 8)})
            per_layer = [sum(col) / len(col) for col in zip(*(r.experts_touched for r in traced.rounds))]
            row["experts_touched_per_layer"] = per_layer
            row["experts_touched_mean"] = sum(per_layer) / len(per_layer)
            busiest = [b for r in traced.rounds for b in r.expert_tokens_max]
            row["expert_tokens_max_mean"] = sum(busiest) / len(busiest)
            row["expert_row_blocks_mean"] = {  # per height: the fused kernel's row blocks per MoE layer
                h: statistics.fmean(b for r in traced.rounds for b in r.expert_row_blocks[h])
                for h in traced.rounds[0].expert_row_blocks}
        rows.append(row)
        if on_row is not None:
            on_row(rows, len(runs))
        if progress:
            print(f"  {label}{method:6s} budget={budget!s:5s} round {forward_s * 1e3:8.3f} ms  "
                  + " ".join(f"{k}={v * 1e3:.3f}" for k, v in per_round.items()), file=sys.stderr, flush=True)
    return {"rows": rows}


def timed_row(method: str, budget, res) -> dict:
    """A bench e2e row of one timed run (a GenerationResult): per round, its stages' seconds and their sum."""
    n = len(res.acceptance_lengths)
    per_round = {k: v / n for k, v in res.stage_seconds.items() if k != "other"}
    return {"method": method, "budget": budget, "rounds": n, "mean_tau": res.mean_acceptance,
            "stage_seconds_per_round": per_round,
            "round_seconds": sum(per_round.values()),
            "wall_seconds": res.wall_seconds, "prefill_seconds": res.prefill_seconds,
            "rounds_per_second": n / max(res.wall_seconds - res.prefill_seconds, 1e-9),
            "tokens_per_second": len(res.tokens) / max(res.wall_seconds, 1e-9),
            "settings": res.settings}


def bench_variants(pair: Pair, variants: list[dict], repeats: int, progress=True, **kw) -> tuple[list, list]:
    """The runs of bench_e2e (`kw`) under the run's own engine choices and under each variant's ({"label",
    "options"}: options.py changes), on one model: each repeat times every variant once, in an order rotated by
    one per repeat (bench e2e --variants). -> (the own choices' rows, the median run of each, with every repeat's
    round time; one entry a variant: label, options and rows with over_base, the median of each repeat's round
    time ÷ the own choices' in the same repeat, and over_base_range)."""
    runs = [{"label": "", "options": {}}] + list(variants)
    timed = [[] for _ in runs]  # [variant][repeat] -> rows
    for rep in range(repeats):
        for i in repeat_order(len(runs), rep):
            release_kept(pair)  # the last choice's graphs: every choice's at once ran a deep model out of memory
            with options.using(**runs[i]["options"]):
                label = f"[{runs[i]['label']}] " if runs[i]["label"] else ""
                timed[i].append(bench_e2e(pair, progress=progress, trace_experts=rep == 0 and i == 0, label=label,
                                          **kw)["rows"])
    base = _median_rows(timed[0])
    out = []
    for run, reps in zip(runs[1:], timed[1:]):
        rows = []
        for j, row in enumerate(_median_rows(reps)):
            ratios = sorted(reps[r][j]["round_seconds"] / timed[0][r][j]["round_seconds"] for r in range(repeats))
            rows.append({**{k: row[k] for k in ("method", "budget", "round_seconds", "stage_seconds_per_round",
                                                "mean_tau")},
                         "round_seconds_repeats": [r[j]["round_seconds"] for r in reps],
                         "over_base": statistics.median(ratios), "over_base_range": [ratios[0], ratios[-1]]})
        out.append({"label": run["label"], "options": run["options"], "rows": rows})
        if progress:
            print(f"  [{run['label']}] round time ÷ the run's own, median (range) of {repeats}: " + ", ".join(
                f"{r['method']}{'' if r['budget'] is None else ' ' + str(r['budget'])} {r['over_base']:.3f} "
                f"({r['over_base_range'][0]:.3f}–{r['over_base_range'][1]:.3f})" for r in rows),
                file=sys.stderr, flush=True)
    return base, out


def median_row(repeats: list[dict]) -> dict:
    """Rows of one run timed several times -> the repeat of median round time (the lower one of an even count),
    with every repeat's round time in order (`round_seconds_repeats`) when there are several."""
    row = dict(sorted(repeats, key=lambda r: r["round_seconds"])[(len(repeats) - 1) // 2])
    if len(repeats) > 1:
        row["round_seconds_repeats"] = [r["round_seconds"] for r in repeats]
    return row


def _median_rows(reps: list[list[dict]]) -> list[dict]:
    """Rows of several repeats of the same runs ([repeat][run]) -> each run's median_row."""
    rows = [median_row([r[j] for r in reps]) for j in range(len(reps[0]))]
    # the first repeat's expert counts (traced once) belong to every repeat's row of the same run
    for row, first in zip(rows, reps[0]):
        for key in ("experts_touched_per_layer", "experts_touched_mean", "expert_tokens_max_mean",
                    "expert_row_blocks_mean"):
            if key in first:
                row[key] = first[key]
    return rows


def bench_model(model: str, dtype, attention, device, compile=False, tp: int = 1, routing=None) -> Pair:
    """A named pair (`lab`, `random:qwen3-8b`, …) or a directory holding target/ and drafter/; `routing` as
    load_pair's (None: its default)."""
    kw = dict(device=device, dtype=dtype, attention=attention, compile=compile, tp=tp, routing=routing)
    if "/" not in model and not Path(model).exists():
        return load_pair(model, **kw)
    return load_pair(target=Path(model) / "target", drafter=Path(model) / "drafter", **kw)


def attach_census(out: dict) -> None:
    """Each row of an eager bench e2e result gets its census (bench/census.py: the kernels, matmuls and activation
    bytes its verify and draft launch), or the result says why not (`census_skipped`): counting annotates the
    timed rows and never costs them."""
    from .census import e2e_census

    try:
        counted = e2e_census({**out, "declared_routing": options.current().declared_routing or "auto"})
    except (ValueError, RuntimeError) as e:  # e.g. a routing replayed from a trace, which the census does not count
        out["census_skipped"] = f"{e.__class__.__name__}: {e}"
        return
    for row, census in zip(out["rows"], counted):
        if census is not None:
            row["census"] = census


def attach_layer_census(out: dict, commit: str | None = None) -> None:
    """A compiled bench e2e result of a random shape gets the kernels a layer of this code launches
    (`layer_census`, bench/census.py: file_layer_census), which the advisor's check prices the file's layers
    with; else the result says why not (`layer_census_skipped`)."""
    from ..environment import git_commit
    from .census import file_layer_census

    try:
        out["layer_census"], out["layer_census_counted_at"] = file_layer_census(out), commit or git_commit()
    except (ValueError, RuntimeError) as e:
        out["layer_census_skipped"] = f"{e.__class__.__name__}: {e}"


def run_e2e(model: str, budgets, prompt_len, rounds, dtype, attention, device, compile=False, tp: int = 1,
            routing=None, on_partial=None, methods=("ar", "dflash", "ddtree"), done_rows=(), variants=(),
            repeats: int = 1) -> dict:
    """`bench e2e`'s result; `on_partial(result)` (if given) gets the result so far after each run but the last,
    marked `incomplete` (rows only: the ratios to AR and the floors are added at the end). `done_rows`: the rows
    of a cut run of the same bench, kept (bench_e2e); the result counts them in `resumed_rows`. `variants`
    (bench_variants): the same runs under other engine choices, taking turns with the run's own, in `variants`;
    such a run is not resumed."""
    pair = bench_model(model, dtype, attention, device, compile, tp, routing)
    out = {"model": model, "dtype": dtype, "attention": attention, "prompt_len": prompt_len, "compile": compile,
           "tp": tp}
    if pair.target.cfg.is_moe:  # what the experts-touched figures rest on: the routing model, the experts held here
        out.update(routing=pair.describe()["routing"], experts_here=pair.target.cfg.experts_here,
                   num_experts=pair.target.cfg.num_experts)
    if pair.device.type == "cuda":
        bw = copy_bandwidth()
        wb = weight_bytes_per_step(pair.target)
        out["roofline"] = {"copy_bytes_per_second": bw, "weight_bytes_per_step": wb,
                           "ar_step_roofline_seconds": wb / bw}
    def partial(rows, runs):
        if on_partial is not None and len(rows) < runs:
            on_partial({**out, "rows": list(rows), "incomplete": f"{len(rows)} of {runs} runs: the bench stopped "
                        "before the rest"})

    kw = dict(budgets=budgets, prompt_len=prompt_len, rounds=rounds, methods=methods)
    if variants:
        out["rows"], out["variants"] = bench_variants(pair, variants, repeats, **kw)
    else:
        if done_rows:
            out["resumed_rows"] = len(done_rows)
        out.update(bench_e2e(pair, on_row=partial, done_rows=done_rows, repeats=repeats, **kw))
    if not compile and tp == 1 and pair.device.type == "cuda":  # eager layers on a GPU: what each row launched
        attach_census(out)
    if compile and model.startswith("random:"):  # compiled layers: what a layer of this code launches
        attach_layer_census(out)
    if "roofline" in out:
        ar = next((r for r in out["rows"] if r["method"] == "ar"), None)
        if ar:
            out["roofline"]["ar_step_over_roofline"] = ar["round_seconds"] / out["roofline"]["ar_step_roofline_seconds"]
            for r in out["rows"]:
                r["round_over_ar_step"] = r["round_seconds"] / ar["round_seconds"]
        for r in out["rows"]:  # MoE: the verify's floor is the weights of the experts it touched
            if "experts_touched_per_layer" in r:
                r["verify_floor_seconds"] = weight_bytes_per_step(pair.target, r["experts_touched_per_layer"]) / bw
                r["verify_over_floor"] = r["stage_seconds_per_round"]["verify"] / r["verify_floor_seconds"]
    return out


def repeat_order(n: int, rep: int) -> list[int]:
    """The order repeat `rep` runs `n` methods in: rotated by one each repeat, so that no method always runs in
    the same slot, after the same neighbour (a clock or cache drift within a pass would favour one)."""
    return [(i + rep) % n for i in range(n)]


def grow_caches(pair: Pair, prompts: list, budgets, max_new_tokens: int, cuda_graphs: bool | None = None) -> None:
    """Untimed, before a bench's warm-up: DDTree at the largest tree among `budgets` (ints or AutoBudgets) on the
    longest prompt, so the caches, which only grow, have the run's size before anything is captured, and no
    program is captured again when the runs alternate. Without a DDTree budget, nothing."""
    rooms = [max(b.budgets) if isinstance(b, AutoBudget) else b for b in budgets]
    if rooms:  # a fixed budget sizes the cache as an auto whose largest candidate it is
        longest = max(prompts, key=lambda p: len(encode_prompt(pair, p)))
        generate(pair, longest, method="ddtree", budget=max(rooms), max_new_tokens=max_new_tokens, trace=False,
                 cuda_graphs=cuda_graphs, stop=[])


@dataclass(frozen=True)
class Run:
    """What a timing bench runs over its prompts: a method, its budget (an int, an AutoBudget, or None for AR and
    DFlash), and the process-wide choices (options.py) it runs under, as (name, value) pairs."""

    name: str
    method: str = "ddtree"
    budget: int | AutoBudget | None = None
    options: tuple = ()

    def generate(self, pair: Pair, prompt, **kw):
        with options.using(**dict(self.options)):
            return generate(pair, prompt, method=self.method, budget=self.budget, **kw)


@dataclass
class Pass:
    """One run's pass over all the prompts: a result per prompt, and the programs captured meanwhile (by kind,
    graphs.captures)."""

    results: list
    captures: dict

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def seconds(self) -> float:
        return sum(r.wall_seconds for r in self.results)

    @property
    def prefill_seconds(self) -> float:
        return sum(r.prefill_seconds for r in self.results)

    @property
    def rounds(self) -> int:
        return sum(len(r.acceptance_lengths) for r in self.results)

    @property
    def taus(self) -> list[int]:
        return [a for r in self.results for a in r.acceptance_lengths]

    @property
    def stage_seconds(self) -> dict[str, float]:
        stages: dict[str, float] = {}
        for r in self.results:
            for stage, sec in r.stage_seconds.items():
                stages[stage] = stages.get(stage, 0.0) + sec
        return stages


def timed_passes(pair: Pair, prompts: list, runs: list[Run], repeats: int, max_new_tokens: int,
                 cuda_graphs: bool | None = None, trace: bool = False,
                 round_times: bool = False) -> tuple[list[list[Pass]], list[list[int]]]:
    """The loop every timing bench runs. Untimed first: the caches grown to the runs' size (grow_caches), every
    prompt length once (a compiled model specialises on shapes), and a pass of every run (kernels compiled,
    graphs captured; auto's costs measured and a first pass of its learning, as a server's table would be after
    its first requests). Then `repeats` passes of every run over all the prompts, in an order rotated each repeat
    (`repeat_order`), so drift (clocks, a busy host) touches all runs alike.
    -> (each run's passes in repeat order, the order of each repeat)."""
    kw = dict(max_new_tokens=max_new_tokens, trace=trace, cuda_graphs=cuda_graphs, stop=[], round_times=round_times)
    grow_caches(pair, prompts, [run.budget for run in runs if run.method == "ddtree"], max_new_tokens, cuda_graphs)
    for prompt in prompts:
        generate(pair, prompt, method="ar", max_new_tokens=2, trace=False, cuda_graphs=cuda_graphs, stop=[])
    for run in runs:
        for prompt in prompts:
            run.generate(pair, prompt, **kw)
    passes: list[list[Pass]] = [[] for _ in runs]
    orders = [repeat_order(len(runs), rep) for rep in range(max(1, repeats))]
    for order in orders:
        for i in order:
            before = captures()
            results = [runs[i].generate(pair, prompt, **kw) for prompt in prompts]
            passes[i].append(Pass(results, {kind: n - before[kind] for kind, n in captures().items()}))
    return passes, orders


def median_repeat(passes: list[Pass]) -> tuple[list[float], float, int]:
    """-> (tokens/s of each repeat, their median, the repeat nearest the median)."""
    per_repeat = [p.tokens / p.seconds for p in passes]
    median = statistics.median(per_repeat)
    return per_repeat, median, min(range(len(per_repeat)), key=lambda i: abs(per_repeat[i] - median))


def bench_prompts(pair: Pair, prompts: list, budgets=(16, 32, 64, 128, 256), max_new_tokens: int = 96,
                  cuda_graphs: bool | None = None, progress=True, repeats: int = 3) -> dict:
    """Tokens/s of AR, DFlash and DDTree on real prompts (same prompts, same run), and the speedup.

    The passes are `timed_passes`'; a method's tokens/s is its median over the repeats (each repeat's is kept).
    Tokens/s counts the whole `generate` call, prefill included; `decode_tokens_per_second` leaves the
    prefill out, and `stage_seconds` splits the median repeat's time by stage (events between stages)."""
    runs, labels = prompts_runs(budgets)
    passes, orders = timed_passes(pair, prompts, runs, repeats, max_new_tokens, cuda_graphs)
    rows = [prompts_row(run.method, label, run_passes, progress) for run, label, run_passes in zip(runs, labels, passes)]
    compare_with_ar(rows, pair.target.attention, len(prompts), progress)
    fixed_rows = [r for r in rows[2:] if not is_auto_label(r["budget"])]
    best = max(fixed_rows, key=lambda r: r["tokens_per_second"]) if fixed_rows else None
    auto_rows = [r for r in rows if is_auto_label(r["budget"])]
    for row in auto_rows:  # each auto against the best fixed budget of the same run
        compare_with_best_fixed(row, best, fixed_rows, len(prompts), progress)
    for row in rows:
        del row["outputs"]
    out = {"rows": rows, "best_budget": best and best["budget"], "repeats": max(1, repeats),
           "order_per_repeat": [[runs[i].name for i in order] for order in orders]}
    if auto_rows:  # the first auto given (plain "auto" when it is there) is the run's verdict
        first = next((r for r in auto_rows if r["budget"] == "auto"), auto_rows[0])
        out.update(auto_vs_best_fixed=first["vs_best_fixed"],
                   auto_vs_best_fixed_same_outputs=first["vs_best_fixed_same_outputs"],
                   auto_vs_best_fixed_per_repeat=first["vs_best_fixed_per_repeat"],
                   auto_vs_best_fixed_band=first["vs_best_fixed_band"])
    return out


def prompts_runs(budgets) -> tuple[list[Run], list]:
    """AR, DFlash, DDTree at each fixed budget, then each auto label ("auto", "auto:memory=8192", …): an auto
    choosing among the fixed budgets. -> (the runs, the budget each row names)."""
    fixed = [b for b in budgets if not is_auto_label(b)]
    labels = list(dict.fromkeys(b for b in budgets if is_auto_label(b)))
    if labels and not fixed:
        raise ValueError("bench prompts: 'auto' chooses among the fixed budgets given with it; give some")
    runs = [Run("ar", "ar"), Run("dflash", "dflash")] + [Run(f"ddtree {b}", "ddtree", b) for b in fixed]
    runs += [Run(f"ddtree {label}", "ddtree", AutoBudget(budgets=tuple(fixed), **auto_label_settings(label)))
             for label in labels]
    return runs, [None, None] + fixed + labels


def prompts_row(method: str, budget, passes: list[Pass], progress: bool) -> dict:
    """A run's row: each repeat's seconds, prefill, stages and τ, and the median repeat's figures."""
    first = passes[0]
    row = {"method": method, "budget": budget, "seconds_per_repeat": [p.seconds for p in passes],
           "prefill_seconds_per_repeat": [p.prefill_seconds for p in passes],
           "stage_seconds_per_repeat": [p.stage_seconds for p in passes]}
    if is_auto_label(budget):  # the rounds each candidate ran, over every timed pass; the last call's settings
        counts: dict[str, int] = {}
        for r in (r for p in passes for r in p.results):
            for b in r.round_budgets:
                counts[str(b)] = counts.get(str(b), 0) + 1
        row.update(round_budget_counts=counts, auto=passes[-1].results[-1].settings["auto"])
    outputs = [r.tokens for r in first.results]
    # the tokens are the same every repeat (T = 0); so is τ but for auto's, which learns
    row.update(seconds_per_prompt_per_repeat=[[r.wall_seconds for r in p.results] for p in passes],
               mean_tau_per_repeat=[statistics.fmean(p.taus) for p in passes], tokens=first.tokens,
               mean_tau=statistics.fmean(first.taus), outputs=outputs, tokens_per_prompt=[len(o) for o in outputs])
    per_repeat, median, i = median_repeat(passes)
    row.update(tokens_per_second_per_repeat=per_repeat, tokens_per_second=median,
               seconds=statistics.median(row["seconds_per_repeat"]), prefill_seconds=passes[i].prefill_seconds,
               stage_seconds=passes[i].stage_seconds,
               decode_tokens_per_second=row["tokens"] / max(passes[i].seconds - passes[i].prefill_seconds, 1e-9))
    if progress:
        print(f"  {method:6s} budget={budget!s:5s} {median:9.1f} tok/s "
              f"(repeats {min(per_repeat):.0f}–{max(per_repeat):.0f})  tau {row['mean_tau']:.2f}  "
              f"prefill {row['prefill_seconds'] / passes[i].seconds:.0%} of the time, "
              f"decode alone {row['decode_tokens_per_second']:.0f} tok/s", file=sys.stderr, flush=True)
    return row


def compare_with_ar(rows: list[dict], attention: str, n_prompts: int, progress: bool) -> None:
    """Each row's speedups over AR (rows[0]) and whether its text is AR's, prompt by prompt."""
    ar = rows[0]
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
        r["decode_speedup_over_ar"] = r["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
        r["lossless"] = r["outputs"] == ar["outputs"]
        # in bf16 a near-tied argmax can flip between batched verify and AR's one-token step: count them
        r["prompts_equal_to_ar"] = sum(o == a for o, a in zip(r["outputs"], ar["outputs"]))
    differ = [r for r in rows if not r["lossless"]]
    if progress and differ:
        worst = min(differ, key=lambda r: r["prompts_equal_to_ar"])
        why = ("attention='invariant' should rule this out: a fault" if attention == "invariant" else
               "the verify's numerics follow the tree's size; --attention invariant gives every budget AR's text")
        print(f"  texts: {len(differ)} of {len(rows) - 1} methods differ from AR's on some prompts (fewest alike: "
              f"{worst['method']} budget={worst['budget']}, {worst['prompts_equal_to_ar']} of {n_prompts}); {why}",
              file=sys.stderr, flush=True)


def compare_with_best_fixed(row: dict, best: dict, fixed_rows: list[dict], n_prompts: int, progress: bool) -> None:
    """An auto row against the best fixed budget: overall and repeat by repeat, over the prompts both emitted
    alike, and with the prompts resampled (prompts_band)."""
    # where bf16 numerics send auto and the best fixed budget down different text, their τ differ for that
    # reason alone: the ratio over the prompts both emitted alike is the like-for-like one
    same = [i for i, (a, b) in enumerate(zip(row["outputs"], best["outputs"])) if a == b]
    if same:
        ratios = [sum(b[i] for i in same) / sum(a[i] for i in same) for a, b in
                  zip(row["seconds_per_prompt_per_repeat"], best["seconds_per_prompt_per_repeat"])]
        same = {"prompts": len(same), "of": n_prompts, "tokens": sum(len(best["outputs"][i]) for i in same),
                "per_repeat": ratios, "median": statistics.median(ratios)}
    row["vs_best_fixed_same_outputs"] = same or None
    row["vs_best_fixed"] = row["tokens_per_second"] / best["tokens_per_second"]
    row["vs_best_fixed_per_repeat"] = [
        a / b for a, b in zip(row["tokens_per_second_per_repeat"], best["tokens_per_second_per_repeat"])]
    row["vs_best_fixed_band"] = spread = prompts_band(row, fixed_rows)
    if progress:
        same = row["vs_best_fixed_same_outputs"]
        print(f"  {row['budget']} ÷ best fixed (budget {best['budget']}): {row['vs_best_fixed']:.3f} "
              f"(repeats {', '.join(f'{x:.3f}' for x in row['vs_best_fixed_per_repeat'])})"
              + (f"; over the {same['prompts']} of {same['of']} prompts both emitted alike: {same['median']:.3f}"
                 if same else "; no prompt emitted alike"), file=sys.stderr, flush=True)
        print(f"  prompts resampled: {row['budget']} ÷ best fixed {spread['low']:.3f}–{spread['high']:.3f} (90 %), "
              f"≥ 1 in {spread['at_least_best']:.0%} of resamples, ≥ 0.97 in {spread['at_least_floor']:.0%}",
              file=sys.stderr, flush=True)


def prompts_band(auto_row: dict, fixed_rows: list[dict], n_boot: int = 2000, seed: int = 0) -> dict:
    """auto ÷ the best fixed budget with the prompts resampled (bootstrap): the text is what varies between
    budgets in bf16, so this is the verdict's spread. A method's tokens/s over a resample is its tokens over
    its wall seconds (each prompt's median over the repeats); the best fixed budget is chosen anew in each."""
    def per_prompt(r):
        secs = [statistics.median(rep[i] for rep in r["seconds_per_prompt_per_repeat"])
                for i in range(len(r["tokens_per_prompt"]))]
        return r["tokens_per_prompt"], secs

    auto, fixed = per_prompt(auto_row), [per_prompt(r) for r in fixed_rows]
    n = len(auto[0])

    def ratio(idx):
        def tps(m):
            return sum(m[0][i] for i in idx) / sum(m[1][i] for i in idx)
        return tps(auto) / max(tps(f) for f in fixed)

    ratios = bootstrap(ratio, n, n_boot, seed)
    low, high = band(ratios)
    return {"centre": ratio(range(n)), "low": low, "high": high, "n_boot": n_boot,
            "at_least_best": float((ratios >= 1.0).mean()), "at_least_floor": float((ratios >= 0.97).mean())}


def profile_rounds(pair: Pair, method: str = "ddtree", budget: int = 64, prompt_len: int = 512,
                   rounds: int = 8) -> dict:
    """Kernels launched and their microseconds, per stage per round, from eager rounds under
    torch.profiler; `top_kernels` lists every (stage, kernel) by time, so two profiles (say, of two depths)
    difference exactly.

    On a GPU every device event counts (torch's kernels, Triton's, copies), attributed by its start
    on the GPU to the stage running then: the rounds run with a synchronisation after each stage
    (`generate(profile=True)`), so a stage's kernels start after its host span begins and before the
    next stage's does. (Triton kernels are launched outside any torch op, so attributing kernels to
    the op that launched them would miss them.) On the CPU the outermost ops of each stage count."""
    from torch.profiler import ProfilerActivity, profile


    prompt = random_prompt(pair, prompt_len)
    on_gpu = pair.device.type == "cuda"
    kw = dict(method=method, budget=budget, max_new_tokens=rounds, trace=False, stop=[], cuda_graphs=False,
              profile=on_gpu)
    generate(pair, prompt, **kw)  # warm-up (compiles, autotunes)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        res = generate(pair, prompt, **kw)
    work = _device_work(prof, STAGES) if on_gpu else _cpu_work(prof, STAGES)
    per_stage = {s: {"kernels": 0, "us": 0.0} for s in STAGES}
    by_name: dict[tuple, list] = {}  # (stage, kernel) -> [us, count]
    for stage, name, us in work:
        per_stage[stage]["kernels"] += 1
        per_stage[stage]["us"] += us
        agg = by_name.setdefault((stage, name), [0.0, 0])
        agg[0] += us
        agg[1] += 1
    n = len(res.acceptance_lengths)
    stages = {s: {"kernels_per_round": v["kernels"] / n, "us_per_round": v["us"] / n}
              for s, v in per_stage.items() if v["kernels"]}
    total = sum(v["us_per_round"] for v in stages.values()) or 1.0
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"method": method, "budget": budget if method == "ddtree" else None, "rounds": n,
            "device": "GPU kernels" if on_gpu else "CPU ops (outermost)", "stages": stages, "us_per_round": total,
            "kernels_per_round": sum(v["kernels_per_round"] for v in stages.values()),
            "top_kernels": [{"name": name[:120], "stage": stage, "us_per_round": v[0] / n, "per_round": v[1] / n,
                             "share": v[0] / n / total} for (stage, name), v in tops]}


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto activity types that are device work


def _device_work(prof, stage_names) -> list[tuple[str, str, float]]:
    """(stage, kernel name, µs) for every GPU event that starts inside a stage's window: from the
    stage span's start to the next span's start (prefill and the host reads have no stage)."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    spans = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                   if e.device_type() == DeviceType.CPU and e.name() in stage_names + ("prefill",))
    starts = [a for a, _, _ in spans]
    out = []
    for e in events:
        # kernels and copies only: not the GPU mirror of annotations, nor synchronisation waits
        if e.device_type() != DeviceType.CUDA or e.duration_ns() <= 0 or not _is_device_work(e, stage_names):
            continue
        i = bisect.bisect_right(starts, e.start_ns()) - 1
        if i < 0 or spans[i][2] == "prefill":
            continue
        out.append((spans[i][2], e.name(), e.duration_ns() / 1e3))
    return out


def _is_device_work(e, stage_names) -> bool:
    if hasattr(e, "activity_type"):  # newer torch says what the event is
        return e.activity_type() in GPU_WORK
    # older: leave out annotations mirrored on the GPU and synchronisation waits by their names
    name = e.name()
    return name not in stage_names + ("prefill",) and "sync" not in name.lower() and not (
        hasattr(e, "is_user_annotation") and e.is_user_annotation())


def _cpu_work(prof, stage_names) -> list[tuple[str, str, float]]:
    """On the CPU the outermost ops of a stage stand in for kernels."""
    out = []
    for e in prof.events():
        parent = e.cpu_parent
        if parent is not None and parent.name in stage_names:
            out.append((parent.name, e.name, e.cpu_time_total))
    return out


