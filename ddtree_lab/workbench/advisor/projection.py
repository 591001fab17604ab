"""A model on one machine, one GPU or an 8-GPU layout: per budget the projected round cost, split into its
measured part (a rank's round time from a bench e2e JSON, where given) and its modelled part (the rank's compute
and memory from the cost model, the layout's communication from layouts.py), tokens/s = τ(B) / cost(B), and the
verdict against budget 8 and against AR with the band the τ inputs' noise gives.

    ddtree-lab advise --model kimi-k2.6 --layout ep8 --machine b300 --tau 8:4.48 16:5.3-6.4
    ddtree-lab advise --model kimi-k2.6 --layout tp8 --machine h200 --external outputs/serving
    ddtree-lab advise outputs/study --model kimi-k2.6 --layout tp8 --machine rtx-pro-6000-server --set link_gbps=25

τ comes from numbers (a range gives the band), from ingested serving runs (external.json: DDTree runs with a
budget and an accept length; several runs of one budget give the band) or from a study (its bootstrap over
prompts, ddtree_lab/stats.py). `ddtree-lab advise` reads its arguments into these (advisor/study.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...names import DEFAULT_ROUTING, _argparse_type, is_budget, parse_budget
from ...stats import BAND, band, resamples
from .cost import round_cost
from .fit import read_bench
from .layouts import Layout, comm_seconds, forward_collectives, rank_load, rank_shape
from .machines import AdvisorError, load_calibration, machine_for_device, parse_set
from .shapes import ModelShape

SCHEMA = "ddtree_lab.layout_advice/1"
REFERENCE_BUDGET = 8   # the verdict's other reference, beside AR
DEFAULT_CONTEXT = 512  # cached tokens a round attends to, without a study (the check's prompt length)


@dataclass
class TauSet:
    """τ per budget: a point, a band and, from a study's bootstrap, the draws (one resample of the prompts per
    column, shared by every budget)."""
    source: str
    point: dict[int, float]
    band: dict[int, tuple[float, float]]
    draws: dict[int, np.ndarray] | None = None
    detail: dict = field(default_factory=dict)


def parse_tau(text: str) -> tuple[int, float, float]:
    """`B:τ` or `B:lo-hi` (a range: its middle, the range the band) -> (budget, lo, hi)."""
    b, sep, tau = str(text).partition(":")
    if not sep:
        raise AdvisorError(f"--tau {text!r}: give BUDGET:TAU or BUDGET:LO-HI, e.g. 8:4.48 16:5.3-6.4")
    try:
        budget = parse_budget(b.strip())
    except ValueError as e:
        raise AdvisorError(f"--tau {text!r}: {e}") from None
    if not is_budget(budget):
        raise AdvisorError(f"--tau {text!r}: budget 'auto' has no one τ; give fixed budgets")
    lo, dash, hi = tau.strip().partition("-")
    try:
        lo_v, hi_v = float(lo), float(hi if dash else lo)
    except ValueError:
        raise AdvisorError(f"--tau {text!r}: {tau!r} is neither a number nor a range LO-HI") from None
    if not lo_v <= hi_v:
        raise AdvisorError(f"--tau {text!r}: the range's low end is above its high end")
    if lo_v < 1 or hi_v > budget + 1:
        raise AdvisorError(f"--tau {text!r}: τ counts the tokens a round emits, 1..{budget + 1} at budget {budget}")
    return budget, lo_v, hi_v


def taus_from_numbers(items: list) -> TauSet:
    parsed = [parse_tau(t) if isinstance(t, str) else t for t in items]
    seen = [b for b, _, _ in parsed]
    dup = sorted({b for b in seen if seen.count(b) > 1})
    if dup:
        raise AdvisorError(f"--tau gives budget {dup[0]} twice")
    return TauSet("numbers (--tau)", {b: (lo + hi) / 2 for b, lo, hi in parsed},
                  {b: (lo, hi) for b, lo, hi in parsed})


def taus_from_external(path: str | os.PathLike) -> TauSet:
    """The DDTree runs of an ingested external.json whose verdict is ok and that carry a budget and an accept length: per budget their mean, the band from the lowest to the
    highest; refused when none, or when they are runs of more than one model."""
    import json

    p = Path(path)
    if p.is_dir():
        raise AdvisorError(f"--external {p} is a folder: give the external.json that ingest wrote in it")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdvisorError(f"--external {p}: not a readable external.json ({e.__class__.__name__})") from None
    runs = [r for r in (doc.get("runs") if isinstance(doc, dict) else None) or [] if isinstance(r, dict)
            and r.get("method") == "ddtree" and r.get("verdict") == "ok" and is_budget(r.get("budget"))
            and isinstance(r.get("accept_length"), (int, float))]
    if not runs:
        raise AdvisorError(f"--external {p}: no DDTree run with a budget and an accept length (verdict ok)")
    models = sorted({str(r["model"]) for r in runs if r.get("model")})
    if len(models) > 1:
        raise AdvisorError(f"--external {p}: DDTree runs of {len(models)} models ({', '.join(models)}); ingest one "
                           "model's files into their own folder")
    per: dict[int, list[float]] = {}
    for r in runs:
        per.setdefault(r["budget"], []).append(float(r["accept_length"]))
    return TauSet(f"serving runs ({p})", {b: float(np.mean(v)) for b, v in sorted(per.items())},
                  {b: (min(v), max(v)) for b, v in sorted(per.items())},
                  detail={"model": models[0] if models else None,
                          "runs": [{"file": r.get("file"), "line": r.get("line"), "budget": r["budget"],
                                    "accept_length": r["accept_length"]} for r in runs]})


def taus_from_study(st: dict, n_boot: int, seed: int = 0) -> TauSet:
    """A study's pooled τ per budget on the prompts every budget ran, its bootstrap draws and their band."""
    per = st["budgets"]
    ids = sorted(set.intersection(*(set(t) for t in per.values())))
    if not ids:
        raise AdvisorError("the DDTree runs share no prompt with recorded rounds")
    budgets = sorted(per)
    accepted, rounds = (np.array([[per[b][i][k] for i in ids] for b in budgets], dtype=float) for k in (0, 1))
    idx = resamples(len(ids), n_boot, seed)
    draws = accepted[:, idx].sum(-1) / rounds[:, idx].sum(-1)        # [budgets, n_boot]
    point = accepted.sum(-1) / rounds.sum(-1)
    return TauSet(f"study {st['study']} (bootstrap over {len(ids)} prompts, {n_boot} resamples)",
                  {b: float(point[i]) for i, b in enumerate(budgets)},
                  {b: tuple(band(draws[i], BAND)) for i, b in enumerate(budgets)},
                  {b: draws[i] for i, b in enumerate(budgets)}, {"prompts": len(ids), "n_boot": n_boot})


