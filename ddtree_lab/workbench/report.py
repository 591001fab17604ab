"""The findings report: one standalone HTML page assembled from `<study_dir>/*/results.json`.

    ddtree-lab report outputs/quickstart

plotly.js is embedded once, inline, so the page works offline. Comparisons (speedup, losslessness)
are recomputed here from every run's results.json, so they never depend on execution order.
Sections: setup, run table, acceptance and speedup vs budget (+ recommended budget), τ histograms,
acceptance by depth, stage breakdown, kernel timeline, draft trees, losslessness, failed/suspect runs.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import plotly.graph_objects as go

from ..atomic import atomic_write_bytes
from ..names import MICROBENCH_FILE, REPORT_FILE, RESULTS_FILE, RUN_FILE, STUDY_FILE, TIMELINE_FILE
from . import ingest, ingest_report, routing_report, viz
from .page import Page, esc, fmt_num, html_table, verdict_html
from .figures import (MIN_CONDITIONAL, acceptance_depth_figure, busy_runs, experts_figure, grid_rows, microbench_figure,
                      recommend_budget, run_config, run_summary, short_kernel_name, stage_figure, sweep_figure,
                      tau_histogram_figure, timeline_cut_note, timeline_figure, verify_cost_figure)
from .profile import peak_bandwidth_gbps
from .results import collect_study, load_traces, recommend, recommendation_text, suspect_reason, tokenizer_for
from .runs import is_fixed



# ----------------------------------------------------------------------------- tree views
def tree_sample_figures(rows: list[dict], max_runs: int = 3, max_rounds: int = 12) -> list[tuple[str, go.Figure]]:
    """Slider figures of the first prompt's rounds for the smallest, the recommended and the largest
    DDTree budget (DFlash when there is no DDTree run)."""
    runs = [r for r in grid_rows(rows) if run_config(r).get("method") in ("ddtree", "dflash")
            and r["status"] == "complete"]
    ddt = [r for r in runs if run_config(r)["method"] == "ddtree" and is_fixed(run_config(r).get("budget"))]
    best = recommend_budget(rows)
    if len(ddt) > max_runs:
        chosen = [ddt[0], next((r for r in ddt if best and r["name"] == best["run"]), ddt[len(ddt) // 2]), ddt[-1]]
        ddt = list({r["name"]: r for r in chosen}.values())
    pick = ddt or runs[:1]
    tok = next((tokenizer_for(r['results']) for r in runs if r.get('results')), None)
    out = []
    for r in pick:
        traces = [t for t in load_traces(r["dir"]) if t.get("tree") is not None]
        if not traces:
            continue
        first = traces[0].get("prompt_id")
        of_prompt = [t for t in traces if t.get("prompt_id") == first]
        sample = of_prompt[:max_rounds]
        star = " (recommended budget)" if best and r["name"] == best["run"] else ""
        title = (f"{r['name']}{star}: prompt {first}, rounds {sample[0].get('index', 0)}–"
                 f"{sample[-1].get('index', len(sample) - 1)} of its {len(of_prompt)}")
        out.append((r["name"], viz.tree_slider_figure(sample, tok, title=title)))
    return out


def _plain(v) -> str:
    """A setup value as text: a dict as `key value` pairs, a list comma-separated, no JSON syntax."""
    if isinstance(v, dict):
        return " · ".join(f"{k} {_plain(x)}" for k, x in v.items() if x not in (None, "", [], {}))
    if isinstance(v, (list, tuple)):
        return ", ".join(_plain(x) for x in v)
    return "" if v is None else str(v)


def _grid_as_written(study_dir: Path, s: dict) -> dict | None:
    """The grid as the study file says it (its copy beside the runs), else as study.json holds it."""
    try:
        import yaml
        g = (yaml.safe_load((study_dir / "study.yaml").read_text(encoding="utf-8")) or {}).get("grid")
        if isinstance(g, dict):
            return g
    except (OSError, ValueError, ImportError, AttributeError):
        pass
    return s.get("grid")


def _setup_html(study: dict, rows: list[dict], study_dir: Path | None = None) -> str:
    res = next((r["results"] for r in grid_rows(rows) if r.get("results")), None) or {}
    s = study.get("study", {})
    models = res.get("models") or s.get("models") or {}
    sm = s.get("models") or {}

    def model(m):
        return _plain({"kind": m.get("kind"), "from": m.get("path")}) if isinstance(m, dict) else _plain(m)

    items = [
        ("study", s.get("name")), ("description", s.get("description")),
        ("pair", models.get("name") or sm.get("pair")),
        ("target", model(models.get("target"))), ("drafter", model(models.get("drafter"))),
        ("device / dtype / attention", " / ".join(str(models.get(k, sm.get(k)) or "–")
                                                  for k in ("device", "dtype", "attention"))),
        ("hardware", _plain(res.get("device"))),
        ("prompts", f"{(s.get('prompts') or {}).get('set')} × {(s.get('prompts') or {}).get('n_prompts')}"),
        ("methods", ", ".join(s.get("methods") or [])),
        ("grid", _plain(_grid_as_written(study_dir, s) if study_dir else s.get("grid"))),
        ("versions", _plain(res.get("versions"))), ("commit", res.get("commit")),
    ]
    return html_table([], [[f"<b>{esc(k)}</b>", esc(v)] for k, v in items if v not in (None, "", "null")])


def _tau_note(study: dict, rows: list[dict]) -> str:
    s = study.get("study", {})
    pr, g = s.get("prompts") or {}, s.get("grid") or {}
    n = pr.get("n_prompts")
    toks = g.get("max_new_tokens")
    size = f"{n} prompt{'s' if n != 1 else ''} × {toks} new tokens" if n and toks else "this study's prompts"
    return (f"<p class='sub'>τ here is measured on {esc(size)} of {esc(pr.get('set') or 'the prompt set')}. "
            "The held-out τ a pair's README gives averages its whole held-out set with longer generations; "
            "a few short prompts land far from it in either direction, so compare runs within this report, "
            "not with that figure.</p>")


def _cpu_note(rows: list[dict]) -> str:
    res = next((r["results"] for r in grid_rows(rows) if r.get("results")), None) or {}
    if str((res.get("models") or {}).get("device", "")).startswith("cuda"):
        return ""
    return ("<p class='sub'>On a CPU with the tiny lab pair, drafting a block costs about as much as a target step "
            "and a verify of a whole tree costs more than one token's step, so DDTree can be slower than AR "
            "even while it accepts several tokens per round; to see the speedup, run "
            "<code>ddtree-lab study params/lab_gpu.yaml</code> on a GPU.</p>")


def sweep_table(rows: list[dict]) -> list[dict]:
    """One plain dict per grid run: what the sweep figures plot (for sweep.json)."""
    out = []
    for r in grid_rows(rows):
        cfg, sm, cmp = run_config(r), run_summary(r), r.get("comparison") or {}
        out.append({"run": r["name"], "status": r["status"], "method": cfg.get("method"),
                    "budget": cfg.get("budget"), "topk": cfg.get("topk"), "temperature": cfg.get("temperature"),
                    "mean_tau": sm.get("mean_tau"), "tokens_per_second": sm.get("tokens_per_second"),
                    "speedup": cmp.get("speedup"), "verdict": cmp.get("verdict"),
                    **({"budget_share": sm["auto"].get("budget_share")} if sm.get("auto") else {})})
    return out


def budget_cell(cfg: dict, sm: dict) -> str:
    """A run's budget as the run table shows it; an `auto` run's with the share of rounds at each budget."""
    share = (sm.get("auto") or {}).get("budget_share")
    if not share:
        return str(cfg.get("budget") or "–")
    return f"{cfg.get('budget')} ({', '.join(f'{b}: {100 * v:.0f}%' for b, v in share.items() if v)})"


def runs_table_html(rows: list[dict]) -> str:
    body = []
    for r in grid_rows(rows):
        cfg, sm, cmp = run_config(r), run_summary(r), r.get("comparison") or {}
        spt = sm.get("seconds_per_token")
        body.append([f"<b>{esc(r['name'])}</b>", esc(cfg.get("method")), esc(budget_cell(cfg, sm)),
                     esc(cfg.get("topk") or "–"), esc(cfg.get("temperature")),
                     f'<span class="{"bad" if r["status"] in ("failed", "damaged") else "ok"}">{esc(r["status"])}</span>',
                     f'<td class="num">{fmt_num(sm.get("mean_tau"))}</td>',
                     f'<td class="num">{fmt_num(sm.get("tokens_per_second"), "{:.1f}")}</td>',
                     f'<td class="num">{fmt_num(spt * 1e3 if spt else None)}</td>',
                     f'<td class="num">{fmt_num(cmp.get("speedup"))}</td>', verdict_html(cmp.get("verdict"))])
    return html_table(["run", "method", "budget", "topk", "T", "status", "mean τ", "tokens/s", "ms/token",
                   "speedup", "lossless"], body)


def study_bandwidth_gbps(study_dir: Path, rows: list[dict]) -> tuple[float | None, str]:
    """The memory bandwidth a floor is drawn with: the study's measured copy bandwidth (its verify
    micro-benchmark), else the GPU's datasheet figure, else none (a CPU study)."""
    for mb_file in sorted(study_dir.glob(f"*/{MICROBENCH_FILE}")):
        try:
            copy = json.loads(mb_file.read_text()).get("copy_gbps")
        except (OSError, ValueError):
            continue
        if copy:
            return float(copy), "measured copy bandwidth"
    gpu = next((((r.get("results") or {}).get("device") or {}).get("gpu") for r in rows
                if ((r.get("results") or {}).get("device") or {}).get("gpu")), None)
    peak = peak_bandwidth_gbps(gpu)
    return (peak, f"{gpu} datasheet bandwidth") if peak else (None, "")


