"""The calibration the cost model runs on, fitted once (machines.json's `calibration.fit`; tests re-fit and
compare): the efficiency factors and kernel counts on H200 bench e2e and profile JSONs (`calibrate`), the MoE
block's terms on the fused-MoE kernel bench (`calibrate_moe`), INT4 experts' unpacking on its INT4 runs
(`calibrate_int4`), MLA attention's kernel on the MLA bench (`calibrate_mla`)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

from ...kernels.moe_layout import ROUTE_IN_ALIGN_MAX_T, reread_bytes, row_height
from .check import bench_census, measured_load, modelled
from .cost import Terms, draft_terms, unpack_speed_over, verify_terms
from .fit import read_bench
from .machines import AdvisorError, Calibration, get_machine, load_calibration, machine_for_device
from .shapes import census_key, int4_weight_bytes, model_shape


def _profile_kernels(profiles: Sequence[dict], layers: Sequence[int], draft_layers: Sequence[int]) -> dict:
    """Kernels per layer and fixed, per stage, from `bench profile` JSONs of two shapes with
    different layer counts (tree build and commit do not scale with layers: their mean)."""
    def stage_counts(p, method, stage):
        row = next(r for r in p["rows"] if r["method"] == method)
        return float(row["stages"][stage]["kernels_per_round"])

    out = {}
    for stage, method, lay in (("verify", "ddtree", layers), ("ar", "ar", layers), ("draft", "ddtree", draft_layers)):
        src = "verify" if stage == "ar" else stage
        (n0, n1), (k0, k1) = lay, [stage_counts(p, method, src) for p in profiles]
        per = (k1 - k0) / (n1 - n0)
        out[stage] = [per, k0 - per * n0]
    for stage in ("tree_build", "commit"):
        out[stage] = [0.0, sum(stage_counts(p, "ddtree", stage) for p in profiles) / len(profiles)]
    return out


def calibrate(e2e_paths: Sequence[str | Path], profile_paths: Sequence[str | Path], machine: str = "h200") -> dict:
    """Fit the efficiency factors once: eta_bw, eta_flops and the launch time (and an AR step's, whose kernels
    handle one token) by least squares on the log of every draft and verify stage time; the tree build's time per node and per vocabulary entry of each
    drafted position, and commit's per token, by least squares on those stages. Returns the `calibration.fit`
    dict of machines.json."""
    import numpy as np
    from scipy.optimize import least_squares

    benches = [read_bench(p) for p in e2e_paths]
    shapes = [model_shape(b["model"]) for b in benches]
    profiles = [json.loads(Path(p).read_text()) for p in profile_paths]
    pshapes = [model_shape(p["model"]) for p in profiles]
    kernels = _profile_kernels(profiles, [s.layers for s in pshapes], [s.draft_layers for s in pshapes])
    m = get_machine(machine)
    copy = [b["roofline"]["copy_bytes_per_second"] for b in benches
            if (b.get("roofline") or {}).get("copy_bytes_per_second")]
    base = Calibration(1.0, 1.0, 0.0, 0.0, 0.0, sum(copy) / len(copy) / m.bandwidth, kernels)

    obs = []  # (terms, measured seconds)
    for b, s in zip(benches, shapes):
        ctx = int(b.get("prompt_len") or 512)
        for r in filter(modelled, b["rows"]):
            st = r["stage_seconds_per_round"]
            if r["method"] == "ar":
                obs.append((verify_terms(s, 1, ctx, base, "ar"), st["verify"]))
                continue
            nodes = s.block_size - 1 if r["method"] == "dflash" else int(r["budget"])
            obs.append((verify_terms(s, nodes + 1, ctx, base), st["verify"]))
            obs.append((draft_terms(s, ctx, base), st["draft"]))

    def resid(x):
        cal = Calibration(x[0], x[1], x[2], 0, 0, base.copy_over_spec, kernels, one_row_launch_seconds=x[3])
        return [math.log(sum(t.seconds(m, cal).values()) / y) for t, y in obs]

    fit = least_squares(resid, x0=[0.8, 0.6, 2e-6, 2e-6], bounds=([0.05, 0.05, 0.0, 0.0], [1.0, 1.0, 1e-4, 1e-4]))
    eta_bw, eta_flops, launch, one_row_launch = (float(v) for v in fit.x)
    per = {}  # tree build: per node and per vocabulary entry of each drafted position (its top-k); commit: per token
    for stage, extra in (("tree_build", 0), ("commit", 1)):
        xs, ys = [], []
        for b, s in zip(benches, shapes):
            for r in filter(modelled, b["rows"]):
                if r["method"] == "ar":
                    continue
                nodes = s.block_size - 1 if r["method"] == "dflash" else int(r["budget"])
                xs.append([nodes + extra, (s.block_size - 1) * s.vocab] if stage == "tree_build" else [nodes + extra])
                ys.append(r["stage_seconds_per_round"][stage] - kernels[stage][1] * launch)
        per[stage] = [max(0.0, float(c)) for c in np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]]
    return {"eta_bw": eta_bw, "eta_flops": eta_flops, "launch_seconds": launch, "one_row_launch_seconds": one_row_launch,
            "tree_node_seconds": per["tree_build"][0], "tree_vocab_seconds": per["tree_build"][1],
            "commit_node_seconds": per["commit"][0],
            "copy_over_spec": base.copy_over_spec, "kernels": kernels, "p": base.p,
            "kernels_per_fused_run": _kernels_per_fused_run(profiles[0]["model"], kernels)}


def _kernels_per_fused_run(model: str, kernels: dict) -> dict:
    """Per stage (AR step, verify): the kernels compile makes of a run of fusible ops, such that the census of the
    first profile's shape (a random shape) gives the kernels a layer that the profiles measured."""
    from ...bench.census import layer_census

    if not model.startswith("random:"):
        raise AdvisorError(f"the first profile's model {model!r} is no random shape; its layers cannot be counted")
    shape = model.split(":", 1)[1].split("@")[0]
    out = {}
    for stage in ("ar", "verify"):
        extern, runs = layer_census(shape, stage)
        out[stage] = (kernels[stage][0] - extern) / runs
    return out


