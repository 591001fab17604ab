"""The findings report: one standalone HTML page assembled from `<study_dir>/*/results.json`.

    ddtree-lab report outputs/quickstart

plotly.js is embedded once, inline, so the page works offline. Comparisons (speedup, losslessness)
are recomputed here from every run's results.json, so they never depend on execution order.
Sections: setup, run table, acceptance and speedup vs budget (+ recommended budget), τ histograms,
acceptance by depth, stage breakdown, kernel timeline, draft trees, losslessness, failed/suspect runs.
"""
from __future__ import annotations

import html
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from ..atomic import atomic_write_text
from ..names import MICROBENCH_FILE, REPORT_FILE, STUDY_FILE, TIMELINE_FILE
from . import viz
from .figures import (acceptance_depth_figure, busy_runs, grid_rows, microbench_figure, recommend_budget,
                      run_config, run_summary, short_kernel_name, stage_figure, sweep_figure, tau_histogram_figure,
                      timeline_figure)
from .results import collect_study, load_traces, suspect_reason, tokenizer_for



# ----------------------------------------------------------------------------- tree views
def tree_sample_figures(rows: list[dict], max_runs: int = 3, max_rounds: int = 12) -> list[tuple[str, go.Figure]]:
    runs = [r for r in grid_rows(rows) if run_config(r).get("method") in ("ddtree", "dflash")
            and r["status"] == "complete"]
    ddt = [r for r in runs if run_config(r)["method"] == "ddtree"]
    if len(ddt) > max_runs:  # smallest, middle and largest budget
        ddt = [ddt[0], ddt[len(ddt) // 2], ddt[-1]]
    pick = ddt or runs[:1]
    tok = next((tokenizer_for(r['results']) for r in runs if r.get('results')), None)
    out = []
    for r in pick:
        traces = [t for t in load_traces(r["dir"]) if t.get("tree") is not None]
        if not traces:
            continue
        first = traces[0].get("prompt_id")
        sample = [t for t in traces if t.get("prompt_id") == first][:max_rounds]
        out.append((r["name"], viz.tree_slider_figure(sample, tok, title=f"{r['name']} · prompt {first}")))
    return out


# ----------------------------------------------------------------------------- html
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px}
h1{margin:0 0 4px} h2{margin-top:38px;border-bottom:2px solid #e4e4e4;padding-bottom:4px}
.sub{color:#666;margin:0 0 18px} .fig{background:#fff;border:1px solid #e6e6e6;border-radius:6px;margin:12px 0;padding:4px}
table{border-collapse:collapse;font-size:13px;background:#fff;margin:8px 0} th,td{border:1px solid #ddd;padding:4px 8px;text-align:left}
th{background:#f0f0f0} td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#1a7f37;font-weight:600} .bad{color:#c62828;font-weight:600} .na{color:#777}
.callout{background:#fff8e1;border-left:4px solid #e4a11b;padding:8px 12px;margin:10px 0}
pre{background:#f4f4f4;padding:8px;overflow-x:auto;font-size:12px;max-height:260px}
nav a{margin-right:12px;font-size:14px}
"""

ERROR_HOOK = ("<script>window.__reportErrors=[];window.addEventListener('error',function(e){"
              "window.__reportErrors.push(String(e.message||e));});</script>")
STATUS_HOOK = """<script>window.addEventListener('load',function(){setTimeout(function(){
var n=Array.prototype.filter.call(document.querySelectorAll('.js-plotly-plot'),
  function(d){return d.querySelector('.main-svg')!==null;}).length;
var s=document.getElementById('render-status');
s.setAttribute('data-plots',String(n));s.setAttribute('data-errors',String(window.__reportErrors.length));
s.textContent='figures rendered: '+n+(window.__reportErrors.length?' · errors: '+window.__reportErrors.join(' | '):'');
},50);});</script>"""


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else "–"


def _table(head: list[str], body: list[list[str]]) -> str:
    h = "".join(f"<th>{_e(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def _verdict_html(v: str | None) -> str:
    cls = {"lossless": "ok", "reference": "ok", "mismatch": "bad", "no tokens": "bad"}.get(v or "", "na")
    return f'<span class="{cls}">{_e(v or "–")}</span>'


class _Page:
    def __init__(self):
        self.parts: list[str] = []
        self.nav: list[tuple[str, str]] = []
        self.n_fig = 0

    def section(self, anchor: str, title: str) -> None:
        self.nav.append((anchor, title))
        self.parts.append(f'<h2 id="{anchor}">{_e(title)}</h2>')

    def add(self, s: str) -> None:
        self.parts.append(s)

    def figure(self, fig: go.Figure) -> None:
        self.n_fig += 1
        div = pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig{self.n_fig}",
                          config={"displaylogo": False, "responsive": True})
        self.parts.append(f'<div class="fig">{div}</div>')

    def render(self, title: str, subtitle: str) -> str:
        from plotly.offline import get_plotlyjs
        nav = "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in self.nav)
        return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
                f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style>"
                f"{ERROR_HOOK}<script type='text/javascript'>{get_plotlyjs()}</script></head><body><main>"
                f"<h1>{_e(title)}</h1><p class='sub'>{subtitle}</p><nav>{nav}</nav>{''.join(self.parts)}"
                f"<p id='render-status' class='sub'></p></main>{STATUS_HOOK}</body></html>")


def _setup_html(study: dict, rows: list[dict]) -> str:
    res = next((r["results"] for r in grid_rows(rows) if r.get("results")), None) or {}
    s = study.get("study", {})
    models = res.get("models") or s.get("models") or {}
    items = [
        ("study", s.get("name")), ("description", s.get("description")),
        ("pair", models.get("name") or (s.get("models") or {}).get("pair")),
        ("target", json.dumps(models.get("target"))), ("drafter", json.dumps(models.get("drafter"))),
        ("device / dtype / attention", f"{models.get('device', (s.get('models') or {}).get('device'))} / "
                                       f"{models.get('dtype', (s.get('models') or {}).get('dtype'))} / "
                                       f"{models.get('attention', (s.get('models') or {}).get('attention'))}"),
        ("hardware", json.dumps(res.get("device"))),
        ("prompts", f"{(s.get('prompts') or {}).get('set')} × {(s.get('prompts') or {}).get('n_prompts')}"),
        ("methods", ", ".join(s.get("methods") or [])), ("grid", json.dumps(s.get("grid"))),
        ("versions", json.dumps(res.get("versions"))), ("commit", res.get("commit")),
    ]
    return _table(["", ""], [[f"<b>{_e(k)}</b>", _e(v)] for k, v in items if v not in (None, "", "null")])


def sweep_table(rows: list[dict]) -> list[dict]:
    """One plain dict per grid run: what the sweep figures plot (for sweep.json)."""
    out = []
    for r in grid_rows(rows):
        cfg, sm, cmp = run_config(r), run_summary(r), r.get("comparison") or {}
        out.append({"run": r["name"], "status": r["status"], "method": cfg.get("method"),
                    "budget": cfg.get("budget"), "topk": cfg.get("topk"), "temperature": cfg.get("temperature"),
                    "mean_tau": sm.get("mean_tau"), "tokens_per_second": sm.get("tokens_per_second"),
                    "speedup": cmp.get("speedup"), "verdict": cmp.get("verdict")})
    return out


def runs_table_html(rows: list[dict]) -> str:
    body = []
    for r in grid_rows(rows):
        cfg, sm, cmp = run_config(r), run_summary(r), r.get("comparison") or {}
        spt = sm.get("seconds_per_token")
        body.append([f"<b>{_e(r['name'])}</b>", _e(cfg.get("method")), _e(cfg.get("budget") or "–"),
                     _e(cfg.get("topk") or "–"), _e(cfg.get("temperature")),
                     f'<span class="{"bad" if r["status"] == "failed" else "ok"}">{_e(r["status"])}</span>',
                     f'<td class="num">{_num(sm.get("mean_tau"))}</td>',
                     f'<td class="num">{_num(sm.get("tokens_per_second"), "{:.1f}")}</td>',
                     f'<td class="num">{_num(spt * 1e3 if spt else None)}</td>',
                     f'<td class="num">{_num(cmp.get("speedup"))}</td>', _verdict_html(cmp.get("verdict"))])
    return _table(["run", "method", "budget", "topk", "T", "status", "mean τ", "tokens/s", "ms/token",
                   "speedup", "lossless"], body)


def _kernel_section(page: _Page, study_dir: Path, rows: list[dict]) -> None:
    # Any run directory holding a timeline.json (normally kernel_timeline/), with or without run.json.
    kt = sorted(p.parent for p in study_dir.glob(f"*/{TIMELINE_FILE}") if not p.parent.name.startswith("."))
    page.section("kernels", "Kernel timeline")
    if not kt:
        page.add("<p class='na'>No kernel_timeline run in this study (add it to notebooks.per_study).</p>")
        return
    d = kt[0]
    tl = json.loads((d / TIMELINE_FILE).read_text())
    page.add(f"<p>Profiled run: {_e(tl.get('run'))} on {_e(tl.get('device'))}; Chrome trace: "
             f"<code>{_e(os.path.relpath(d / tl.get('trace_file', 'trace.json'), study_dir))}</code> "
             "(open it in a trace viewer for the full detail). Stage rows come from the engine's stage "
             "clocks laid end to end when the engine emits no profiler annotations, so they show each "
             "stage's share and order, not exact alignment with the kernel rows.</p>")
    page.figure(timeline_figure(tl))
    top = tl.get("top_kernels", [])[:15]
    if top:
        page.add(_table(["kernel / op (hover for the full name)", "calls", "total ms", "share"],
                        [[f'<span title="{_e(k["name"])}">{_e(short_kernel_name(k["name"], 90))}</span>',
                          f'<td class="num">{k["count"]}</td>',
                          f'<td class="num">{k["total_us"] / 1e3:.2f}</td>',
                          f'<td class="num">{100 * k.get("share", 0):.1f}%</td>'] for k in top]))
    if (d / MICROBENCH_FILE).is_file():
        mb = json.loads((d / MICROBENCH_FILE).read_text())
        page.add("<h3>Verify micro-benchmark</h3>")
        page.figure(microbench_figure(mb))
        if mb.get("note"):
            page.add(f"<p class='sub'>{_e(mb['note'])}</p>")


BENCH_COLUMNS = [("method", "method", "{}"), ("budget", "budget", "{}"), ("mean_tau", "mean τ", "{:.2f}"),
                 ("tokens_per_second", "tokens/s", "{:.1f}"), ("round_seconds", "round ms", "1e3:{:.3f}"),
                 ("speedup_over_ar", "speedup", "{:.2f}"), ("round_over_ar_step", "round / AR step", "{:.2f}"),
                 ("lossless", "lossless", "{}")]


def _bench_files(study_dir: Path) -> list[Path]:
    """`ddtree-lab bench … --out <study_dir>/bench/NAME.json` files (or *.bench.json beside the runs)."""
    return sorted(study_dir.glob("bench/*.json")) + sorted(study_dir.glob("*.bench.json"))


def _bench_section(page: "_Page", study_dir: Path) -> None:
    files = _bench_files(study_dir)
    if not files:
        return
    page.section("bench", "Benchmarks (ddtree-lab bench)")
    for f in files:
        try:
            b = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        env = b.get("environment") or {}
        head = " · ".join(str(x) for x in (b.get("kind"), b.get("model"), b.get("attention"), env.get("device"),
                                           env.get("commit")) if x)
        page.add(f"<h3>{_e(f.name)}</h3><p class='sub'>{_e(head)}</p>")
        roof = b.get("roofline") or {}
        if roof.get("copy_bytes_per_second"):
            page.add(f"<p class='sub'>measured copy bandwidth {roof['copy_bytes_per_second'] / 1e9:.0f} GB/s; AR step "
                     f"{_num(roof.get('ar_step_over_roofline'))}× its weight-read roofline</p>")
        rows = [r for r in b.get("rows", []) if isinstance(r, dict)]
        cols = [c for c in BENCH_COLUMNS if any(c[0] in r for r in rows)]
        body = []
        for r in rows:
            cells = []
            for key, _, fmt in cols:
                v = r.get(key)
                if fmt.startswith("1e3:") and isinstance(v, (int, float)):
                    v, fmt = v * 1e3, fmt[4:]
                cells.append(f'<td class="num">{_num(v, fmt)}</td>' if isinstance(v, float) else _e(v if v is not None else "–"))
            body.append(cells)
        if body:
            page.add(_table([c[1] for c in cols], body))


def build_report(study_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Assemble `<study_dir>/report.html` (or `out`) from every run of the study."""
    study_dir = Path(study_dir).resolve()
    if not study_dir.is_dir():
        raise FileNotFoundError(f"no study directory {study_dir}")
    rows = collect_study(study_dir)
    try:
        study = json.loads((study_dir / STUDY_FILE).read_text())
    except (OSError, ValueError):
        study = {"study": {"name": study_dir.name}}
    grid = grid_rows(rows)
    ok = [r for r in grid if r.get("results")]
    page = _Page()

    page.section("setup", "Setup")
    page.add(_setup_html(study, rows))
    page.section("runs", "Runs")
    page.add(runs_table_html(rows))

    best = recommend_budget(rows)
    page.section("budget", "Acceptance and speedup vs budget")
    if best and best["speedup"] >= 1:
        page.add(f"<div class='callout'><b>Recommended budget: {best['budget']}</b> "
                 f"(topk {best['topk'] or '= budget'}, T {best['temperature']:g}): "
                 f"{best['speedup']:.2f}× over AR, mean τ {_num(best['mean_tau'])} — run {_e(best['run'])}.</div>")
    elif best:
        page.add(f"<div class='callout'><b>No budget beat AR here.</b> The best DDTree run, budget "
                 f"{best['budget']} ({_e(best['run'])}), reached {best['speedup']:.2f}× with mean τ "
                 f"{_num(best['mean_tau'])}: the drafter is not accepted often enough to pay for drafting "
                 "and a wider verify on this hardware.</div>")
    else:
        page.add("<p class='na'>No recommendation: it needs an AR run and at least one complete DDTree run.</p>")
    if ok:
        page.figure(sweep_figure(rows, "mean_tau"))
        page.figure(sweep_figure(rows, "speedup"))
        page.figure(sweep_figure(rows, "tokens_per_second"))

    spec = [r for r in ok if run_config(r).get("method") != "ar"]
    hidden = busy_runs(spec)
    note = (f"<p class='sub'>{len(hidden)} of {len(spec)} runs start hidden; click a legend entry to show it.</p>"
            if hidden else "")
    page.section("tau", "τ histograms")
    if spec:
        page.add(note)
        page.figure(tau_histogram_figure({r["name"]: run_summary(r).get("tau_histogram", {}) for r in spec},
                                             hidden=hidden))
    page.section("depth", "Acceptance by depth")
    if spec:
        page.add(note)
        page.figure(acceptance_depth_figure({r["name"]: run_summary(r).get("acceptance_by_depth", {}) for r in spec},
                                                hidden=hidden))
    page.section("stages", "Stage breakdown")
    if ok:
        page.figure(stage_figure(rows))

    _kernel_section(page, study_dir, rows)

    page.section("trees", "Draft trees (sample rounds)")
    samples = tree_sample_figures(rows)
    if not samples:
        page.add("<p class='na'>No traced DDTree rounds.</p>")
    for _, fig in samples:
        page.figure(fig)

    _bench_section(page, study_dir)

    page.section("lossless", "Losslessness")
    page.add("<p>At T = 0 every run must emit exactly the AR run's tokens for every prompt.</p>")
    page.add(_table(["run", "verdict", "detail"],
                    [[_e(r["name"]), _verdict_html((r.get("comparison") or {}).get("verdict")),
                      _e((r.get("comparison") or {}).get("detail"))] for r in ok]))

    page.section("suspect", "Failed or suspect runs")
    bad = [(r, suspect_reason(r)) for r in rows]
    bad = [(r, why) for r, why in bad if why]
    if not bad:
        page.add("<p class='ok'>None: every run completed, produced tokens and matched AR where checked.</p>")
    for r, why in bad:
        nb = r["run"].get("error_notebook")
        link = f" — notebook <a href='{_e(r['name'])}/{_e(nb)}'>{_e(r['name'])}/{_e(nb)}</a>" if nb else ""
        page.add(f"<h3 class='bad'>{_e(r['name'])}</h3><p>{_e(why)}{link}</p>")
        if r["run"].get("error_detail"):
            page.add(f"<pre>{_e(r['run']['error_detail'])}</pre>")

    name = study.get("study", {}).get("name", study_dir.name)
    subtitle = (f"{len(grid)} runs · {sum(r['status'] == 'failed' for r in rows)} failed · "
                f"built {time.strftime('%Y-%m-%d %H:%M')} from <code>{_e(study_dir)}</code>")
    out = Path(out) if out else study_dir / REPORT_FILE
    atomic_write_text(out, page.render(f"DDTree study: {name}", subtitle))
    return out


# ----------------------------------------------------------------------------- CLI pieces
def add_report_args(p) -> None:
    p.description = "Assemble report.html from a study's output directory."
    p.add_argument("study_dir", help="a study output directory, e.g. outputs/quickstart")
    p.add_argument("--out", default=None, help="where to write the page (default: STUDY_DIR/report.html)")


def run_report_cli(args) -> int:
    try:
        path = build_report(args.study_dir, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0
