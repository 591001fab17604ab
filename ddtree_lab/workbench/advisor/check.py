"""The first-principles model against bench e2e measurements: each row's predicted round time and error,
and the bench files shipped for it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

from ...kernels.moe_layout import at_kernel_height
from ...names import recorded_routing
from .cost import LaunchCensus, counted_layer_kernels, round_cost
from .fit import read_bench
from .machines import (CALIBRATIONS, AdvisorError, Calibration, get_machine, load_calibration, machine_for_device,
                       profile_names)
from .shapes import ExpertLoad, census_key, model_shape

CHECK_TOLERANCE = 0.15
CHECK_BUDGETS = (16, 1024)  # the DDTree budgets the first-principles check covers on a dense target's file


def gated(row: dict, moe: bool, lo: int = CHECK_BUDGETS[0], hi: int = CHECK_BUDGETS[1]) -> bool:
    """A row the check's verdict rests on: a DDTree budget in [lo, hi]; on an MoE target's file every round (AR,
    DFlash, every budget), since which budget pays there is a question of the routing the MoE terms price."""
    return moe or (row["method"] == "ddtree" and lo <= int(row.get("budget") or 0) <= hi)


def modelled(row: dict) -> bool:
    """A bench row the model can price: a budget="auto" row has no one tree size (its rounds vary)."""
    return row["method"] != "ddtree" or isinstance(row.get("budget"), int)


def _matches(bench: dict, settings: Mapping) -> list[str]:
    return [f"{k}={bench.get(k)!r} (calibrated: {v!r})" for k, v in settings.items() if bench.get(k) != v]


def calibration_for(bench: dict) -> tuple[Calibration | None, list[str]]:
    """The calibration whose settings a bench e2e JSON ran with (compiled or eager layers, …), else None and
    why each one does not fit."""
    why = []
    for kind in CALIBRATIONS:
        cal = load_calibration(kind)
        differs = _matches(bench, cal.settings)
        if not differs:
            return cal, []
        why.append(f"{kind}: {', '.join(differs)}")
    return None, why


def check_bench(paths: Sequence[str | Path], cal: Calibration | None = None,
                lo: int = CHECK_BUDGETS[0], hi: int = CHECK_BUDGETS[1]) -> dict:
    """Predicted vs measured round times of bench e2e JSONs (machine from each file's device; calibration: the
    one the file's settings ran with, unless given): which shapes were checked, each row's error, and whether
    every gated row (`gated`: budgets in [lo, hi], every round of an MoE target) is within 15 %."""
    checked, skipped = [], []
    for path in paths:
        b = read_bench(path)
        device = (b.get("environment") or {}).get("device")
        mname = machine_for_device(device)
        file_cal, why = (cal, _matches(b, cal.settings)) if cal else calibration_for(b)
        if mname is None:
            why.append(f"device {device!r} matches no machine of machines.json")
        elif mname not in profile_names():
            why.append(f"device {device!r} is {mname}, which has no FLOP/s figure in machines.json")
        try:
            shape = model_shape(b.get("model") or "")
        except (AdvisorError, ValueError) as e:
            shape, why = None, why + [str(e)]
        if shape is not None and shape.num_experts and shape.census_shape:  # its layers, routed as the file ran
            shape = dataclasses.replace(shape, census_shape=census_key(shape.census_shape, recorded_routing(b)))
        if shape is not None and shape.census_shape and b.get("layer_census") and file_cal is not None:
            # the layers of the code the file ran, counted when it ran (or annotated): the stored count is today's
            file_cal = dataclasses.replace(file_cal, layer_census={**file_cal.layer_census,
                                                                   shape.census_shape: b["layer_census"]})
        census = None
        if not why and file_cal.launches_from == "census":
            try:
                census = bench_census(b, shape)
            except (ImportError, ValueError) as e:  # no triton here, a routing trace not on this machine
                why.append(f"its launch census: {e}")
        if why:
            skipped.append({"file": Path(path).name, "model": b.get("model"), "reason": "; ".join(why)})
            continue
        m, ctx = get_machine(mname), int(b.get("prompt_len") or 512)
        load = measured_load(b, shape)  # an MoE bench's own expert counts, else None (uniform routing)
        rows = []
        for r in filter(modelled, b["rows"]):
            pred = round_cost(shape, m, r["method"], r.get("budget"), ctx, file_cal, load, census)
            meas = float(r["round_seconds"])
            rows.append({"method": r["method"], "budget": r.get("budget"), "measured_seconds": meas,
                         "predicted_seconds": pred.seconds, "error": pred.seconds / meas - 1,
                         "dominant": pred.dominant,
                         "in_range": gated(r, bool(shape.num_experts), lo, hi)})
        if not any(x["in_range"] for x in rows):
            skipped.append({"file": Path(path).name, "model": b.get("model"),
                            "reason": f"no DDTree budget in {lo}–{hi}"})
            continue
        ok = all(abs(x["error"]) <= CHECK_TOLERANCE for x in rows if x["in_range"])
        layers_counted = file_cal.launches_from == "profile" and counted_layer_kernels(shape, file_cal, "verify")
        checked.append({"file": Path(path).name, "model": b.get("model"), "machine": mname, "device": device,
                        "launches": "layers" if layers_counted else file_cal.launches_from,
                        "expert_union": "measured" if load else ("uniform routing" if shape.num_experts else None),
                        "prompt_len": ctx, "rows": rows, "within_tolerance": ok,
                        **({"incomplete": b["incomplete"]} if "incomplete" in b else {}),
                        "max_error": max((abs(x["error"]) for x in rows if x["in_range"]), default=None)})
    return {"tolerance": CHECK_TOLERANCE, "budgets": [lo, hi],
            "gate": f"DDTree budgets {lo}–{hi}, every round of an MoE target", "checked": checked, "skipped": skipped,
            "passed": bool(checked) and all(c["within_tolerance"] for c in checked)}


def measured_load(bench: dict, shape) -> ExpertLoad | None:
    """The routing a bench e2e JSON's rows measured, per verify size (forwards of 1, block_size and budget + 1
    tokens): mean distinct experts per MoE layer and row blocks at the kernel's height; None without counts."""
    touched, blocks = {}, {}
    for r in filter(modelled, bench.get("rows", [])):
        if r.get("experts_touched_mean") is None:
            continue
        tokens = {"ar": 1, "dflash": shape.block_size}.get(r["method"], int(r.get("budget") or 0) + 1)
        touched[tokens] = float(r["experts_touched_mean"])
        at_height = at_kernel_height(r.get("expert_row_blocks_mean"), tokens, shape.int4_experts)
        if at_height is not None:
            blocks[tokens] = float(at_height)
    return ExpertLoad(touched, blocks or None) if touched else None


