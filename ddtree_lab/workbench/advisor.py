"""The budget advisor's round cost model: cost(T) of one DDTree round for a target + drafter on a machine.

Two ways. `FittedCost`: per-stage a + b·B + c·B² least-squares fits to measured stage times (a `bench e2e`
JSON or a study's runs), with leave-one-out error. `round_cost`: first principles for a named machine —
weights read (dense, or through the expert union for MoE layers), KV and activation bytes, FLOPs and
kernel launches per stage — with efficiency factors fitted once on H200 data (`calibrate`, stored in
machines.json). `choose_budget` is the pure rule the engine's `budget="auto"` applies on the device.
Torch-free: shapes come from configs, stage times from JSON.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

MACHINES_FILE = Path(__file__).with_name("machines.json")
MEASURED = "measured"
FIT_STAGES = ("draft", "tree_build", "verify", "commit")
MIN_FIT_POINTS = 4  # a quadratic has three coefficients; leave-one-out needs one more
CHECK_TOLERANCE = 0.15
CHECK_BUDGETS = (16, 1024)  # the budget range the first-principles check covers
PARTS = ("weights", "kv", "flops", "launches", "other")
PART_TITLES = {"weights": "weights read", "kv": "KV and activations", "flops": "FLOPs",
               "launches": "kernel launches", "other": "tree build and commit"}


class AdvisorError(ValueError):
    """Bad advisor input: one line naming what is wrong."""


# ----------------------------------------------------------------------------- machines
@dataclass(frozen=True)
class Machine:
    name: str
    title: str
    bandwidth: float      # bytes/s, spec-equivalent (a measured copy bandwidth is converted)
    flops: float          # dense bf16 FLOP/s
    source: str
    url: str = ""


def machines_data() -> dict:
    return json.loads(MACHINES_FILE.read_text())


def known_machines() -> list[str]:
    return [*machines_data()["machines"], MEASURED]


def _device_machine(device: str | None) -> str | None:
    """The profile a device name (e.g. 'NVIDIA H200') matches, by its model number."""
    d = (device or "").lower().replace(" ", "")
    for name in machines_data()["machines"]:
        key = name.replace("-", "")
        if key in d.replace("-", ""):
            return name
    return None


def get_machine(name: str, bench: dict | None = None, cal: "Calibration | None" = None) -> Machine:
    """A named profile, or `measured`: a bench JSON's copy bandwidth (converted to its spec equivalent
    with the calibration's copy/spec ratio) and its GEMM throughput, else its device's spec FLOP/s."""
    data = machines_data()["machines"]
    if name in data:
        m = data[name]
        return Machine(name, m["title"], float(m["bandwidth_bytes_per_second"]), float(m["bf16_dense_flops"]),
                       m["source"], m.get("url", ""))
    if name != MEASURED:
        raise AdvisorError(f"unknown machine {name!r}; known: {', '.join(known_machines())}")
    roof = (bench or {}).get("roofline") or {}
    if not roof.get("copy_bytes_per_second"):
        raise AdvisorError("machine 'measured' needs a bench e2e JSON with roofline.copy_bytes_per_second "
                           "(ddtree-lab bench e2e on the GPU)")
    cal = cal or load_calibration()
    device = ((bench or {}).get("environment") or {}).get("device")
    flops = roof.get("gemm_flops_per_second")
    if not flops:
        spec = _device_machine(device)
        if spec is None:
            raise AdvisorError(f"machine 'measured': the bench JSON has no gemm_flops_per_second and its "
                               f"device {device!r} matches no profile ({', '.join(data)})")
        flops = data[spec]["bf16_dense_flops"] * 1.0
    return Machine(MEASURED, f"measured ({device})", float(roof["copy_bytes_per_second"]) / cal.copy_over_spec,
                   float(flops), "copy bandwidth and GEMM throughput of the bench JSON")


# ----------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a target + DFlash drafter (sizes only)."""
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_layers: int
    draft_intermediate: int
    block_size: int
    draft_features: int          # target layers the drafter reads (its fc is features·H × H)
    num_experts: int = 0         # MoE: experts per MoE layer (0: dense)
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0
    dtype_bytes: int = 2

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def experts_touched(self, tokens: int, curve: Mapping[int, float] | None = None) -> float:
        """Distinct experts one MoE layer reads for `tokens` tokens: a measured curve (tokens -> mean
        experts, interpolated in log tokens) or uniform routing, E·(1 − (1 − k/E)^T)."""
        if not self.num_experts:
            return 0.0
        if curve:
            return _interp_log(curve, tokens)
        e, k = self.num_experts, self.experts_per_tok
        return e * (1 - (1 - k / e) ** tokens)


