"""`auto` in a study's grid.budget: a tiny study run end to end with papermill (the auto run's results,
its trees, the sweep and the report), then the recommendation and the figures on hand-made rows."""
import json

import pytest
import yaml

import ddtree_lab as dl
from ddtree_lab.workbench import figures, runner, viz
from ddtree_lab.workbench import results as R


@pytest.fixture(scope="module")
def auto_study(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("auto_study")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    t, d = tiny_dirs
    spec = {
        "name": "tinyauto",
        "models": {"target": str(t), "drafter": str(d), "device": "cpu"},
        "prompts": {"set": "prompts.jsonl", "n_prompts": 1},
        "methods": ["ar", "ddtree"],
        "grid": {"budget": [2, 8, "auto"], "max_new_tokens": 8, "repeats": 1},
        "notebooks": {"per_run": ["accepted_paths", "draft_trees"], "per_study": ["budget_sweep"], "timeout": 600},
        "warmup": False,
    }
    (root / "tinyauto.yaml").write_text(yaml.safe_dump(spec))
    log = []
    summary = runner.main_study(root / "tinyauto.yaml", root / "out", progress=False, log=log.append)
    return root / "out", summary, log


def test_auto_run_records_its_choice(auto_study):
    out, summary, log = auto_study
    status = {o.name: o.status for o in summary.outcomes}
    assert status == {"ar-t0": "complete", "ddtree-b2-k0-t0": "complete", "ddtree-b8-k0-t0": "complete",
                      "ddtree-auto-k0-t0": "complete", "budget_sweep": "complete"}, log
    res = json.loads((out / "ddtree-auto-k0-t0" / "results.json").read_text())
    assert res["config"]["budget"] == "auto" and res["comparison"]["verdict"] == "lossless"
    auto = res["summary"]["auto"]
    assert auto["candidates"] == [2, 8] and set(auto["budget_share"]) == {"2", "8"}
    assert sum(auto["budget_share"].values()) == pytest.approx(1.0)
    chosen = res["prompts"][0]["round_budgets"]
    assert len(chosen) == res["prompts"][0]["rounds"] and set(chosen) <= {2, 8}
    assert sum(auto["rounds_per_budget"].values()) == len(chosen)
    rows = R.load_traces(out / "ddtree-auto-k0-t0")
    assert [r["budget"] for r in rows] == chosen
    # the fixed runs are untouched by the auto run beside them
    fixed = json.loads((out / "ddtree-b8-k0-t0" / "results.json").read_text())
    assert "auto" not in fixed["summary"] and "round_budgets" not in fixed["prompts"][0]


def test_advice_bounds_what_any_choice_could_gain_on_the_studys_rounds(auto_study):
    """advise: per machine, auto's rule replayed on the largest budget's traces and the ceiling of any choice on
    them; hindsight is at least either binned choice, which is at least the best fixed budget."""
    from ddtree_lab.workbench.advisor.study import advice_table, advise

    out, _, _ = auto_study
    adv = advise(out, machines=["h200", "rtx-pro-6000"], model="random:qwen3-8b", n_boot=20)
    for m in adv["machines"].values():
        ceiling, replay = m["auto_ceiling"], m["auto_replay"]
        assert ceiling["rounds"] == replay["rounds"] > 0 and ceiling["best_fixed"] == replay["best_fixed"]
        assert ceiling["per_round"] >= max(ceiling["per_bin"], ceiling["same_round"]) >= 1.0
        assert replay["vs_best_fixed"] <= ceiling["per_round"] + 1e-12  # no rule beats hindsight
        assert set(ceiling["per_bin_choice"].values()) <= {2, 8}
    assert advice_table(adv).count("each round's best in hindsight") == 2


def test_sweep_and_report_show_auto_apart_from_the_budgets(auto_study):
    out, summary, _ = auto_study
    sweep = json.loads((out / "budget_sweep" / "sweep.json").read_text())
    assert [r["run"] for r in sweep["runs"]] == ["ar-t0", "ddtree-b2-k0-t0", "ddtree-b8-k0-t0", "ddtree-auto-k0-t0"]
    assert sweep["recommended"]["budget"] in (2, 8) and sweep["recommended"]["auto"]["run"] == "ddtree-auto-k0-t0"
    assert sweep["runs"][-1]["budget_share"]
    rec = R.recommend(R.collect_study(out))[0]
    assert "Budget auto (ddtree-auto-k0-t0, choosing among 2, 8)" in R.recommendation_text(rec)
    page = summary.report.read_text()
    assert summary.report == out / "report.html" and "ddtree-auto-k0-t0" in page and "dash-dot line" in page
    # the auto run's own trees, after the integer budgets, in its per-run tree explorer
    nb = (out / "ddtree-auto-k0-t0" / "draft_trees.ipynb").read_text()
    assert "'auto': " in nb and '"output_type": "error"' not in nb


def _row(name, budget, tps, spread, share=None):
    sm = {"tokens_per_second": tps, "tokens_per_second_spread": spread, "timing_repeats": 3, "mean_tau": 2.0,
          "rounds": 10, "new_tokens": 20, "stage_seconds": {"verify": 0.1}}
    if share:
        sm["auto"] = {"candidates": [16, 32], "budget_share": share}
    method = "ar" if budget is None else "ddtree"
    res = {"config": {"method": method, "budget": budget or 0, "topk": 0, "temperature": 0.0}, "summary": sm}
    return {"name": name, "kind": "run", "status": "complete", "results": res}


def _rows(auto_tps, auto_spread):
    rows = [_row("ar-t0", None, 100, [99, 101]), _row("ddtree-b16-k0-t0", 16, 130, [128, 132]),
            _row("ddtree-b32-k0-t0", 32, 120, [118, 122]),
            _row("ddtree-auto-k0-t0", "auto", auto_tps, auto_spread, {"16": 0.75, "32": 0.25})]
    for r in rows:
        r["comparison"] = {**R.compare(r["results"], rows[0]["results"]), "verdict": "lossless"}
    return rows


@pytest.mark.parametrize("tps, spread, words", [
    (143, [141, 145], "1.10× the tokens/s of budget 16: auto won."),
    (117, [115, 119], "0.90× the tokens/s of budget 16: the fixed budget 16 won."),
    (131, [129, 133], "auto won, within noise"),
])
def test_recommendation_sets_auto_against_the_best_fixed_budget(tps, spread, words):
    rows = _rows(tps, spread)
    rec = R.recommend(rows)[0]
    assert rec["budget"] == 16 and rec["run"] == "ddtree-b16-k0-t0"  # auto is never the best fixed budget
    assert rec["auto"]["vs_best_fixed"] == pytest.approx(tps / 130)
    assert words in R.recommendation_text(rec)
    assert R.recommend_budget(rows)["budget"] == 16


def test_numeric_figures_keep_integer_budgets_and_draw_auto_as_a_line():
    rows = _rows(143, [141, 145])
    assert [r["name"] for r in figures.grid_rows(rows)][-1] == "ddtree-auto-k0-t0"
    for metric in ("mean_tau", "speedup", "tokens_per_second"):
        fig = figures.sweep_figure(rows, metric)
        xs = [x for t in fig.data if t.name and t.name.startswith("DDTree") for x in t.x]
        assert xs == [16, 32]
        labels = [a.text for a in fig.layout.annotations]
        assert any(t.startswith("ddtree-auto-k0-t0: ") for t in labels), labels
    assert list(figures.verify_cost_figure(rows, None).data[0].x) == [16, 32]
    # an auto-only study: no star on the budget axis, the recommendation is the auto run
    only = [rows[0], rows[3]]
    assert R.recommend(only)[0]["budget"] == "auto" and R.recommend(only)[0]["auto"] is None
    figures.sweep_figure(only, "speedup")


def test_tree_explorer_lists_auto_after_the_budgets(tiny_pair):
    res = dl.generate(tiny_pair, "def add(a, b):\n", method="ddtree", budget=dl.AutoBudget(budgets=(2, 8)),
                      max_new_tokens=4, trace=True)
    rows = R.trace_rows({"id": "p0"}, res)
    ex = viz.TreeExplorer.from_traces({"auto": rows, 8: rows, 2: rows})
    assert ex.budgets == [2, 8, "auto"]
    ex.select(budget="auto")
    assert ex.budget == "auto"
