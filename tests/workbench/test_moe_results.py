"""An MoE target's runs record the experts each verify forward touched, and the bytes such a forward reads."""
import dataclasses
import json

import pytest
import yaml

import ddtree_lab as dl
from ddtree_lab.bench.e2e import weight_bytes_per_step
from ddtree_lab.testing import make_tiny_pair
from ddtree_lab.workbench import results as R
from ddtree_lab.workbench.runs import RunParams


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_run_records_experts_touched_and_bytes(tmp_path, arch):
    t, d = make_tiny_pair(tmp_path / "moe", arch=arch, seed=2)
    pair = dl.load_pair(target=t, drafter=d)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "def add(a, b):"}\n')
    base = RunParams(study_name="moe", run_dir=str(tmp_path / "r"), target_dir=str(t), drafter_dir=str(d),
                     pair="", prompt_set=str(tmp_path / "p.jsonl"), n_prompts=1, max_new_tokens=12, warmup=False)
    ar, _ = R.generate_run(dataclasses.replace(base, method="ar", budget=0), pair, progress=False)
    tree, rows = R.generate_run(dataclasses.replace(base, method="ddtree", budget=24), pair, progress=False)
    k, E = pair.target.cfg.num_experts_per_tok, pair.target.cfg.num_experts
    assert ar["summary"]["experts_touched_per_layer"] == [float(k)] * len(ar["summary"]["experts_touched_per_layer"])
    s = tree["summary"]
    assert k < s["experts_touched_mean"] <= E  # a tree reads the union of its tokens' experts
    assert s["verify_weight_bytes"] == weight_bytes_per_step(pair.target, s["experts_touched_per_layer"])
    assert s["verify_weight_bytes"] > ar["summary"]["verify_weight_bytes"]
    assert all(r["experts_touched"] for r in rows if r.get("tree"))
    # each traced round keeps the kernel's row blocks per height, at least the experts it touched
    for r in rows:
        for h, per_layer in r["expert_row_blocks"].items():
            assert all(b >= u for b, u in zip(per_layer, r["experts_touched"])), h
    # the busiest expert gets at least its share of the pairs and at most every token of the forward
    assert ar["summary"]["expert_tokens_max_mean"] == 1.0
    assert k * 25 / E <= s["expert_tokens_max_mean"] <= 25
    # 25 tokens run 32-row blocks, which hold any expert's tokens: one block per touched expert, no re-read
    assert s["expert_row_blocks_mean"] == pytest.approx(s["experts_touched_mean"])
    assert ar["summary"]["expert_row_blocks_mean"] == float(k)


def test_dense_run_records_its_bytes_and_no_experts(tiny_pair):
    assert R.verify_reads(tiny_pair, [{"experts_touched": None}]) == {
        "verify_weight_bytes": weight_bytes_per_step(tiny_pair.target)}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_report_shows_experts_and_verify_cost_for_an_moe_study(tmp_path, arch):
    from ddtree_lab.workbench import report

    t, d = make_tiny_pair(tmp_path / "moe", arch=arch, seed=2)
    pair = dl.load_pair(target=t, drafter=d)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "prompt": "def add(a, b):"}\n')
    study = tmp_path / "study"
    params = RunParams(study_name="moe", study_dir=str(study), target_dir=str(t), drafter_dir=str(d), pair="",
                       prompt_set=str(tmp_path / "p.jsonl"), n_prompts=1, max_new_tokens=10, warmup=False, repeats=1)
    R.quick_sweep(params, [4, 16], pair)
    html = report.build_report(study).read_text()
    assert "experts touched per MoE layer per verify forward" in html and "row blocks (each past" in html
    assert "verify time per round vs budget" in html and "No floor is drawn" in html  # a CPU study: no bandwidth
    from ddtree_lab.workbench.advisor.study import advise

    advice = advise(study, model=str(tmp_path / "moe"))  # its own pair: the measured routing prices its rounds
    k = pair.target.cfg.num_experts_per_tok
    assert advice["experts_touched"][1] == k == advice["expert_row_blocks"][1]  # AR's step: one token, k experts
    assert {1, 5, 17} <= set(advice["experts_touched"]) == set(advice["expert_row_blocks"])


def test_an_mla_moe_study_runs_its_notebooks_and_report(tmp_path):
    """A DeepSeek-V3 target (MLA, grouped sigmoid routing, shared expert) through a whole study: each run's
    notebook and the study's (papermill), then the report with its experts figure."""
    from ddtree_lab.workbench import runner

    t, d = make_tiny_pair(tmp_path / "ds", arch="deepseek_v3", seed=2)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n"}) + "\n")
    spec = {"name": "mla", "models": {"target": str(t), "drafter": str(d), "device": "cpu"},
            "prompts": {"set": "prompts.jsonl", "n_prompts": 1}, "methods": ["ar", "ddtree"],
            "grid": {"budget": [4], "max_new_tokens": 8},
            "notebooks": {"per_run": ["accepted_paths"], "per_study": ["draft_trees", "budget_sweep"],
                          "timeout": 600},
            "warmup": False}
    (tmp_path / "mla.yaml").write_text(yaml.safe_dump(spec))
    log = []
    summary = runner.main_study(tmp_path / "mla.yaml", tmp_path / "out", progress=False, log=log.append)
    assert {o.name: o.status for o in summary.outcomes} == {
        "ar-t0": "complete", "ddtree-b4-k0-t0": "complete", "draft_trees": "complete", "budget_sweep": "complete"}, log
    assert (tmp_path / "out" / "ddtree-b4-k0-t0" / "accepted_paths.ipynb").is_file()
    assert "experts touched per MoE layer per verify forward" in summary.report.read_text()
