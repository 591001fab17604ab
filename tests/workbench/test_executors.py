"""Executors: the Ray executor hands every job to `execute` once, holding its GPUs, retries a job whose worker
died, and reports one that died on every attempt; the sequential executor is the reference."""
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_lab.workbench.executors import RayExecutor, SequentialExecutor, WorkerDied, make_executor


@dataclass
class Job:
    name: str
    marker: str = ""      # a file: the first attempt creates it and dies, the retry finds it and succeeds
    always_die: bool = False


def execute(job: Job):
    """What a run does under test: report the GPUs it was given, or kill its own process."""
    if job.always_die or (job.marker and not Path(job.marker).exists()):
        if job.marker:
            Path(job.marker).touch()
        os._exit(1)  # the worker dies, as with a crashed CUDA driver or an OOM kill
    return {"name": job.name, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def collect(executor, jobs):
    done = {}
    executor.map(execute, jobs, lambda job, outcome: done.__setitem__(job.name, outcome))
    return done


def test_sequential_runs_each_job_in_order():
    order = []
    SequentialExecutor().map(lambda j: j.name, [Job("a"), Job("b")], lambda j, o: order.append(o))
    assert order == ["a", "b"]


def test_executor_choice_is_checked():
    assert isinstance(make_executor("sequential"), SequentialExecutor)
    with pytest.raises(ValueError, match="is not one of sequential, ray"):
        make_executor("dask")
    with pytest.raises(ValueError, match="--address needs --executor ray"):
        make_executor("sequential", address="auto")


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)  # two fake GPUs
    yield ray
    ray.shutdown()


def test_ray_jobs_hold_one_gpu_each_and_match_sequential(ray_local):
    jobs = [Job(f"run{i}") for i in range(4)]
    got = collect(RayExecutor(gpus_per_run=1), jobs)
    assert set(got) == {j.name for j in jobs}
    assert all(got[j.name]["gpus"] in ("0", "1") for j in jobs)  # one of the two GPUs, never both
    assert {k: v["name"] for k, v in got.items()} == {k: v["name"] for k, v in collect(SequentialExecutor(), jobs).items()}


def test_ray_retries_a_dead_worker_once_then_reports_it(ray_local, tmp_path):
    got = collect(RayExecutor(gpus_per_run=1), [Job("flaky", marker=str(tmp_path / "died-once")),
                                                Job("doomed", always_die=True)])
    assert got["flaky"]["name"] == "flaky"  # died, retried, succeeded
    assert isinstance(got["doomed"], WorkerDied) and "2 attempt(s)" in got["doomed"].error


def test_ray_refuses_more_gpus_per_run_than_the_machine_has(ray_local):
    with pytest.raises(ValueError, match="asks for 3 GPU"):
        collect(RayExecutor(gpus_per_run=3), [Job("big")])


@pytest.mark.parametrize("device,gpus", [("cuda", 1), ("cuda:1", 1), ("auto", 1), ("cpu", 0)])
def test_ray_gpus_per_run_defaults_to_the_studys_device(device, gpus):
    assert RayExecutor(device=device).gpus_per_run == gpus
    assert make_executor("ray", device=device).gpus_per_run == gpus
    assert make_executor("ray", gpus_per_run=0.5, device=device).gpus_per_run == 0.5  # an explicit count wins


def test_ray_default_made_without_a_device_is_one_gpu():
    assert RayExecutor().gpus_per_run == 1 and make_executor("ray").gpus_per_run == 1
    with pytest.raises(ValueError, match="must be ≥ 0"):
        RayExecutor(gpus_per_run=-1)


def test_the_study_command_gives_ray_the_studys_device(tmp_path, monkeypatch):
    """The CLI's Ray executor for a CPU study asks for no GPU, before the runner sees it."""
    from argparse import ArgumentParser
    from types import SimpleNamespace

    from ddtree_lab.workbench import runner

    given = []

    def run_study(study, out, executor, **_):
        given.append(executor)
        raise KeyboardInterrupt  # stop before any run: only the executor is under test
    study = SimpleNamespace(name="s", models=SimpleNamespace(device="cpu"))
    monkeypatch.setattr(runner, "load_study", lambda path: study)
    monkeypatch.setattr(runner, "run_study", run_study)
    monkeypatch.setattr(runner, "_interrupted", lambda study, out: 130)
    p = ArgumentParser()
    runner.add_study_args(p)
    assert runner.run_study_cli(p.parse_args(["x.yaml", "--executor", "ray", "--out", str(tmp_path)])) == 130
    assert isinstance(given[0], RayExecutor) and given[0].gpus_per_run == 0