def _verify_section(page: Page, study_dir: Path, rows: list[dict]) -> None:
    """Verify time vs budget with its floor, and for an MoE target the experts a verify forward touches."""
    bw, source = study_bandwidth_gbps(study_dir, rows)
    verify = verify_cost_figure(rows, bw)
    if verify is None:
        return
    page.section("verify", "What a verify forward reads")
    floor = (f"The floor is the weight bytes one verify forward reads over the {source} ({bw:.0f} GB/s)."
             if bw else "No floor is drawn: this study ran without a GPU whose bandwidth is known.")
    page.add(f"<p>Verify time per round against the budget. {esc(floor)} On an MoE target a tree reads the "
             "union of its tokens' experts, so the bytes (and the floor) grow with the budget; on a dense "
             "target every token reads the same weights.</p>")
    page.figure(verify)
    experts = experts_figure(rows)
    if experts is not None:
        page.figure(experts)


def _kernel_section(page: Page, study_dir: Path, rows: list[dict]) -> None:
    # Any run directory holding a timeline.json (normally kernel_timeline/), with or without run.json.
    kt = sorted(p.parent for p in study_dir.glob(f"*/{TIMELINE_FILE}") if not p.parent.name.startswith("."))
    page.section("kernels", "Kernel timeline")
    if not kt:
        page.add("<p class='na'>No kernel_timeline run in this study (add it to notebooks.per_study).</p>")
        return
    d = kt[0]
    tl = json.loads((d / TIMELINE_FILE).read_text())
    what = " ".join(str(x) for x in (tl.get("method"), f"budget {tl['budget']}" if tl.get("budget") and
                                     tl.get("method") == "ddtree" else None) if x)
    cut = timeline_cut_note(tl)
    page.add(f"<p>Profiled: one generate of {esc(what or tl.get('run'))} on {esc(tl.get('device'))}"
             f"{'; ' + esc(cut) if cut else ''}. Chrome trace: "
             f"<code>{esc(os.path.relpath(d / tl.get('trace_file', 'trace.json'), study_dir))}</code> "
             "(open it in a trace viewer for the full detail). Stage rows come from the engine's stage "
             "clocks laid end to end when the engine emits no profiler annotations, so they show each "
             "stage's share and order, not exact alignment with the kernel rows.</p>")
    page.figure(timeline_figure(tl))
    top = tl.get("top_kernels", [])[:15]
    if top:
        page.add(html_table(["kernel / op (hover for the full name)", "calls", "total ms", "share"],
                        [[f'<span title="{esc(k["name"])}">{esc(short_kernel_name(k["name"], 90))}</span>',
                          f'<td class="num">{k["count"]}</td>',
                          f'<td class="num">{k["total_us"] / 1e3:.2f}</td>',
                          f'<td class="num">{100 * k.get("share", 0):.1f}%</td>'] for k in top]))
    if (d / MICROBENCH_FILE).is_file():
        mb = json.loads((d / MICROBENCH_FILE).read_text())
        page.section("microbench", "Verify micro-benchmark")
        page.figure(microbench_figure(mb))
        lines = ("the dashed lines are the memory rooflines" if mb.get("peak_gbps") or mb.get("copy_gbps")
                 else "no roofline is drawn: there is none to measure on a CPU")
        page.add(f"<p class='sub'>Verify time per round against the tree budget; achieved GB/s = bytes "
                 f"read per verify (target weights + KV cache at the mean position) / verify time; {lines}.</p>")


