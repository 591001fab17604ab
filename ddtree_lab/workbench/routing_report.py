"""The report part of routing dumps: experts touched vs tokens (measured vs independent uniform routing),
overall and per rank of the EP placement, and a table of what each dump held, from routing.json alone
(`routing_dumps`), on the ingest page and in a study's report."""
from __future__ import annotations

import math
import os

import plotly.graph_objects as go

from .page import Page, esc, fmt_num, html_table
from .routing_dumps import places

MEASURED_DASH, UNIFORM_DASH = "solid", "dot"


def _label(entry: dict) -> str:
    name = os.path.basename(entry["file"])
    return f"{name} ({entry['model']})" if entry.get("model") else name


def _rows(entry: dict) -> list[tuple[str, list[dict]]]:
    """(what, rows) of an entry: windows of T consecutive tokens, and whole forward passes."""
    return [(what, entry.get(key) or []) for what, key in (("windows", "windows"), ("per forward", "forward_passes"))
            if entry.get(key)]


def log2_ticks(values) -> list[int]:
    """The powers of two from 1 to the largest value: where a log-2 token axis is labelled (a last point at
    1025, the largest tree with its root, sits by 1024's label)."""
    top = max([v for v in values if v], default=1)
    return [2 ** i for i in range(int(math.log2(top)) + 1)]


def _axis(xs) -> dict:
    ticks = log2_ticks(xs)
    return dict(type="log", tickvals=ticks, ticktext=[str(t) for t in ticks],
                title=dict(text="tokens (a window of consecutive tokens, or one forward pass)"))


def touched_figure(doc: dict) -> go.Figure:
    """Distinct experts a MoE layer touches (mean over layers) vs tokens: per dump, measured over windows
    (lines) and per forward pass (markers), and independent uniform routing for its E and k (dotted)."""
    fig = go.Figure()
    uniform_done = set()
    for e in doc.get("files") or []:
        for what, rows in _rows(e):
            pts = [r for r in rows if r.get("touched") is not None]
            if pts:
                fig.add_scatter(x=[r["tokens"] for r in pts], y=[r["touched"] for r in pts],
                                name=f"{_label(e)}: {what}", legendgroup=e["file"],
                                mode="lines+markers" if what == "windows" else "markers", line=dict(dash=MEASURED_DASH),
                                hovertemplate="%{x} tokens: %{y:.1f} experts<extra></extra>")
            key = (e.get("experts"), e.get("top_k"), what)
            uni = [r for r in rows if r.get("uniform") is not None]
            if uni and key not in uniform_done:
                uniform_done.add(key)
                fig.add_scatter(x=[r["tokens"] for r in uni], y=[r["uniform"] for r in uni],
                                name=f"uniform routing, E {e['experts']}, k {e['top_k']}", mode="lines",
                                line=dict(dash=UNIFORM_DASH, color="#888"),
                                hovertemplate="%{x} tokens: %{y:.1f} experts (uniform)<extra></extra>")
    fig.update_layout(title=dict(text="experts touched per MoE layer vs tokens: measured vs uniform routing"),
                      template="plotly_white", height=420, margin=dict(l=60, r=20, t=60, b=50),
                      xaxis=_axis([x for tr in fig.data for x in tr.x]),
                      yaxis=dict(title=dict(text="distinct experts per layer (mean over layers)")))
    return fig