def rank_bench_seconds(path: str, machine: str) -> dict:
    """A bench e2e JSON of one rank's shape on the machine: {"ar": s, budget: s, "model", "file"}; refused when
    its device is another machine."""
    b = read_bench(path)
    device = (b.get("environment") or {}).get("device")
    if machine_for_device(device) != machine:
        raise AdvisorError(f"--rank-bench {path}: measured on {device!r}, not on {machine}: its round times are "
                           "that machine's")
    out = {"file": str(path), "model": b.get("model")}
    for r in b.get("rows", []):
        if r.get("method") == "ar":
            out["ar"] = float(r["round_seconds"])
        elif r.get("method") == "ddtree" and is_budget(r.get("budget")):
            out[r["budget"]] = float(r["round_seconds"])
    return out


def verdict(ratio_band: tuple[float, float]) -> str:
    """Against a reference, with the band: better or worse when the whole band says so, else within noise."""
    lo, hi = ratio_band
    return "better" if lo > 1 else "worse" if hi < 1 else "within noise"


def _vs(tps: float, tps_band, ref: float, ref_band, paired: tuple | None = None) -> dict:
    """tokens/s against a reference's: the ratio and its band (paired bootstrap draws where both have them, else
    the ends of the two bands against each other)."""
    if paired is not None:
        lo, hi = band(paired[0] / paired[1], BAND)
    else:
        lo, hi = tps_band[0] / ref_band[1], tps_band[1] / ref_band[0]
    return {"ratio": tps / ref, "band": [lo, hi], "verdict": verdict((lo, hi))}