BENCH_COLUMNS = [("method", "method", "{}"), ("budget", "budget", "{}"), ("mean_tau", "mean τ", "{:.2f}"),
                 ("tokens_per_second", "tokens/s", "{:.1f}"), ("round_seconds", "round ms", "1e3:{:.3f}"),
                 ("speedup_over_ar", "speedup", "{:.2f}"), ("round_over_ar_step", "round / AR step", "{:.2f}"),
                 ("lossless", "lossless", "{}")]


def _bench_files(study_dir: Path) -> list[Path]:
    """`ddtree-lab bench … --out <study_dir>/bench/NAME.json` files (or *.bench.json beside the runs)."""
    return sorted(study_dir.glob("bench/*.json")) + sorted(study_dir.glob("*.bench.json"))


def _bench_section(page: "Page", study_dir: Path) -> None:
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
        page.add(f"<h3>{esc(f.name)}</h3><p class='sub'>{esc(head)}</p>")
        if b.get("incomplete"):  # a bench cut short keeps the runs it finished (bench e2e)
            page.add(f"<p class='sub'>incomplete: {esc(b['incomplete'])}</p>")
        roof = b.get("roofline") or {}
        if roof.get("copy_bytes_per_second"):
            page.add(f"<p class='sub'>measured copy bandwidth {roof['copy_bytes_per_second'] / 1e9:.0f} GB/s; AR step "
                     f"{fmt_num(roof.get('ar_step_over_roofline'))}× its weight-read roofline</p>")
        rows = [r for r in b.get("rows", []) if isinstance(r, dict)]
        cols = [c for c in BENCH_COLUMNS if any(c[0] in r for r in rows)]
        body = []
        for r in rows:
            cells = []
            for key, _, fmt in cols:
                v = r.get(key)
                if fmt.startswith("1e3:") and isinstance(v, (int, float)):
                    v, fmt = v * 1e3, fmt[4:]
                cells.append(f'<td class="num">{fmt_num(v, fmt)}</td>' if isinstance(v, float) else esc(v if v is not None else "–"))
            body.append(cells)
        if body:
            page.add(html_table([c[1] for c in cols], body))