def _interp_log(curve: Mapping[int, float], x: float) -> float:
    pts = sorted((float(k), float(v)) for k, v in curve.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def shape_from_configs(name: str, tcfg, dcfg, raw: Mapping | None = None) -> ModelShape:
    """From a TargetConfig + DrafterConfig; MoE fields from the config object or its raw HF dict
    (`num_experts` / `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `decoder_sparse_step`, `mlp_only_layers`)."""
    raw = dict(raw or {})

    def get(*keys, default=0):
        for k in keys:
            v = getattr(tcfg, k, None)
            v = raw.get(k) if v is None else v
            if v is not None:
                return v
        return default

    experts = int(get("num_experts", "num_local_experts"))
    layers = tcfg.num_hidden_layers
    moe_layers = 0
    if experts:
        step = int(get("decoder_sparse_step", default=1)) or 1
        dense = set(get("mlp_only_layers", default=[]) or [])
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return ModelShape(name=name, layers=layers, hidden=tcfg.hidden_size, intermediate=tcfg.intermediate_size,
                      heads=tcfg.num_attention_heads, kv_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                      vocab=tcfg.vocab_size, draft_layers=dcfg.num_hidden_layers,
                      draft_intermediate=dcfg.intermediate_size, block_size=dcfg.block_size,
                      draft_features=len(dcfg.target_layer_ids), num_experts=experts,
                      experts_per_tok=int(get("num_experts_per_tok")),
                      expert_intermediate=int(get("moe_intermediate_size")), moe_layers=moe_layers)


def model_shape(name: str) -> ModelShape:
    """A pair's shape by name: `random:<shape>`, a named pair (`lab`, ...) or a directory holding
    target/ and drafter/ (reads config.json only)."""
    from ..config import drafter_config_from_hf, read_json, target_config_from_hf
    from ..pairs.random import RANDOM_SHAPES, shape_configs

    if name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise AdvisorError(f"unknown model {name!r}; known: "
                               f"{', '.join('random:' + s for s in RANDOM_SHAPES)}")
        t, d = shape_configs(shape)
        return shape_from_configs(name, t, d, RANDOM_SHAPES[shape])
    path = Path(name)
    if (path / "target").is_dir():
        tdir, ddir = path / "target", path / "drafter"
    else:
        from ..pairs import PAIRS, resolve
        if name not in PAIRS:
            raise AdvisorError(f"unknown model {name!r}; known: {', '.join(PAIRS)}, "
                               f"{', '.join('random:' + s for s in RANDOM_SHAPES)}")
        try:
            tdir, ddir = resolve(name)
        except ValueError as e:
            raise AdvisorError(f"model {name!r}: {e}") from None
    traw = read_json(Path(tdir) / "config.json")
    t = target_config_from_hf(traw, Path(tdir) / "config.json")
    d = drafter_config_from_hf(read_json(Path(ddir) / "config.json"), Path(ddir) / "config.json")
    return shape_from_configs(name, t, d, traw)


# ----------------------------------------------------------------------------- first principles
@dataclass
class Calibration:
    """Efficiency factors fitted once on H200 (`calibrate`); stated in docs/workbench.md."""
    eta_bw: float                 # achieved fraction of spec bandwidth when streaming weights
    eta_flops: float              # achieved fraction of dense bf16 peak in the verify GEMMs
    launch_seconds: float         # per kernel in a captured round (launch gap + minimum kernel time)
    tree_node_seconds: float      # tree build per node (latency-bound; taken as machine-independent)
    commit_node_seconds: float    # commit per verified token (same)
    copy_over_spec: float         # measured copy bandwidth / spec bandwidth on the calibration machine
    kernels: dict = field(default_factory=dict)  # stage -> [per layer, fixed]
    p: float = 2.0                # memory and compute times combine as (M^p + C^p)^(1/p)
    settings: dict = field(default_factory=dict)


def load_calibration() -> Calibration:
    cal = machines_data()["calibration"]
    if "fit" not in cal:
        raise AdvisorError(f"{MACHINES_FILE}: no calibration fit; run ddtree_lab.workbench.advisor.calibrate")
    return Calibration(**cal["fit"], settings=cal.get("settings", {}))


@dataclass
class Terms:
    """The work of one stage: bytes by kind, FLOPs, kernel launches."""
    weights: float = 0.0
    kv: float = 0.0
    flops: float = 0.0
    launches: float = 0.0
    fixed_seconds: float = 0.0    # tree build / commit

    def seconds(self, m: Machine, cal: Calibration) -> dict[str, float]:
        """This stage's time split into PARTS (sums to its total)."""
        bw, fl = m.bandwidth * cal.eta_bw, m.flops * cal.eta_flops
        tw, tk, tc = self.weights / bw, self.kv / bw, self.flops / fl
        mem = tw + tk
        core = (mem ** cal.p + tc ** cal.p) ** (1 / cal.p) if mem or tc else 0.0
        share_m = mem ** cal.p / (mem ** cal.p + tc ** cal.p) if mem or tc else 0.0
        out = {"weights": core * share_m * (tw / mem if mem else 0.0),
               "kv": core * share_m * (tk / mem if mem else 0.0),
               "flops": core * (1 - share_m), "launches": self.launches * cal.launch_seconds,
               "other": self.fixed_seconds}
        return out


def _kernels(cal: Calibration, stage: str, layers: int) -> float:
    per_layer, fixed = cal.kernels.get(stage, (0.0, 0.0))
    return per_layer * layers + fixed


def verify_terms(s: ModelShape, tokens: int, ctx: int, cal: Calibration, stage: str = "verify",
                 union: Mapping[int, float] | None = None) -> Terms:
    """The target forward over `tokens` tokens after `ctx` cached ones."""
    b, h = s.dtype_bytes, s.hidden
    dense_layers = s.layers - s.moe_layers
    touched = s.experts_touched(tokens, union)
    expert = 3 * h * s.expert_intermediate
    weights = (s.layers * s.attn_params + dense_layers * 3 * h * s.intermediate
               + s.moe_layers * (h * s.num_experts + touched * expert) + s.vocab * h) * b
    used = (s.layers * s.attn_params + dense_layers * 3 * h * s.intermediate
            + s.moe_layers * (h * s.num_experts + s.experts_per_tok * expert) + s.vocab * h)
    flops = 2 * tokens * used + 4 * s.layers * s.heads * s.head_dim * tokens * (ctx + tokens)
    inter = s.intermediate if not s.moe_layers else s.experts_per_tok * s.expert_intermediate
    kv = (s.layers * 2 * s.kv_heads * s.head_dim * (ctx + tokens) * b               # cache read + new rows
          + tokens * s.layers * (6 * h + 2 * s.heads * s.head_dim + 3 * inter) * b  # activations
          + tokens * s.vocab * 4)                                                   # fp32 logits
    return Terms(weights=weights, kv=kv, flops=flops, launches=_kernels(cal, stage, s.layers))


def draft_terms(s: ModelShape, ctx: int, cal: Calibration) -> Terms:
    """The DFlash drafter over one block, then the target's LM head on its block_size − 1 positions."""
    b, h, q = s.dtype_bytes, s.hidden, s.block_size
    layer = s.attn_params + 3 * h * s.draft_intermediate
    params = s.draft_layers * layer + s.draft_features * h * h
    flops = (2 * q * params + 2 * (q - 1) * s.vocab * h
             + 4 * s.draft_layers * s.heads * s.head_dim * q * (ctx + q))
    kv = (s.draft_layers * 2 * s.kv_heads * s.head_dim * (ctx + q) * b
          + q * s.draft_layers * (6 * h + 3 * s.draft_intermediate) * b + (q - 1) * s.vocab * 4)
    return Terms(weights=(params + s.vocab * h) * b, kv=kv, flops=flops,
                 launches=_kernels(cal, "draft", s.draft_layers))


@dataclass
class RoundCost:
    method: str
    budget: int | None
    stages: dict[str, float]     # seconds per stage
    parts: dict[str, float]      # seconds per PARTS entry

    @property
    def seconds(self) -> float:
        return sum(self.stages.values())

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get)


