"""Running a study: each run's notebooks through papermill into `<study_dir>/<run>/`, then the report.

    ddtree-lab study params/quickstart.yaml [--out DIR]

Each run directory holds the executed notebooks, `results.json`, `traces.jsonl`, `figures/` and
`run.json` (status, fingerprint, error). Runs are built in a temp directory and renamed into place, so
a directory is either a finished run, a recorded failure or absent; a run already complete with the same
fingerprint is skipped, so a study resumes where it stopped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..atomic import (atomic_dir, atomic_write_json, atomic_write_text, changed_files, clean_stale_temps,
                      digest_tree)
from ..environment import REPO_DIR
from ..names import REPORT_FILE, RUN_FILE, STUDY_FILE
from .report import build_report
from .runs import (RunParams, base_params, changed_inputs, expand_grid, input_digests, read_run_status,
                   run_fingerprint, study_params)
from .executors import EXECUTORS, SequentialExecutor, WorkerDied, make_executor
from .measurement import study_kernel_env
from .notebook_filter import KERNEL
from .spec import Study, StudyError, find_notebook, load_study


@dataclass
class RunOutcome:
    name: str
    status: str                   # complete | failed | skipped
    seconds: float = 0.0
    error: str | None = None


@dataclass
class StudySummary:
    study_dir: Path
    outcomes: list[RunOutcome]
    report: Path | None

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def _kernel_env() -> dict:
    # The kernel must import this very package even when it is not pip-installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return study_kernel_env(env)  # the CPU threads every timing uses, notebooks run alone included


def _short_error(exc: BaseException) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {exc}"


def execute_notebook(nb: Path, out_nb: Path, params: RunParams, cwd: Path, timeout: int,
                     progress: bool) -> None:
    """Execute `nb` into `out_nb` with cwd = `cwd`, in the study's shared kernel (workbench/kernels.py:
    namespace reset before each notebook, a kernel that died or timed out replaced by a fresh one)."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    from .kernels import ENGINE, shared_kernel
    kernel = shared_kernel(KERNEL)
    km = kernel.manager(_kernel_env())
    usable = False
    try:
        pm.execute_notebook(str(nb), str(out_nb), parameters=params.to_json(), kernel_name=KERNEL,
                            engine_name=ENGINE, km=km, kernel_cwd=str(cwd), cwd=str(cwd),
                            progress_bar=progress, execution_timeout=timeout,
                            store_widget_state=False)  # widget state would embed plotly.js per notebook
        usable = True
    except PapermillExecutionError:  # a cell raised: the kernel is idle and fine for the next notebook
        usable = True
        raise
    finally:
        if not usable:  # dead, timed out (still busy) or interrupted: the next notebook gets a new one
            kernel.shutdown()


