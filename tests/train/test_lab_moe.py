"""The lab-moe pair: its pipeline at toy scale on the CPU, the routing balance, the pair's names, and (once its
weights ship) its exactness: DDTree == AR at several budgets, the INT4 copy == its dequantized weights."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab import pairs
from ddtree_lab.attention import TreeMask
from ddtree_lab.checkpoint import load_target
from ddtree_lab.config import CheckpointError
from ddtree_lab.model import Target
from ddtree_lab.testing import random_init, tiny_target_config
from ddtree_lab.train.generate import greedy_all, greedy_extend
from ddtree_lab.train.lab_moe.balance import RouterBalance, load_figures, moe_blocks

LAB = pairs.PAIRS["lab"].prompt_dir.parent
SHIPPED = pairs.LAB_MOE_DIR
shipped = pytest.mark.skipif(not (SHIPPED / "target" / "config.json").is_file(),
                             reason="lab-moe weights not shipped yet: `ddtree-lab train-lab-moe --device cuda` "
                                    "makes them (docs/lab_moe.md)")


def _prompt(set_name: str, i: int = 0) -> str:
    return json.loads((LAB / "prompts" / f"{set_name}.jsonl").read_text().splitlines()[i])["prompt"]


def _mla_target(seed: int = 3, **overrides) -> Target:
    t = Target(tiny_target_config("deepseek_v3", vocab_size=64, **overrides))
    random_init(t, seed)
    return t.eval().requires_grad_(False)


def test_greedy_extend_matches_forward_train_on_an_mla_target():
    t = _mla_target()
    x = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    out = greedy_extend(t, x, 9)
    ref = x
    for _ in range(9):
        logits, _ = t.forward_train(ref)
        ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]  # left-padded batches give each row its tokens alone
    for p, seq in zip(prompts, greedy_all(t, prompts, 10, torch.device("cpu"), batch=2)):
        assert torch.equal(seq, greedy_extend(t, torch.tensor([p]), 10))


def test_bias_update_moves_load_toward_balance():
    """Correction biases that send every token to experts 0 and 1: the sign rule alone (no training) spreads the
    load over every expert; without it the two keep every token."""
    skewed = _mla_target(seed=0, n_group=1, topk_group=1)
    for m in moe_blocks(skewed):
        m.router.e_score_correction_bias.data[:2] = 2.0
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))

    def run(rate: float, steps: int = 80) -> dict:
        model = copy.deepcopy(skewed)
        balance = RouterBalance(rate)
        balance.attach(model)
        for step in range(steps):
            model.forward_train(tokens)
            balance.after_step(model, step)
        model.forward_train(tokens)
        counts = torch.stack([m.counts for m in balance.blocks]).numpy()
        return load_figures(counts, balance.blocks[0].top_k)

    still, moved = run(0.0), run(0.05)
    assert still["max_token_share"] == [1.0] * 3 and still["max_vs_fair"] == [4.0] * 3 and not still["none_dead"]
    assert moved["none_dead"] and moved["none_takes_most"], moved
    assert max(moved["max_vs_fair"]) < 1.5 and min(moved["min_vs_fair"]) > 0.4


def test_load_figures():
    f = load_figures(np.array([[10, 10, 10, 10], [37, 1, 1, 1]]), top_k=2)  # 20 tokens, two experts each
    assert f["min_vs_fair"] == [1.0, 0.1] and f["max_vs_fair"] == [1.0, 3.7]
    assert f["max_token_share"] == [0.5, 1.85] and f["tokens"] == 20
    assert f["none_dead"] and not f["none_takes_most"] and f["dead_experts"] == 0


# ----------------------------------------------------------------------------- the pipeline at toy scale

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from ddtree_lab.train.lab_moe.pipeline import main
    root = tmp_path_factory.mktemp("lab_moe")
    assert main(["--preset", "smoke", "--run-dir", str(root), "--device", "cpu"]) == 0
    return root


def test_smoke_run_writes_a_loadable_pair_in_the_real_format(smoke):
    pair_dir = smoke / "pair"
    t = json.loads((pair_dir / "target" / "config.json").read_text())
    d = json.loads((pair_dir / "drafter" / "config.json").read_text())
    assert t["architectures"] == ["DeepseekV3ForCausalLM"] and t["torch_dtype"] == "bfloat16"
    assert t["n_routed_experts"] == 8 and t["scoring_func"] == "sigmoid" and t["topk_method"] == "noaux_tc"
    assert t["first_k_dense_replace"] == 1 and t["n_shared_experts"] == 1 and t["n_group"] == 4
    assert d["architectures"] == ["DFlashDraftModel"] and d["dflash_config"]["mask_token_id"] == 1
    # the lab pair's tokenizer, byte for byte; the lab pair's prompt sets are read, not copied
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (pair_dir / "target" / name).read_bytes() == (LAB / "target" / name).read_bytes()
    assert not (pair_dir / "prompts").exists()
    pair = dl.load_pair(target=pair_dir / "target", drafter=pair_dir / "drafter")
    assert pair.target.cfg.mla is not None and pair.target.cfg.is_moe
    ar = dl.generate(pair, _prompt("code"), method="ar", max_new_tokens=16, trace=False)
    assert dl.generate(pair, _prompt("code"), budget=8, max_new_tokens=16, trace=False).tokens == ar.tokens
    assert (smoke / "log.txt").read_text().count("card: T = 0") == 1  # --run-dir keeps the log


def test_smoke_run_moves_the_correction_bias_by_the_sign_rule_only(smoke):
    tsum = json.loads((smoke / "work" / "target_summary.json").read_text())
    routing = tsum["routing"]
    rate, bias = routing["bias_update_rate"], np.array(routing["final_bias"])
    assert bias.shape == (2, 8) and np.abs(bias).max() > 0
    # 8 steps of ±rate: the optimizer (weight decay, gradients) never touched it
    assert np.allclose(bias / rate, np.round(bias / rate), atol=1e-3) and np.abs(bias).max() <= 8 * rate + 1e-6
    assert len(routing["load_history"]) == 2 and all("load_min_vs_fair" in h for h in tsum["history"])
    counts = np.array(routing["load_history"][0]["counts"])  # 4 steps of 8 x 64 tokens, top-2
    assert counts.shape == (2, 8) and (counts.sum(-1) == 4 * 8 * 64 * 2).all()


def test_smoke_card_data(smoke):
    ev = json.loads((smoke / "pair" / "eval.json").read_text())
    assert ev["t0"]["lossless"] is True and set(ev["t0"]["sets"]) == {"code", "docstring"}
    assert set(ev["t1"]["overall_tau"]) >= {"dflash", "ddtree4", "ddtree8"}
    for routing in ("router", "uniform"):  # DFlash's block of 16, DDTree(4) and (8) with their roots
        assert set(ev["union"][routing]) == {"5", "9", "16"}
        assert all(2 <= u["mean"] <= 8 for u in ev["union"][routing].values())
    assert len(ev["load"]["min_vs_fair"]) == 2 and isinstance(ev["load"]["none_dead"], bool)
    card = (smoke / "pair" / "README.md").read_text()
    for part in ("T = 1", "Experts touched per verify forward", "uniform, expected", "INT4 experts", "no dead expert"):
        assert part in card
    if ev["int4"]:
        assert ev["int4"]["int4"]["lossless"] is True and ev["int4"]["group_size"] == 32
    else:
        assert "Not measured in this run" in card


def test_a_rerun_skips_finished_stages_and_tidy_keeps_the_products(smoke):
    from ddtree_lab.train.lab_moe.pipeline import main
    work = smoke / "work"
    before = (work / "target_final.safetensors").stat().st_mtime_ns
    assert (work / "pool.npz").is_file() and (work / "target_state.pt").is_file()
    assert main(["--preset", "smoke", "--run-dir", str(smoke), "--device", "cpu",
                 "--stages", "prepare,target,pool,drafter", "--tidy"]) == 0
    assert (work / "target_final.safetensors").stat().st_mtime_ns == before
    assert sorted(f.name for f in work.glob("*.safetensors")) == ["drafter_final.safetensors",
                                                                  "target_final.safetensors"]
    assert not any((work / n).exists() for n in ("pool.npz", "target_state.pt", "drafter_state.pt"))


def _int4_equals_dequantized(int4_dir: Path, dense_dir: Path, vocab: int, n: int = 24) -> None:
    """The INT4 copy's logits == those of the dense target with its experts replaced by the dequantized INT4 ones."""
    from ddtree_lab.kernels.int4 import dequantize
    from ddtree_lab.moe import Int4Experts

    packed, dense = load_target(int4_dir), load_target(dense_dir)
    with torch.no_grad():
        for p, d in zip(moe_blocks(packed), moe_blocks(dense)):
            assert isinstance(p.gate_up, Int4Experts) and isinstance(p.down, Int4Experts)
            d.gate_up.copy_(dequantize(p.gate_up.weights(), torch.float32))
            d.down.copy_(dequantize(p.down.weights(), torch.float32))
        tokens = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7))
        out = []
        for m in (packed, dense):
            m.setup_cache(n)
            out.append(m(tokens, torch.arange(n), 0, TreeMask.causal(n, "cpu"))[0])
    assert torch.equal(*out)


