"""The findings report, built from a study directory written without papermill (fast), and
opened in headless Chromium: no JavaScript errors, figures rendered, a non-blank screenshot."""
import argparse
import json
import math
import shutil
import struct
import subprocess
import zlib

import pytest

from ddtree_lab import metrics
from ddtree_lab.workbench import figures, profile, report, results as R
from ddtree_lab.workbench.advisor import figures as advisor_figures
from ddtree_lab.atomic import atomic_write_json
from ddtree_lab.workbench.runs import RunParams


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory, tiny_dirs, tiny_pair):
    """AR + DDTree b2/b4/b8 runs of the tiny pair, one failed run, one tampered (lossy) run and a
    kernel timeline, laid out as `ddtree-lab study` lays them out."""
    root = tmp_path_factory.mktemp("report_study")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": s}) for i, s in
                                 enumerate(["def add(a, b):\n", "class Point:\n"])))
    sd = root / "study"
    t, d = tiny_dirs
    p = RunParams(study_name="rep", study_dir=str(sd), pair="", target_dir=str(t), drafter_dir=str(d),
                  prompt_set=str(prompts), n_prompts=2, max_new_tokens=10, warmup=False, topk=0)
    R.quick_sweep(p, [2, 4, 8], tiny_pair)
    atomic_write_json(sd / "study.json", {"study": {"name": "rep", "methods": ["ar", "ddtree"],
                                                    "prompts": {"set": str(prompts), "n_prompts": 2}},
                                          "runs": ["ar-t0", "ddtree-b2-k0-t0", "ddtree-b4-k0-t0",
                                                   "ddtree-b8-k0-t0", "ddtree-b16-k0-t0"]})
    # A run left over from an earlier version of the study file: not in study.json, left out.
    shutil.copytree(sd / "ddtree-b4-k0-t0", sd / "ddtree-b99-k0-t0")
    # A lossy run: tokens that differ from AR must be flagged.
    res = json.loads((sd / "ddtree-b8-k0-t0" / "results.json").read_text())
    res["prompts"][0]["tokens"][3] += 1
    atomic_write_json(sd / "ddtree-b8-k0-t0" / "results.json", res)
    # A failed run, as the study runner records it.
    (sd / "ddtree-b16-k0-t0").mkdir()
    atomic_write_json(sd / "ddtree-b16-k0-t0" / "run.json", {
        "name": "ddtree-b16-k0-t0", "kind": "run", "status": "failed", "error": "RuntimeError: out of cheese",
        "error_notebook": "accepted_paths.ipynb", "error_detail": "RuntimeError: out of cheese\n",
        "params": {"method": "ddtree", "budget": 16}})
    # A kernel timeline from a synthetic Chrome trace.
    kt = sd / "kernel_timeline"
    kt.mkdir()
    events = [{"ph": "X", "name": "ddtree_lab.generate", "cat": "user_annotation", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::linear", "cat": "cpu_op", "ts": 10, "dur": 300, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::addmm", "cat": "cpu_op", "ts": 20, "dur": 200, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::softmax", "cat": "cpu_op", "ts": 400, "dur": 50, "pid": 1, "tid": 1}]
    rounds = [{"index": 0, "stage_seconds": {"draft": 1e-4, "tree_build": 5e-5, "verify": 3e-4, "commit": 1e-4}}]
    tl = profile.summarize_chrome_trace({"traceEvents": events}, rounds, {"verify": 4e-4})
    atomic_write_json(kt / "timeline.json", {**tl, "run": "kernel_timeline", "device": "cpu", "trace_file": "trace.json"})
    atomic_write_json(kt / "microbench.json", {"points": [{"budget": 2, "verify_ms": 1.0, "achieved_gbps": 0.1},
                                                         {"budget": 8, "verify_ms": 1.5, "achieved_gbps": 0.08}],
                                              "peak_gbps": None, "note": "cpu"})
    atomic_write_json(kt / "run.json", {"name": "kernel_timeline", "kind": "study", "status": "complete"})
    return sd


def test_summarize_chrome_trace_outermost_ops_and_stages(study_dir):
    tl = json.loads((study_dir / "kernel_timeline" / "timeline.json").read_text())
    assert tl["kind"].startswith("CPU ops")
    assert [k["name"] for k in tl["top_kernels"]] == ["aten::linear", "aten::softmax"]  # addmm is nested
    assert [s["name"] for s in tl["stages"]] == ["prefill", "draft", "tree_build", "verify", "commit"]
    assert tl["stages"][0]["dur_us"] == pytest.approx(100.0)


def test_collect_and_compare(study_dir):
    rows = {r["name"]: r for r in R.collect_study(study_dir)}
    assert rows["ar-t0"]["comparison"]["verdict"] == "reference"
    assert rows["ddtree-b2-k0-t0"]["comparison"]["verdict"] == "lossless"
    assert rows["ddtree-b2-k0-t0"]["comparison"]["speedup"] > 0
    assert rows["ddtree-b8-k0-t0"]["comparison"]["verdict"] == "mismatch"
    assert "p0 diverges at token 3" in rows["ddtree-b8-k0-t0"]["comparison"]["detail"]
    assert rows["ddtree-b16-k0-t0"]["status"] == "failed"
    assert "ddtree-b99-k0-t0" not in rows
    assert R.suspect_reason(rows["ddtree-b16-k0-t0"]).startswith("failed: RuntimeError")
    assert R.suspect_reason(rows["ddtree-b8-k0-t0"]).startswith("mismatch")
    assert R.suspect_reason(rows["ddtree-b2-k0-t0"]) is None
    assert R.suspect_reason(rows["kernel_timeline"]) is None
    best = figures.recommend_budget(list(rows.values()))
    assert best["budget"] in (2, 4)  # never the lossy b8 run


def test_a_16_bit_mismatch_points_to_the_invariant_target_unless_it_ran_there():
    def run(method, tokens, **cfg):
        return {"config": {"method": method, "temperature": 0.0, **cfg}, "summary": {"new_tokens": len(tokens)},
                "prompts": [{"id": "p0", "tokens": tokens}]}

    ar = run("ar", [1, 2, 3], dtype="bfloat16", attention="triton")
    fast = R.losslessness(run("ddtree", [1, 2, 4], dtype="bfloat16", attention="triton"), ar)
    assert fast["verdict"] == "mismatch" and "attention: invariant" in fast["detail"]
    ar["config"]["attention"] = "invariant"  # there every run must equal AR: a mismatch is a fault, unexcused
    inv = R.losslessness(run("ddtree", [1, 2, 4], dtype="bfloat16", attention="invariant"), ar)
    assert inv["verdict"] == "mismatch" and inv["detail"] == "p0 diverges at token 2"


def test_results_json_fields(study_dir):
    res = json.loads((study_dir / "ddtree-b4-k0-t0" / "results.json").read_text())
    for key in ("config", "models", "device", "versions", "commit", "prompts", "summary", "comparison"):
        assert key in res, key
    s = res["summary"]
    for key in ("new_tokens", "rounds", "mean_tau", "tau_histogram", "acceptance_by_depth",
                "stage_seconds", "tokens_per_second", "seconds_per_token"):
        assert key in s, key
    assert s["new_tokens"] == sum(len(p["tokens"]) for p in res["prompts"]) > 0
    assert set(s["stage_seconds"]) >= {"draft", "tree_build", "verify", "commit", "other"}
    assert res["config"]["budget"] == 4 and res["models"]["target"]["path"]
    rows = R.load_traces(study_dir / "ddtree-b4-k0-t0")
    assert rows and rows[0]["tree"]["parents"] and "prompt_id" in rows[0]


def test_metrics_helpers():
    a = metrics.acceptance_by_depth([1, 2, 3, 3], max_depth=3)
    assert a["survival"] == [0.75, 0.5, 0.0] and a["conditional"][:2] == [0.75, 2 / 3]
    assert metrics.tau_histogram([1, 3, 3]) == {"values": [1, 2, 3], "counts": [1, 0, 2]}
    assert profile.peak_bandwidth_gbps("NVIDIA H200") == 4800 and profile.peak_bandwidth_gbps("cpu") is None


def test_build_report(study_dir):
    path = report.build_report(study_dir)
    page = path.read_text()
    assert path == study_dir / "report.html"
    assert "<script src" not in page  # nothing loaded from the network
    assert page.count("plotly.js v") == 1  # plotly.js embedded exactly once, inline
    for section in ("Setup", "Acceptance and speedup vs budget", "τ histograms", "Acceptance by depth",
                    "Stage breakdown", "Kernel timeline", "Draft trees", "Losslessness", "Failed or suspect runs"):
        assert section in page, section
    assert "Recommended budget" in page or "No budget beat AR" in page  # speedups vary by machine
    assert "out of cheese" in page and "diverges at token 3" in page
    assert "verify micro-benchmark" in page.lower()
    assert '<a href="#microbench">Verify micro-benchmark</a>' in page  # in the navigation
    assert "there is none to measure on a CPU" in page  # its caption speaks of no undrawn roofline
    assert "params/lab_gpu.yaml" in page  # the CPU note says what to run next
    assert "τ here is measured on" in page  # why τ differs from a README's held-out τ
    assert "figures rendered" not in page and "<th></th>" not in page  # no debug footer, no empty row
    setup = page[page.index('id="setup"'):page.index('id="runs"')]
    assert "{" not in setup and "[" not in setup, setup[:400]  # no raw JSON in the setup table


def test_acceptance_conditional_needs_enough_rounds():
    a = metrics.acceptance_by_depth([1, 2, 2, 3, 3, 3, 3, 3, 3, 7])
    fig = figures.acceptance_depth_figure({"r": a})
    right = fig.data[1]
    before = [a["rounds"]] + a["reached"][:-1]
    for y, b in zip(right.y, before):
        assert (y is None) == (b < figures.MIN_CONDITIONAL)
    assert [tuple(c) for c in right.customdata] == list(zip(a["reached"], before))  # counts on hover


def test_budget_ticks_for_every_budget():
    rows = [{"name": f"ddtree-b{b}-k0-t0", "kind": "run", "status": "complete",
             "results": {"config": {"method": "ddtree", "budget": b, "topk": 0, "temperature": 0.0},
                         "summary": {"mean_tau": 2.0}}} for b in (4, 24, 100)]
    fig = figures.sweep_figure(rows, "mean_tau")
    assert list(fig.layout.xaxis.tickvals) == [4, 24, 100]


def _speedup_rows(speedups: dict) -> list[dict]:
    """An AR run and one lossless DDTree run per budget at the given {budget: speedup over AR}."""
    def row(name, method, budget, tps):
        return {"name": name, "kind": "run", "status": "complete",
                "results": {"run": name, "config": {"method": method, "budget": budget, "topk": 0, "temperature": 0.0},
                            "summary": {"mean_tau": 2.0, "tokens_per_second": tps}}}
    rows = [row("ar-t0", "ar", None, 100.0)] + [row(f"ddtree-b{b}-k0-t0", "ddtree", b, 100.0 * x)
                                                for b, x in speedups.items()]
    for r in rows:
        r["comparison"] = {**R.compare(r["results"], rows[0]["results"]), "verdict": "lossless"}
    return rows


@pytest.mark.parametrize("speedups, inwards", [({4: 1.2, 16: 1.5, 64: 2.0}, "right"),
                                                ({4: 2.0, 16: 1.5, 64: 1.2}, "left"),
                                                ({4: 1.2, 16: 2.0, 64: 1.5}, "center")])
def test_best_budget_label_stays_inside_the_plot(speedups, inwards):
    fig = figures.sweep_figure(_speedup_rows(speedups), "speedup")
    best = max(speedups, key=speedups.get)
    star = next(t for t in fig.data if t.name == "recommended")
    assert star.x == (best,) and star.y == (speedups[best],)
    (label,) = [a for a in fig.layout.annotations if a.yref == "paper"]  # the baselines' labels sit on their lines
    # inside the plot area: hung from its top edge, and at either end of the budget axis growing inwards
    assert label.y == 1.0 and label.yanchor == "top" and str(best) in label.text
    assert label.xref == "x" and label.x == pytest.approx(math.log10(best)) and label.xanchor == inwards
    lo, hi = fig.layout.yaxis.range  # with room left above the star for the label
    assert (hi - speedups[best]) / (hi - lo) >= 0.15


def test_every_log_axis_is_labelled_at_the_budgets(study_dir):
    figs = report.page_figures(report.build_report(study_dir).read_text())
    log_axes = 0
    for f in figs:
        lay = f["layout"]
        for key, axis in lay.items():
            if not (key.startswith(("xaxis", "yaxis")) and isinstance(axis, dict) and axis.get("type") == "log"):
                continue
            log_axes += 1
            assert axis.get("tickvals"), (key, lay["title"])
            assert axis["ticktext"] == [f"{t:g}" for t in axis["tickvals"]], (key, lay["title"])
            if key.startswith("xaxis"):  # a budget axis: a label at each budget the figure draws, no other
                ref = "x" + key[5:]
                budgets = {x for t in f["data"] if t.get("xaxis", "x") == ref for x in t.get("x") or []}
                assert axis["tickvals"] == sorted(budgets), (key, lay["title"])
    assert log_axes >= 7  # three sweeps, the micro-benchmark's two, verify time, the advisor's
    check = {"checked": [{"file": "e2e.json", "model": "m", "rows": [
        {"method": "ddtree", "budget": b, "measured_seconds": ms / 1e3, "predicted_seconds": ms / 1e3}
        for b, ms in ((16, 3.0), (64, 9.0), (256, 40.0))]}]}
    fig = advisor_figures.check_figure(check)
    assert list(fig.layout.xaxis.tickvals) == [16, 64, 256] and list(fig.layout.xaxis.ticktext) == ["16", "64", "256"]
    assert list(fig.layout.yaxis.tickvals) == [5.0, 10.0, 20.0] and list(fig.layout.yaxis.ticktext) == ["5", "10", "20"]


def test_report_refuses_a_folder_that_is_no_study_output(tmp_path, capsys):
    from ddtree_lab import cli

    (tmp_path / "photos").mkdir()
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "study.json" in err and "Traceback" not in err
    atomic_write_json(tmp_path / "study.json", {"study": {"name": "s"}, "runs": ["ar-t0"]})
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "no runs" in err
    assert not (tmp_path / "report.html").exists()
    # a study whose every run failed is still a study: its page lists the failure
    atomic_write_json(tmp_path / "ar-t0" / "run.json", {"name": "ar-t0", "kind": "run", "status": "failed",
                                                        "error": "RuntimeError: no GPU", "params": {"method": "ar"}})
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "no GPU" in (tmp_path / "report.html").read_text()


def test_report_of_a_study_under_a_name_that_is_not_utf8(study_dir, tmp_path, capsys):
    import os
    from ddtree_lab import cli

    sd = tmp_path / os.fsdecode(b"caf\xe9") / "study"  # Python holds the byte as a lone surrogate
    shutil.copytree(study_dir, sd)
    odd_run = os.fsdecode(b"ddtree-b2-k0-t0-\xff")  # a run folder too
    shutil.copytree(sd / "ddtree-b2-k0-t0", sd / odd_run)
    listed = json.loads((sd / "study.json").read_text())
    atomic_write_json(sd / "study.json", {**listed, "runs": listed["runs"] + [odd_run]})
    assert cli.main(["report", str(sd)]) == 0
    assert "caf\\xe9" in capsys.readouterr().out
    page = (sd / "report.html").read_text(encoding="utf-8")
    assert "caf\\xe9" in page and "ddtree-b2-k0-t0-\\udcff" in page


def test_report_cli(study_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    report.add_report_args(parser)
    assert report.run_report_cli(parser.parse_args([str(study_dir), "--out", str(tmp_path / "r.html")])) == 0
    assert (tmp_path / "r.html").stat().st_size > 1_000_000
    assert report.run_report_cli(parser.parse_args([str(tmp_path / "missing")])) == 2
    assert "no study directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- headless Chromium
def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def _png_pixels(data: bytes):
    """-> (width, height, rows of RGB(A) bytes) for 8-bit RGB/RGBA PNGs (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert depth == 8 and color in (2, 6)
    bpp = 3 if color == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def render_status(dom: str) -> dict:
    """The attributes of the page's hidden #render-status element in a dumped DOM."""
    from html.parser import HTMLParser

    found = {}

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if a.get("id") == "render-status":
                found.update({k: v or "" for k, v in a.items()})
    P().feed(dom)
    return found


def test_report_renders_in_headless_chromium(study_dir, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    page = report.build_report(study_dir)
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000",
             "--enable-logging=stderr", "--v=0"]
    url = page.as_uri()
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr, [l for l in dom.stderr.splitlines() if "CONSOLE" in l]
    status = render_status(dom.stdout)
    assert "data-plots" in status, "the page's load hook did not run"
    assert int(status["data-errors"]) == 0, status.get("data-error-text")
    n_figs = page.read_text().count('class="fig"')
    assert int(status["data-plots"]) == n_figs  # every figure drew its SVG
    figs = json.loads(status["data-figures"])
    assert len(figs) == n_figs >= 10
    untitled = [f["id"] for f in figs if not f["title"].strip()]
    assert not untitled, untitled
    bare_axes = [(f["title"], k) for f in figs for k, t in f["axes"].items() if not t.strip()]
    assert not bare_axes, bare_axes
    titles = " | ".join(f["title"] for f in figs)
    for expected in ("acceptance vs budget", "acceptance by depth", "timeline of one generate",
                     "verify micro-benchmark", "prompt p0, rounds"):
        assert expected in titles, (expected, titles)

    png = tmp_path / "shot.png"
    shot = subprocess.run(flags + ["--window-size=1200,1800", f"--screenshot={png}", url],
                          capture_output=True, text=True, timeout=180)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    w, h, bpp, rows = _png_pixels(png.read_bytes())
    pixels = [r[i:i + 3] for r in rows[::8] for i in range(0, w * bpp, 8 * bpp)]
    common = max(set(pixels), key=pixels.count)
    assert sum(p != common for p in pixels) / len(pixels) > 0.05  # not a blank page
    assert len(set(pixels)) > 50                                    # text, lines, colours


def test_many_runs_start_partly_hidden():
    rows = [{"name": f"ddtree-b{b}-k{k}-t{t}", "kind": "run", "status": "complete",
             "results": {"config": {"method": "ddtree", "budget": b, "topk": k, "temperature": t}}}
            for t in (0, 1) for k in (0, 8) for b in (1, 4, 16, 64, 256, 1024)]
    rows.append({"name": "dflash-t0", "kind": "run", "status": "complete",
                 "results": {"config": {"method": "dflash", "temperature": 0}}})
    runs = figures.grid_rows(rows)
    shown = {r["name"] for r in runs} - figures.busy_runs(runs)
    assert "dflash-t0" in shown and "ddtree-b1-k0-t0" in shown and len(shown) <= 8
    assert all(n.endswith("-k0-t0") for n in shown - {"dflash-t0"})
    assert figures.busy_runs(runs[:5]) == set()


def test_pair_without_tokenizer_gets_byte_prompts(tiny_pair, tmp_path):
    # Random-weight pairs (random:<shape>) have no tokenizer: prompts go in as UTF-8 bytes.
    import dataclasses
    bare = dataclasses.replace(tiny_pair, tokenizer=None)
    assert R.prompt_input(bare, "ab") == [97, 98] and R.prompt_input(tiny_pair, "ab") == "ab"
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]}))
    p = RunParams(prompt_set=str(tmp_path / "p.jsonl"), n_prompts=1, max_new_tokens=4, budget=2, warmup=False,
                  run_dir=str(tmp_path / "run"), study_dir="")
    res, rows = R.generate_run(p, bare, progress=False)
    assert res["summary"]["new_tokens"] == 4 and rows[0]["tree"]


