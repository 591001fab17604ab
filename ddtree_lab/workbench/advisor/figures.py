"""The report's "Advisor" section: τ(B), cost(B) per machine, tokens/s(B) with the best budget marked,
what dominates the cost there, and the cost model against bench measurements (workbench/page.py Page)."""
from __future__ import annotations

import os

import plotly.graph_objects as go

from .. import advisor as A
from ..figures import budget_axis, log_axis
from ..page import Page, esc, fmt_num, html_table
from .study import advise

COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]


def _layout(fig: go.Figure, title: str, x: str, y: str, budgets=None) -> go.Figure:
    """Title, axis titles and size; with `budgets`, x is the log budget axis labelled at each of them."""
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template="plotly_white", height=380,
                      margin=dict(l=60, r=20, t=50, b=50))
    if budgets is not None:
        fig.update_xaxes(**budget_axis(budgets))
    return fig


def tau_figure(advice: dict) -> go.Figure:
    b = advice["budgets"]
    fig = go.Figure(go.Scatter(x=b, y=[advice["tau"][x] for x in b], mode="lines+markers", name="measured τ"))
    auto = advice.get("tau_auto")
    if auto:  # chosen per round: a reference line, not a budget on the axis
        fig.add_hline(y=auto["tau"], line=dict(dash="dashdot", color="#8172b3"),
                      annotation_text=f"auto ({auto['run']}): {auto['tau']:.2f}")
    return _layout(fig, f"Measured τ(B) on {advice['study_pair'] or 'the study pair'}", "budget B",
                   "mean τ per round", b)


def cost_figure(advice: dict) -> go.Figure:
    fig = go.Figure()
    for i, (name, m) in enumerate(advice["machines"].items()):
        fig.add_trace(go.Scatter(x=advice["budgets"], y=[r["cost_seconds"] * 1e3 for r in m["rows"]],
                                 mode="lines+markers", name=name, line=dict(color=COLORS[i % len(COLORS)])))
    return _layout(fig, f"Modelled round cost(B) of {advice['model']} per machine", "budget B", "ms per round",
                   advice["budgets"])


def tps_figure(advice: dict) -> go.Figure:
    fig = go.Figure()
    for i, (name, m) in enumerate(advice["machines"].items()):
        c = COLORS[i % len(COLORS)]
        rows = m["rows"]
        fig.add_trace(go.Scatter(
            x=advice["budgets"], y=[r["tokens_per_second"] for r in rows], mode="lines+markers", name=name,
            line=dict(color=c), error_y=dict(type="data", symmetric=False,
                                             array=[r["band"][1] - r["tokens_per_second"] for r in rows],
                                             arrayminus=[r["tokens_per_second"] - r["band"][0] for r in rows])))
        best = m["best"]
        fig.add_trace(go.Scatter(x=[best["budget"]], y=[best["tokens_per_second"]], mode="markers",
                                 marker=dict(symbol="star", size=16, color=c), name=f"{name} best",
                                 showlegend=False))
    return _layout(fig, "Projected tokens/s(B) = τ(B) / cost(B) (★ best; bars: 90 % bootstrap over prompts)",
                   "budget B", "tokens/s", advice["budgets"])


def parts_figure(advice: dict) -> go.Figure:
    names = list(advice["machines"])
    fig = go.Figure()
    for part in A.PARTS:
        fig.add_trace(go.Bar(x=names, y=[advice["machines"][n]["best"]["parts"][part] * 1e3 for n in names],
                             name=A.PART_TITLES[part]))
    fig.update_layout(barmode="stack")
    return _layout(fig, "What the round costs at each machine's best budget", "machine", "ms per round")


def check_figure(check: dict) -> go.Figure:
    fig = go.Figure()
    per_model: dict[str, dict] = {}  # one file per shape, the one with most budgets (the table has all)
    for c in check["checked"]:
        n = sum(r["method"] == "ddtree" for r in c["rows"])
        if n > sum(r["method"] == "ddtree" for r in per_model.get(c["model"], {"rows": []})["rows"]):
            per_model[c["model"]] = c
    for i, c in enumerate(per_model.values()):
        rows = [r for r in c["rows"] if r["method"] == "ddtree"]
        color = COLORS[i % len(COLORS)]
        fig.add_trace(go.Scatter(x=[r["budget"] for r in rows], y=[r["measured_seconds"] * 1e3 for r in rows],
                                 mode="markers", name=f"{c['file']} measured", marker=dict(color=color)))
        fig.add_trace(go.Scatter(x=[r["budget"] for r in rows], y=[r["predicted_seconds"] * 1e3 for r in rows],
                                 mode="lines", name=f"{c['file']} model", line=dict(color=color, dash="dash")))
    fig.update_yaxes(**log_axis(y for t in fig.data for y in t.y))
    return _layout(fig, "Cost model vs bench e2e round times (first principles, one calibration: machines.json)",
                   "budget B", "ms per round", [x for t in fig.data for x in t.x])