def execute_run(name: str, notebooks: list[Path], params: RunParams, study_dir: Path,
                timeout: int = 3600, progress: bool = True, log=print, kind: str = "run",
                fingerprint: str | None = None, inputs: dict | None = None) -> RunOutcome:
    """Execute `notebooks` in order into `<study_dir>/<name>/` (atomically); never raises for a
    notebook error: the failure and the partial notebook are recorded in the run directory.
    run.json records the fingerprint (default: the parameters' alone), the digests of what the run
    read (`inputs`) and the size and sha256 of every file the run wrote (`files`)."""
    t0 = time.perf_counter()
    status, error, tb, error_nb = "complete", None, None, None
    with atomic_dir(study_dir / name) as tmp:
        for nb in notebooks:
            log(f"    {nb.name}")
            try:
                execute_notebook(nb, tmp / nb.name, params, tmp, timeout, progress)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - any failure becomes a recorded failed run
                status, error = "failed", _short_error(e)
                tb = "".join(traceback.format_exception_only(type(e), e))[-4000:]
                error_nb = nb.name
                break
        secs = time.perf_counter() - t0
        atomic_write_json(tmp / RUN_FILE, {
            "name": name, "kind": kind, "status": status, "fingerprint": fingerprint or params.fingerprint(),
            "inputs": inputs or {}, "files": digest_tree(tmp, exclude=[RUN_FILE]),
            "params": params.to_json(), "notebooks": [n.name for n in notebooks],
            "error": error, "error_notebook": error_nb, "error_detail": tb,
            "seconds": round(secs, 3), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return RunOutcome(name, status, secs, error)


def why_rerun(run_dir: Path, fingerprint: str, retry_failed: bool, inputs: dict | None = None) -> str | None:
    """Why a run must execute again ('not run yet', 'inputs changed: prompts', 'results.json: 7 bytes,
    was 8', ...), or None when it is complete, unchanged and its files are whole."""
    st = read_run_status(run_dir)
    if st is None:
        return "not run yet" if not run_dir.exists() else "no readable run.json"
    if st.get("fingerprint") != fingerprint:
        changed = changed_inputs(st.get("inputs"), inputs) if inputs is not None else []
        return f"inputs changed: {', '.join(changed)}" if changed else "settings changed"
    if st.get("status") != "complete":
        return f"it {st.get('status')} before" if retry_failed else None
    if not isinstance(st.get("files"), dict):
        return "run.json records no file digests (written by an older version)"
    damaged = changed_files(run_dir, st["files"])
    return f"its files changed since it finished: {'; '.join(damaged[:3])}" if damaged else None


def _needs_run(run_dir: Path, fingerprint: str, retry_failed: bool) -> bool:
    return why_rerun(run_dir, fingerprint, retry_failed) is not None


LOCK_FILE = ".study.lock"  # beside it, LOCK_FILE + ".json" says who holds it


class StudyBusy(StudyError):
    """Another process is running a study into the same folder."""


@contextlib.contextmanager
def study_lock(study_dir: Path):
    """Hold the study folder's lock (an OS file lock: released when the process dies) for a whole study;
    a second study into the same folder is refused with who holds it."""
    from filelock import FileLock, Timeout

    lock, info = FileLock(str(study_dir / LOCK_FILE)), study_dir / (LOCK_FILE + ".json")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            who = json.loads(info.read_text())
            holder = f"pid {who.get('pid')} on {who.get('host')} since {who.get('started')}"
        except (OSError, ValueError, AttributeError):
            holder = "another process"
        raise StudyBusy("--out", f"{study_dir} is in use by another study: {holder} (lock {lock.lock_file}); "
                                 "wait for it or choose another --out") from None
    try:
        atomic_write_json(info, {"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        yield
    finally:
        with contextlib.suppress(OSError):
            info.unlink()
        lock.release()


def _prepare_dir(study_dir: Path) -> None:
    if study_dir.exists() and not study_dir.is_dir():
        raise StudyError("--out", f"{study_dir} is a file, not a folder")
    try:
        study_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StudyError("--out", f"cannot create {study_dir}: {e.strerror}") from None
    if not os.access(study_dir, os.W_OK | os.X_OK):
        raise StudyError("--out", f"{study_dir} is not writable")


@dataclass
class RunJob:
    """One grid run for an executor: everything `execute_job` needs, picklable (a Ray task gets a copy)."""

    name: str
    notebooks: list[Path]
    params: RunParams
    study_dir: Path
    timeout: int
    progress: bool
    fingerprint: str
    inputs: dict


def execute_job(job: RunJob) -> RunOutcome:
    return execute_run(job.name, job.notebooks, job.params, job.study_dir, job.timeout, job.progress,
                       fingerprint=job.fingerprint, inputs=job.inputs)


def record_lost_run(job: RunJob, error: str) -> RunOutcome:
    """A run whose worker died before it returned: recorded as failed (a re-run retries it)."""
    with atomic_dir(job.study_dir / job.name) as tmp:
        atomic_write_json(tmp / RUN_FILE, {
            "name": job.name, "kind": "run", "status": "failed", "fingerprint": job.fingerprint,
            "inputs": job.inputs, "files": {}, "params": job.params.to_json(),
            "notebooks": [n.name for n in job.notebooks], "error": error, "error_notebook": None,
            "error_detail": None, "seconds": 0.0, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return RunOutcome(job.name, "failed", 0.0, error)


def grid_state(runs: list[RunParams], per_run: list[Path], study_dir: Path, retry_failed: bool):
    """For each grid run: (params, the digests of what it reads, its fingerprint, why it must run again or
    None when a re-run skips it)."""
    for params in runs:
        inputs = input_digests(params, per_run)
        fp = run_fingerprint(params, inputs)
        yield params, inputs, fp, why_rerun(study_dir / params.run_name, fp, retry_failed, inputs)


def run_study(study: Study, study_dir: str | os.PathLike | None = None, *, retry_failed: bool = True,
              progress: bool = True, log=print, executor=None) -> StudySummary:
    """Execute a validated study; see the module docstring. `executor` (workbench/executors.py) runs the
    grid's runs: one after another here by default, or as Ray tasks; everything else is the same."""
    study_dir = Path(study_dir or Path("outputs") / study.name).resolve()
    _prepare_dir(study_dir)
    with study_lock(study_dir):
        return _run_locked(study, study_dir, retry_failed, progress, log, executor or SequentialExecutor())


def _run_locked(study: Study, study_dir: Path, retry_failed: bool, progress: bool, log,
                executor) -> StudySummary:
    base = study.path.parent if study.path else None
    runs = expand_grid(study, study_dir)
    own = [r.run_name for r in runs] + [Path(n).stem for n in study.notebooks.per_study] + \
        [Path(study.notebooks.report).stem]
    for p in clean_stale_temps(study_dir, own):
        log(f"removed {p.name}: left by a study that was stopped")
    atomic_write_json(study_dir / STUDY_FILE, {"study": study.to_json(),
                                                 "runs": [r.run_name for r in runs]})
    if study.path:
        atomic_write_text(study_dir / "study.yaml", study.path.read_text(encoding="utf-8"))

    per_run = [find_notebook(n, base) for n in study.notebooks.per_run]
    by_name: dict[str, RunOutcome] = {}
    total = len(runs) + len(study.notebooks.per_study)
    jobs = []
    for i, (params, inputs, fp, why) in enumerate(grid_state(runs, per_run, study_dir, retry_failed), 1):
        rdir = study_dir / params.run_name
        if why is None:
            log(f"[{i}/{total}] {params.run_name}: complete, skipped")
            by_name[params.run_name] = RunOutcome(params.run_name, "skipped")
            continue
        log(f"[{i}/{total}] {params.run_name}" + (f" (again: {why})" if rdir.exists() else "")
            + (f" -> {executor.name}" if executor.name != "sequential" else ""))
        jobs.append(RunJob(params.run_name, per_run, params, study_dir, study.notebooks.timeout, progress, fp, inputs))

    def done(job: RunJob, o) -> None:
        if isinstance(o, WorkerDied):
            o = record_lost_run(job, o.error)
        by_name[job.name] = o
        who = f"    {job.name}: " if executor.name != "sequential" else "    "
        log(f"{who}{o.status} in {o.seconds:.1f}s" + (f": {o.error}" if o.error else ""))

    executor.map(execute_job, jobs, done)
    outcomes: list[RunOutcome] = [by_name[r.run_name] for r in runs]

    # Once-per-study notebooks depend on every run's results: their fingerprint covers them.
    state = [(o.name, (read_run_status(study_dir / o.name) or {}).get("finished_at")) for o in outcomes]
    for j, nb_name in enumerate(study.notebooks.per_study, len(runs) + 1):
        params = study_params(study, study_dir, nb_name)
        fp_params = dataclasses.replace(params, run_name=f"{params.run_name}|{json.dumps(state)}")
        name = Path(nb_name).stem
        nb_inputs = input_digests(params, [find_notebook(nb_name, base)])
        fp = run_fingerprint(fp_params, nb_inputs)
        if why_rerun(study_dir / name, fp, retry_failed, nb_inputs) is None:
            log(f"[{j}/{total}] {name}: complete, skipped")
            outcomes.append(RunOutcome(name, "skipped"))
            continue
        log(f"[{j}/{total}] {name}")
        o = execute_run(name, [find_notebook(nb_name, base)], params, study_dir, study.notebooks.timeout,
                        progress, log, kind="study", fingerprint=fp, inputs=nb_inputs)
        log(f"    {o.status} in {o.seconds:.1f}s" + (f": {o.error}" if o.error else ""))
        outcomes.append(o)

    report = None
    if study.report:
        report = _make_report(study, study_dir, base, progress, log)
    return StudySummary(study_dir, outcomes, report)


def _make_report(study: Study, study_dir: Path, base, progress: bool, log) -> Path:
    """Execute the findings notebook (it writes report.html); if that notebook fails, build the
    page in-process so a study always ends with a report."""
    nb = find_notebook(study.notebooks.report, base)
    params = RunParams(**base_params(study, study_dir), run_name="findings_report", run_dir=".")
    log("[report]")
    o = execute_run(Path(study.notebooks.report).stem, [nb], params, study_dir,
                    study.notebooks.timeout, progress, log, kind="report")
    path = study_dir / REPORT_FILE
    if o.status != "complete" or not path.is_file():
        log(f"    report notebook {o.status}: {o.error}; building the report directly")
        build_report(study_dir)
    return path


def main_study(path: str | os.PathLike, out: str | os.PathLike | None = None, *,
               retry_failed: bool = True, progress: bool = True, log=print, executor=None) -> StudySummary:
    """Validate the study file (raising StudyError before anything runs), then run it.

    `out` is the study's output directory (default: outputs/<name>)."""
    study = load_study(path)
    return run_study(study, out, retry_failed=retry_failed, progress=progress, log=log, executor=executor)


# ----------------------------------------------------------------------------- CLI pieces
def add_study_args(p) -> None:
    p.description = "Run a study: expand the grid, execute notebooks with papermill, write the report."
    p.add_argument("params", help="study file (YAML), e.g. params/quickstart.yaml")
    p.add_argument("--out", default=None, help="output directory for this study (default: outputs/<name>)")
    p.add_argument("--check", action="store_true", help="only validate the study file and list its runs")
    p.add_argument("--no-retry-failed", action="store_true", help="keep failed runs as they are on a re-run")
    p.add_argument("--quiet", action="store_true", help="no per-cell progress bars")
    p.add_argument("--executor", choices=EXECUTORS, default="sequential",
                   help="how the grid's runs execute: one after another here (default), or as Ray tasks, each "
                        "holding its GPUs, on this machine or a Ray cluster (pip install -e '.[ray]')")
    p.add_argument("--address", default=None, help="with --executor ray: a running Ray cluster ('auto': the local "
                   "one); default: start a Ray for this study")
    p.add_argument("--gpus-per-run", type=float, default=None, help="with --executor ray: GPUs each run holds "
                   "(default: 1 for a CUDA study, 0 for a CPU one)")


def run_study_cli(args) -> int:
    study = out = None
    try:
        study = load_study(args.params)
        out = Path(args.out or Path("outputs") / study.name)
        if args.check:
            if out.exists() and not out.is_dir():
                raise StudyError("--out", f"{out} is a file, not a folder")
            for r in expand_grid(study, out):
                print(r.run_name)
            print(f"ok: {len(expand_grid(study))} runs -> {out}")
            return 0
        executor = make_executor(args.executor, args.address, args.gpus_per_run, device=study.models.device)
        started = time.perf_counter()
        s = run_study(study, out, retry_failed=not args.no_retry_failed, progress=not args.quiet, executor=executor)
        took = time.perf_counter() - started
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only disk mid-study: finished runs stay as they are
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"error: {e.strerror or e}{where}; finished runs are kept, a re-run resumes", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(study, out)
    # Count the grid's runs as the report does; the once-per-study notebooks are named apart.
    grid = set(json.loads((s.study_dir / STUDY_FILE).read_text()).get("runs", []))
    runs = [o for o in s.outcomes if o.name in grid]
    nbs = [o for o in s.outcomes if o.name not in grid]

    def counts(outs):
        return ", ".join(f"{sum(o.status == k for o in outs)} {k}" for k in ("complete", "skipped", "failed"))
    print(f"{len(runs)} runs ({counts(runs)}); {len(nbs)} study notebooks ({counts(nbs)}) in {took:.0f} s "
          f"-> {s.study_dir}")
    if s.report:
        print(f"report: {s.report}")
    return 1 if s.count("failed") else 0


def _interrupted(study: Study | None, out: Path | None) -> int:
    """After a Ctrl-C: nothing is lost (runs are written atomically), so one line says what is kept."""
    from .kernels import after_interrupt

    kept = "nothing ran yet"
    with after_interrupt():
        if study is not None and out is not None and out.is_dir():
            runs = expand_grid(study, out.resolve())
            per_run = [find_notebook(n, study.path.parent if study.path else None) for n in study.notebooks.per_run]
            skipped = sum(why is None for *_, why in grid_state(runs, per_run, out.resolve(), retry_failed=True))
            kept = f"{skipped} of {len(runs)} runs complete are kept"
    print(f"ddtree-lab study: interrupted; {kept}, re-run the same command to resume", file=sys.stderr)
    return 130
