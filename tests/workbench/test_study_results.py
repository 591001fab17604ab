"""Trustworthy results (issue 15): what a run read is in its fingerprint, finished runs are verified
before a skip, a damaged run is listed with its file and line, the study folder is locked, timings
are repeated and the recommendation says when a margin is within noise. No papermill here."""
import json
import os
import socket

import pytest

from ddtree_lab import prompts as P
from ddtree_lab.atomic import atomic_write_json, digest_tree
from ddtree_lab.names import RUN_FILE
from ddtree_lab.workbench import report, runner
from ddtree_lab.workbench import results as R
from ddtree_lab.workbench.runs import RunParams, input_digests, run_fingerprint


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_dirs, tiny_pair):
    root = tmp_path_factory.mktemp("trust")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    t, d = tiny_dirs
    p = RunParams(study_name="trust", study_dir=str(root / "study"), pair="", target_dir=str(t), drafter_dir=str(d),
                  prompt_set=str(prompts), n_prompts=1, max_new_tokens=8, warmup=False, topk=0, repeats=3)
    R.quick_sweep(p, [2, 4], tiny_pair)
    return root, p


def test_timing_passes_median_and_spread(sweep):
    root, _ = sweep
    res = json.loads((root / "study" / "ddtree-b2-k0-t0" / "results.json").read_text())
    s = res["summary"]
    assert s["timing_repeats"] == 3 and len(s["tokens_per_second_passes"]) == 3
    lo, hi = s["tokens_per_second_spread"]
    assert lo <= s["tokens_per_second"] <= hi and sorted(s["tokens_per_second_passes"])[1] == s["tokens_per_second"]
    cmp = R.compare(res, json.loads((root / "study" / "ar-t0" / "results.json").read_text()))
    assert cmp["speedup_spread"][0] <= cmp["speedup"] <= cmp["speedup_spread"][1]


def _row(name, method, t, tps, spread, budget=0, verdict="lossless"):
    res = {"config": {"method": method, "budget": budget, "topk": 0, "temperature": t},
           "summary": {"tokens_per_second": tps, "tokens_per_second_spread": spread, "timing_repeats": 3,
                       "mean_tau": 2.0}}
    return {"name": name, "kind": "run", "status": "complete", "results": res}


def _with_comparisons(rows):
    ars = {r["results"]["config"]["temperature"]: r["results"] for r in rows if r["results"]["config"]["method"] == "ar"}
    for r in rows:
        r["comparison"] = {**R.compare(r["results"], ars[r["results"]["config"]["temperature"]]), "verdict": "lossless"}
    return rows


def test_recommendation_per_temperature_and_within_noise():
    rows = _with_comparisons([
        _row("ar-t0", "ar", 0.0, 100, [95, 105]),
        _row("ddtree-b16-k0-t0", "ddtree", 0.0, 130, [125, 135], 16),   # clear win over AR ...
        _row("ddtree-b32-k0-t0", "ddtree", 0.0, 128, [120, 131], 32),   # ... but b32 overlaps it
        _row("ar-t1", "ar", 1.0, 100, [80, 120]),
        _row("ddtree-b16-k0-t1", "ddtree", 1.0, 110, [100, 125], 16),   # its margin over AR is noise
        _row("ddtree-b32-k0-t1", "ddtree", 1.0, 90, [88, 92], 32),
    ])
    recs = R.recommend(rows)
    assert [(r["temperature"], r["budget"]) for r in recs] == [(0.0, 16), (1.0, 16)]
    assert recs[0]["within_noise"] and recs[0]["noise_against"] == "ddtree-b32-k0-t0"
    assert recs[1]["within_noise"] and recs[1]["noise_against"] == "AR"
    assert "within noise" in R.recommendation_text(recs[1]) and "T 1:" in R.recommendation_text(recs[1])
    rows[2]["results"]["summary"].update(tokens_per_second=110, tokens_per_second_spread=[108, 112])
    rows[2]["comparison"] = {**R.compare(rows[2]["results"], rows[0]["results"]), "verdict": "lossless"}
    first = R.recommend(rows)[0]
    assert not first["within_noise"] and "within noise" not in R.recommendation_text(first)
    assert R.recommend_budget(rows)["budget"] == 16


