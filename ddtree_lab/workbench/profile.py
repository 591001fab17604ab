"""Where a run's time goes: a torch.profiler timeline of its rounds (stages and kernels on one time axis)
and the verify micro-benchmark (verify time and achieved bandwidth against the budget)."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..atomic import atomic_write_json
from ..bench.e2e import copy_bandwidth, weight_bytes_per_step
from ..decode import generate
from ..environment import device_info
from ..names import MICROBENCH_FILE, STAGES, TIMELINE_FILE
from ..prompts import read_prompt_set
from .advisor.machines import spec_bandwidth
from .results import gen_kwargs, load_run_pair, prompt_input, round_to_json
from .runs import RunParams


def peak_bandwidth_gbps(gpu_name: str | None) -> float | None:
    """Datasheet memory bandwidth of the GPU (the machine table, advisor/machines.json), else None."""
    bandwidth = spec_bandwidth(gpu_name)
    return bandwidth / 1e9 if bandwidth else None


def _top_level(events: list[dict]) -> list[dict]:
    """Events not nested inside another event of the same thread (outermost ops)."""
    out = []
    by_tid: dict[Any, list[dict]] = {}
    for e in events:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        end = -1.0
        for e in sorted(evs, key=lambda e: (e["ts"], -e.get("dur", 0))):
            if e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e.get("dur", 0)
    return out


def summarize_chrome_trace(trace: dict | list, rounds: list[dict] | None = None,
                           totals: dict | None = None, span: str = "ddtree_lab.generate",
                           max_events: int = 4000, prefill_seconds: float | None = None) -> dict:
    """A torch.profiler Chrome trace -> {stages, kernels, top_kernels} on one time axis (µs).

    Stages come from `record_function` annotations named after a stage if the engine emits them,
    else from the rounds' stage clocks laid end to end from the start of the `span` annotation.
    Kernels are GPU kernels when there are any, else the outermost CPU ops."""
    events = [e for e in (trace.get("traceEvents", []) if isinstance(trace, dict) else trace)
              if e.get("ph") == "X" and "ts" in e]
    for e in events:
        e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0))
    spans = [e for e in events if e.get("name") == span]
    t0 = spans[0]["ts"] if spans else min((e["ts"] for e in events), default=0.0)
    t1 = spans[0]["ts"] + spans[0]["dur"] if spans else max((e["ts"] + e["dur"] for e in events), default=0.0)

    def stage_of(name: str) -> str | None:
        base = name.split("/")[-1].split(".")[-1].split("::")[-1]
        return base if base in STAGES else None

    ann = [e for e in events if "user_annotation" in str(e.get("cat", "")) and stage_of(e["name"])]
    stages, source = [], "record_function annotations"
    if ann:
        stages = [{"name": stage_of(e["name"]), "start_us": e["ts"], "dur_us": e["dur"]} for e in ann]
    elif rounds:
        source, t = "stage clocks of each round", t0
        in_rounds = {s: sum((r.get("stage_seconds") or {}).get(s, 0.0) for r in rounds) for s in STAGES}
        prefill = prefill_seconds  # the prompt's forward; older engines counted it as verify
        if prefill is None:
            prefill = max(0.0, (totals or {}).get("verify", 0.0) - in_rounds["verify"])
        if prefill:
            stages.append({"name": "prefill", "start_us": t, "dur_us": prefill * 1e6})
            t += prefill * 1e6
        for r in rounds:
            for s, sec in (r.get("stage_seconds") or {}).items():
                stages.append({"name": s, "start_us": t, "dur_us": sec * 1e6, "round": r.get("index")})
                t += sec * 1e6

    gpu = [e for e in events if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    kind = "GPU kernels"
    if not gpu:
        kind = "CPU ops (outermost)"
        gpu = _top_level([e for e in events if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1])
    agg: dict[str, list[float]] = {}
    for e in gpu:
        a = agg.setdefault(e["name"], [0.0, 0])
        a[0] += e["dur"]
        a[1] += 1
    total = sum(a[0] for a in agg.values()) or 1.0
    top = sorted(({"name": k, "total_us": v[0], "count": v[1], "share": v[0] / total} for k, v in agg.items()),
                 key=lambda k: -k["total_us"])
    keep = {k["name"] for k in top[:12]}
    busy = [e for e in sorted(gpu, key=lambda e: e["ts"]) if e["name"] in keep]
    kernels = [{"name": e["name"], "start_us": e["ts"], "dur_us": e["dur"]} for e in busy[:max_events]]
    # The figure says where its kernel rows stop when the cut drops events (the trace has them all).
    cut = {"kernel_events": len(busy), "kernels_shown": len(kernels),
           "kernels_until_us": (kernels[-1]["start_us"] + kernels[-1]["dur_us"] - t0) if kernels else 0.0}
    return {"kind": kind, "source": source, "stages": stages, "kernels": kernels, "top_kernels": top[:40],
            "span_us": t1 - t0, **cut}


@contextlib.contextmanager
def _quiet_native_stderr():
    """The profiler's native library prints start/stop lines to file descriptor 2 (no switch turns
    them off); they would land on the terminal and in the notebook, so fd 2 points at /dev/null
    meanwhile. Python errors are exceptions, not writes, so nothing that matters is lost."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profile_run(params: RunParams, pair: Any = None, out_dir: str | os.PathLike = ".",
                max_new_tokens: int | None = None) -> dict:
    """Profile one generate of the run's first prompt with torch.profiler; write trace.json (Chrome
    trace) and timeline.json (the summary the report draws) into out_dir."""
    pair = pair if pair is not None else load_run_pair(params)
    prompt = prompt_input(pair, read_prompt_set(params.prompt_set, 1)[0]["prompt"])
    kw = {**gen_kwargs(params), "max_new_tokens": max_new_tokens or min(params.max_new_tokens, 32)}
    generate(pair, prompt, **{**kw, "max_new_tokens": 8}, seed=params.seed, trace=False)  # warm-up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     and str(getattr(pair, "device", "cpu")).startswith("cuda") else [])
    with _quiet_native_stderr(), profile(activities=acts) as prof:
        with record_function("ddtree_lab.generate"):
            res = generate(pair, prompt, seed=params.seed, trace=True, profile=True, **kw)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".trace.json.tmp"
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, out_dir / "trace.json")
    trace = json.loads((out_dir / "trace.json").read_text())
    tl = summarize_chrome_trace(trace, [round_to_json(r) for r in res.rounds], res.stage_seconds,
                                prefill_seconds=getattr(res, "prefill_seconds", None))
    tl.update(run=params.run_name, method=params.method, budget=params.budget, trace_file="trace.json",
              device=str(getattr(pair, "device", params.device)), stage_seconds=res.stage_seconds,
              acceptance_lengths=res.acceptance_lengths, new_tokens=len(res.tokens))
    atomic_write_json(out_dir / TIMELINE_FILE, tl)
    return tl