def round_cost(shape: ModelShape, machine: Machine, method: str, budget: int | None = None, ctx: int = 512,
               cal: Calibration | None = None, union: Mapping[int, float] | None = None) -> RoundCost:
    """First-principles cost of one round (AR: one step). budget: DDTree nodes beyond the root."""
    cal = cal or load_calibration()
    if method == "ar":
        terms = {"verify": verify_terms(shape, 1, ctx, cal, "ar", union)}
    else:
        nodes = shape.block_size - 1 if method == "dflash" else int(budget or 0)
        if nodes < 1:
            raise AdvisorError(f"a {method} round needs a budget ≥ 1, got {budget!r}")
        terms = {"draft": draft_terms(shape, ctx, cal),
                 "tree_build": Terms(launches=_kernels(cal, "tree_build", 0),
                                     fixed_seconds=cal.tree_node_seconds * nodes),
                 "verify": verify_terms(shape, nodes + 1, ctx, cal, "verify", union),
                 "commit": Terms(launches=_kernels(cal, "commit", 0),
                                 fixed_seconds=cal.commit_node_seconds * (nodes + 1))}
    split = {k: t.seconds(machine, cal) for k, t in terms.items()}
    parts = {p: sum(v[p] for v in split.values()) for p in PARTS}
    return RoundCost(method, budget if method == "ddtree" else None, {k: sum(v.values()) for k, v in split.items()},
                     parts)