def count_layer_census(shapes: Sequence[str] | None = None) -> dict:
    """machines.json's `calibration.layer_census`: per random shape (default: every one), per stage ("ar",
    "verify"), the [extern kernels, fused runs] a layer launches (bench/census.py: layer_census); an MoE shape's
    also under each other routing (census_key's keys)."""
    from ...bench.census import OTHER_ROUTINGS, counted_routing, layer_census
    from ...pairs.random import SHAPE_NAMES, shape_configs

    out = {}
    for shape in shapes or SHAPE_NAMES:
        kinds = [None, *(OTHER_ROUTINGS if shape_configs(shape)[0].is_moe else ())]
        for kind in kinds:
            routing = kind and counted_routing(kind, shape)
            out[census_key(shape, kind)] = {stage: list(layer_census(shape, stage, routing=routing))
                                             for stage in ("ar", "verify")}
    return out


EAGER_FREE = ("launch_seconds", "eager_matmul_seconds", "eager_matvec_seconds")


def calibrate_eager(e2e_paths: Sequence[str | Path], free: Sequence[str] = EAGER_FREE) -> dict:
    """The eager-layers calibration, on bench e2e JSONs of eager rounds: each row's kernels, matmuls and activation
    bytes counted by its launch census (check.bench_census), every other term the compiled calibration's (the
    bytes, FLOPs, attention and MoE kernels are the same either way), and `free` fitted by least squares on the
    log of every draft and verify stage time: by default what one of the many small eager kernels costs in a
    graph, and what a matmul kernel costs beyond its bytes and FLOPs, a GEMM's and a one-row (matrix-vector)
    product's apart (the compiled fit prices all three alike). Each
    file is priced on the card it ran on (its environment's device). -> the `eager_calibration.fit` dict of
    machines.json."""
    from scipy.optimize import least_squares


    base = dataclasses.replace(load_calibration("compiled"), launches_from="census")
    obs = []  # (terms, machine, measured seconds)
    for path in e2e_paths:
        b = read_bench(path)
        if b.get("compile"):
            raise AdvisorError(f"{path}: compiled layers (compile=True); the eager fit takes eager rounds")
        m = _bench_machine(path, b)
        s = model_shape(b["model"])
        ctx, load, census = int(b.get("prompt_len") or 512), measured_load(b, s), bench_census(b, s)
        for r in filter(modelled, b["rows"]):
            st = r["stage_seconds_per_round"]
            if r["method"] == "ar":
                obs.append((verify_terms(s, 1, ctx, base, "ar", load, census), m, st["verify"]))
                continue
            nodes = s.block_size - 1 if r["method"] == "dflash" else int(r["budget"])
            obs.append((verify_terms(s, nodes + 1, ctx, base, "verify", load, census), m, st["verify"]))
            obs.append((draft_terms(s, ctx, base, census), m, st["draft"]))
    start = {k: getattr(base, k) or base.launch_seconds for k in free}

    def resid(x):
        cal = dataclasses.replace(base, **dict(zip(free, x)))
        return [math.log(sum(t.seconds(m, cal).values()) / y) for t, m, y in obs]

    seconds = [k.endswith("_seconds") for k in free]  # times, else efficiencies (fractions of the spec)
    bounds = ([0.0 if t else 0.05 for t in seconds], [1e-4 if t else 1.0 for t in seconds])
    fit = least_squares(resid, x0=list(start.values()), bounds=bounds)
    return {k: float(v) for k, v in zip(free, fit.x)}


