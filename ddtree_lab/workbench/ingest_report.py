"""The report part of `ddtree-lab ingest`: figures and an HTML section for runs measured by serving
stacks, as a page of its own (`write_page`) or inside a study's report (`add_section`).

Input is the external.json document (see `ingest`), so a page can be rebuilt from that file alone.
The page machinery (layout, CSS, tables, error hooks, plotly.js embedded once) is the study report's.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import plotly.graph_objects as go

from ..atomic import atomic_write_text
from ..names import AUTO
from . import routing_report
from .figures import budget_axis
from .page import Page, esc, fmt_num, html_table

PROBLEMS = ("failed", "truncated", "partial", "garbage", "suspect")
_CLASS = {"ok": "ok", "suspect": "na", "partial": "bad", "garbage": "bad", "truncated": "bad", "failed": "bad"}


def _verdict(v: str) -> str:
    return f'<span class="{_CLASS.get(v, "na")}">{esc(v)}</span>'


def _usable(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r.get("verdict") in ("ok", "suspect")]


def _series_label(r: dict) -> str:
    topk = r.get("topk")
    parts = [r.get("engine"), r.get("model"), r.get("method"),
             f"topk {topk}" if topk else None, f"c{r['concurrency']}" if r.get("concurrency") else None,
             f"tp{r['tp']}" if r.get("tp") else None]
    return " · ".join(str(p) for p in parts if p)


def _baseline_label(r: dict) -> str:
    parts = [r.get("engine"), r.get("model"), "AR", f"c{r['concurrency']}" if r.get("concurrency") else None]
    return " · ".join(str(p) for p in parts if p)


METRICS = {
    "output_throughput": ("output throughput vs budget (serving stacks)", "output tokens / s", "{:.0f}"),
    "mean_tpot_ms": ("time per output token vs budget (serving stacks)", "mean TPOT (ms)", "{:.2f}"),
    "accept_length": ("acceptance length vs budget (serving stacks)", "accept length (tokens per round)", "{:.2f}"),
    "speedup_over_ar": ("speedup over AR vs budget (serving stacks)", "speedup ×", "{:.2f}"),
}


def sweep_figure(runs: list[dict], metric: str) -> go.Figure:
    """One line per (engine, model, method, topk, concurrency, tp) over budget, for usable runs; the
    AR runs' values as dotted lines where the metric applies to them."""
    title, ylabel, _ = METRICS[metric]
    series: dict[str, list[dict]] = {}
    for r in _usable(runs):
        if r.get("method") != "ar" and r.get("budget") and r.get(metric) is not None:
            series.setdefault(_series_label(r), []).append(r)
    fig = go.Figure()
    for label, rs in sorted(series.items()):
        rs.sort(key=lambda r: r["budget"])
        fig.add_scatter(x=[r["budget"] for r in rs], y=[r[metric] for r in rs], mode="lines+markers",
                        name=label,
                        text=[f"{os.path.basename(r['file'])}:{r['line']} ({r['verdict']})" for r in rs],
                        hovertemplate="%{text}<br>budget %{x}: %{y:.3f}<extra></extra>")
    if metric in ("output_throughput", "mean_tpot_ms"):
        for r in _usable(runs):
            if r.get("method") == "ar" and r.get(metric) is not None:
                fig.add_hline(y=r[metric], line=dict(dash="dot", color="#888"),
                              annotation_text=f"{_baseline_label(r)}: {r[metric]:.1f}",
                              annotation_position="top left")
    if metric == "speedup_over_ar":
        fig.add_hline(y=1.0, line=dict(dash="dot", color="#888"), annotation_text="AR",
                      annotation_position="top left")
    fig.update_layout(title=dict(text=title), template="plotly_white", height=400,
                      margin=dict(l=55, r=20, t=60, b=45),
                      xaxis=dict(title=dict(text="tree budget (nodes)"),
                                 **budget_axis([x for trace in fig.data for x in trace.x])),
                      yaxis=dict(title=dict(text=ylabel)))
    return fig