# ----------------------------------------------------------------------------- bench JSON
def read_bench(path: str | Path) -> dict:
    try:
        b = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise AdvisorError(f"{path}: not a readable JSON file ({e.__class__.__name__})") from None
    if b.get("kind") != "e2e" or not isinstance(b.get("rows"), list):
        raise AdvisorError(f"{path}: not a 'bench e2e' JSON (field 'kind' is {b.get('kind')!r})")
    return b


def bench_points(bench: dict) -> dict[int, dict[str, float]]:
    """{budget: stage seconds per round} of a bench JSON's DDTree rows."""
    return {int(r["budget"]): dict(r["stage_seconds_per_round"]) for r in bench["rows"]
            if r.get("method") == "ddtree" and r.get("budget")}


def _matches(bench: dict, settings: Mapping) -> list[str]:
    return [f"{k}={bench.get(k)!r} (calibrated: {v!r})" for k, v in settings.items() if bench.get(k) != v]


def check_bench(paths: Sequence[str | Path], cal: Calibration | None = None,
                lo: int = CHECK_BUDGETS[0], hi: int = CHECK_BUDGETS[1]) -> dict:
    """Predicted vs measured round times of bench e2e JSONs (machine from each file's device): which
    shapes were checked, each row's error, and whether every budget in [lo, hi] is within 15 %."""
    cal = cal or load_calibration()
    checked, skipped = [], []
    for path in paths:
        b = read_bench(path)
        device = (b.get("environment") or {}).get("device")
        mname = _device_machine(device)
        why = _matches(b, cal.settings)
        if mname is None:
            why.append(f"device {device!r} matches no machine profile")
        try:
            shape = model_shape(b.get("model") or "")
        except (AdvisorError, ValueError) as e:
            shape, why = None, why + [str(e)]
        if why:
            skipped.append({"file": Path(path).name, "model": b.get("model"), "reason": "; ".join(why)})
            continue
        m, ctx = get_machine(mname), int(b.get("prompt_len") or 512)
        rows = []
        for r in b["rows"]:
            pred = round_cost(shape, m, r["method"], r.get("budget"), ctx, cal)
            meas = float(r["round_seconds"])
            rows.append({"method": r["method"], "budget": r.get("budget"), "measured_seconds": meas,
                         "predicted_seconds": pred.seconds, "error": pred.seconds / meas - 1,
                         "dominant": pred.dominant,
                         "in_range": r["method"] == "ddtree" and lo <= int(r.get("budget") or 0) <= hi})
        ok = all(abs(x["error"]) <= CHECK_TOLERANCE for x in rows if x["in_range"])
        checked.append({"file": Path(path).name, "model": b.get("model"), "machine": mname, "device": device,
                        "prompt_len": ctx, "rows": rows, "within_tolerance": ok,
                        "max_error": max((abs(x["error"]) for x in rows if x["in_range"]), default=None)})
    return {"tolerance": CHECK_TOLERANCE, "budgets": [lo, hi], "checked": checked, "skipped": skipped,
            "passed": bool(checked) and all(c["within_tolerance"] for c in checked)}


