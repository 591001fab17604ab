"""A tiny study executed end to end with papermill: runs, a deliberately failing run, the
once-per-study notebooks, the report, and a re-run that skips what is complete.

Kernel starts are the cost here (a few seconds each), so one study serves every test."""
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import uuid

import nbformat
import pytest
import yaml

from ddtree_lab.workbench import notebook_filter, runner
from ddtree_lab.workbench import runs as study_runs
from ddtree_lab.workbench import spec as study_spec

NOTEBOOKS = ["draft_trees", "accepted_paths", "budget_sweep", "kernel_timeline", "findings_report"]


def _committed_notebooks() -> list[str]:
    """Every notebook git tracks in the repository (every *.ipynb outside outputs/ without git)."""
    import subprocess
    try:
        out = subprocess.run(["git", "-C", str(study_spec.REPO_DIR), "ls-files", "*.ipynb"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = [str(p.relative_to(study_spec.REPO_DIR)) for p in study_spec.REPO_DIR.glob("**/*.ipynb")
               if "outputs" not in p.parts and not any(x.startswith(".") for x in p.parts)]
    return sorted(out)


def test_shipped_notebooks_are_all_committed():
    assert {f"notebooks/{n}.ipynb" for n in NOTEBOOKS} <= set(_committed_notebooks())


@pytest.mark.parametrize("path", _committed_notebooks())
def test_committed_notebooks_hold_no_outputs(path):
    nb = nbformat.read(study_spec.REPO_DIR / path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path}: cells {dirty} hold outputs or execution counts (see notebook_filter.py)"
    assert "widgets" not in nb.metadata, f"{path}: saved widget state"
    assert "language_info" not in nb.metadata, f"{path}: the kernel's language_info (its Python version) was saved"
    assert nb.metadata.kernelspec == notebook_filter.KERNELSPEC
    text = (study_spec.REPO_DIR / path).read_text(encoding="utf-8")
    assert notebook_filter.strip(text) == text, f"{path}: not as the notebook filter commits it"


@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    """What a real kernel leaves in a notebook it ran: the notebook's metadata and an executed code cell."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": dict(notebook_filter.KERNELSPEC)})
    nb.cells = [nbformat.v4.new_code_cell("print('ran')\n1")]
    km = KernelManager(kernel_name=runner.KERNEL, transport="ipc", ip=str(tmp_path_factory.mktemp("kernel") / "k"))
    NotebookClient(nb, km=km).execute()
    assert "version" in nb.metadata.language_info and nb.cells[0].outputs
    return nb.metadata, nb.cells[0]


def _saved_after_a_run(committed: str, kernel_run) -> str:
    """A committed notebook as JupyterLab saves it after running every cell, under a kernelspec of its own."""
    metadata, ran = kernel_run
    nb = nbformat.reads(committed, as_version=4)
    nb.metadata.update(copy.deepcopy(metadata))
    nb.metadata.kernelspec.display_name = "Python 3.11 (my venv)"
    for c in nb.cells:
        c.id = uuid.uuid4().hex[:8]
        if c.cell_type == "code":
            c.outputs, c.execution_count = copy.deepcopy(ran.outputs), ran.execution_count
            c.metadata.update(copy.deepcopy(ran.metadata))  # the kernel's timings
    return nbformat.writes(nb) + "\n"


@pytest.mark.parametrize("path", _committed_notebooks())
def test_a_notebook_run_in_a_kernel_strips_to_its_committed_bytes(path, kernel_run):
    committed = (study_spec.REPO_DIR / path).read_text(encoding="utf-8")
    assert notebook_filter.strip(_saved_after_a_run(committed, kernel_run)) == committed


def test_the_installed_filter_stages_a_run_notebook_as_committed(tmp_path, kernel_run):
    """In a fresh clone (here a new repository with the same .gitattributes) after the one install command."""
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, env=env, capture_output=True, check=True).stdout
    git("init", "-q")
    (tmp_path / ".gitattributes").write_bytes((study_spec.REPO_DIR / ".gitattributes").read_bytes())
    subprocess.run([sys.executable, notebook_filter.__file__, "--install"], cwd=tmp_path, env=env, check=True)
    committed = (study_spec.REPO_DIR / "notebooks" / "budget_sweep.ipynb").read_text(encoding="utf-8")
    (tmp_path / "budget_sweep.ipynb").write_text(_saved_after_a_run(committed, kernel_run), encoding="utf-8")
    git("add", "budget_sweep.ipynb")
    assert git("cat-file", "blob", ":budget_sweep.ipynb").decode("utf-8") == committed


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_shipped_notebooks_are_valid_and_clean(name):
    nb = nbformat.read(study_spec.REPO_DIR / "notebooks" / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert nb.metadata.kernelspec.name == "python3"
    for c in nb.cells:  # committed without outputs
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    # every parameter is typed and commented, and papermill can read it
    from papermill.inspection import _infer_parameters
    from papermill.iorw import load_notebook_node
    params = {p.name: p for p in _infer_parameters(load_notebook_node(str(study_spec.REPO_DIR / "notebooks" / f"{name}.ipynb")))}
    assert set(params) == {f.name for f in dataclasses.fields(study_runs.RunParams)}
    assert all(p.help for p in params.values()), [n for n, p in params.items() if not p.help]
    assert all(p.inferred_type_name != "None" for p in params.values())


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("study_run")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    # A per-run notebook that fails for budget 4, after the parameters are injected.
    nb = nbformat.read(study_spec.REPO_DIR / "notebooks" / "accepted_paths.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
        'if budget == 4:\n    raise RuntimeError("deliberate failure for budget 4")'))
    (root / "notebooks").mkdir()
    nbformat.write(nb, root / "notebooks" / "paths_or_fail.ipynb")
    t, d = tiny_dirs
    spec = {
        "name": "tinyrun",
        "models": {"target": str(t), "drafter": str(d), "device": "cpu"},
        "prompts": {"set": "prompts.jsonl", "n_prompts": 1},
        "methods": ["ar", "ddtree"],
        "grid": {"budget": [2, 4], "max_new_tokens": 8},
        "notebooks": {"per_run": ["notebooks/paths_or_fail.ipynb"],
                      "per_study": ["draft_trees", "budget_sweep", "kernel_timeline"], "timeout": 600},
        "warmup": False,
    }
    (root / "tinyrun.yaml").write_text(yaml.safe_dump(spec))
    out = root / "out"
    log = []
    summary = runner.main_study(root / "tinyrun.yaml", out, progress=False, log=log.append)
    return root, out, summary, log


def test_study_runs_and_records(tiny_study):
    root, out, summary, log = tiny_study
    status = {o.name: o.status for o in summary.outcomes}
    assert status == {"ar-t0": "complete", "ddtree-b2-k0-t0": "complete", "ddtree-b4-k0-t0": "failed",
                      "draft_trees": "complete", "budget_sweep": "complete", "kernel_timeline": "complete"}, log
    assert (out / "study.json").is_file() and (out / "study.yaml").is_file()
    for run in ("ar-t0", "ddtree-b2-k0-t0"):
        d = out / run
        assert {"paths_or_fail.ipynb", "results.json", "traces.jsonl", "run.json", "figures"} <= \
            {p.name for p in d.iterdir()}
        res = json.loads((d / "results.json").read_text())
        for key in ("config", "models", "device", "versions", "commit", "prompts", "summary", "comparison"):
            assert key in res
        assert res["summary"]["new_tokens"] == 8 and res["summary"]["mean_tau"] >= 1
        nb = nbformat.read(d / "paths_or_fail.ipynb", as_version=4)
        assert any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)
        assert not any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))
    # draft_trees ran once for the study, on the rounds the runs recorded (b4 failed: b2 only)
    nb = nbformat.read(out / "draft_trees" / "draft_trees.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "{2: " in printed and (out / "draft_trees" / "figures" / "draft_trees.json").is_file()
    b2 = json.loads((out / "ddtree-b2-k0-t0" / "results.json").read_text())
    assert b2["comparison"]["verdict"] == "lossless"  # AR ran first: compared at run time already
    assert [p.name for p in out.glob(".*")] == [runner.LOCK_FILE]  # no temp dirs left; the lock stays
    st = json.loads((out / "ar-t0" / "run.json").read_text())
    assert {"results.json", "traces.jsonl", "paths_or_fail.ipynb"} <= set(st["files"])
    assert {"prompts", "target/config.json", "target/model.safetensors", "notebook/paths_or_fail.ipynb"} <= \
        set(st["inputs"])


def test_failed_run_is_recorded_and_reported(tiny_study):
    root, out, summary, log = tiny_study
    d = out / "ddtree-b4-k0-t0"
    st = json.loads((d / "run.json").read_text())
    assert st["status"] == "failed" and "deliberate failure for budget 4" in st["error"]
    assert st["error_notebook"] == "paths_or_fail.ipynb"
    assert (d / "paths_or_fail.ipynb").is_file()  # the partial notebook is kept
    assert [p.name for p in d.glob("*.ipynb")] == ["paths_or_fail.ipynb"]
    page = (out / "report.html").read_text()
    assert "deliberate failure for budget 4" in page and "ddtree-b4-k0-t0" in page


def test_study_notebooks_and_report(tiny_study):
    root, out, summary, log = tiny_study
    assert summary.report == out / "report.html" and summary.report.stat().st_size > 1_000_000
    kt = out / "kernel_timeline"
    assert {"trace.json", "timeline.json", "microbench.json", "kernel_timeline.ipynb"} <= {p.name for p in kt.iterdir()}
    tl = json.loads((kt / "timeline.json").read_text())
    assert tl["stages"] and tl["top_kernels"]
    sweep = json.loads((out / "budget_sweep" / "sweep.json").read_text())
    assert [r["run"] for r in sweep["runs"]] == ["ar-t0", "ddtree-b2-k0-t0", "ddtree-b4-k0-t0"]
    assert (out / "findings_report" / "findings_report.ipynb").is_file()
    page = summary.report.read_text()
    assert page.count("plotly.js v") == 1 and "Kernel timeline" in page and "lossless" in page


NETWORK_REF = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)


def _network_refs(text: str) -> list[str]:
    hits = [m.group(0) for m in NETWORK_REF.finditer(text)]
    hits += [w for w in ("cdn.plot.ly", "cdn.jsdelivr", "unpkg.com", "require.config") if w in text]
    return hits


def test_nothing_written_needs_the_network(tiny_study):
    root, out, summary, log = tiny_study
    executed = sorted(out.glob("*/*.ipynb"))
    assert len(executed) >= 5
    for path in executed:
        nb = nbformat.read(path, as_version=4)
        outputs = [o for c in nb.cells for o in c.get("outputs", [])]
        text = json.dumps(outputs)
        assert not _network_refs(text), (path.name, _network_refs(text)[:3])
    assert any("application/vnd.plotly.v1+json" in json.dumps(nbformat.read(p, as_version=4).cells) for p in executed)
    # The page inlines plotly.js, whose source names its CDN for map data no figure here uses: only
    # tags that load something are looked for.
    page = summary.report.read_text()
    assert not NETWORK_REF.findall(page), NETWORK_REF.findall(page)[:3]


def test_rerun_skips_complete_runs(tiny_study):
    root, out, summary, log = tiny_study
    before = (out / "ar-t0" / "results.json").stat().st_mtime_ns
    again = runner.main_study(root / "tinyrun.yaml", out, retry_failed=False, progress=False, log=lambda *_: None)
    assert {o.name: o.status for o in again.outcomes} == {
        "ar-t0": "skipped", "ddtree-b2-k0-t0": "skipped", "ddtree-b4-k0-t0": "skipped",
        "draft_trees": "skipped", "budget_sweep": "skipped", "kernel_timeline": "skipped"}
    assert (out / "ar-t0" / "results.json").stat().st_mtime_ns == before
    assert again.report.is_file()


def test_needs_run_logic(tmp_path):
    from ddtree_lab.atomic import atomic_write_json
    d = tmp_path / "r"
    assert runner._needs_run(d, "fp", retry_failed=True)  # absent
    atomic_write_json(d / "run.json", {"status": "complete", "fingerprint": "fp", "files": {}})
    assert not runner._needs_run(d, "fp", True) and runner._needs_run(d, "other", True)  # changed parameters
    atomic_write_json(d / "run.json", {"status": "failed", "fingerprint": "fp"})
    assert runner._needs_run(d, "fp", True) and not runner._needs_run(d, "fp", False)


def test_ray_executor_writes_what_the_sequential_one_wrote(tiny_study):
    """The same grid as Ray tasks on a local Ray that declares two GPUs, each run holding one: the same run
    folders, statuses (the deliberate failure included) and tokens as the default executor's."""
    ray = pytest.importorskip("ray")
    from ddtree_lab.workbench.executors import RayExecutor

    root, out, _, _ = tiny_study
    spec = yaml.safe_load((root / "tinyrun.yaml").read_text())
    spec["notebooks"]["per_study"] = []
    spec["report"] = False
    (root / "tinyrun_ray.yaml").write_text(yaml.safe_dump(spec))
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = runner.main_study(root / "tinyrun_ray.yaml", root / "out_ray", progress=False, log=lambda *_: None,
                                    executor=RayExecutor(gpus_per_run=1))
    finally:
        ray.shutdown()
    grid = ["ar-t0", "ddtree-b2-k0-t0", "ddtree-b4-k0-t0"]
    assert [o.name for o in summary.outcomes] == grid
    for name in grid:
        seq = json.loads((out / name / "run.json").read_text())
        par = json.loads((root / "out_ray" / name / "run.json").read_text())
        assert par["status"] == seq["status"] and par["fingerprint"] == seq["fingerprint"]
        if seq["status"] == "complete":
            tokens = [json.loads((d / name / "results.json").read_text())["prompts"][0]["tokens"]
                      for d in (out, root / "out_ray")]
            assert tokens[0] == tokens[1] and tokens[0]
