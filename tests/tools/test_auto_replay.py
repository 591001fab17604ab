"""tools/auto_replay.py: the engine's auto rule replayed over one traced text (lab pair, CPU, float32)."""
import json


def test_replay_tool_traces_every_round_and_reports_each_pass(tmp_path, load_tool, monkeypatch):
    tool = load_tool("auto_replay")
    import ddtree_lab as dl

    pair = dl.load_pair("lab")
    rows = tool.traced_rows(pair, ["def add(a, b):", "The quick brown fox"], 32, 24)
    assert {r["prompt_id"] for r in rows} == {"p0", "p1"} and [r["index"] for r in rows].count(0) == 2
    assert all(r["tree"]["scores"] and r["budget"] == 32 for r in rows)
    costs = tmp_path / "prompts.json"
    costs.write_text(json.dumps({"rows": [{"method": "ddtree", "budget": b, "seconds": s, "tokens": 40,
                                           "mean_tau": 4.0} for b, s in ((4, 0.1), (32, 10.0))]}))
    out = tmp_path / "replay.json"
    monkeypatch.setattr("sys.argv", ["auto_replay.py", "--n-prompts", "2", "--max-new-tokens", "24", "--costs-from",
                                     str(costs), "--passes", "2", "--out", str(out)])
    tool.main()
    rep = json.loads(out.read_text())
    # 4 nodes cost a hundredth of 32 per round: the best fixed budget, and what the rule runs once learned
    assert rep["best_fixed"] == 4 and len(rep["passes_vs_best_fixed"]) == 2
    assert rep["budget_share"].get("4", 0) > 0.8 and rep["vs_best_fixed"] > 0.9
    ceiling = rep["ceiling"]  # any choice's bound on the same rounds: hindsight ≥ either binned choice ≥ fixed
    assert ceiling["best_fixed"] == 4 and ceiling["rounds"] == rep["rounds"]
    assert ceiling["per_round"] >= max(ceiling["per_bin"], ceiling["same_round"]) >= 1.0


def test_replay_tool_runs_a_grid_of_settings_on_one_trace(tmp_path, load_tool, monkeypatch, capsys):
    import pytest

    tool = load_tool("auto_replay")
    costs = tmp_path / "prompts.json"
    costs.write_text(json.dumps({"rows": [{"method": "ddtree", "budget": b, "seconds": s, "tokens": 40,
                                           "mean_tau": 4.0} for b, s in ((4, 0.1), (32, 10.0))]}))
    out = tmp_path / "grid.json"
    monkeypatch.setattr("sys.argv", ["auto_replay.py", "--n-prompts", "1", "--max-new-tokens", "16", "--costs-from",
                                     str(costs), "--passes", "1", "--explore", "1.0", "0.0", "--memory", "1", "4096",
                                     "--out", str(out)])
    tool.main()
    runs = json.loads(out.read_text())["runs"]
    assert [r["settings"] for r in runs] == [{"explore": 1.0, "memory": 1}, {"explore": 1.0, "memory": 4096},
                                              {"explore": 0.0, "memory": 1}, {"explore": 0.0, "memory": 4096}]
    assert len({r["rounds"] for r in runs}) == 1  # one trace for all four
    # a bad value is refused by name before any decoding
    monkeypatch.setattr("sys.argv", ["auto_replay.py", "--costs-from", str(costs), "--memory", "0"])
    with pytest.raises(SystemExit):
        tool.main()
    assert "memory" in capsys.readouterr().err


def test_a_costs_file_that_is_not_a_bench_prompts_json_is_refused_in_one_line(tmp_path, load_tool, monkeypatch,
                                                                              capsys):
    import pytest

    tool = load_tool("auto_replay")
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"method": "ar", "budget": None}]}))
    (tmp_path / "broken.json").write_text("{")
    for name, says in (("missing.json", "No such file"), ("broken.json", "not a `ddtree-lab bench prompts` JSON"),
                       ("other.json", "no fixed DDTree budget")):
        monkeypatch.setattr("sys.argv", ["auto_replay.py", "--costs-from", str(tmp_path / name)])
        with pytest.raises(SystemExit):
            tool.main()
        err = capsys.readouterr().err
        assert says in err and name in err and "Traceback" not in err
