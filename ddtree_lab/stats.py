"""The bootstrap over prompts and its band: one resampling and one quantile rule (numpy's default, linear
interpolation between order statistics) for every band the advisor and the benches report. No torch."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

BAND = (0.05, 0.95)  # the 90 % band


def resamples(n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """n_boot resamples of n items with replacement: an (n_boot, n) array of indices."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def band(draws: Sequence[float], levels: Sequence[float] = BAND) -> list[float]:
    """The interval of a bootstrap's draws at `levels` (numpy's quantiles)."""
    return [float(q) for q in np.quantile(np.asarray(draws, dtype=float), levels)]


def bootstrap(statistic: Callable[[np.ndarray], float], n: int, n_boot: int, seed: int = 0) -> np.ndarray:
    """statistic(indices) over n_boot resamples of n items."""
    return np.array([statistic(idx) for idx in resamples(n, n_boot, seed)], dtype=float)