def bench_census(bench: dict, shape) -> LaunchCensus:
    """The kernels, matmuls and activation bytes of an eager bench's rounds: the rows' own `census` (bench e2e
    writes it for eager layers; `bench census --annotate` adds it to older files), else counted now under the
    file's settings (bench/census.py: e2e_census)."""
    from ...bench.census import e2e_census

    rows = [r for r in bench.get("rows", []) if modelled(r)]
    counted = [r.get("census") for r in rows]
    if not all(counted):
        counted = [c for c in e2e_census(bench) if c is not None]
    stages = {}
    for r, census in zip(rows, counted):
        tokens = {"ar": 1, "dflash": shape.block_size}.get(r["method"], int(r.get("budget") or 0) + 1)
        for stage, c in census.items():
            key = (("ar", 1) if r["method"] == "ar" else ("draft", shape.block_size) if stage == "draft"
                   else (stage, tokens))
            stages[key] = (c["kernels"], c["matmuls"], c["activation_bytes"])
    return LaunchCensus(stages)


def shipped_bench_files() -> list[str]:
    """The bench e2e JSONs shipped in the package for the check (package data: an installed package checks
    its model as a source checkout does). Copies of files of docs/bench, H200 and H100: compiled rounds, and eager
    MoE rounds that carry their census."""
    return sorted(str(p) for p in Path(__file__).with_name("check_data").glob("e2e_*.json"))