def project(full: ModelShape, lay: Layout | None, machine, link, taus: TauSet, ctx: int = DEFAULT_CONTEXT,
            cal=None, rank_bench: dict | None = None, figures: dict | None = None) -> dict:
    """The projection document (advice.json): per budget of `taus` and for AR, the round's measured part (the
    rank's round time from `rank_bench`, where it has that budget), its modelled parts (the rank's compute and
    memory where not measured, the layout's communication), tokens/s with the τ band and the two verdicts."""
    cal = cal or load_calibration()
    budgets = sorted(taus.point)
    rank = rank_shape(full, lay) if lay else full
    load = rank_load(full, lay, [1] + [b + 1 for b in budgets]) if lay else None
    rank_bench = rank_bench or {}

    def priced(key, tokens: int) -> dict:
        measured = rank_bench.get(key)
        modelled = None
        if measured is None:
            c = round_cost(rank, machine, "ar" if key == "ar" else "ddtree", None if key == "ar" else key, ctx, cal,
                           load)
            modelled = {"rank_seconds": c.seconds, "stages": c.stages, "parts": c.parts, "dominant": c.dominant}
        coll = forward_collectives(full, lay, link, tokens) if lay else []
        comm = comm_seconds(coll)
        rank_s = measured if measured is not None else modelled["rank_seconds"]
        return {"seconds": rank_s + comm,
                "measured": None if measured is None else {"rank_seconds": measured, "file": rank_bench["file"]},
                "modelled": {"rank": modelled, "comm_seconds": comm,
                             "collectives": [{"kind": c.kind, "count": c.count, "bytes": c.bytes,
                                              "algorithm": c.algorithm, "seconds_each": c.seconds} for c in coll]}}

    ar = priced("ar", 1)
    ar_tps = 1.0 / ar["seconds"]
    rows = []
    for b in budgets:
        rnd = priced(b, b + 1)
        tps = taus.point[b] / rnd["seconds"]
        lo, hi = (x / rnd["seconds"] for x in taus.band[b])
        rows.append({"budget": b, "tau": taus.point[b], "tau_band": list(taus.band[b]), "round": rnd,
                     "tokens_per_second": tps, "band": [lo, hi],
                     "vs_ar": {"ratio": tps / ar_tps, "band": [lo / ar_tps, hi / ar_tps],
                               "verdict": verdict((lo / ar_tps, hi / ar_tps))}})
    ref = next((r for r in rows if r["budget"] == REFERENCE_BUDGET), None)
    for r in rows:
        if ref is None or r is ref:
            r["vs_budget8"] = None if ref is None else {"ratio": 1.0, "band": [1.0, 1.0], "verdict": "reference"}
            continue
        paired = None
        if taus.draws is not None:
            paired = (taus.draws[r["budget"]] / r["round"]["seconds"], taus.draws[REFERENCE_BUDGET] / ref["round"]["seconds"])
        r["vs_budget8"] = _vs(r["tokens_per_second"], r["band"], ref["tokens_per_second"], ref["band"], paired)
    best = max(rows, key=lambda r: (r["tokens_per_second"], -r["budget"]))
    return {"schema": SCHEMA, "projection": True, "model": full.name, "rank_shape": rank.name,
            "layout": None if lay is None else {"name": lay.name, "attention": lay.attention, "ranks": lay.ranks},
            "machine": {"name": machine.name, "title": machine.title, "source": machine.source, "url": machine.url,
                        "interconnect": None if link is None or lay is None else
                        {"kind": link.kind, "title": link.title, "source": link.source, "url": link.url},
                        "figures": figures or {}},
            "context_tokens": ctx, "routing": DEFAULT_ROUTING if full.num_experts else None,
            "tau_source": {"source": taus.source, **taus.detail},
            "rank_bench": {k: v for k, v in rank_bench.items() if k in ("file", "model")} or None,
            "ar": {"round": ar, "tokens_per_second": ar_tps}, "rows": rows, "best_budget": best["budget"],
            "reference_budget": REFERENCE_BUDGET,
            "note": None if ref else f"no τ at budget {REFERENCE_BUDGET}: no verdict against it"}