def calibrate_moe(fused_moe_paths: Sequence[str | Path], cal: Calibration | None = None,
                  machine: str = "h200") -> dict:
    """The MoE block's time beyond its bytes and FLOPs, from `bench fused_moe` JSONs (the block alone at
    1 … 1025 tokens; independent, alike and crowded routing, so the fit sees few and many experts, one row
    block each or many, at one T): least squares of measured − modelled = moe_block_seconds + moe_pair_seconds
    · T·k + moe_sort_seconds · [T > ROUTE_IN_ALIGN_MAX_T] + re-read bytes / (spec bandwidth ·
    moe_reread_over_bandwidth), the re-read bytes being (row blocks − experts touched) · an expert's weights.
    Kernel-level data, so the e2e check of MoE rounds stays a check. -> those calibration.fit keys."""
    import numpy as np

    cal = cal or load_calibration()
    m = get_machine(machine)
    xs, ys = [], []
    for path in fused_moe_paths:
        d = _whole_block_bench(path)
        if d.get("int4_group"):
            raise AdvisorError(f"{path}: an INT4 bench (int4_group {d['int4_group']}); its term is calibrate_int4's")
        sh = d["shape"]
        h, w, k = int(sh["hidden"]), int(sh["width"]), int(sh["top_k"])
        elsize = 4 if d.get("dtype") == "float32" else 2
        for r in d["rows"]:
            if "row_blocks" not in r:
                raise AdvisorError(f"{path}: a row without row_blocks (written before they were recorded); "
                                   "re-run python -m ddtree_lab.bench.fused_moe")
            parts = Terms(weights=r["touched_bytes"], flops=2 * r["T"] * k * 3 * h * w).seconds(m, cal)
            core = parts["weights"] + parts["flops"]
            reread = reread_bytes(r["row_blocks"], r["experts_touched"], h, w, elsize)
            xs.append([1.0, float(r["T"] * k), float(r["T"] > ROUTE_IN_ALIGN_MAX_T), reread / m.bandwidth])
            ys.append(r["triton_us"] * 1e-6 - core)
    if len(xs) < 5:
        raise AdvisorError(f"{', '.join(map(str, fused_moe_paths))}: {len(xs)} rows; the MoE fit needs at least 5")
    block, pair, sort, reread = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]
    return {"moe_block_seconds": max(0.0, float(block)), "moe_pair_seconds": max(0.0, float(pair)),
            "moe_sort_seconds": max(0.0, float(sort)), "moe_reread_over_bandwidth": _positive_inverse(reread)}


def _whole_block_bench(path) -> dict:
    """A fused-MoE bench of the whole block (router and routing in the kernel), as the MoE terms price it; an
    expert-parallel share's bench times its expert stage alone, so it is refused."""
    d = json.loads(Path(path).read_text())
    if (d.get("shape") or {}).get("all_experts"):
        raise AdvisorError(f"{path}: an expert-parallel share's bench (the expert stage alone, routed over "
                           f"{d['shape']['all_experts']} experts); the MoE fits take whole blocks")
    return d


def _int4_bench(path) -> dict:
    d = _whole_block_bench(path)
    if not int(d.get("int4_group") or 0):
        raise AdvisorError(f"{path}: not an INT4 bench (no int4_group); a dense block's terms are calibrate_moe's")
    if any("row_blocks" not in r for r in d["rows"]):
        raise AdvisorError(f"{path}: a row without row_blocks; re-run python -m ddtree_lab.bench.fused_moe")
    return d


def _todays_rows(d: dict) -> list[dict]:
    """The rows run at today's row height (`moe_layout.row_height`)."""
    return [r for r in d["rows"] if (r.get("launch") or {}).get("BLOCK_M", row_height(int(r["T"]), int4=True))
            == row_height(int(r["T"]), int4=True)]