def test_nan_never_becomes_a_figure():
    """Case 6: a NaN throughput gives no speedup, and the run is listed as suspect."""
    ar = _row("ar-t0", "ar", 0.0, 100, [95, 105])["results"]
    bad = _row("ddtree-b16-k0-t0", "ddtree", 0.0, float("nan"), None, 16)
    assert R.compare(bad["results"], ar)["speedup"] is None
    bad["results"]["prompts"] = [{"id": "p0", "tokens": [1]}]
    bad["results"]["summary"]["new_tokens"] = 1
    bad["comparison"] = R.compare(bad["results"], ar)
    assert "tokens_per_second" in R.suspect_reason(bad)
    assert R.recommend([_row("ar-t0", "ar", 0.0, 100, None) | {"comparison": {}}, bad]) == []
    assert R.summarize([{"tokens": [1, 2], "wall_seconds": 0.0}])["tokens_per_second"] is None
    sm = R.summarize([{"tokens": [1, 2], "wall_seconds": float("nan"), "acceptance_lengths": [1]}])
    assert sm["tokens_per_second"] is None and sm["wall_seconds"] is None and "wall_seconds" in sm["non_finite"]


def test_collected_rows_carry_no_nan(sweep, tmp_path):
    import shutil

    root, _ = sweep
    sd = tmp_path / "study"
    shutil.copytree(root / "study", sd)
    f = sd / "ddtree-b2-k0-t0" / "results.json"
    res = json.loads(f.read_text())
    res["summary"]["mean_tau"] = float("nan")
    f.write_text(json.dumps(res))  # NaN as JSON writes it, allow_nan
    rows = {r["name"]: r for r in R.collect_study(sd)}
    assert rows["ddtree-b2-k0-t0"]["results"]["summary"]["mean_tau"] is None
    assert "mean_tau not a finite number" in R.suspect_reason(rows["ddtree-b2-k0-t0"])
    assert "NaN" not in json.dumps(report.sweep_table(list(rows.values())))


def test_damaged_runs_listed_with_file_and_line_and_report_built(sweep, tmp_path):
    """Case 10: a garbage traces.jsonl line and a results.json holding a list: listed as damaged."""
    import shutil

    root, _ = sweep
    sd = tmp_path / "study"
    shutil.copytree(root / "study", sd)
    with open(sd / "ddtree-b2-k0-t0" / "traces.jsonl", "a") as f:
        f.write("garbage\n")
    (sd / "ddtree-b4-k0-t0" / "results.json").write_text("[1, 2, 3]")
    rows = {r["name"]: r for r in R.collect_study(sd)}
    n_lines = len((sd / "ddtree-b2-k0-t0" / "traces.jsonl").read_text().splitlines())
    assert rows["ddtree-b2-k0-t0"]["status"] == "damaged"
    assert f"traces.jsonl line {n_lines}: not JSON" in R.suspect_reason(rows["ddtree-b2-k0-t0"])
    assert "results.json: holds a JSON list" in R.suspect_reason(rows["ddtree-b4-k0-t0"])
    assert R.suspect_reason(rows["ar-t0"]) is None
    page = report.build_report(sd).read_text()
    assert "damaged: traces.jsonl line" in page and "holds a JSON list" in page
    with pytest.raises(ValueError, match="traces.jsonl line"):
        R.load_traces(sd / "ddtree-b2-k0-t0")


def _finished_run(d, fingerprint, inputs):
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"summary": {"new_tokens": 3}}))
    (d / "traces.jsonl").write_text('{"index": 0}\n')
    atomic_write_json(d / RUN_FILE, {"status": "complete", "fingerprint": fingerprint, "inputs": inputs,
                                     "files": digest_tree(d, exclude=[RUN_FILE])})