def build_report(study_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Assemble `<study_dir>/report.html` (or `out`) from every run of the study."""
    study_dir = Path(study_dir).resolve()
    if not study_dir.is_dir():
        raise FileNotFoundError(f"no study directory {ingest.shown(study_dir)}")
    rows = collect_study(study_dir)
    grid = grid_rows(rows)
    if not grid:  # a folder that is no study output (or none yet): no page of "0 runs"
        what = "no runs" if (study_dir / STUDY_FILE).is_file() else f"no {STUDY_FILE} and no runs"
        raise ValueError(f"{ingest.shown(study_dir)} is not a study output: {what} (a run is a folder holding "
                         f"{RUN_FILE} or {RESULTS_FILE})")
    try:
        study = json.loads((study_dir / STUDY_FILE).read_text())
    except (OSError, ValueError):
        study = {"study": {"name": study_dir.name}}
    ok = [r for r in grid if r.get("results")]
    page = Page()

    page.section("setup", "Setup")
    page.add(_setup_html(study, rows, study_dir))
    page.section("runs", "Runs")
    page.add(runs_table_html(rows))

    recs = recommend(rows)  # one per temperature, with the timing spread (results.py)
    page.section("budget", "Acceptance and speedup vs budget")
    for rec in recs:
        page.add(f"<div class='callout'>{esc(recommendation_text(rec))}</div>")
    if not recs:
        page.add("<p class='na'>No recommendation: it needs an AR run and at least one complete DDTree run.</p>")
    if ok:  # on a CPU, whichever way the speedup went
        page.add(_cpu_note(rows))
    page.add(_tau_note(study, rows))
    if any(run_config(r).get("method") == "ddtree" and not is_fixed(run_config(r).get("budget")) for r in ok):
        page.add("<p class='sub'>A budget=auto run chooses each round's budget, so it has no place on the budget "
                 "axis: it is the dash-dot line; the run table gives the share of its rounds at each budget.</p>")
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
        page.add(f"<p class='sub'>Right: of the rounds that reached depth d−1, the share that reached d; drawn "
                 f"where at least {MIN_CONDITIONAL} rounds reached d−1 (hover for the counts).</p>")
        page.figure(acceptance_depth_figure({r["name"]: run_summary(r).get("acceptance_by_depth", {}) for r in spec},
                                                hidden=hidden))
    page.section("stages", "Stage breakdown")
    if ok:
        page.figure(stage_figure(rows))
    _verify_section(page, study_dir, rows)

    _kernel_section(page, study_dir, rows)

    page.section("trees", "Draft trees (sample rounds)")
    samples = tree_sample_figures(rows)
    if not samples:
        page.add("<p class='na'>No traced DDTree rounds.</p>")
    for _, fig in samples:
        page.figure(fig)

    _bench_section(page, study_dir)

    # -- the budget advisor (section and figures live in workbench/advisor/figures.py)
    from .advisor.figures import add_section as add_advisor_section
    add_advisor_section(page, study_dir)
    # -- end of the budget advisor

    # -- results from serving stacks (ddtree-lab ingest): the study file's `external:` paths, or an
    #    external.json in the study directory; the section lives in workbench/ingest_report.py
    ext, routing = ingest.study_sources(study_dir, study)
    if ext is not None:
        ingest_report.add_section(page, ext, ingest.THRESHOLDS, rows)
    # -- end of serving-stack results
    # -- routing dumps (ddtree-lab ingest's routing.json, or the `external:` paths' dumps): routing_report.py
    if routing is not None and (routing.get("files") or routing.get("unread")):
        routing_report.add_section(page, routing)
    # -- end of routing dumps

    page.section("lossless", "Losslessness")
    page.add("<p>At T = 0 every run must emit exactly the AR run's tokens for every prompt.</p>")
    page.add(html_table(["run", "verdict", "detail"],
                    [[esc(r["name"]), verdict_html((r.get("comparison") or {}).get("verdict")),
                      esc((r.get("comparison") or {}).get("detail"))] for r in ok]))

    page.section("suspect", "Failed or suspect runs")
    bad = [(r, suspect_reason(r)) for r in rows]
    bad = [(r, why) for r, why in bad if why]
    if not bad:
        page.add("<p class='ok'>None: every run completed, produced tokens and matched AR where checked.</p>")
    for r, why in bad:
        nb = r["run"].get("error_notebook")
        link = f" — notebook <a href='{esc(r['name'])}/{esc(nb)}'>{esc(r['name'])}/{esc(nb)}</a>" if nb else ""
        page.add(f"<h3 class='bad'>{esc(r['name'])}</h3><p>{esc(why)}{link}</p>")
        if r["run"].get("error_detail"):
            page.add(f"<pre>{esc(r['run']['error_detail'])}</pre>")

    name = study.get("study", {}).get("name", study_dir.name)
    subtitle = (f"{len(grid)} runs · {sum(r['status'] == 'failed' for r in rows)} failed · "
                f"built {time.strftime('%Y-%m-%d %H:%M')} from <code>{esc(ingest.shown(study_dir))}</code>")
    out = Path(out) if out else study_dir / REPORT_FILE
    # a folder name that is not UTF-8 (a run's) is shown escaped rather than failing the whole page
    atomic_write_bytes(out, page.render(f"DDTree study: {name}", subtitle).encode("utf-8", "backslashreplace"))
    return out


# how plotly.io.to_html (Page.figure) starts drawing a figure: its data, layout and config follow as JSON
_NEW_PLOT = re.compile(r'getElementById\("([^"]+)"\)\)\s*\{\s*Plotly\.newPlot\(\s*"\1",\s*')
_NEXT_ARGUMENT = re.compile(r",\s*")


def page_figures(html: str) -> list[dict]:
    """The figures a report page draws, decoded from the page: [{"id", "data", "layout"}] in page order."""
    decoder, out = json.JSONDecoder(), []
    for m in _NEW_PLOT.finditer(html):
        data, end = decoder.raw_decode(html, m.end())
        layout, _ = decoder.raw_decode(html, _NEXT_ARGUMENT.match(html, end).end())
        out.append({"id": m.group(1), "data": data, "layout": layout})
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
    print(f"report: {ingest.shown(path)}")
    return 0