def test_smoke_int4_copy_equals_its_dequantized_weights(smoke):
    pytest.importorskip("compressed_tensors")
    _int4_equals_dequantized(smoke / "target_int4", smoke / "pair" / "target", 4096)


def test_named_pairs_say_how_to_make_their_weights(smoke, tmp_path, monkeypatch):
    assert pairs.prompt_set_path("lab-moe", "code") == LAB / "prompts" / "code.jsonl"
    monkeypatch.setattr(pairs, "LAB_MOE_DIR", tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"`ddtree-lab train-lab-moe --device cuda` trains them"):
        dl.load_pair("lab-moe")
    monkeypatch.setattr(pairs, "LAB_MOE_DIR", smoke / "pair")
    monkeypatch.setenv("DDTREE_LAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match=r"`ddtree-lab train-lab-moe --stages int4` makes it"):
        dl.load_pair("lab-moe-int4")
    assert dl.load_pair("lab-moe").target.cfg.expert_int4_group == 0
    if (smoke / "target_int4").is_dir():
        shutil.copytree(smoke / "target_int4", tmp_path / "cache" / pairs.LAB_MOE_INT4_DIRNAME)
        assert dl.load_pair("lab-moe-int4").target.cfg.expert_int4_group == 32


# ----------------------------------------------------------------------------- the shipped pair

@shipped
def test_shipped_lab_moe_format_size_and_bars():
    from ddtree_lab.train.lab_moe.card import SIZE_BUDGET_MIB
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file() and f.suffix != ".py"
               and "__pycache__" not in f.parts and f.name != "README.md")
    assert size <= SIZE_BUDGET_MIB * 2**20
    t = json.loads((SHIPPED / "target" / "config.json").read_text())
    assert t["architectures"] == ["DeepseekV3ForCausalLM"] and t["torch_dtype"] == "bfloat16"
    assert (SHIPPED / "target" / "tokenizer.json").read_bytes() == (LAB / "target" / "tokenizer.json").read_bytes()
    ev = json.loads((SHIPPED / "eval.json").read_text())
    tau = ev["t0"]["overall_tau"]
    assert ev["t0"]["lossless"] and tau["dflash"] >= 3.0 and tau["ddtree64"] >= 1.3 * tau["dflash"]
    assert ev["load"]["none_dead"] and ev["load"]["none_takes_most"]
    assert (SHIPPED / "README.md").is_file()


