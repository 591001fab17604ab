"""Per-stage a + b·B + c·B² fits to measured stage times, with leave-one-out error; bench e2e JSON reading."""
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
    if b.get("kind") != "e2e" or not isinstance(b.get("rows"), list):
        raise AdvisorError(f"{path}: not a 'bench e2e' JSON (field 'kind' is {b.get('kind')!r})")
    return b


def bench_points(bench: dict) -> dict[int, dict[str, float]]:
    """{budget: stage seconds per round} of a bench JSON's DDTree rows."""
    return {int(r["budget"]): dict(r["stage_seconds_per_round"]) for r in bench["rows"]
            if r.get("method") == "ddtree" and r.get("budget")}



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