def runs_table_html(runs: list[dict]) -> str:
    order = {v: i for i, v in enumerate(("ok", "suspect", "partial", "garbage", "truncated", "failed"))}
    body = []
    for r in sorted(runs, key=lambda r: (r.get("engine") or "", r.get("model") or "", r.get("method") or "",
                                         r.get("concurrency") or 0, r.get("budget") or 0,
                                         order.get(r["verdict"], 9), r["file"], r["line"])):
        src = r.get("sources") or {}
        settings = ", ".join(f"{k} {r[k]}" + ("*" if src.get(k) == "filename" else "")
                             for k in ("budget", "topk", "draft_window", "concurrency", "tp") if r.get(k) is not None)
        body.append([f'<span title="{esc(r["file"])}">{esc(os.path.basename(r["file"]))}:{r["line"]}</span>',
                     esc(r.get("tool") or "–"), esc(r.get("model") or "–"), esc(r.get("method") or "–"),
                     esc(settings or "–"), _verdict(r["verdict"]),
                     f'<td class="num">{fmt_num(r.get("completed"), "{}")}</td>',
                     f'<td class="num">{fmt_num(r.get("failed"), "{}")}</td>',
                     f'<td class="num">{fmt_num(r.get("output_throughput"), "{:.1f}")}</td>',
                     f'<td class="num">{fmt_num(r.get("mean_tpot_ms"))}</td>',
                     f'<td class="num">{fmt_num(r.get("accept_length"))}</td>',
                     f'<td class="num">{fmt_num(r.get("speedup_over_ar"))}</td>'])
    return html_table(["run (file:line)", "tool", "model", "method", "settings", "verdict", "completed", "failed",
                   "output tok/s", "TPOT ms", "accept length", "speedup"], body)


def problems_html(runs: list[dict]) -> str:
    bad = [r for r in runs if r["verdict"] in PROBLEMS]
    if not bad:
        return "<p class='ok'>None: every run completed and its outputs look sound.</p>"
    bad.sort(key=lambda r: (PROBLEMS.index(r["verdict"]), r["file"], r["line"]))
    return html_table(["run (file:line)", "verdict", "reason"],
                  [[esc(f"{r['file']}:{r['line']}"), _verdict(r["verdict"]), esc(r.get("reason"))] for r in bad])


def thresholds_html(thresholds: dict) -> str:
    return ("<p class='sub'>Garbage and failure thresholds (see docs/workbench.md):</p>"
            + html_table(["threshold", "value"], [[f"<code>{esc(k)}</code>", esc(v)] for k, v in thresholds.items()]))


def workbench_taus(rows: list[dict]) -> list[dict]:
    """The study's own complete DDTree/DFlash runs (rows of `collect_study`): method, budget, topk, τ. An
    `auto` run is left out: a serving stack reports fixed budgets, so it has nothing to stand beside."""
    out = []
    for r in rows:
        res = r.get("results") or {}
        cfg, tau = res.get("config") or {}, (res.get("summary") or {}).get("mean_tau")
        if r.get("kind") == "run" and r.get("status") == "complete" and cfg.get("method") in ("ddtree", "dflash") \
                and tau is not None and cfg.get("budget") != AUTO:
            out.append({"run": r["name"], "method": cfg["method"], "budget": cfg.get("budget"),
                        "topk": cfg.get("topk") or None, "tau": tau})
    return out


def compare_figure(mine: list[dict], runs: list[dict]) -> go.Figure:
    fig = go.Figure()
    for m in sorted({(w["method"], w["topk"]) for w in mine}, key=str):
        ws = sorted((w for w in mine if (w["method"], w["topk"]) == m), key=lambda w: w["budget"] or 0)
        fig.add_scatter(x=[w["budget"] for w in ws], y=[w["tau"] for w in ws], mode="lines+markers",
                        name=f"workbench {m[0]}" + (f", topk {m[1]}" if m[1] else ""), text=[w["run"] for w in ws],
                        hovertemplate="%{text}<br>budget %{x}: τ %{y:.3f}<extra></extra>")
    theirs: dict[str, list[dict]] = {}
    for r in _usable(runs):
        if r.get("accept_length") is not None and r.get("budget"):
            theirs.setdefault(_series_label(r), []).append(r)
    for label, rs in sorted(theirs.items()):
        rs.sort(key=lambda r: r["budget"])
        fig.add_scatter(x=[r["budget"] for r in rs], y=[r["accept_length"] for r in rs], mode="lines+markers",
                        name=f"reported: {label}", line=dict(dash="dash"),
                        marker=dict(symbol="diamond"), hovertemplate="budget %{x}: %{y:.3f}<extra></extra>")
    fig.update_layout(title=dict(text="τ per budget: measured here vs reported by serving stacks"),
                      template="plotly_white", height=400, margin=dict(l=55, r=20, t=60, b=45),
                      xaxis=dict(title=dict(text="tree budget (nodes)"),
                                 **budget_axis([x for trace in fig.data for x in trace.x])),
                      yaxis=dict(title=dict(text="tokens per target forward")))
    return fig


