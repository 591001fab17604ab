"""Every figure of the workbench, once: per-run figures (τ histogram, acceptance by depth, accepted
paths) for notebooks and the report, and study figures (acceptance, speedup and throughput vs budget,
stage breakdown, kernel timeline, verify micro-benchmark). Rows are `results.collect_study` rows."""
from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..atomic import atomic_write_text
from ..names import STAGES
from .results import recommend_budget  # noqa: F401 - the star of the speedup figure; lives in results.py
from .runs import is_fixed
from .viz import make_decoder, round_view, show_token

PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
BASELINE_LABEL_SPOTS = ["top left", "bottom right", "top right", "bottom left"]


def stage_color(stage: str) -> str:
    """One colour per stage, the same in the stage breakdown and the kernel timeline."""
    known = ["prefill"] + [s for s in STAGES if s != "prefill"]
    i = known.index(stage) if stage in known else len(known) + sum(map(ord, stage))
    return PALETTE[i % len(PALETTE)]


def budget_axis(budgets) -> dict:
    """A log budget axis labelled at every budget swept (powers of two or not): plotly's own log ticks
    label the minor ones with bare digits ("4 5 6 7 8 9 10 2 3")."""
    ticks = sorted({b for b in budgets if is_fixed(b) and b})
    return dict(type="log", tickvals=ticks, ticktext=[str(b) for b in ticks]) if ticks else dict(type="log")


