"""How runs are timed, in one place for a study's kernels and for a notebook run on its own (JupyterLab,
plain papermill), and the conditions each timing records, so a verdict can say when its timings do not compare.

Threads: one CPU thread unless OMP_NUM_THREADS says otherwise. The lab pair's matrices are too small to gain
from more, and OpenMP threads stall (ops many times slower) whenever another process holds a core, which would
make CPU timings meaningless. The runner puts the count in its kernels' environment and the first cell of
every notebook that times pins torch to it, so a notebook run alone times as its study does. GPU runs do not
depend on it.

Conditions: a run records the 1-minute load average before and after its timed passes, and whether it ran
in a study's kernel; results.json's `device` holds its thread count and cores. The timings behind a verdict
are flagged when one was taken with the load above the machine's cores (processes were waiting for a core,
so others competed with the timing), or when the runs were timed with different thread counts. Runs timed
at different times are not flagged for that alone: the load each recorded says whether its moment was busy.
"""
from __future__ import annotations

import os

THREADS_ENV = "OMP_NUM_THREADS"
DEFAULT_THREADS = 1
STUDY_KERNEL_ENV = "DDTREE_LAB_STUDY_KERNEL"  # "1" in a study's kernels: a run records it was timed in one


def cpu_threads(environ=None) -> int:
    """The CPU threads runs are timed with: OMP_NUM_THREADS where it is a positive integer, else one."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_THREADS


def study_kernel_env(environ) -> dict:
    """`environ` with the timing threads set, marked as a study's kernel (torch reads the threads at its start)."""
    env = dict(environ)
    env[THREADS_ENV] = str(cpu_threads(env))
    env[STUDY_KERNEL_ENV] = "1"
    return env


def pin_threads() -> int:
    """Pin torch in this process to `cpu_threads()`, as a study's kernel has them; returns the count.
    A timing notebook's first cell calls it: JupyterLab's kernel would otherwise use one thread per core."""
    import torch

    torch.set_num_threads(cpu_threads())
    return torch.get_num_threads()


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def timing_record(load_before: float | None, load_after: float | None) -> dict:
    """What a run records about its timed passes (results.json `timing_conditions`)."""
    return {"load_average": [load_before, load_after], "study_kernel": os.environ.get(STUDY_KERNEL_ENV) == "1"}


def conditions(results: dict) -> dict:
    """How a run was timed, from its results.json: when, on what, with how many threads on how many cores,
    the higher load average around its timed passes and whether in a study's kernel (None: not recorded)."""
    device = results.get("device") or {}
    rec = results.get("timing_conditions") or {}
    loads = [x for x in rec.get("load_average") or [] if isinstance(x, (int, float))]
    return {"at": results.get("created_at"), "device": device.get("gpu") or device.get("device"),
            "threads": device.get("torch_threads"), "cores": device.get("cpu_count"),
            "load": max(loads) if loads else None, "study_kernel": rec.get("study_kernel")}


def contended(c: dict) -> bool:
    """Timed while more processes were runnable than the machine has cores (both counts are the whole
    host's, a container's included)."""
    return c["load"] is not None and bool(c["cores"]) and c["load"] > c["cores"]


def timing_text(results: dict) -> str:
    """One line: when and how a run was timed."""
    c = conditions(results)
    threads = "threads not recorded" if c["threads"] is None else f"{c['threads']} thread{'s' * (c['threads'] != 1)}"
    load = "load not recorded" if c["load"] is None else f"load average {c['load']:.2f} on {c['cores']} cores"
    where = {True: "in a study's kernel", False: "outside a study"}.get(c["study_kernel"], "study kernel unrecorded")
    return (f"timed {c['at'] or 'at an unrecorded time'} on {c['device'] or 'an unrecorded device'}, {threads}, "
            f"{load}{' (contended)' if contended(c) else ''}, {where}")


def timing_caveats(runs: dict[str, dict]) -> list[str]:
    """Why the timings of these runs ({name: results}) do not compare as they stand: some were taken under
    contention, or the runs used different thread counts; [] when neither."""
    cs = {name: conditions(res) for name, res in runs.items() if res}
    out = []
    busy = [n for n, c in cs.items() if contended(c)]
    if busy:
        worst = max(busy, key=lambda n: cs[n]["load"] / cs[n]["cores"])
        out.append(f"{', '.join(busy)} timed with more runnable processes than cores (up to load average "
                   f"{cs[worst]['load']:.1f} on {cs[worst]['cores']} cores)")
    threads = {n: c["threads"] for n, c in cs.items() if c["threads"] is not None}
    if len(set(threads.values())) > 1:
        out.append("runs timed with different thread counts (" + ", ".join(f"{n}: {t}" for n, t in threads.items()) + ")")
    return out
