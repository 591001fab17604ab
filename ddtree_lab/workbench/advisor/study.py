"""The budget advisor on a study: expected tokens/s(B) = E[τ(B)] / cost(B) per machine, the best budget
with a bootstrap band over prompts, `advice.json`, and the `ddtree-lab advise` command (a layout, τ numbers or
serving runs, or the user's machine figures: projection.py).

    ddtree-lab advise outputs/quickstart --machine h200 --machine rtx-pro-6000 --model random:qwen3-8b
    ddtree-lab advise --model kimi-k2.6 --layout ep8 --machine b300 --tau 8:4.48 16:5.3-6.4

τ comes from the study's runs; cost(B) from the first-principles model (`advisor/cost.py`) for the chosen
model shape on each machine, so every figure here is a projection unless the machine and shape are the
ones the study ran on.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from ...atomic import atomic_write_json
from ...names import positive_int
from ...stats import BAND, band, resamples
from .. import advisor as A
from . import projection as P
from ..figures import grid_rows, run_config
from ..results import collect_study, load_traces, text_can_drift
from ..runs import is_fixed

ADVICE_FILE = "advice.json"
SCHEMA = "ddtree_lab.advice/1"
N_BOOT = 1000
DEFAULT_PROJECTION = "random:qwen3-8b"  # a real-size target for the named pairs, which are laptop-size


def _prompt_taus(res: dict) -> dict[str, tuple[int, int]]:
    """{prompt id: (tokens accepted over all rounds, rounds)}."""
    return {p["id"]: (sum(p.get("acceptance_lengths") or []), len(p.get("acceptance_lengths") or []))
            for p in res.get("prompts", []) if p.get("acceptance_lengths")}


def study_taus(study_dir: str | os.PathLike) -> dict:
    """The study's measured τ per prompt, per budget (the first DDTree series with most budgets), plus
    AR, DFlash and the series' `auto` run (a measured reference, never a point of the fits); refused with
    what is missing."""
    study_dir = Path(study_dir)
    if not study_dir.is_dir():
        raise A.AdvisorError(f"no study directory {study_dir}")
    rows = [r for r in grid_rows(collect_study(study_dir)) if r.get("results") and r["status"] == "complete"]
    ar = next((r for r in rows if run_config(r).get("method") == "ar"), None)
    if ar is None:
        raise A.AdvisorError(f"{study_dir}: no complete AR run (add 'ar' to methods): the advisor needs the "
                             "AR step as the reference")
    series: dict[tuple, dict[int, dict]] = {}
    autos: dict[tuple, dict] = {}
    for r in rows:
        cfg = run_config(r)
        key = (cfg.get("topk") or 0, cfg.get("temperature", 0.0))
        if cfg.get("method") == "ddtree" and is_fixed(cfg.get("budget")) and cfg["budget"]:
            series.setdefault(key, {})[cfg["budget"]] = r
        elif cfg.get("method") == "ddtree" and cfg.get("budget"):
            autos[key] = r
    if not series:
        raise A.AdvisorError(f"{study_dir}: no complete DDTree run (add 'ddtree' to methods and budgets "
                             "to grid.budget)")
    key, runs = max(series.items(), key=lambda kv: (len(kv[1]), -kv[0][1]))
    if len(runs) < 2:
        raise A.AdvisorError(f"{study_dir}: a single DDTree budget ({next(iter(runs))}); the advisor compares "
                             "budgets: give grid.budget at least two values")
    dflash = next((r for r in rows if run_config(r).get("method") == "dflash"
                   and run_config(r).get("temperature", 0.0) == key[1]), None)
    res = ar["results"]
    prompts = res.get("prompts", [])
    ntok = [p.get("n_prompt_tokens") or 0 for p in prompts]
    ctx = int(sum(ntok) / max(1, len(ntok)) + (res.get("config") or {}).get("max_new_tokens", 0) / 2)
    cfg = res.get("config") or {}
    return {"study": study_dir.name, "pair": cfg.get("pair") or "",
            "dirs": ((cfg["target_dir"], cfg["drafter_dir"])
                     if cfg.get("target_dir") and cfg.get("drafter_dir") else None),
            "device": (res.get("device") or {}), "topk": key[0], "temperature": key[1], "context_tokens": ctx,
            "budgets": {b: _prompt_taus(r["results"]) for b, r in sorted(runs.items())},
            # whether each budget emitted AR's text (results.losslessness): τ(B) compares one text only then
            "texts": {b: (r.get("comparison") or {}).get("verdict") for b, r in sorted(runs.items())},
            "numerics": {k: cfg.get(k) for k in ("dtype", "attention")},
            "dflash": _prompt_taus(dflash["results"]) if dflash else None,
            "auto": _auto_taus(autos.get(key)),
            "traces": {b: load_traces(r["dir"]) for b, r in sorted(runs.items())},
            # AR's and DFlash's rounds: the routing of one token and of a block, beside the trees'
            "other_traces": [t for r in (ar, dflash) if r is not None for t in load_traces(r["dir"])],
            "stage_points": {b: {k: v / max(1, r["results"]["summary"].get("rounds") or 1)
                                 for k, v in (r["results"]["summary"].get("stage_seconds") or {}).items()}
                             for b, r in sorted(runs.items())}}


def _auto_taus(row: dict | None) -> dict | None:
    """An `auto` run's τ per prompt and the share of its rounds at each budget."""
    if row is None:
        return None
    auto = (row["results"].get("summary") or {}).get("auto") or {}
    return {"run": row["name"], "taus": _prompt_taus(row["results"]), "budget_share": auto.get("budget_share")}


