"""tools/auto_replay.py: the engine's auto rule replayed over one traced text (lab pair, CPU, float32)."""
import ddtree_lab as dl


def test_replay_learns_the_cheap_budget_and_counts_the_traced_tau(load_tool):
    tool = load_tool("auto_replay")
    pair = dl.load_pair("lab")
    prompts = ["def add(a, b):", "The quick brown fox"]
    calls = tool.traced_rounds(pair, prompts, 32, 24)
    assert calls and all(calls)
    # at the largest candidate τ is the trace's own acceptance; a smaller tree never accepts more
    for rounds in calls:
        for accepted, _ in rounds:
            assert tool.tau_at(accepted, 32) == len(accepted)
            assert 1 <= tool.tau_at(accepted, 4) <= tool.tau_at(accepted, 32)
    # 4 nodes cost a hundredth of 32: once learned, the rule runs 4 and gets its tokens/s
    auto = dl.AutoBudget(budgets=(4, 32), costs=(0.01, 1.0))
    passes = tool.replay(calls, auto, pair.drafter.cfg.block_size - 1, lag=1, passes=3)
    rounds = sum(len(c) for c in calls)
    assert sum(passes[-1]["rounds"].values()) == rounds
    assert passes[-1]["rounds"].get(4, 0) >= rounds - 2  # the first rounds of a call may run the prior's pick
    fixed4 = sum(tool.tau_at(acc, 4) for c in calls for acc, _ in c) / (rounds * 0.01)
    assert passes[-1]["tokens_per_second"] >= 0.9 * fixed4
    # a single candidate: the replay is that fixed budget
    one = tool.replay(calls, dl.AutoBudget(budgets=(32,), costs=(1.0,)), pair.drafter.cfg.block_size - 1, 1, 1)
    assert abs(one[0]["tokens_per_second"] - sum(len(a) for c in calls for a, _ in c) / rounds) < 1e-9
