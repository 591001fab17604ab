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