def log_axis(values) -> dict:
    """A log axis for measured values (ms, GB/s) labelled at 1, 2 and 5 times the powers of ten inside
    their span, or at the two ends when the span holds fewer than two of those."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not vals:
        return dict(type="log")
    lo, hi = min(vals), max(vals)
    decades = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    ticks = [t for t in (m * 10.0 ** e for e in decades for m in (1, 2, 5)) if lo <= t <= hi]
    if len(ticks) < 2:
        ticks = sorted({float(f"{v:.2g}") for v in (lo, hi)})
    return dict(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


# ----------------------------------------------------------------------------- table helpers
def run_config(row: dict) -> dict:
    return (row.get("results") or {}).get("config") or row.get("run", {}).get("params") or {}


def run_summary(row: dict) -> dict:
    return (row.get("results") or {}).get("summary") or {}


def _budget_order(budget) -> tuple:
    return (0, budget) if is_fixed(budget) else (1, 0)  # "auto" after every integer budget


def grid_rows(rows: list[dict]) -> list[dict]:
    """The grid runs (not the once-per-study notebooks), in AR / DFlash / DDTree-by-budget order."""
    order = {"ar": 0, "dflash": 1, "ddtree": 2}
    runs = [r for r in rows if r["kind"] == "run"]
    return sorted(runs, key=lambda r: (order.get(run_config(r).get("method"), 3), run_config(r).get("temperature", 0),
                                       run_config(r).get("topk", 0), _budget_order(run_config(r).get("budget", 0)),
                                       r["name"]))


def _series_key(cfg: dict) -> str:
    k = cfg.get("topk") or 0
    return f"topk {k if k else '= budget'}, T {cfg.get('temperature', 0):g}"


def busy_runs(runs: list[dict], limit: int = 8) -> set[str]:
    """With many runs, which start hidden in per-run figures: keep DFlash and up to `limit` DDTree
    runs spread over the budgets of the first (topk, temperature) series."""
    if len(runs) <= limit:
        return set()
    ddt = [r for r in runs if run_config(r).get("method") == "ddtree"]
    first = _series_key(run_config(ddt[0])) if ddt else None
    ddt = [r for r in ddt if _series_key(run_config(r)) == first]
    keep = {r["name"] for r in runs if run_config(r).get("method") == "dflash" and run_config(r).get("temperature", 0) == 0}
    step = max(1, math.ceil(len(ddt) / (limit - len(keep) or 1)))
    keep |= {r["name"] for r in ddt[::step]}
    return {r["name"] for r in runs} - keep


# ----------------------------------------------------------------------------- study figures
def _by_series(rows: list[dict], value) -> dict[str, tuple[list, list, list]]:
    series: dict[str, tuple[list, list, list]] = {}
    for r in grid_rows(rows):
        cfg = run_config(r)
        if cfg.get("method") != "ddtree" or not is_fixed(cfg.get("budget")) or r.get("results") is None:
            continue
        y = value(r)
        if y is None:
            continue
        xs, ys, names = series.setdefault(_series_key(cfg), ([], [], []))
        xs.append(cfg.get("budget"))
        ys.append(y)
        names.append(r["name"])
    return series


def _baseline_lines(fig: go.Figure, rows: list[dict], value, label_fmt: str) -> None:
    # Each baseline's label at its own corner of the line, so AR and DFlash labels never sit on each other.
    # An `auto` run has no one budget to sit at on the budget axis: it is a reference line too.
    k = 0
    for r in grid_rows(rows):
        cfg = run_config(r)
        auto = cfg.get("method") == "ddtree" and not is_fixed(cfg.get("budget"))
        if (cfg.get("method") in ("ar", "dflash") or auto) and r.get("results") is not None and value(r) is not None:
            dash = "dashdot" if auto else "dot" if cfg["method"] == "ar" else "dash"
            fig.add_hline(y=value(r), line=dict(dash=dash, color="#8172b3" if auto else "#888"),
                          annotation_text=label_fmt.format(name=r["name"], v=value(r)),
                          annotation_position=BASELINE_LABEL_SPOTS[k % len(BASELINE_LABEL_SPOTS)])
            k += 1


def sweep_figure(rows: list[dict], metric: str = "mean_tau") -> go.Figure:
    """metric: mean_tau | speedup | tokens_per_second, against budget (log2 axis)."""
    titles = {"mean_tau": ("acceptance vs budget", "mean τ (tokens per target forward)"),
              "speedup": ("speedup over AR vs budget", "speedup ×"),
              "tokens_per_second": ("throughput vs budget", "tokens / s")}
    get = {"mean_tau": lambda r: run_summary(r).get("mean_tau"),
           "speedup": lambda r: (r.get("comparison") or {}).get("speedup"),
           "tokens_per_second": lambda r: run_summary(r).get("tokens_per_second")}[metric]
    title, ylabel = titles[metric]
    fig = go.Figure()
    series = _by_series(rows, get)
    for i, (key, (xs, ys, names)) in enumerate(series.items()):
        fig.add_scatter(x=xs, y=ys, name=f"DDTree, {key}", mode="lines+markers", text=names,
                        line=dict(color=PALETTE[i % len(PALETTE)]),
                        hovertemplate="%{text}<br>budget %{x}: %{y:.3f}<extra></extra>")
    _baseline_lines(fig, rows, get, "{name}: {v:.2f}")
    budgets = sorted({x for xs, _, _ in series.values() for x in xs})
    fig.update_layout(title=dict(text=title), template="plotly_white", height=400,
                      margin=dict(l=55, r=20, t=60, b=45),
                      xaxis=dict(title=dict(text="tree budget (nodes)"), **budget_axis(budgets)),
                      yaxis=dict(title=dict(text=ylabel)))
    if metric == "speedup":
        best = recommend_budget(rows)
        if best and is_fixed(best["budget"]):  # an auto-only study's best is its reference line
            fig.add_scatter(x=[best["budget"]], y=[best["speedup"]], mode="markers",
                            marker=dict(symbol="star", size=18, color="#e4572e"), name="recommended",
                            hovertemplate="recommended: budget %{x}, %{y:.2f}×<extra></extra>")
            _label_best(fig, best, budgets, [v for v in map(get, grid_rows(rows)) if v is not None])
    return fig


BEST_LABEL_ROOM = 0.25  # share of the y span left free above the highest point, for the best budget's label


def _label_best(fig: go.Figure, best: dict, budgets: list, ys: list) -> None:
    """The best budget's label at the top of the plot area above its star (the y range leaves it room),
    growing inwards at either end of the budget axis: a label on the data itself runs off the plot there."""
    lo, hi = min(ys + [best["speedup"]]), max(ys + [best["speedup"]])
    span = (hi - lo) or abs(hi) or 1.0
    fig.update_yaxes(range=[lo - 0.08 * span, hi + BEST_LABEL_ROOM * span])
    end = "left" if best["budget"] == min(budgets) else "right" if best["budget"] == max(budgets) else "center"
    fig.add_annotation(text=f"★ best: budget {best['budget']} ({best['speedup']:.2f}×)", showarrow=False,
                       xref="x", x=math.log10(best["budget"]), xanchor=end,  # a log axis places by log10
                       yref="paper", y=1.0, yanchor="top", font=dict(color="#e4572e"))


def stage_figure(rows: list[dict]) -> go.Figure:
    """Stacked ms per output token by stage, per run."""
    runs = [r for r in grid_rows(rows) if run_summary(r).get("new_tokens")]
    names = [r["name"] for r in runs]
    fig = go.Figure()
    stages = list(STAGES) + sorted({k for r in runs for k in run_summary(r).get("stage_seconds", {})} - set(STAGES))
    for i, st in enumerate(stages):
        ys = [1e3 * run_summary(r).get("stage_seconds", {}).get(st, 0.0) / run_summary(r)["new_tokens"] for r in runs]
        if any(ys):
            fig.add_bar(name=st, x=names, y=ys, marker_color=stage_color(st),
                        hovertemplate="%{x}<br>" + st + ": %{y:.2f} ms/token<extra></extra>")
    fig.update_layout(title=dict(text="where the time goes (ms per output token)"), barmode="stack",
                      template="plotly_white", height=420, margin=dict(l=55, r=20, t=60, b=90),
                      xaxis=dict(title=dict(text="run")), yaxis=dict(title=dict(text="ms / token")))
    return fig


def short_kernel_name(name: str, width: int = 60) -> str:
    """`void ns::kernel<128, 4, Functor<...>>(args)` -> `ns::kernel<…>`: templates and arguments out."""
    if "<" not in name:  # plain names ("aten::linear", "Memcpy DtoD (Device -> Device)") stay
        return name if len(name) <= width else name[: width - 1] + "…"
    out, depth = [], 0
    for ch in name.removeprefix("void "):
        if ch in "<(":
            if depth == 0:
                out.append("<…>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip() or name
    return s if len(s) <= width else s[: width - 1] + "…"


def timeline_figure(tl: dict, max_kernel_rows: int = 12) -> go.Figure:
    """Horizontal bars on a time axis: one row per stage, then the busiest kernels/ops."""
    fig = go.Figure()
    t0 = min([e["start_us"] for e in tl.get("stages", []) + tl.get("kernels", [])] or [0])
    for i, st in enumerate(sorted({e["name"] for e in tl.get("stages", [])}, key=lambda s: (s not in STAGES, s))):
        ev = [e for e in tl["stages"] if e["name"] == st]
        fig.add_bar(y=[f"stage: {st}"] * len(ev), x=[e["dur_us"] / 1e3 for e in ev],
                    base=[(e["start_us"] - t0) / 1e3 for e in ev], orientation="h", name=st,
                    marker_color=stage_color(st),
                    hovertemplate=st + ": %{x:.3f} ms at %{base:.2f} ms<extra></extra>")
    top = [k["name"] for k in tl.get("top_kernels", [])[:max_kernel_rows]]
    labels: dict[str, int] = {}
    for name in top:
        ev = [e for e in tl.get("kernels", []) if e["name"] == name]
        short = short_kernel_name(name, 44)
        labels[short] = labels.get(short, 0) + 1
        short += f" #{labels[short]}" if labels[short] > 1 else ""  # distinct instantiations, distinct rows
        fig.add_bar(y=[short] * len(ev), x=[e["dur_us"] / 1e3 for e in ev],
                    base=[(e["start_us"] - t0) / 1e3 for e in ev], orientation="h", showlegend=False,
                    marker_color="#555", hovertemplate=html.escape(name) + ": %{x:.3f} ms<extra></extra>")
    rows = len({*(f"stage: {e['name']}" for e in tl.get("stages", [])), *top})
    fig.update_layout(title=dict(text=timeline_title(tl)),
                      barmode="overlay", template="plotly_white", height=max(300, 80 + 26 * rows),
                      margin=dict(l=260, r=20, t=80, b=45), xaxis=dict(title=dict(text="time since the generate call (ms)")),
                      yaxis=dict(title=dict(text="stage / kernel"), autorange="reversed"))
    return fig


def timeline_cut_note(tl: dict) -> str | None:
    """A sentence when the kernel rows stop before the profiled span ends, else None."""
    total, shown = tl.get("kernel_events"), tl.get("kernels_shown")
    if not total or shown is None or shown >= total:
        return None
    return (f"kernel rows show the first {shown} of {total} events (to {tl.get('kernels_until_us', 0) / 1e3:.0f} ms "
            f"of {tl.get('span_us', 0) / 1e3:.0f} ms); trace.json holds them all")


def timeline_title(tl: dict) -> str:
    what = " · ".join(str(x) for x in (tl.get("method"), f"budget {tl['budget']}" if tl.get("budget") and
                                        tl.get("method") == "ddtree" else None, tl.get("device")) if x)
    head = f"timeline of one generate{f' ({what})' if what else ''}: {tl.get('kind', 'kernels')}"
    cut = timeline_cut_note(tl)
    return head + (f"<br><sup>{cut}</sup>" if cut else "")


def microbench_figure(mb: dict) -> go.Figure:
    from plotly.subplots import make_subplots
    pts = mb.get("points", [])
    fig = make_subplots(rows=1, cols=2, subplot_titles=("verify time per round", "achieved bandwidth"))
    x = [p["budget"] for p in pts]
    fig.add_scatter(x=x, y=[p.get("verify_ms") for p in pts], mode="lines+markers", name="verify ms",
                    row=1, col=1)
    fig.add_scatter(x=x, y=[p.get("achieved_gbps") for p in pts], mode="lines+markers",
                    name="achieved GB/s", row=1, col=2)
    if mb.get("peak_gbps"):
        fig.add_hline(y=mb["peak_gbps"], line=dict(dash="dash", color="#c44e52"), row=1, col=2,
                      annotation_text=f"datasheet {mb['peak_gbps']:.0f} GB/s ({mb.get('gpu', '')})")
    if mb.get("copy_gbps"):
        fig.add_hline(y=mb["copy_gbps"], line=dict(dash="dot", color="#8172b3"), row=1, col=2,
                      annotation_text=f"measured copy {mb['copy_gbps']:.0f} GB/s", annotation_position="bottom right")
    fig.update_xaxes(title_text="tree budget (nodes)", **budget_axis(x))
    fig.update_yaxes(title_text="verify ms per round", row=1, col=1)
    fig.update_yaxes(title_text="achieved GB/s", row=1, col=2)
    where = mb.get("gpu") or mb.get("device") or "cpu"
    fig.update_layout(title=dict(text=f"verify micro-benchmark: one verify forward per tree budget ({where})"),
                      template="plotly_white", height=400, showlegend=False, margin=dict(l=55, r=20, t=90, b=45))
    return fig


# ----------------------------------------------------------------------------- run figures
def save_figure(fig: go.Figure, run_dir, name: str):
    """figures/<name>.json (plotly JSON; plotly.io.read_json reads it back), written atomically."""
    return atomic_write_text(Path(run_dir) / "figures" / f"{name}.json", fig.to_json())


def _fig(title: str, height: int = 380, **kw) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=dict(text=title), template="plotly_white", height=height,
                      margin=dict(l=50, r=20, t=60, b=45), **kw)
    return fig


def tau_histogram_figure(runs: dict[str, dict], title: str = "τ histogram (share of rounds)",
                         hidden: Sequence[str] = ()) -> go.Figure:
    """runs: {label: tau_histogram dict {"values", "counts"}}; `hidden` labels start legend-only."""
    fig = _fig(title, barmode="group", xaxis=dict(title=dict(text="τ (accepted tokens per round)"), dtick=1),
               yaxis=dict(title=dict(text="share of rounds"), tickformat=".0%"))
    for label, h in runs.items():
        total = sum(h.get("counts", [])) or 1
        fig.add_bar(name=label, x=h.get("values", []), y=[c / total for c in h.get("counts", [])],
                    visible="legendonly" if label in hidden else True,
                    hovertemplate="τ=%{x}: %{y:.1%}<extra>" + label + "</extra>")
    return fig


def acceptance_depth_figure(runs: dict[str, dict], title: str = "acceptance by depth",
                            hidden: Sequence[str] = ()) -> go.Figure:
    """runs: {label: acceptance_by_depth dict}. Left: share of rounds reaching depth >= d;
    right: P(reach d | reach d-1). `hidden` labels start legend-only (click to show)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("share of rounds reaching depth ≥ d",
                                                        "P(reach d | reach d−1)"))
    for i, (label, a) in enumerate(runs.items()):
        color = PALETTE[i % len(PALETTE)]
        vis = "legendonly" if label in hidden else True
        fig.add_scatter(x=a.get("depth", []), y=a.get("survival", []), name=label, legendgroup=label,
                        mode="lines+markers", line=dict(color=color), visible=vis, row=1, col=1)
        # P(reach d | reach d-1) is drawn only where at least MIN_CONDITIONAL rounds reached d-1: a
        # ratio of two or three rounds jumps between 0 and 100 % and says nothing; hover gives the counts.
        depth, cond, reached = a.get("depth", []), a.get("conditional", []), a.get("reached")
        before = ([a.get("rounds")] + list(reached[:-1])) if reached is not None else [None] * len(depth)
        after = list(reached) if reached is not None else [None] * len(depth)
        ys = [c if c is not None and (b is None or b >= MIN_CONDITIONAL) else None for c, b in zip(cond, before)]
        fig.add_scatter(x=depth, y=ys, name=label, legendgroup=label, customdata=list(zip(after, before)),
                        hovertemplate="depth %{x}: %{y:.0%} (%{customdata[0]} of %{customdata[1]} rounds)<extra>"
                                      + html.escape(label) + "</extra>",
                        showlegend=False, mode="lines+markers", line=dict(color=color), visible=vis, row=1, col=2)
    fig.update_layout(title=dict(text=title), template="plotly_white", height=400,
                      margin=dict(l=50, r=20, t=80, b=45))
    fig.update_xaxes(title_text="depth d", dtick=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    fig.update_yaxes(title_text="share of rounds", row=1, col=1)
    fig.update_yaxes(title_text=f"P(reach d | reach d−1), ≥ {MIN_CONDITIONAL} rounds at d−1", row=1, col=2)
    return fig


MIN_CONDITIONAL = 5


def accepted_paths_figure(rows: Sequence[dict], tokenizer: Any = None, title: str = "accepted path per round") -> go.Figure:
    """One bar per round: its τ, hover shows the accepted tokens and the target's next token."""
    decode = make_decoder(tokenizer)
    x, y, hover = [], [], []
    for k, row in enumerate(rows):
        v = round_view(row)
        x.append(k)
        y.append(v.tau)
        acc = " ".join(repr(show_token(decode(v.tokens[a]))) for a in v.accepted if a < len(v.tokens))
        nxt = show_token(decode(v.next_token)) if v.next_token is not None else "?"
        hover.append(f"round {k}: τ = {v.tau}<br>accepted {acc}<br>then target: {nxt!r}")
    fig = _fig(title, xaxis=dict(title=dict(text="round")), yaxis=dict(title=dict(text="τ"), dtick=1))
    fig.add_bar(x=x, y=y, hovertext=hover, hoverinfo="text", marker_color="#4c72b0")
    return fig


# ----------------------------------------------------------------------------- what a verify forward reads
def _verify_points(rows: list[dict]) -> tuple[list, list, list]:
    """DDTree runs with the figures of their verify forward: (budgets, summaries, names), by budget."""
    pts = [(run_config(r).get("budget"), run_summary(r), r["name"]) for r in grid_rows(rows)
           if run_config(r).get("method") == "ddtree" and is_fixed(run_config(r).get("budget"))
           and run_summary(r).get("rounds")]
    pts.sort(key=lambda p: p[0])
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def experts_figure(rows: list[dict]) -> go.Figure | None:
    """An MoE target's distinct experts per layer per verify forward against the budget (AR's step and
    DFlash's block as lines): a tree reads the union of its tokens' experts; beside it the fused kernel's row
    blocks, where they exceed the experts each extra block re-reads its expert's weights. None for a dense study."""
    budgets, sums, names = _verify_points(rows)
    if not any(s.get("experts_touched_mean") for s in sums):
        return None
    fig = go.Figure()
    fig.add_scatter(x=budgets, y=[s.get("experts_touched_mean") for s in sums], mode="lines+markers", text=names,
                    name="experts touched", hovertemplate="%{text}: %{y:.1f} experts per layer<extra></extra>")
    if any(s.get("expert_row_blocks_mean") for s in sums):
        fig.add_scatter(x=budgets, y=[s.get("expert_row_blocks_mean") for s in sums], mode="lines+markers",
                        text=names, name="row blocks (each past an expert's first re-reads its weights)",
                        line=dict(dash="dash"), hovertemplate="%{text}: %{y:.1f} row blocks per layer<extra></extra>")
    _baseline_lines(fig, rows, lambda r: run_summary(r).get("experts_touched_mean"), "{name}: {v:.1f}")
    fig.update_layout(title=dict(text="experts touched per MoE layer per verify forward"), template="plotly_white",
                      height=380, margin=dict(l=55, r=20, t=60, b=45),
                      xaxis=dict(title=dict(text="tree budget (nodes)"), **budget_axis(budgets)),
                      yaxis=dict(title=dict(text="per MoE layer (mean over layers and rounds)")),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def verify_cost_figure(rows: list[dict], bandwidth_gbps: float | None) -> go.Figure | None:
    """Verify time per round against the budget, with its floor: the weight bytes that forward reads (the
    touched experts only, on an MoE target) over the memory bandwidth (none drawn without one, e.g. a CPU)."""
    budgets, sums, names = _verify_points(rows)
    ms = [1e3 * s.get("stage_seconds", {}).get("verify", 0.0) / s["rounds"] for s in sums]
    if not any(ms):
        return None
    fig = go.Figure()
    fig.add_scatter(x=budgets, y=ms, mode="lines+markers", name="verify (measured)", text=names,
                    hovertemplate="%{text}: %{y:.3f} ms per round<extra></extra>")
    if bandwidth_gbps:
        floor = [s.get("verify_weight_bytes") / (bandwidth_gbps * 1e6) if s.get("verify_weight_bytes") else None
                 for s in sums]
        fig.add_scatter(x=budgets, y=floor, mode="lines", name=f"floor: weight bytes ÷ {bandwidth_gbps:.0f} GB/s",
                        line=dict(dash="dot"))
    fig.update_layout(title=dict(text="verify time per round vs budget"), template="plotly_white", height=380,
                      margin=dict(l=55, r=20, t=60, b=45),
                      xaxis=dict(title=dict(text="tree budget (nodes)"), **budget_axis(budgets)),
                      yaxis=dict(title=dict(text="ms per round"), rangemode="tozero"))
    return fig
