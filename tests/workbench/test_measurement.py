"""Notebooks and studies time alike (measurement.py): a notebook run alone pins the threads a study's kernel
has, a stored run that is reused says when and how it was timed, and a verdict from timings taken under
contention or with different thread counts is flagged."""
import json
import os
import subprocess
import sys

import torch

from ddtree_lab.workbench import measurement, runner
from ddtree_lab.workbench import results as R
from ddtree_lab.workbench import spec as study_spec
from ddtree_lab.workbench.runs import RunParams

TIMING_NOTEBOOKS = ["draft_trees", "accepted_paths", "budget_sweep", "kernel_timeline"]  # the report times nothing

FIRST_CELLS = """
import json, sys, nbformat, torch
threads = {}
for path in sys.argv[3:]:
    if sys.argv[1] == "alone":
        torch.set_num_threads(2)  # as JupyterLab's kernel starts on a machine of two cores or more
    code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    ns = {}
    exec(code[0], ns)  # the parameters cell, its defaults as they stand
    ns["study_dir"] = sys.argv[2]  # ... writing under the test's folder
    exec(code[1], ns)  # the first cell after it
    threads[path] = torch.get_num_threads()
print(json.dumps(threads))
"""


def _threads_after_first_cells(how: str, env: dict, tmp_path) -> dict:
    paths = [str(study_spec.REPO_DIR / "notebooks" / f"{n}.ipynb") for n in TIMING_NOTEBOOKS]
    out = subprocess.run([sys.executable, "-c", FIRST_CELLS, how, str(tmp_path), *paths], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_notebook_alone_times_with_the_threads_of_a_study(tmp_path, monkeypatch):
    monkeypatch.delenv(measurement.THREADS_ENV, raising=False)  # neither JupyterLab nor the user sets it
    alone = _threads_after_first_cells("alone", dict(os.environ), tmp_path)
    study = _threads_after_first_cells("study", runner._kernel_env(), tmp_path)
    assert alone == study, (alone, study)
    assert set(study.values()) == {measurement.DEFAULT_THREADS}


def test_the_user_sets_the_threads_for_both(monkeypatch):
    monkeypatch.setenv(measurement.THREADS_ENV, "3")
    assert measurement.cpu_threads() == 3 and runner._kernel_env()[measurement.THREADS_ENV] == "3"
    for bad in ("", "0", "two"):
        assert measurement.cpu_threads({measurement.THREADS_ENV: bad}) == measurement.DEFAULT_THREADS


def _sweep(root, tiny_dirs) -> RunParams:
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    t, d = tiny_dirs
    return RunParams(study_name="timed", study_dir=str(root / "timed"), pair="", target_dir=str(t), drafter_dir=str(d),
                     prompt_set=str(prompts), n_prompts=1, max_new_tokens=8, warmup=False, repeats=2)


def test_a_reused_run_says_when_and_how_it_was_timed(tmp_path, tiny_dirs, tiny_pair, capsys, monkeypatch):
    p = _sweep(tmp_path, tiny_dirs)
    monkeypatch.setenv(measurement.STUDY_KERNEL_ENV, "1")  # as in a study's kernel
    R.quick_sweep(p, [2], tiny_pair)
    monkeypatch.delenv(measurement.STUDY_KERNEL_ENV)
    capsys.readouterr()
    R.quick_sweep(p, [2], tiny_pair)  # nothing changed: both runs are reused
    printed = capsys.readouterr().out
    for name in ("ar-t0", "ddtree-b2-k0-t0"):
        res = json.loads((tmp_path / "timed" / name / "results.json").read_text())
        c = measurement.conditions(res)
        assert c["threads"] == torch.get_num_threads() and c["study_kernel"] is True and c["device"] == "cpu"
        line = next(x for x in printed.splitlines() if x.startswith(name))
        assert res["created_at"] in line and measurement.timing_text(res) in line
    # the description tells a run timed in a study's kernel from one timed outside
    outside = {**res, "timing_conditions": {**res["timing_conditions"], "study_kernel": False}}
    assert measurement.timing_text(outside) != measurement.timing_text(res)


def test_a_stored_run_timed_with_other_threads_is_timed_again(tmp_path, tiny_dirs, tiny_pair):
    p = _sweep(tmp_path, tiny_dirs)
    R.quick_sweep(p, [2], tiny_pair)
    path = tmp_path / "timed" / "ar-t0" / "results.json"
    stored = json.loads(path.read_text())
    stored["device"]["torch_threads"] = torch.get_num_threads() + 1
    stored["created_at"] = "earlier"
    path.write_text(json.dumps(stored))
    ar = RunParams(**{**p.to_json(), "method": "ar", "budget": 0, "run_name": "ar-t0", "run_dir": str(path.parent)})
    again = R.ensure_results(ar, tiny_pair, progress=False)
    assert again["created_at"] != "earlier" and again["device"]["torch_threads"] == torch.get_num_threads()


def _row(name, method, tps, budget=0, threads=1, load=0.5, cores=2):
    res = {"config": {"method": method, "budget": budget, "topk": 0, "temperature": 0.0},
           "summary": {"tokens_per_second": tps, "tokens_per_second_spread": [tps, tps], "timing_repeats": 3,
                       "mean_tau": 2.0},
           "device": {"device": "cpu", "torch_threads": threads, "cpu_count": cores},
           "timing_conditions": {"load_average": [load, load], "study_kernel": True},
           "created_at": "2025-01-01T00:00:00+0000"}
    return {"name": name, "kind": "run", "status": "complete", "results": res}


def _recommend(rows):
    for r in rows:
        r["comparison"] = {**R.compare(r["results"], rows[0]["results"]), "verdict": "lossless"}
    return R.recommend(rows)[0]


def test_contended_or_mixed_timings_flag_the_verdict():
    def sweep(**b16):
        return [_row("ar-t0", "ar", 100), _row("ddtree-b16-k0-t0", "ddtree", 300, 16, **b16),
                _row("ddtree-b32-k0-t0", "ddtree", 90, 32)]

    clean = _recommend(sweep())
    assert clean["run"] == "ddtree-b16-k0-t0" and clean["timing_caveats"] == []
    mixed = _recommend(sweep(threads=2))  # the winner timed with two threads, the rest with one
    contended = _recommend(sweep(load=3.5))  # the winner timed while other processes wanted the cores
    for rec in (mixed, contended):
        assert len(rec["timing_caveats"]) == 1 and "ddtree-b16-k0-t0" in rec["timing_caveats"][0]
        assert R.recommendation_text(rec).startswith(R.recommendation_text(clean))
        assert R.recommendation_text(rec) != R.recommendation_text(clean)
    assert _recommend(sweep(load=1.9))["timing_caveats"] == []  # busy, but no process waited for a core
    # runs of an older version recorded no load: nothing is claimed about it
    old = sweep()
    for r in old:
        r["results"].pop("timing_conditions")
    assert _recommend(old)["timing_caveats"] == []