def _int4_row_parts(d: dict, r: dict, m, cal: Calibration) -> tuple[float, float, float]:
    """An INT4 block bench row on machine m: (what the dense block's terms price for its bytes: weights at
    eta_bw, FLOPs, and calibrate_moe's fixed, per-pair, sort and re-read parts; the experts' INT4 bytes, less the
    bf16 router; the row blocks the kernel ran)."""
    sh = d["shape"]
    h, w, k, e = int(sh["hidden"]), int(sh["width"]), int(sh["top_k"]), int(sh["experts"])
    T = int(r["T"])
    parts = Terms(weights=r["touched_bytes"], flops=2 * T * k * 3 * h * w).seconds(m, cal)
    sort = cal.moe_sort_seconds if T > ROUTE_IN_ALIGN_MAX_T else 0.0
    reread = reread_bytes(r["row_blocks"], r["experts_touched"], h, w, int4_weight_bytes(int(d["int4_group"])))
    known = (parts["weights"] + parts["flops"] + cal.moe_block_seconds + cal.moe_pair_seconds * T * k + sort
             + reread / (m.bandwidth * cal.moe_reread_over_bandwidth))
    return known, float(r["touched_bytes"] - e * h * 2), float(r["row_blocks"])


def _bench_machine(path, d: dict):
    """The machine a bench JSON ran on: its `device` (the fused-MoE bench's) or its environment's (bench e2e,
    bench mla)."""
    device = d.get("device") or (d.get("environment") or {}).get("device")
    name = machine_for_device(device)
    if name is None:
        raise AdvisorError(f"{path}: device {device!r} matches no machine of machines.json")
    return get_machine(name)


def price_int4_bench(path, cal: Calibration | None = None) -> list[dict]:
    """A fused-MoE INT4 bench's rows (today's row heights) priced on the machine it ran on (its `device`): T,
    measured and predicted seconds, the error. The check of the INT4 terms on a machine other than the one they
    were fitted on (the unpacking moves by the SMs' FP32 rate: cost.int4_unpack_rate)."""
    cal = cal or load_calibration()
    d = _int4_bench(path)
    m = _bench_machine(path, d)
    out = []
    for r in _todays_rows(d):
        known, int4_bytes, blocks = _int4_row_parts(d, r, m, cal)
        pred = known + Terms(int4_bytes=int4_bytes, int4_blocks=blocks).seconds(m, cal)["moe"]
        meas = r["triton_us"] * 1e-6
        out.append({"T": int(r["T"]), "measured_seconds": meas, "predicted_seconds": pred, "error": pred / meas - 1})
    return out


def calibrate_int4(fused_moe_int4_paths: Sequence[str | Path], cal: Calibration | None = None) -> dict:
    """INT4 experts' unpacking, from `bench fused_moe --int4` JSONs (the block alone with INT4 experts, at several
    T and expert widths): the time beyond what the dense block's terms price for the same bytes (weights at
    eta_bw, FLOPs, and calibrate_moe's fixed, per-pair, sort and re-read parts) = INT4 bytes touched / (spec
    bandwidth · x) + row blocks · y, by least squares (as calibrate_moe's, on the same kernel). A narrow expert
    (a TP8 rank's, 256 wide) is mostly its blocks' start; a full one its bytes.
    Rows run at another row height than today's kernel (`moe_layout.row_height`) are left out. Kernel-level
    data, as calibrate_moe's. Each file is priced on the machine it ran on, and x is in the calibration's machine's
    terms (cost.int4_unpack_rate moves it), so an H100's blocks fit the H200-based calibration.
    -> {"moe_int4_unpack_over_bandwidth": x, "moe_int4_block_seconds": y}."""
    import numpy as np

    cal = cal or load_calibration()
    ref = get_machine(cal.machine)
    xs, ys, widths = [], [], set()
    for path in fused_moe_int4_paths:
        d = _int4_bench(path)
        m = _bench_machine(path, d)
        for r in _todays_rows(d):
            known, int4_bytes, blocks = _int4_row_parts(d, r, m, cal)
            xs.append([int4_bytes / (ref.bandwidth * unpack_speed_over(m, ref)), blocks])
            ys.append(r["triton_us"] * 1e-6 - known)
            widths.add(int(d["shape"]["width"]))
    if len(xs) < 3:
        raise AdvisorError(f"{', '.join(map(str, fused_moe_int4_paths))}: {len(xs)} rows at today's row heights; "
                           "the INT4 fit needs at least 3")
    if len(widths) < 2:  # bytes and row blocks grow together at one width: the fit cannot tell them apart
        raise AdvisorError(f"{', '.join(map(str, fused_moe_int4_paths))}: experts {widths.pop()} wide only; the INT4 "
                           "fit needs benches of two expert widths, e.g. --shape kimi-k2.6 and --shape "
                           "kimi-k2.6-tp8-rank")
    per_byte, per_block = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)[0]
    if per_byte <= 0:
        raise AdvisorError("the INT4 fit found unpacking free: the INT4 block ran as fast as the dense terms price "
                           "its bytes, so there is no term to fit")
    if per_block < 0:
        raise AdvisorError("the INT4 fit found row blocks free (a negative term): give rows over more T at each "
                           "expert width")
    return {"moe_int4_unpack_over_bandwidth": float(1.0 / per_byte), "moe_int4_block_seconds": float(per_block)}