def test_truncated_results_are_not_trusted(tmp_path):
    """Case 9: a finished run is skipped only while its files match the digests in run.json."""
    d = tmp_path / "ar-t0"
    _finished_run(d, "fp", {"prompts": "a"})
    assert runner.why_rerun(d, "fp", True, {"prompts": "a"}) is None
    (d / "results.json").write_text('{"summary": {"new_')
    why = runner.why_rerun(d, "fp", True, {"prompts": "a"})
    assert "results.json" in why and "bytes, was" in why
    assert "damaged: results.json line 1: not JSON" in R.suspect_reason(R.collect_study(tmp_path)[0])
    st = json.loads((d / RUN_FILE).read_text())
    del st["files"]
    atomic_write_json(d / RUN_FILE, st)
    assert "no file digests" in runner.why_rerun(d, "fp", True, {"prompts": "a"})


def test_fingerprint_covers_what_the_run_read(tmp_path, tiny_dirs):
    """Case 3: an edit in place of the prompt set, a checkpoint's config or weights, or a notebook reruns."""
    import shutil

    t, d = (tmp_path / "target", tmp_path / "drafter")
    shutil.copytree(tiny_dirs[0], t)
    shutil.copytree(tiny_dirs[1], d)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    nb = tmp_path / "n.ipynb"
    nb.write_text('{"cells": []}')
    p = RunParams(pair="", target_dir=str(t), drafter_dir=str(d), prompt_set=str(prompts))
    first = input_digests(p, [nb])
    fp = run_fingerprint(p, first)
    _finished_run(tmp_path / "run", fp, first)
    assert runner.why_rerun(tmp_path / "run", run_fingerprint(p, input_digests(p, [nb])), True,
                            input_digests(p, [nb])) is None
    edits = [(prompts, lambda b: b.replace(b'"x"', b'"y"'), "prompts"),
             (t / "config.json", lambda b: b.replace(b"}", b', "note": 1}', 1), "target/config.json"),
             (d / "model.safetensors", lambda b: b[:8] + b[8:].replace(b"F32", b"F16", 1), "drafter/model.safetensors"),
             (nb, lambda b: b + b" ", "notebook/n.ipynb")]
    for path, edit, name in edits:
        old = path.read_bytes()
        path.write_bytes(edit(old))
        now = input_digests(p, [nb])
        assert now != first and run_fingerprint(p, now) != fp, name
        assert runner.why_rerun(tmp_path / "run", run_fingerprint(p, now), True, now) == f"inputs changed: {name}"
        path.write_bytes(old)
    assert input_digests(p, [nb]) == first


def test_second_study_into_a_locked_folder_says_who_holds_it(tmp_path):
    """Case 8: the study folder is locked for a whole study; the second is refused, naming the holder."""
    with runner.study_lock(tmp_path):
        with pytest.raises(runner.StudyBusy) as e:
            with runner.study_lock(tmp_path):
                pass
    msg = str(e.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in msg and "in use by another study" in msg
    with runner.study_lock(tmp_path):  # released: a later study gets it
        pass
    assert not (tmp_path / (runner.LOCK_FILE + ".json")).exists()


def test_out_that_is_a_file_or_read_only(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(runner.StudyError, match="is a file, not a folder"):
        runner._prepare_dir(f)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permission bits: nothing to refuse then
            return
        with pytest.raises(runner.StudyError, match="not writable"):
            runner._prepare_dir(ro)
    finally:
        os.chmod(ro, 0o700)


def test_prompt_sets_refuse_duplicates_bad_json_and_unknown_roles(tmp_path):
    """Case 2 and the prompt-file errors: file and line named."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt id 'a' repeats line 1"):
        P.read_prompt_set(str(f))
    f.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        P.read_prompt_set(str(f))
    f.write_text('{"id": "a", "messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: chat prompt message 0: role 'robot'"):
        P.read_prompt_set(str(f))
    f.write_bytes(b'{"id": "a", "prompt": "\xff"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        P.read_prompt_set(str(f))