def test_short_kernel_names():
    assert figures.short_kernel_name("void at::native::k<128, F<a<b>>>(int, T<x>)") == "at::native::k<…>"
    assert figures.short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    assert len(figures.short_kernel_name("x" * 200, 40)) == 40


def test_tree_rounds_own_sibling_live(study_dir, tiny_pair):
    cfg = json.loads((study_dir / "ddtree-b2-k0-t0" / "results.json").read_text())["config"]
    p = RunParams(**{**cfg, "study_dir": str(study_dir), "run_dir": str(study_dir / "budget_sweep"), "budgets": []})
    rounds = R.tree_rounds(p, [2, 4, 6], pair=tiny_pair)
    assert set(rounds) == {2, 4, 6}
    assert rounds[4] == [r for r in R.load_traces(study_dir / "ddtree-b4-k0-t0")]  # from the study's run
    assert len(rounds[6][0]["tree"]["tokens"]) == 6  # generated live
    assert {r["prompt_id"] for r in rounds[6]} == {"p0", "p1"}
    assert R.tree_rounds(RunParams(method="ar"), [2]) == {}
    assert R.run_tokenizer(p) is not None  # from the study's results, no model load


def test_no_comparison_across_settings(study_dir):
    res = json.loads((study_dir / "ddtree-b2-k0-t0" / "results.json").read_text())
    ar = json.loads((study_dir / "ar-t0" / "results.json").read_text())
    assert R.compare(res, ar)["verdict"] == "lossless"
    ar["config"]["max_new_tokens"] += 1
    c = R.compare(res, ar)
    assert c["verdict"] == "not checked" and "max_new_tokens" in c["detail"] and c["speedup"] is None


