"""One bootstrap and one band (ddtree_lab.stats) behind the advisor's and the benches' 90 % bands: each band
is numpy's quantile of the statistic over the same resamples."""
from __future__ import annotations

import numpy as np
import pytest

from ddtree_lab import stats
from ddtree_lab.workbench.advisor.study import best_budget


def test_the_band_is_numpys_quantile():
    draws = np.random.default_rng(1).gamma(2.0, size=37)
    assert stats.band(draws) == pytest.approx(np.quantile(draws, [0.05, 0.95]).tolist(), rel=0, abs=0)
    idx = stats.resamples(5, 40, seed=2)
    assert idx.shape == (40, 5) and idx.min() >= 0 and idx.max() <= 4
    assert (stats.bootstrap(lambda i: float(i.sum()), 5, 40, seed=2) == idx.sum(1)).all()


def test_the_advisors_band_is_numpys_quantile_of_its_resamples():
    taus = {4: {"a": (10, 5), "b": (12, 5), "c": (9, 5), "d": (20, 6)},
            16: {"a": (5, 5), "b": (25, 5), "c": (14, 4), "d": (30, 6)}}
    costs = {4: 1.0, 16: 1.3}
    out = best_budget(taus, costs, n_boot=301, seed=7)
    idx = stats.resamples(4, 301, seed=7)
    for b, per_prompt in taus.items():
        acc, rounds = (np.array([per_prompt[i][k] for i in sorted(per_prompt)]) for k in (0, 1))
        draws = acc[idx].sum(1) / rounds[idx].sum(1) / costs[b]
        assert out["band"][b] == pytest.approx(np.quantile(draws, [0.05, 0.95]).tolist())


def test_the_bench_band_is_numpys_quantile_of_its_resamples():
    from ddtree_lab.bench.e2e import prompts_band

    def row(secs):
        return {"tokens_per_prompt": [10] * len(secs), "seconds_per_prompt_per_repeat": [secs, secs]}

    auto, fixed = row([1.0, 0.9, 1.2, 1.1, 0.7]), row([0.6, 1.4, 1.0, 1.0, 1.0])
    got = prompts_band(auto, [fixed], n_boot=500, seed=3)
    idx = stats.resamples(5, 500, seed=3)
    ratios = [sum(fixed["seconds_per_prompt_per_repeat"][0][i] for i in s)
              / sum(auto["seconds_per_prompt_per_repeat"][0][i] for i in s) for s in idx]
    assert [got["low"], got["high"]] == pytest.approx(np.quantile(ratios, [0.05, 0.95]).tolist())
    assert got["at_least_best"] == pytest.approx(np.mean(np.array(ratios) >= 1.0))