def check_table(check: dict) -> str:
    body = []
    for c in check["checked"]:
        for r in c["rows"]:
            cls = "ok" if abs(r["error"]) <= check["tolerance"] else ("bad" if r["in_range"] else "na")
            name = c["file"] + (" (incomplete)" if c.get("incomplete") else "")  # a bench cut short: its rows only
            body.append([esc(name), esc(c["model"]), esc(c["machine"]), esc(LAUNCHES_FROM[c["launches"]]),
                         esc(r["method"]),
                         esc(r["budget"] or "–"), f'<td class="num">{r["measured_seconds"] * 1e3:.3f}</td>',
                         f'<td class="num">{r["predicted_seconds"] * 1e3:.3f}</td>',
                         f'<td class="num"><span class="{cls}">{100 * r["error"]:+.1f} %</span></td>',
                         esc(A.PART_TITLES[r["dominant"]])])
    return html_table(["bench file", "model", "machine", "layers: kernels from", "method", "budget", "measured ms",
                       "model ms", "error", "dominates"], body)


# how a checked file's kernels were known (check_bench's `launches`)
LAUNCHES_FROM = {"profile": "compiled: profiled counts", "layers": "compiled: its layers' census",
                 "census": "eager: the file's census"}


def _auto_cell(rep: dict | None) -> str:
    if not rep:
        return "<span class='na'>no scored traces</span>"
    share = ", ".join(f"{b}: {100 * v:.0f} %" for b, v in sorted(rep["budget_share"].items()))
    return f"{rep['vs_best_fixed']:.3f}× (B={rep['best_fixed']}); chose {esc(share)}"


def _ceiling_cell(ceiling: dict | None) -> str:
    if not ceiling:
        return "<span class='na'>no scored traces</span>"
    return f"{ceiling['per_bin']:.3f}× / {ceiling['per_round']:.3f}×"


def add_section(page: Page, study_dir: str | os.PathLike) -> dict | None:
    """The "Advisor" section; a study the advisor cannot use gets its reason, never an exception."""
    page.section("advisor", "Advisor: the best budget per machine (a projection)")
    try:  # the defaults `ddtree-lab advise` takes: one answer per study
        advice = advise(study_dir)
    except (A.AdvisorError, ValueError, OSError, KeyError) as e:  # a malformed study: its reason
        page.add(f"<p class='na'>No advice: {esc(e)}</p>")
        return None
    page.add(f"<div class='callout'><b>A projection.</b> τ is measured in this study on "
             f"{esc(advice['study_pair'])}; each round's cost is the first-principles model of "
             f"<code>{esc(advice['model'])}</code> on each machine (weights, KV, FLOPs, launches; efficiency "
             f"factors fitted once on H200), context {advice['context_tokens']} tokens. "
             f"<code>ddtree-lab advise</code> writes the same figures to advice.json.</div>")
    if (advice.get("texts") or {}).get("note"):
        page.add(f"<div class='callout'><b>Texts.</b> {esc(advice['texts']['note'])}.</div>")
    body = []
    for name, m in advice["machines"].items():
        b = m["best"]
        freq = ", ".join(f"{k}: {100 * v:.0f} %" for k, v in sorted(b["best_frequency"].items()))
        body.append([f"<b>{esc(name)}</b>", esc(m["title"]), f'<td class="num">{b["budget"]}</td>',
                     f'<td class="num">{b["tokens_per_second"]:.1f}</td>',
                     f'<td class="num">{b["band"][0]:.1f} – {b["band"][1]:.1f}</td>',
                     f'<td class="num">{fmt_num(b["speedup"])}×</td>',
                     f'<td class="num">{b["cost_seconds"] * 1e3:.2f}</td>',
                     esc(A.PART_TITLES[b["dominant"]]), esc(freq), _auto_cell(m.get("auto_replay")),
                     _ceiling_cell(m.get("auto_ceiling"))])
    page.add(html_table(["machine", "profile", "best B", "tokens/s", "90 % band", "vs AR", "round ms",
                         "dominates", "bootstrap: best budget", "auto (replayed) vs best fixed",
                         "any choice: per bin / hindsight"], body))
    page.add("<p class='sub'>auto (replayed): the engine's own budget=\"auto\" rule run over the traced rounds "
             "of the largest budget, three passes (it learns across prompts), each round priced at its budget's "
             "modelled cost; the last pass against the best fixed budget on the same rounds — an estimate "
             "(docs/workbench.md, \"The budget advisor\"). Any choice: the most a rule with one budget per "
             "confidence bin (the bin the host has read, as auto's) could reach on the same rounds, and each "
             "round at its best budget in hindsight, both against the best fixed budget.</p>")
    page.figure(tau_figure(advice))
    page.figure(cost_figure(advice))
    page.figure(tps_figure(advice))
    page.figure(parts_figure(advice))
    fit = advice.get("measured_fit") or {}
    told = (esc(fit["refused"]) if "refused" in fit
            else f"{fit['kind']}, leave-one-out max error " + fmt_num(100 * fit["max_loo"], "{:.1f}") + " %")
    page.add(f"<p class='sub'>Fit to this study's own stage times: {told}.</p>")
    chk = advice["check"]
    page.add("<h3>The cost model against measurements</h3>")
    if chk["checked"]:
        verdict = "within" if chk["passed"] else "NOT within"
        page.add(f"<p>Round times ({esc(chk['gate'])}): {verdict} "
                 f"{round(100 * chk['tolerance'])} % on every checked file "
                 f"(shapes: {esc(', '.join(sorted({c['model'] for c in chk['checked']})))}).</p>")
        page.figure(check_figure(chk))
        page.add(check_table(chk))
    else:
        page.add(f"<p class='na'>No bench e2e JSON to check the model against ({esc(chk.get('note', ''))}).</p>")
    for s in chk.get("skipped", []):
        page.add(f"<p class='sub'>not checked: {esc(s['file'])} — {esc(s['reason'])}</p>")
    return advice