def ranks_figure(doc: dict) -> go.Figure:
    """Distinct experts one rank of the EP placement holds vs tokens: the mean over ranks and the most on one
    rank (the slowest rank sets the round), measured and under uniform routing."""
    fig = go.Figure()
    uniform_done = set()
    for e in doc.get("files") or []:
        if not e.get("ep_ranks"):
            continue
        for what, rows in _rows(e):
            for key, name, dash in (("rank_max", "most on one rank", "solid"),
                                    ("rank_mean", "mean over ranks", "dash")):
                pts = [r for r in rows if r.get(key) is not None]
                if pts:
                    fig.add_scatter(x=[r["tokens"] for r in pts], y=[r[key] for r in pts],
                                    name=f"{_label(e)}: {what}, {name}", legendgroup=e["file"],
                                    mode="lines+markers" if what == "windows" else "markers", line=dict(dash=dash),
                                    hovertemplate="%{x} tokens: %{y:.2f} experts<extra></extra>")
            ukey = (e.get("experts"), e.get("top_k"), e["ep_ranks"], what)
            if ukey in uniform_done:
                continue
            uniform_done.add(ukey)
            for key, name, dash in (("uniform_rank_max", "most on one rank", "dot"),
                                    ("uniform_rank_mean", "mean over ranks", "dashdot")):
                uni = [r for r in rows if r.get(key) is not None]
                if uni:
                    fig.add_scatter(x=[r["tokens"] for r in uni], y=[r[key] for r in uni], mode="lines",
                                    name=f"uniform, E {e['experts']}, k {e['top_k']}, {e['ep_ranks']} ranks: {name}",
                                    line=dict(dash=dash, color="#888"),
                                    hovertemplate="%{x} tokens: %{y:.2f} experts (uniform)<extra></extra>")
    fig.update_layout(title=dict(text="experts one EP rank holds per MoE layer vs tokens: mean and most over ranks"),
                      template="plotly_white", height=420, margin=dict(l=60, r=20, t=60, b=50),
                      xaxis=_axis([x for tr in fig.data for x in tr.x]),
                      yaxis=dict(title=dict(text="distinct experts on a rank (mean over layers)")))
    return fig


def dumps_table_html(doc: dict) -> str:
    body = []
    for e in doc.get("files") or []:
        def src(key):
            return f" ({e[key + '_source']})" if e.get(key + "_source") not in (None, "file") else ""
        refused = sum(r.get("count", 1) for r in e.get("refused") or [])
        body.append([f'<span title="{esc(e["file"])}">{esc(os.path.basename(e["file"]))}</span>', esc(e.get("format")),
                     esc(e.get("kind") or "–"), esc(e.get("model") or "–"),
                     f'<td class="num">{fmt_num(e.get("moe_layers"), "{}")}</td>',
                     esc(f"{e['experts']}{src('experts')}" if e.get("experts") else "–"),
                     esc(f"{e['top_k']}{src('top_k')}" if e.get("top_k") else "–"),
                     f'<td class="num">{fmt_num(e.get("sequences"), "{}")}</td>',
                     f'<td class="num">{fmt_num(e.get("tokens"), "{}")}</td>',
                     f'<td class="num">{fmt_num(e.get("forwards"), "{}")}</td>',
                     '<span class="bad">truncated</span>' if e.get("truncated") else "–",
                     esc(refused or "–")])
    return html_table(["dump", "format", "kind", "model", "MoE layers", "experts", "top_k", "sequences", "tokens",
                       "forwards", "cut", "refused"], body)


def add_section(page: Page, doc: dict, prefix: str = "routing") -> None:
    """routing.json as a report section: the dumps, both figures, and what was refused or not read."""
    files = doc.get("files") or []
    page.section(f"{prefix}-dumps", "MoE routing from routing dumps")
    page.add("<p class='sub'>Experts touched by T consecutive tokens of one sequence (every window, never across "
             "sequences), or by one forward pass; uniform is what independent uniform routing of the same E and k "
             f"would touch. EP placement: {esc(doc.get('ep_ranks'))} ranks of contiguous experts. Sources other than "
             "the dump itself are in brackets.</p>")
    if files:
        page.add(dumps_table_html(doc))
        page.figure(touched_figure(doc))
        if any(e.get("ep_ranks") for e in files):
            page.figure(ranks_figure(doc))
    else:
        page.add("<p class='na'>No routing dump was read.</p>")
    problems = [(e["file"], places(r), r["reason"]) for e in files for r in e.get("refused") or []]
    problems += [(e["file"], c, "cut off here (what came before is kept)") for e in files for c in e.get("cut") or []]
    problems += [(e["file"], "", n) for e in files for n in e.get("notes") or []]
    problems += [(u["file"], "", u["reason"]) for u in doc.get("unread") or []]
    if problems:
        rows = [[esc(f), esc(w or "–"), esc(r)] for f, w, r in problems]
        page.add("<h3>Refused, cut or not read</h3>" + html_table(["dump", "where", "why"], rows))