def _tau(per_prompt: dict[str, tuple[int, int]], ids: list[str]) -> float:
    acc = sum(per_prompt[i][0] for i in ids if i in per_prompt)
    rounds = sum(per_prompt[i][1] for i in ids if i in per_prompt)
    return acc / rounds if rounds else float("nan")


def best_budget(taus: dict[int, dict], costs: dict[int, float], n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """tokens/s(B) = τ(B)/cost(B), the best B, and a bootstrap over prompts (the same resample for every
    budget, since the prompts are shared): a band per budget and how often each budget wins."""
    ids = sorted(set.intersection(*(set(t) for t in taus.values())))
    if not ids:
        raise A.AdvisorError("the DDTree runs share no prompt with recorded rounds")
    point = {b: _tau(taus[b], ids) / costs[b] for b in taus}
    budgets = sorted(taus)
    accepted, rounds = (np.array([[taus[b][i][k] for i in ids] for b in budgets], dtype=float) for k in (0, 1))
    idx = resamples(len(ids), n_boot, seed)
    draws = accepted[:, idx].sum(-1) / rounds[:, idx].sum(-1) / np.array([costs[b] for b in budgets])[:, None]
    wins = np.bincount(draws.argmax(0), minlength=len(budgets))  # argmax takes the first: ties to the smaller B
    best = max(point, key=lambda b: (point[b], -b))
    return {"best": best, "tokens_per_second": point,
            "band": {b: band(draws[i], BAND) for i, b in enumerate(budgets)},
            "best_frequency": {b: int(w) / n_boot for b, w in zip(budgets, wins) if w}, "prompts": len(ids),
            "n_boot": n_boot}


def advised_shape(st: dict, model: str | None = None) -> "A.ModelShape":
    """The shape a study's τ is priced on, one rule for `ddtree-lab advise` and the report: `model` when given;
    else the study's own (a `random:<shape>` pair, or its checkpoint directories); else, for a named pair,
    DEFAULT_PROJECTION."""
    if model:
        return A.model_shape(model)
    if st["pair"].startswith("random:"):
        return A.model_shape(st["pair"])
    if not st["pair"] and st["dirs"]:
        return A.shape_from_dirs(*st["dirs"])
    return A.model_shape(DEFAULT_PROJECTION)


def bench_files(study_dir: str | os.PathLike, bench: list[str] | None = None) -> list[str]:
    """The bench e2e JSONs that give the `measured` machine: those given, else the study's bench/e2e*.json."""
    return [str(p) for p in bench or sorted(Path(study_dir).glob("bench/e2e*.json"))]


def advise(study_dir: str | os.PathLike, machines: list[str] | None = None, model: str | None = None,
           bench: list[str] | None = None, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """The advice.json dict of a study: what it measured, then per machine the projected budgets, the study's
    own stage-time fit and the cost model's check."""
    for m in machines or []:
        A.check_machine_name(m)
    st = study_taus(study_dir)
    shape = advised_shape(st, model)
    if not st["pair"] and st["dirs"]:
        st["pair"] = str(st["dirs"][0])  # a study of checkpoint directories goes by its target's, as its shape
    cal = A.load_calibration()
    bench = bench_files(study_dir, bench)
    bench_data = [A.read_bench(p) for p in bench]
    measured = next((b for b in bench_data if (b.get("roofline") or {}).get("copy_bytes_per_second")), None)
    load = A.expert_load([r for t in st["traces"].values() for r in t] + st["other_traces"])
    out = measured_section(st, shape.name, cal, load)
    own_load = load if shape.name == st["pair"] else None  # a measured expert union prices the study's own shape
    for name in machines or [*A.profile_names(), *([A.MEASURED] if measured else [])]:
        out["machines"][name] = machine_advice(st, out["tau"], shape, A.get_machine(name, measured, cal), cal,
                                               own_load, n_boot, seed)
    out["measured_fit"] = measured_fit(st)
    out["check"] = model_check(bench or A.shipped_bench_files())
    return out


def measured_section(st: dict, shape_name: str, cal, load) -> dict:
    """What the study measured, before any machine: τ per budget on the prompts every budget ran, DFlash's and
    auto's τ, the texts' verdict, the draft's confidence against τ and the expert union its traces counted."""
    all_ids = sorted(set.intersection(*(set(t) for t in st["budgets"].values())))
    return {"schema": SCHEMA, "study": st["study"], "study_pair": st["pair"], "model": shape_name,
            "projection": True, "context_tokens": st["context_tokens"], "topk": st["topk"],
            "temperature": st["temperature"], "budgets": sorted(st["budgets"]),
            "tau": {b: _tau(t, all_ids) for b, t in st["budgets"].items()},
            "tau_dflash": _tau(st["dflash"], sorted(st["dflash"])) if st["dflash"] else None,
            "tau_auto": ({"run": st["auto"]["run"], "tau": _tau(st["auto"]["taus"], all_ids),
                          "budget_share": st["auto"]["budget_share"]} if st["auto"] else None),
            "texts": texts_note(st["texts"], st["numerics"]), "calibration": dataclasses.asdict(cal),
            # the calibration budget="auto" would use, and (MoE traces) the measured expert-union curve
            "tau_calibration": {b: A.tau_calibration(t) for b, t in st["traces"].items()},
            "experts_touched": dict(load.touched) if load else None,
            "expert_row_blocks": dict(load.row_blocks) if load and load.row_blocks else None,
            "machines": {}}


def machine_advice(st: dict, tau: dict, shape, m, cal, load, n_boot: int, seed: int) -> dict:
    """One machine: each budget's modelled round cost and projected tokens/s with its band, the best budget,
    AR, and budget="auto" replayed on the largest tree's rounds (smaller trees are their prefixes)."""
    ctx, budgets = st["context_tokens"], sorted(st["budgets"])
    costs = {b: A.round_cost(shape, m, "ddtree", b, ctx, cal, load) for b in budgets}
    round_seconds = {b: c.seconds for b, c in costs.items()}
    ar = A.round_cost(shape, m, "ar", None, ctx, cal, load)
    bb = best_budget(st["budgets"], round_seconds, n_boot, seed)
    ar_tps = 1.0 / ar.seconds
    rows = [{"budget": b, "tau": tau[b], "cost_seconds": c.seconds, "stages": c.stages, "parts": c.parts,
             "dominant": c.dominant, "tokens_per_second": bb["tokens_per_second"][b], "band": bb["band"][b],
             "speedup": bb["tokens_per_second"][b] / ar_tps} for b, c in costs.items()]
    best = next(r for r in rows if r["budget"] == bb["best"])
    largest = st["traces"][budgets[-1]]
    return {"title": m.title, "source": m.source, "url": m.url, "bandwidth": m.bandwidth, "flops": m.flops,
            "ar": {"cost_seconds": ar.seconds, "tokens_per_second": ar_tps, "dominant": ar.dominant},
            "rows": rows, "best": {**best, "best_frequency": bb["best_frequency"]}, "prompts": bb["prompts"],
            "n_boot": n_boot, "auto_replay": A.replay_auto(largest, round_seconds),
            "auto_ceiling": A.auto_ceiling(largest, round_seconds)}


def measured_fit(st: dict) -> dict:
    """The study's own stage times fitted on the machine it ran on, or why not (too few budgets)."""
    try:
        fit = A.fit_stage_times(st["stage_points"], f"{st['study']} stage times")
    except A.AdvisorError as e:
        return {"refused": str(e)}
    return {"kind": fit.kind, "coeffs": fit.coeffs, "loo": fit.loo, "max_loo": fit.max_loo, "device": st["device"]}


def model_check(files: list[str]) -> dict:
    """The cost model against bench e2e round times, each file under the calibration its settings ran with
    (compiled or eager layers); a note asking for --bench when there are none."""
    if files:
        return A.check_bench(files)
    return {"checked": [], "skipped": [], "passed": False,
            "note": "this install ships no bench e2e JSON to check the model against; give --bench FILE"}


def texts_note(verdicts: dict, numerics: dict) -> dict:
    """Whether the budgets' τ were measured on one text (every budget equal to AR's), and what to do if not."""
    differ = [b for b, v in verdicts.items() if v == "mismatch"]
    note = None
    if differ:
        note = (f"budget{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} emitted other text than AR "
                "on some prompt, so τ(B) compares different texts")
        if text_can_drift(numerics):
            note += f" ({numerics['dtype']} numerics); attention: invariant measures every budget on AR's text"
    return {"verdicts": verdicts, "one_text": not differ, "differ": differ, "note": note, **numerics}


def write_advice(study_dir: str | os.PathLike, advice: dict, out: str | os.PathLike | None = None) -> Path:
    path = Path(out) if out else Path(study_dir) / ADVICE_FILE
    atomic_write_json(path, advice)
    return path


def advice_table(advice: dict) -> str:
    """The plain-text table `ddtree-lab advise` prints."""
    lines = [f"{advice['study']}: τ measured on {advice['study_pair'] or '?'}, cost of {advice['model']} "
             f"(a projection), context {advice['context_tokens']} tokens",
             "budget  τ     " + "".join(f"{n:>22}" for n in advice["machines"])]
    for i, b in enumerate(advice["budgets"]):
        cells = []
        for mach in advice["machines"].values():
            r = mach["rows"][i]
            mark = "*" if mach["best"]["budget"] == b else " "
            cells.append(f"{r['tokens_per_second']:9.1f} tok/s {r['cost_seconds'] * 1e3:6.2f}ms{mark}")
        lines.append(f"{b:>6}  {advice['tau'][b]:4.2f}  " + "".join(f"{c:>22}" for c in cells))
    lines.append("best (90 % band, speedup over AR, dominant cost):")
    for name, mach in advice["machines"].items():
        best = mach["best"]
        lines.append(f"  {name:<13} B={best['budget']:<5} {best['tokens_per_second']:8.1f} tok/s "
                     f"[{best['band'][0]:.1f}, {best['band'][1]:.1f}]  {best['speedup']:.2f}× AR  "
                     f"{A.PART_TITLES[best['dominant']]}")
    if (advice.get("texts") or {}).get("note"):
        lines.append(f"texts: {advice['texts']['note']}")
    auto = advice.get("tau_auto")
    if auto:
        share = ", ".join(f"{b}: {100 * v:.0f}%" for b, v in (auto.get("budget_share") or {}).items() if v)
        lines.append(f"auto (measured, {auto['run']}): τ {auto['tau']:.2f}; budgets chosen {share or '?'}")
    for name, mach in advice["machines"].items():
        rep = mach.get("auto_replay")
        if rep:
            share = ", ".join(f"{b}: {100 * v:.0f}%" for b, v in rep["budget_share"].items())
            lines.append(f"  auto (replayed on B={advice['budgets'][-1]} traces) on {name}: "
                         f"{rep['tokens_per_second']:.1f} tok/s, {rep['vs_best_fixed']:.3f}× the best fixed "
                         f"(B={rep['best_fixed']}); budgets chosen {share}")
        ceiling = mach.get("auto_ceiling")
        if ceiling:
            lines.append(f"    any choice on those rounds, ÷ the best fixed: one budget per confidence bin "
                         f"{ceiling['per_bin']:.3f}×, each round's best in hindsight {ceiling['per_round']:.3f}×")
    chk = advice.get("check") or {}
    if chk.get("checked"):
        lines.append("model check (%s, within %d %%): %s" % (
            chk["gate"], round(100 * chk["tolerance"]),
            ", ".join(f"{c['file']} max {100 * c['max_error']:.1f}%" for c in chk["checked"])))
        if not chk["passed"]:
            lines.append("WARNING: the cost model misses a checked bench file by more than the tolerance; "
                         "treat these projections as unreliable (docs/workbench.md, 'The budget advisor')")
    return "\n".join(lines)


def add_advise_args(p) -> None:
    p.description = ("Expected tokens/s per budget on each machine from a study's measured τ and the round cost "
                     "model; with --layout, --tau, --external or your machine's figures, a projection of one model "
                     "on one machine (one GPU, tp8 or ep8). Prints a table and writes advice.json.")
    p.add_argument("study_dir", nargs="?", default=None,
                   help="a study output directory, e.g. outputs/quickstart (its τ per budget)")
    p.add_argument("--machine", action="append", default=None,
                   help=f"a machine profile (repeatable): {', '.join(A.known_machines())}; default: all "
                        "(a projection: exactly one)")
    p.add_argument("--model", default=None, help="the shape whose cost τ is applied to, e.g. random:qwen3-8b or a "
                                                 f"whole model ({', '.join(A.FULL_MODELS)}) (default: the study's "
                                                 f"own, {DEFAULT_PROJECTION} for a named pair)")
    p.add_argument("--layout", choices=A.LAYOUTS, default=None,
                   help="8 GPUs: tp8 (two all-reduces a layer) or ep8 (experts placed, dispatch and combine); "
                        "default: one GPU")
    p.add_argument("--attention-layout", choices=A.ATTENTION_LAYOUTS, default=None,
                   help="ep8's attention: tp (split over the ranks) or dp (whole on the sequence's rank); default tp")
    p.add_argument("--tau", nargs="+", type=P.tau_arg, default=None, metavar="B:TAU",
                   help="τ per budget as numbers, e.g. 8:4.48 16:5.3-6.4 (a range gives the band)")
    p.add_argument("--external", default=None, metavar="EXTERNAL_JSON",
                   help="τ per budget from ingested serving runs (ddtree-lab ingest's external.json)")
    p.add_argument("--machine-file", default=None,
                   help=f"your measured figures (JSON or YAML mapping), keys: {', '.join(A.OVERRIDES)}")
    p.add_argument("--set", action="append", type=P.set_arg, default=None, metavar="KEY=VALUE",
                   help="one measured figure over the table's (repeatable; after --machine-file), e.g. link_gbps=25")
    p.add_argument("--rank-bench", default=None,
                   help="a bench e2e JSON of one rank's shape on the machine: the round's measured part")
    p.add_argument("--context", type=positive_int, default=None,
                   help=f"cached tokens a round attends to (default: the study's, else {P.DEFAULT_CONTEXT})")
    p.add_argument("--bench", action="append", default=None,
                   help="bench e2e JSON(s): the model check and the 'measured' machine (default: the study's "
                        "bench/e2e*.json, else, for the check, the files shipped with the package)")
    p.add_argument("--out", default=None, help="where to write advice.json (default: STUDY_DIR/advice.json, "
                                               "without a study ./advice.json)")
    p.add_argument("--boot", type=positive_int, default=N_BOOT, help="bootstrap resamples over prompts")


def wants_projection(args) -> bool:
    """`advise` projects (projection.py) when asked for a layout, τ numbers, serving runs, a measured rank or the
    user's machine figures, or when no study is given."""
    return bool(args.study_dir is None or args.layout or args.attention_layout or args.tau or args.external
                or args.machine_file or args.set or args.rank_bench)


def machine_overrides(args) -> tuple[dict, dict]:
    """--machine-file then --set (a --set wins): ({key: value}, {key: where it came from})."""
    values, origins = {}, {}
    if args.machine_file:
        for k, v in A.read_machine_file(args.machine_file).items():
            values[k], origins[k] = v, str(args.machine_file)
    for k, v in args.set or []:
        values[k], origins[k] = v, "--set"
    return values, origins


def advise_projection(args) -> tuple[dict, Path]:
    """The projection `ddtree-lab advise` runs from its arguments, and where its advice.json goes."""
    sources = [s for s in ("study_dir", "tau", "external") if getattr(args, s)]
    if not sources:
        raise A.AdvisorError("give τ per budget: a study directory, --tau 8:4.48 16:5.3-6.4, or --external "
                             "(an ingested external.json)")
    if len(sources) > 1:
        names = {"study_dir": "a study directory", "tau": "--tau", "external": "--external"}
        raise A.AdvisorError("give τ one way: " + " or ".join(names[s] for s in sources))
    if len(args.machine or []) != 1:
        raise A.AdvisorError(f"a projection prices one machine: give one --machine ({', '.join(A.profile_names())})")
    if args.attention_layout and args.layout != "ep8":
        raise A.AdvisorError("--attention-layout goes with --layout ep8")
    lay = A.get_layout(args.layout, args.attention_layout) if args.layout else None
    values, origins = machine_overrides(args)
    machine, link, figures = A.machine_profile(args.machine[0], values, origins, need_link=lay is not None)
    if args.study_dir:
        st = study_taus(args.study_dir)
        taus, shape = P.taus_from_study(st, args.boot), advised_shape(st, args.model)
        ctx, out = args.context or st["context_tokens"], Path(args.out or Path(args.study_dir) / ADVICE_FILE)
    else:
        if not args.model:
            raise A.AdvisorError(f"give --model, the model to price: e.g. {', '.join(A.FULL_MODELS)} or "
                                 f"{DEFAULT_PROJECTION}")
        taus = P.taus_from_numbers(args.tau) if args.tau else P.taus_from_external(args.external)
        shape, ctx, out = A.model_shape(args.model), args.context or P.DEFAULT_CONTEXT, Path(args.out or ADVICE_FILE)
    bench = P.rank_bench_seconds(args.rank_bench, args.machine[0]) if args.rank_bench else None
    return P.project(shape, lay, machine, link, taus, ctx, rank_bench=bench, figures=figures), out


def run_advise_cli(args) -> int:
    if wants_projection(args):
        doc, path = advise_projection(args)
        atomic_write_json(path, doc)
        print(P.projection_table(doc))
        print(f"advice: {path}")
        return 0
    advice = advise(args.study_dir, args.machine, args.model, args.bench, n_boot=args.boot)
    path = write_advice(args.study_dir, advice, args.out)
    print(advice_table(advice))
    print(f"advice: {path}")
    return 0


def load_advice(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())