def repo_bench_dir() -> Path:
    """docs/bench of a source checkout (absent in an installed package)."""
    return Path(__file__).resolve().parents[2] / "docs" / "bench"


# ----------------------------------------------------------------------------- calibration
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
    """Fit the efficiency factors once: eta_bw, eta_flops and the launch time by least squares on the
    log of every draft and verify stage time; per-node tree build and commit times by least squares on
    those stages. Returns the `calibration.fit` dict of machines.json."""
    import numpy as np
    from scipy.optimize import least_squares

    benches = [read_bench(p) for p in e2e_paths]
    shapes = [model_shape(b["model"]) for b in benches]
    profiles = [json.loads(Path(p).read_text()) for p in profile_paths]
    pshapes = [model_shape(p["model"]) for p in profiles]
    kernels = _profile_kernels(profiles, [s.layers for s in pshapes], [s.draft_layers for s in pshapes])
    m = get_machine(machine)
    copy = [b["roofline"]["copy_bytes_per_second"] for b in benches if (b.get("roofline") or {}).get("copy_bytes_per_second")]
    base = Calibration(1.0, 1.0, 0.0, 0.0, 0.0, sum(copy) / len(copy) / m.bandwidth, kernels)

    obs = []  # (terms, measured seconds)
    for b, s in zip(benches, shapes):
        ctx = int(b.get("prompt_len") or 512)
        for r in b["rows"]:
            st = r["stage_seconds_per_round"]
            if r["method"] == "ar":
                obs.append((verify_terms(s, 1, ctx, base, "ar"), st["verify"]))
                continue
            nodes = s.block_size - 1 if r["method"] == "dflash" else int(r["budget"])
            obs.append((verify_terms(s, nodes + 1, ctx, base), st["verify"]))
            obs.append((draft_terms(s, ctx, base), st["draft"]))

    def resid(x):
        cal = Calibration(x[0], x[1], x[2], 0, 0, base.copy_over_spec, kernels)
        return [math.log(sum(t.seconds(m, cal).values()) / y) for t, y in obs]

    fit = least_squares(resid, x0=[0.8, 0.6, 2e-6], bounds=([0.05, 0.05, 0.0], [1.0, 1.0, 1e-4]))
    eta_bw, eta_flops, launch = (float(v) for v in fit.x)
    per_node = {}
    for stage, extra in (("tree_build", 0), ("commit", 1)):
        xs, ys = [], []
        for b, s in zip(benches, shapes):
            for r in b["rows"]:
                if r["method"] == "ar":
                    continue
                nodes = s.block_size - 1 if r["method"] == "dflash" else int(r["budget"])
                xs.append(nodes + extra)
                ys.append(r["stage_seconds_per_round"][stage] - kernels[stage][1] * launch)
        per_node[stage] = max(0.0, float(np.dot(xs, ys) / np.dot(xs, xs)))
    return {"eta_bw": eta_bw, "eta_flops": eta_flops, "launch_seconds": launch,
            "tree_node_seconds": per_node["tree_build"], "commit_node_seconds": per_node["commit"],
            "copy_over_spec": base.copy_over_spec, "kernels": kernels, "p": base.p}