def _ms(s: float) -> str:
    return f"{s * 1e3:8.2f}"


def projection_table(doc: dict) -> str:
    """The plain-text table `ddtree-lab advise` prints for a projection."""
    lay = doc["layout"]
    where = f"as {lay['name']}" + (f" (attention {lay['attention']})" if lay["name"] == "ep8" else "") if lay else "on one GPU"
    link = doc["machine"]["interconnect"]
    lines = [f"A PROJECTION: {doc['model']} {where} on {doc['machine']['name']} ({doc['machine']['title']}"
             + (f"; {link['title']}" if link else "") + f"), context {doc['context_tokens']} tokens"
             + (f", {doc['routing']} routing" if doc["routing"] else ""),
             f"τ from {doc['tau_source']['source']}; round ms = rank (measured or modelled) + communication "
             "(modelled)",
             f"{'budget':>6} {'τ':>5} {'τ band':>13} {'rank ms':>8} {'':6} {'comm ms':>8} {'round ms':>8} "
             f"{'tok/s':>8} {'tok/s band':>17}  {'vs B=8 [band]':<32} vs AR [band]"]

    def rank_cells(rnd):
        m = rnd["measured"]
        return (_ms(m["rank_seconds"]), "meas. ") if m else (_ms(rnd["modelled"]["rank"]["rank_seconds"]), "model ")

    ar = doc["ar"]
    rc, how = rank_cells(ar["round"])
    lines.append(f"{'AR':>6} {1.0:5.2f} {'':>13} {rc} {how} {_ms(ar['round']['modelled']['comm_seconds'])} "
                 f"{_ms(ar['round']['seconds'])} {ar['tokens_per_second']:8.1f}")
    for r in doc["rows"]:
        rc, how = rank_cells(r["round"])
        tb = "" if r["tau_band"][0] == r["tau_band"][1] else f"[{r['tau_band'][0]:.2f}, {r['tau_band'][1]:.2f}]"
        v8 = r["vs_budget8"]
        v8s = ("–" if v8 is None else "reference" if v8["verdict"] == "reference" else
               f"{v8['ratio']:.2f}× [{v8['band'][0]:.2f}, {v8['band'][1]:.2f}] {v8['verdict']}")
        va = r["vs_ar"]
        mark = "*" if r["budget"] == doc["best_budget"] else " "
        lines.append(f"{r['budget']:>6} {r['tau']:5.2f} {tb:>13} {rc} {how} "
                     f"{_ms(r['round']['modelled']['comm_seconds'])} {_ms(r['round']['seconds'])} "
                     f"{r['tokens_per_second']:8.1f}{mark}[{r['band'][0]:7.1f}, {r['band'][1]:7.1f}]  {v8s:<32} "
                     f"{va['ratio']:.2f}× [{va['band'][0]:.2f}, {va['band'][1]:.2f}] {va['verdict']}")
    changed = [f"{k} {v['value']:g} ({v['origin']}; table {v['table'] if v['table'] is not None else '–'})"
               for k, v in doc["machine"]["figures"].items() if v["origin"] != "machines.json"]
    if changed:
        lines.append("your figures: " + ", ".join(changed))
    if doc.get("note"):
        lines.append(doc["note"])
    return "\n".join(lines)


set_arg = _argparse_type(parse_set)    # --set KEY=VALUE, refused at parse in one line
tau_arg = _argparse_type(parse_tau)    # --tau B:τ or B:LO-HI, the same