@shipped
@pytest.mark.parametrize("set_name", ["code", "docstring"])
def test_shipped_lab_moe_ddtree_equals_ar_at_several_budgets(set_name):
    pair = dl.load_pair("lab-moe")
    prompt = _prompt(set_name)
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=32, trace=False)
    assert dl.generate(pair, prompt, method="dflash", max_new_tokens=32, trace=False).tokens == ar.tokens
    for budget in (1, 4, 16, 64, 256):
        assert dl.generate(pair, prompt, budget=budget, max_new_tokens=32, trace=False).tokens == ar.tokens, budget


@shipped
def test_shipped_lab_moe_int4_copy_equals_its_dequantized_weights(tmp_path):
    pytest.importorskip("compressed_tensors")
    from ddtree_lab.train.lab_moe.pipeline import make_int4_copy
    make_int4_copy(SHIPPED / "target", tmp_path / "int4", 32)
    _int4_equals_dequantized(tmp_path / "int4", SHIPPED / "target", 4096)
    pair = dl.load_pair(target=tmp_path / "int4", drafter=SHIPPED / "drafter")
    ar = dl.generate(pair, _prompt("code"), method="ar", max_new_tokens=32, trace=False)
    for budget in (4, 64):
        assert dl.generate(pair, _prompt("code"), budget=budget, max_new_tokens=32, trace=False).tokens == ar.tokens
