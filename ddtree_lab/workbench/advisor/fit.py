"""Per-stage fits to measured stage times (quadratic or piecewise-linear in the budget), with leave-one-out
error; bench e2e JSON reading."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .machines import AdvisorError

FIT_STAGES = ("draft", "tree_build", "verify", "commit")
MIN_FIT_POINTS = 4  # a quadratic has three coefficients; leave-one-out needs one more


def read_bench(path: str | Path) -> dict:
    try:
        b = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise AdvisorError(f"{path}: not a readable JSON file ({e.__class__.__name__})") from None
    if not isinstance(b, dict) or b.get("kind") != "e2e" or not isinstance(b.get("rows"), list):
        kind = b.get("kind") if isinstance(b, dict) else None
        raise AdvisorError(f"{path}: not a 'bench e2e' JSON (field 'kind' is {kind!r})")
    return b


def bench_points(bench: dict) -> dict[int, dict[str, float]]:
    """{budget: stage seconds per round} of a bench JSON's DDTree rows at a fixed budget (not "auto")."""
    return {r["budget"]: dict(r["stage_seconds_per_round"]) for r in bench["rows"]
            if r.get("method") == "ddtree" and isinstance(r.get("budget"), int) and r["budget"]}



FIT_KINDS = ("quadratic", "linear")  # a + b·B + c·B² per stage, or piecewise-linear through the points


@dataclass
class FittedCost:
    """Per-stage fits to measured stage times of one machine: `quadratic` (coeffs {stage: [a, b, c]})
    or piecewise-`linear` (coeffs {stage: [[B, seconds], ...]}, extended along the end segments);
    `loo` holds each budget's leave-one-out relative error of the round time (an end budget left out
    is an extrapolation)."""
    kind: str
    coeffs: dict[str, list]
    budgets: list[int]
    loo: dict[int, float]
    source: str = ""

    def stages(self, budget: float) -> dict[str, float]:
        if self.kind == "quadratic":
            return {k: max(0.0, c[0] + c[1] * budget + c[2] * budget * budget) for k, c in self.coeffs.items()}
        return {k: max(0.0, _piecewise(pts, budget)) for k, pts in self.coeffs.items()}

    def seconds(self, budget: float) -> float:
        return sum(self.stages(budget).values())

    @property
    def max_loo(self) -> float:
        return max(abs(v) for v in self.loo.values())


def _quadfit(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    import numpy as np
    a = np.vander(np.asarray(xs, float), 3, increasing=True)
    return [float(v) for v in np.linalg.lstsq(a, np.asarray(ys, float), rcond=None)[0]]


def _piecewise(pts: Sequence[Sequence[float]], x: float) -> float:
    """Linear through the points, the end segments extended (a degree-1 spline extrapolates its end pieces)."""
    from scipy.interpolate import make_interp_spline

    xs, ys = zip(*pts)
    return float(make_interp_spline(xs, ys, k=1)(x))


def fit_stage_times(points: Mapping[int, Mapping[str, float]], source: str = "", kind: str = "best") -> FittedCost:
    """points: {budget: {stage: seconds per round}}; kind: quadratic, linear or best (the one with the
    smaller largest leave-one-out error). Refused below MIN_FIT_POINTS budgets."""
    budgets = sorted(int(b) for b in points)
    if len(budgets) < MIN_FIT_POINTS:
        raise AdvisorError(f"{source or 'fit'}: a stage-time fit needs at least {MIN_FIT_POINTS} budgets "
                           f"(a quadratic and one left out); got {len(budgets)}: {budgets}")
    if kind == "best":
        fits = [fit_stage_times(points, source, k) for k in FIT_KINDS]
        return min(fits, key=lambda f: f.max_loo)
    if kind not in FIT_KINDS:
        raise AdvisorError(f"fit kind {kind!r}; known: {', '.join(FIT_KINDS)}, best")
    stages = sorted({k for p in points.values() for k in p if k in FIT_STAGES}) or ["verify"]

    def fit(bs):
        ys = {k: [float(points[b].get(k, 0.0)) for b in bs] for k in stages}
        if kind == "quadratic":
            return {k: _quadfit(bs, ys[k]) for k in stages}
        return {k: [[float(b), y] for b, y in zip(bs, ys[k])] for k in stages}

    full = FittedCost(kind, fit(budgets), budgets, {}, source)
    for b in budgets:
        part = FittedCost(kind, fit([x for x in budgets if x != b]), [], {})
        meas = sum(float(points[b].get(k, 0.0)) for k in stages)
        full.loo[b] = part.seconds(b) / meas - 1
    return full


def fit_bench(path: str | Path, kind: str = "best") -> FittedCost:
    return fit_stage_times(bench_points(read_bench(path)), str(path), kind)