def test_bench_json_in_report(study_dir):
    # What `ddtree-lab bench e2e --out <study_dir>/bench/e2e.json` writes (fields the table reads).
    bench = study_dir / "bench"
    atomic_write_json(bench / "e2e.json", {
        "kind": "e2e", "model": "random:qwen3-8b", "attention": "triton", "environment": {"device": "NVIDIA H200"},
        "roofline": {"copy_bytes_per_second": 4.2e12, "ar_step_over_roofline": 2.2},
        "rows": [{"method": "ar", "budget": None, "mean_tau": 1.0, "tokens_per_second": 95.0, "round_seconds": 0.008},
                 {"method": "ddtree", "budget": 64, "mean_tau": 1.0, "tokens_per_second": 80.5, "round_seconds": 0.0101}]})
    page = report.build_report(study_dir).read_text()
    assert "Benchmarks (ddtree-lab bench)" in page and "random:qwen3-8b" in page and "4200 GB/s" in page
    assert "10.100" in page  # round seconds shown in ms
    assert "incomplete: " not in page
    cut = json.loads((bench / "e2e.json").read_text())
    atomic_write_json(bench / "e2e.json", {**cut, "rows": cut["rows"][:1], "incomplete": "1 of 2 runs: stopped"})
    page = report.build_report(study_dir).read_text()  # a bench cut short: its rows, and that it was cut
    assert "incomplete: 1 of 2 runs: stopped" in page and "10.100" not in page
    shutil.rmtree(bench)
