"""Ctrl-C during `ddtree-lab study`: one line (no traceback, no asyncio or kernel noise), exit 130, and a
re-run resumes, skipping the runs that completed before the interrupt."""
import os
import signal
import subprocess
import sys
import time

import nbformat
import yaml

from ddtree_lab.workbench import runner
from ddtree_lab.workbench import spec as study_spec


def _study(root):
    """Two runs of a notebook that imports nothing heavy; the DDTree run's writes `started`, then sleeps
    until it is interrupted (only while `started` is absent, so the re-run completes)."""
    marker = root / "started"
    src = nbformat.read(study_spec.REPO_DIR / "notebooks" / "accepted_paths.ipynb", as_version=4)
    nb = nbformat.v4.new_notebook(metadata=src.metadata)
    nb.cells = [next(c for c in src.cells if "parameters" in c.metadata.get("tags", [])),
                nbformat.v4.new_code_cell(f"import pathlib, time\nmarker = pathlib.Path({str(marker)!r})\n"
                                          "if method == 'ddtree' and not marker.exists():\n"
                                          "    marker.write_text('started')\n    time.sleep(120)")]
    nbformat.write(nb, root / "sleepy.ipynb")
    spec = {"name": "interrupted", "models": {"pair": "lab", "device": "cpu"},
            "prompts": {"set": "lab:code", "n_prompts": 1}, "methods": ["ar", "ddtree"], "grid": {"budget": [2]},
            "notebooks": {"per_run": ["sleepy.ipynb"], "per_study": []}, "report": False}
    (root / "interrupted.yaml").write_text(yaml.safe_dump(spec))
    return root / "interrupted.yaml", marker


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell starting pytest in the background ignores it


def test_ctrl_c_prints_one_line_and_a_rerun_resumes(tmp_path):
    path, marker = _study(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_lab.cli", "study", str(path), "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not marker.exists():
        proc.kill()
        raise AssertionError(f"the second run never started: {proc.communicate()}")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert len(stderr.splitlines()) == 1, stderr
    assert "Traceback" not in stdout + stderr and "Error" not in stdout + stderr, (stdout, stderr)
    assert not list(out.glob(".*.tmp-*"))  # the interrupted run left nothing half-written

    again = runner.main_study(path, out, progress=False, log=lambda *_: None)
    assert {o.name: o.status for o in again.outcomes} == {"ar-t0": "skipped", "ddtree-b2-k0-t0": "complete"}