# ----------------------------------------------------------------------------- fitted from measurements
@dataclass
class FittedCost:
    """Per-stage a + b·B + c·B² fitted to measured stage times of one machine; `loo` holds each
    budget's leave-one-out relative error of the round time."""
    coeffs: dict[str, list[float]]
    budgets: list[int]
    loo: dict[int, float]
    source: str = ""

    def stages(self, budget: float) -> dict[str, float]:
        return {k: max(0.0, c[0] + c[1] * budget + c[2] * budget * budget) for k, c in self.coeffs.items()}

    def seconds(self, budget: float) -> float:
        return sum(self.stages(budget).values())

    @property
    def max_loo(self) -> float:
        return max(abs(v) for v in self.loo.values())


def _quadfit(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    import numpy as np
    a = np.vander(np.asarray(xs, float), 3, increasing=True)
    return [float(v) for v in np.linalg.lstsq(a, np.asarray(ys, float), rcond=None)[0]]


def fit_stage_times(points: Mapping[int, Mapping[str, float]], source: str = "") -> FittedCost:
    """points: {budget: {stage: seconds per round}}; refused below MIN_FIT_POINTS budgets."""
    budgets = sorted(int(b) for b in points)
    if len(budgets) < MIN_FIT_POINTS:
        raise AdvisorError(f"{source or 'fit'}: a stage-time fit needs at least {MIN_FIT_POINTS} budgets "
                           f"(a quadratic and one left out); got {len(budgets)}: {budgets}")
    stages = sorted({k for p in points.values() for k in p if k in FIT_STAGES}) or ["verify"]

    def fit(bs):
        return {k: _quadfit(bs, [float(points[b].get(k, 0.0)) for b in bs]) for k in stages}

    full = FittedCost(fit(budgets), budgets, {}, source)
    for b in budgets:
        part = FittedCost(fit([x for x in budgets if x != b]), [], {})
        meas = sum(float(points[b].get(k, 0.0)) for k in stages)
        full.loo[b] = part.seconds(b) / meas - 1
    return full


def fit_bench(path: str | Path) -> FittedCost:
    return fit_stage_times(bench_points(read_bench(path)), str(path))


# ----------------------------------------------------------------------------- budget="auto"
def expected_tau_from_scores(node_probs: Sequence[float], budgets: Sequence[int], calibration: float = 1.0) -> dict[int, float]:
    """E[τ(B)] of the trees of each candidate budget from the draft's own confidence.

    node_probs: every candidate node's path probability (the product of the draft's probabilities
    along its path), in the order DDTree adds nodes (best first). A tree accepts the node on the
    target's path at each depth it covers, so E[accepted nodes] = Σ over its nodes of P(that node's path
    is the target's) and E[τ(B)] = 1 + calibration · (sum of the first B path probabilities); the 1 is
    the target's bonus token. calibration < 1 corrects an over-confident drafter (fit it on traces)."""
    out, acc, n = {}, 0.0, 0
    for b in sorted(budgets):
        while n < min(b, len(node_probs)):
            acc += float(node_probs[n])
            n += 1
        out[b] = 1.0 + calibration * acc
    return out


def union_curve(trace_rows: Sequence[Mapping]) -> dict[int, float]:
    """The measured expert-union curve {verify tokens: mean distinct experts per MoE layer} from trace
    rows carrying `experts_touched` (one count per MoE layer for that round's verify forward) and, for
    the tokens verified, `verify_tokens` or else the tree's node count (an AR row: 1). Empty for dense."""
    sums: dict[int, list[float]] = {}
    for r in trace_rows:
        per_layer = r.get("experts_touched")
        if not per_layer:
            continue
        t = int(r.get("verify_tokens") or len(((r.get("tree") or {}).get("tokens")) or [0]))
        acc = sums.setdefault(t, [0.0, 0])
        acc[0] += sum(per_layer) / len(per_layer)
        acc[1] += 1
    return {t: v / n for t, (v, n) in sorted(sums.items())}


def tau_calibration(trace_rows: Sequence[Mapping]) -> float | None:
    """How far the draft's confidence predicts acceptance: measured Σ(τ − 1) over the rounds divided by
    Σ of each round's tree path probabilities (exp of its node scores); the `calibration` of
    expected_tau_from_scores. None without scored trees."""
    got = pred = 0.0
    for r in trace_rows:
        scores = (r.get("tree") or {}).get("scores")
        if not scores or r.get("acceptance_length") is None:
            continue
        got += r["acceptance_length"] - 1
        pred += sum(math.exp(x) for x in scores)
    return got / pred if pred else None


def choose_budget(costs: Mapping[int, float], expected_tau: Mapping[int, float]) -> int:
    """The captured budget with the highest E[τ(B)] / cost(B); ties go to the smaller budget."""
    common = sorted(set(costs) & set(expected_tau))
    if not common:
        raise AdvisorError("choose_budget: no budget has both a cost and an expected τ")
    return max(common, key=lambda b: (expected_tau[b] / costs[b], -b))


def replay_auto(trace_rows: Sequence[Mapping], costs: Mapping[int, float], calibration: float = 1.0) -> dict | None:
    """`choose_budget` replayed on the traced rounds of the largest budget: each round picks its budget
    from its own node scores, and its τ at a smaller budget B is 1 + the accepted nodes with index ≤ B
    (the tree of B is the first B nodes, a parent before its children; exact per round at T = 0).
    Rounds are taken as independent (a shorter acceptance would change later contexts), so this is an
    estimate of `auto` against the fixed budgets on the same rounds. None without scored trees."""
    budgets = sorted(costs)
    got = {b: 0.0 for b in budgets}
    auto_tau = auto_cost = 0.0
    picks = {b: 0 for b in budgets}
    n = 0
    for r in trace_rows:
        tree, acc = r.get("tree") or {}, r.get("accepted")
        if not tree.get("scores") or acc is None:
            continue
        path = [int(i) for i in acc[1:]]  # node indices (1-based; 0 is the root)

        def tau_at(b):
            k = 0
            while k < len(path) and path[k] <= b:
                k += 1
            return 1 + k

        for b in budgets:
            got[b] += tau_at(b)
        exp_tau = expected_tau_from_scores([math.exp(x) for x in tree["scores"]], budgets, calibration)
        pick = choose_budget(costs, exp_tau)
        picks[pick] += 1
        auto_tau += tau_at(pick)
        auto_cost += costs[pick]
        n += 1
    if not n:
        return None
    fixed = {b: got[b] / (n * costs[b]) for b in budgets}
    best = max(fixed, key=lambda b: (fixed[b], -b))
    auto = auto_tau / auto_cost
    return {"rounds": n, "tokens_per_second": auto, "fixed_tokens_per_second": fixed, "best_fixed": best,
            "vs_best_fixed": auto / fixed[best], "budget_share": {b: c / n for b, c in picks.items() if c}}


def dump(obj) -> dict:
    return asdict(obj)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