def _mla_rows(path):
    """A `bench mla` JSON's Triton rows with the machine it ran on: (row, machine) pairs."""
    d = json.loads(Path(path).read_text())
    if d.get("kind") != "mla":
        raise AdvisorError(f"{path}: not a 'bench mla' JSON (field 'kind' is {d.get('kind')!r})")
    m = _bench_machine(path, d)
    return [(r, m) for r in d["rows"] if r.get("backend") == "triton" and r.get("ms")]


def _mla_roofline(r: dict, m, cal: Calibration) -> float:
    """A bench mla row's roofline part, (M² + C²)^½ of its latent bytes and FLOPs (the fit prices the rest)."""
    parts = Terms(kv=r["bytes"], flops=r["flops"]).seconds(m, cal)
    return parts["kv"] + parts["flops"]


def calibrate_mla(mla_paths: Sequence[str | Path], cal: Calibration | None = None) -> dict:
    """MLA attention's time beyond its latent bytes and FLOPs, from `bench mla` JSONs (the Triton kernel at trees
    of T tokens over contexts, 64 and 8 heads): measured − (M² + C²)^½ = a per call + bytes / (spec bandwidth ·
    x) + FLOPs / (peak · y), least squares relative to each row's time (the rows span 25 µs to 17 ms). Kernel-
    level data, as calibrate_moe's; each file priced on the machine it ran on (x and y are fractions of its spec).
    -> {"mla_call_seconds", "mla_bytes_over_bandwidth", "mla_flops_over_peak"}."""
    import numpy as np

    cal = cal or load_calibration()
    xs, ys, ts = [], [], []
    for path in mla_paths:
        for r, m in _mla_rows(path):
            t = r["ms"] * 1e-3
            xs.append([1.0, r["bytes"] / m.bandwidth, r["flops"] / m.flops])
            ys.append(t - _mla_roofline(r, m, cal))
            ts.append(t)
    if len(xs) < 4:
        raise AdvisorError(f"{', '.join(map(str, mla_paths))}: {len(xs)} Triton rows; the MLA fit needs at least 4")
    w = 1 / np.array(ts)
    call, per_byte, per_flop = np.linalg.lstsq(np.array(xs) * w[:, None], np.array(ys) * w, rcond=None)[0]
    if min(call, per_byte, per_flop) <= 0:
        raise AdvisorError("the MLA fit found a term free (non-positive): give rows over more trees and contexts, "
                           "e.g. ddtree-lab bench mla --trees 1 9 33 129 1025 --contexts 4096 32768")
    return {"mla_call_seconds": float(call), "mla_bytes_over_bandwidth": float(1 / per_byte),
            "mla_flops_over_peak": float(1 / per_flop)}


def price_mla_bench(path, cal: Calibration | None = None) -> list[dict]:
    """A bench mla JSON's Triton rows priced by the stored MLA terms on the machine it ran on: heads, T, context,
    measured and predicted seconds, the error. The check of those terms on a run they were not fitted on."""
    cal = cal or load_calibration()
    out = []
    for r, m in _mla_rows(path):
        pred = sum(Terms(mla_calls=1, mla_bytes=r["bytes"], mla_flops=r["flops"]).seconds(m, cal).values())
        meas = r["ms"] * 1e-3
        out.append({"H": r["H"], "T": r["T"], "context": r["context"], "measured_seconds": meas,
                    "predicted_seconds": pred, "error": pred / meas - 1})
    return out


def _positive_inverse(seconds_per_spec_byte: float) -> float:
    if seconds_per_spec_byte <= 0:
        raise AdvisorError("the MoE fit found re-read weights free (a non-positive term): the files do not tell it "
                           "apart; give benches with crowded routing (--similarity 0.99) beside independent routing")
    return float(1.0 / seconds_per_spec_byte)