def verify_microbench(params: RunParams, pair: Any = None, budgets: list[int] | None = None,
                      max_new_tokens: int = 24, out_dir: str | os.PathLike | None = None) -> dict:
    """Verify time per round against the budget, and the bandwidth that implies: a verify forward
    reads every target weight once plus the KV cache, so bytes / time is the achieved bandwidth
    (compared with the GPU's datasheet peak, the memory roofline)."""
    pair = pair if pair is not None else load_run_pair(params)
    prompt = prompt_input(pair, read_prompt_set(params.prompt_set, 1)[0]["prompt"])
    target = getattr(pair, "target", None)
    weight_bytes = weight_bytes_per_step(target)  # every matrix, one row of an untied embedding
    cfg = getattr(target, "cfg", None)
    kv_per_pos = (cfg.num_hidden_layers * cfg.cache_values_per_token * next(target.parameters()).element_size()
                  if cfg is not None else 0)
    budgets = budgets or params.budgets or [params.budget]
    generate(pair, prompt, method="ddtree", budget=budgets[0], max_new_tokens=8, trace=False)
    points = []
    for b in budgets:
        res = generate(pair, prompt, method="ddtree", budget=b, max_new_tokens=max_new_tokens,
                          temperature=params.temperature, seed=params.seed, trace=True)
        rounds = res.rounds or []
        if not rounds:
            continue
        verify = sum(r.stage_seconds.get("verify", 0.0) for r in rounds) / len(rounds)
        pos = sum(r.position for r in rounds) / len(rounds)
        nbytes = weight_bytes + kv_per_pos * pos
        points.append({"budget": b, "rounds": len(rounds), "verify_ms": verify * 1e3,
                       "draft_ms": 1e3 * sum(r.stage_seconds.get("draft", 0.0) for r in rounds) / len(rounds),
                       "mean_tau": sum(res.acceptance_lengths) / len(res.acceptance_lengths),
                       "bytes": nbytes, "achieved_gbps": nbytes / verify / 1e9 if verify > 0 else None})
    dev = device_info(getattr(pair, "device", params.device))
    copy_gbps = None
    if dev.get("gpu"):
        try:  # measured device copy bandwidth (read + write): the attainable roofline
            copy_gbps = copy_bandwidth() / 1e9
        except Exception:  # noqa: BLE001 - the datasheet peak still stands
            pass
    out = {"points": points, "gpu": dev.get("gpu"), "peak_gbps": peak_bandwidth_gbps(dev.get("gpu")),
           "copy_gbps": copy_gbps,
           "weight_bytes": weight_bytes, "device": dev.get("device"),
           "note": ("bytes = target weights read per forward + KV cache at the mean position; the dashed lines "
                    "are the datasheet memory bandwidth and the measured device copy bandwidth"
                    if dev.get("gpu") else "bytes = target weights read per forward + KV cache at the mean "
                    "position; on a CPU there is no memory roofline to draw, so the right panel is the "
                    "achieved rate alone")}
    if out_dir is not None:
        atomic_write_json(Path(out_dir) / MICROBENCH_FILE, out)
    return out