def compare_table_html(mine: list[dict], runs: list[dict]) -> str:
    theirs: dict[tuple, list[dict]] = {}
    for r in _usable(runs):
        if r.get("accept_length") is not None:
            theirs.setdefault((r.get("method"), r.get("budget"), r.get("topk")), []).append(r)
    body, used = [], set()
    for w in sorted(mine, key=lambda w: (w["method"], w["topk"] or 0, w["budget"] or 0)):
        key = (w["method"], w["budget"], w["topk"])
        match = theirs.get(key, [])
        used.add(key)
        rep = "; ".join(f"{r['accept_length']:.2f} ({r['engine']}, {os.path.basename(r['file'])}:{r['line']}"
                        + (", suspect" if r["verdict"] == "suspect" else "") + ")" for r in match)
        body.append([esc(w["method"]), esc(w["budget"]), esc(w["topk"] or "= budget"),
                     f'<td class="num">{w["tau"]:.2f}</td>', esc(w["run"]), esc(rep or "–")])
    for key, match in sorted(theirs.items(), key=lambda kv: str(kv[0])):
        if key not in used:
            rep = "; ".join(f"{r['accept_length']:.2f} ({r['engine']}, {os.path.basename(r['file'])}:{r['line']})"
                            for r in match)
            body.append([esc(key[0]), esc(key[1]), esc(key[2] or "–"), "<td class='num'>–</td>", "–", esc(rep)])
    return html_table(["method", "budget", "topk", "τ measured here", "workbench run", "reported there"], body)


def add_section(page: Page, doc: dict, thresholds: dict, rows: list[dict] | None = None,
                prefix: str = "ext") -> None:
    """The serving-stack runs of `doc` as report sections; with the study's `rows`, also the
    workbench's τ per budget beside the accept lengths the serving stacks reported."""
    runs = doc.get("runs") or []
    page.section(f"{prefix}-runs", "Runs measured by serving stacks")
    page.add("<p class='sub'>Settings marked * come from the file name (the file's own fields did not say). "
             "Speedup is over the fastest usable AR run of the same engine, model, hardware, tp and "
             "concurrency.</p>")
    page.add(runs_table_html(runs) if runs else "<p class='na'>No run was recognised.</p>")
    usable = [r for r in _usable(runs) if r.get("method") != "ar" and r.get("budget")]
    page.section(f"{prefix}-sweep", "Serving stacks: throughput, TPOT and acceptance vs budget")
    if usable:
        for metric in METRICS:
            if any(r.get(metric) is not None for r in usable):
                page.figure(sweep_figure(runs, metric))
    else:
        page.add("<p class='na'>No usable speculative run with a known budget.</p>")
    if rows is not None:
        mine = workbench_taus(rows)
        page.section(f"{prefix}-compare", "τ per budget: workbench vs serving stacks")
        if mine or any(r.get("accept_length") is not None for r in _usable(runs)):
            page.figure(compare_figure(mine, runs))
            page.add(compare_table_html(mine, runs))
        else:
            page.add("<p class='na'>Neither side has acceptance lengths to compare.</p>")
    page.section(f"{prefix}-problems", "Failed, partial, garbage and suspect runs (serving stacks)")
    page.add(problems_html(runs))
    page.add(thresholds_html(thresholds))
    notes = doc.get("unrecognised") or []
    if notes:
        page.add("<h3>Not ingested</h3>" + html_table(["file", "why"], [[esc(n.get("file")), esc(n.get("reason"))]
                                                                 for n in notes]))


def write_page(doc: dict, out: str | os.PathLike, thresholds: dict, title: str = "Results from serving stacks",
               routing: dict | None = None) -> Path:
    """The ingest page: the serving-stack runs, and the routing dumps of `routing` (routing.json) if any."""
    page = Page()
    add_section(page, doc, thresholds)
    if routing and (routing.get("files") or routing.get("unread")):
        routing_report.add_section(page, routing)
    runs = doc.get("runs") or []
    counts = ", ".join(f"{sum(r['verdict'] == v for r in runs)} {v}" for v in ("ok",) + PROBLEMS
                       if any(r["verdict"] == v for r in runs))
    subtitle = (f"{len(runs)} runs ({counts or 'none'}) · {len(doc.get('unrecognised') or [])} not ingested · "
                f"built {time.strftime('%Y-%m-%d %H:%M')}")
    out = Path(out)
    atomic_write_text(out, page.render(title, subtitle))
    return out
