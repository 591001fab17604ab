"""How a study's runs are executed: one after another in this process (the default; needs nothing), or as
Ray tasks, each holding its GPUs, on this machine or a Ray cluster (`pip install -e '.[ray]'`).

Either way a job is one call, `execute(job) -> outcome`, that writes one run directory atomically and never
raises for a notebook's error; so output folders, resume, failure records and the report do not depend on the
executor. What an executor adds is where and when that call runs, and what happens when the process running
it dies: Ray retries the task once (`retries`), and a run whose worker died again comes back as a failed
outcome for the runner to record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

EXECUTORS = ("sequential", "ray")


@dataclass
class WorkerDied:
    """The outcome of a job whose process died (twice, with Ray's retry) before it returned one."""

    name: str
    error: str


class SequentialExecutor:
    """Each job in turn, in this process: the default, and the reference the others must equal."""

    name = "sequential"

    def map(self, execute: Callable[[Any], Any], jobs: Iterable[Any], on_done: Callable[[Any, Any], None]) -> None:
        for job in jobs:
            on_done(job, execute(job))


class RayExecutor:
    """Each job a Ray task holding `gpus_per_run` GPUs (Ray sets CUDA_VISIBLE_DEVICES for the task, and
    the notebook kernels it starts inherit it). None: 1 for a study whose `device` is a GPU, 0 for a CPU
    study (its runs need none, and asking for one would leave them unscheduled on a CPU machine).
    `address`: a running cluster ("auto" finds the local one); None starts a local Ray for this study, given
    `num_gpus` (default: what Ray detects; a CPU machine can declare fake GPUs to test the scheduling). Run
    directories must be on a filesystem every node sees."""

    name = "ray"

    def __init__(self, address: str | None = None, gpus_per_run: float | None = None, num_gpus: int | None = None,
                 retries: int = 1, device: str = "cuda"):
        if gpus_per_run is None:
            gpus_per_run = 0 if device == "cpu" else 1
        if gpus_per_run < 0:
            raise ValueError(f"--gpus-per-run {gpus_per_run} must be ≥ 0")
        self.address, self.gpus_per_run, self.num_gpus, self.retries = address, gpus_per_run, num_gpus, retries

    def _init(self):
        try:
            import ray
        except ImportError:
            raise ValueError("--executor ray needs Ray: pip install -e '.[ray]'") from None
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=False)
            if self.address is not None:
                kw["address"] = self.address
            elif self.num_gpus is not None:
                kw["num_gpus"] = self.num_gpus
            ray.init(**kw)
        return ray

    def map(self, execute: Callable[[Any], Any], jobs: Iterable[Any], on_done: Callable[[Any, Any], None]) -> None:
        ray = self._init()
        jobs = list(jobs)
        if self.address is None and self.gpus_per_run > ray.cluster_resources().get("GPU", 0) and jobs:
            raise ValueError(f"each run asks for {self.gpus_per_run:g} GPU(s) but Ray sees "
                             f"{ray.cluster_resources().get('GPU', 0):g}: lower --gpus-per-run")
        task = ray.remote(num_gpus=self.gpus_per_run, max_retries=self.retries)(execute)
        pending = {task.remote(job): job for job in jobs}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(done[0])
            try:
                outcome = ray.get(done[0])
            except ray.exceptions.RayError as e:  # the worker died on every attempt
                outcome = WorkerDied(getattr(job, "name", str(job)), f"{type(e).__name__}: the run's worker "
                                     f"died ({self.retries + 1} attempt(s))")
            on_done(job, outcome)


def make_executor(name: str = "sequential", address: str | None = None, gpus_per_run: float | None = None,
                  num_gpus: int | None = None, device: str = "cuda"):
    """`device`: the study's, which sets the Ray runs' default GPU count."""
    if name == "sequential":
        if address is not None:
            raise ValueError("--address needs --executor ray")
        return SequentialExecutor()
    if name == "ray":
        return RayExecutor(address, gpus_per_run, num_gpus, device=device)
    raise ValueError(f"--executor {name!r} is not one of {', '.join(EXECUTORS)}")
