"""The advisor's 8-GPU layouts (advisor/layouts.py) and projections (advisor/projection.py): each collective's term
against arithmetic written out here, the slowest rank's experts against a seeded simulation, a rank's shape and
bytes, `ddtree-lab advise` with τ numbers, serving runs or a study end to end on the CPU, the user's machine
figures, and each refusal in one line."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ddtree_lab.cli import main
from ddtree_lab.workbench import advisor as A

REPO = Path(__file__).resolve().parents[2]
H200_8B = REPO / "docs" / "bench" / "e2e_random_qwen3_8b_triton_compile.json"
KIMI = A.model_shape("kimi-k2.6")
ACT = 7168 * 2  # bytes of one token's hidden activations in bf16


# ----------------------------------------------------------------------------- shapes
def test_the_whole_kimi_model_and_its_bytes():
    s = KIMI
    assert (s.layers, s.moe_layers, s.hidden, s.heads, s.num_experts, s.experts_per_tok) == (61, 60, 7168, 64, 384, 8)
    assert (s.kv_lora_rank, s.qk_rope_head_dim, s.q_lora_rank, s.shared_intermediate, s.vocab) == (512, 64, 1536, 2048,
                                                                                                    163840)
    assert s.expert_bytes == 4 / 8 + 2 / 32                      # INT4, one bf16 scale per 32 weights
    q = 7168 * 1536 + 1536 * 64 * (128 + 64)                     # q_a, q_b
    kv = 7168 * (512 + 64) + 64 * 512 * (128 + 128)              # kv_a (latent + RoPE key), kv_b
    assert s.attn_params == q + kv + 64 * 128 * 7168             # + o
    assert s.kv_width == 576 and s.attn_pair_width == 512 + 64 + 512
    assert s.moe_block_bytes(10) == 384 * 7168 * 2 + 10 * 3 * 7168 * 2048 * 0.5625
    assert s.draft_attention == (64, 8, 128) and s.draft_layers == 6


def test_rank_shapes_of_each_layout():
    tp = A.rank_shape(KIMI, A.get_layout("tp8"))
    assert (tp.heads, tp.intermediate, tp.expert_intermediate, tp.shared_intermediate) == (8, 2304, 256, 256)
    assert tp.num_experts == 384 and tp.experts_per_tok == 8          # every expert, at 1/8 width
    # the down projections and the latent are whole on every rank, the heads' share of q_b, kv_b and o is 1/8
    assert tp.attn_params == 7168 * 1536 + 7168 * 576 + 8 * (1536 * 192 + 512 * 256 + 128 * 7168)
    assert tp.kv_width == 576 and tp.draft_attention == (64, 8, 128)   # the drafter is whole on every rank
    ep = A.rank_shape(KIMI, A.get_layout("ep8"))
    assert (ep.heads, ep.intermediate, ep.shared_intermediate, ep.experts_per_tok) == (8, 18432, 2048, 1.0)
    dp = A.rank_shape(KIMI, A.get_layout("ep8", "dp"))
    assert dp.heads == 64 and dp.attn_params == KIMI.attn_params
    gqa = A.rank_shape(A.model_shape("random:qwen3-30b-a3b"), A.get_layout("tp8"))
    assert (gqa.heads, gqa.kv_heads, gqa.expert_intermediate) == (4, 1, 96)  # 4 KV heads: one replicated a rank
    with pytest.raises(A.AdvisorError, match="is dense: ep8 places experts"):
        A.rank_shape(A.model_shape("random:qwen3-8b"), A.get_layout("ep8"))
    with pytest.raises(A.AdvisorError, match=r"attention heads \(6\) does not split over 8 ranks"):
        A.rank_shape(A.model_shape("lab"), A.get_layout("tp8"))


# ----------------------------------------------------------------------------- collectives
def test_tp8_all_reduces_against_a_hand_computation():
    link = A.get_interconnect("h200")
    assert (link.bandwidth, link.all_reduce_latency, link.nvls_latency) == (450e9, 15.0e-6, 25.0e-6)
    (c,) = A.forward_collectives(KIMI, A.get_layout("tp8"), link, 65)
    message = 65 * 7168 * 2
    assert (c.kind, c.count, c.algorithm) == ("all_reduce", 2 * 61, "ring")
    assert c.bytes == pytest.approx(2 * 7 / 8 * message)
    assert c.seconds == pytest.approx(15.0e-6 + 1.75 * message / 450e9)
    # 1025 tokens: 14.7 MB, where the switch's one send and one receive beat the ring's 1.75 of each
    (big,) = A.forward_collectives(KIMI, A.get_layout("tp8"), link, 1025)
    assert big.algorithm == "nvls" and big.seconds == pytest.approx(25.0e-6 + 1025 * ACT / 450e9)
    pcie = A.get_interconnect("rtx-pro-6000-server")
    assert not pcie.nvls and pcie.bandwidth == 64e9
    (p,) = A.forward_collectives(KIMI, A.get_layout("tp8"), pcie, 1025)
    assert p.algorithm == "ring" and p.seconds == pytest.approx(20.6e-6 + 1.75 * 1025 * ACT / 64e9)
    assert A.comm_seconds([p]) == pytest.approx(122 * p.seconds)


def test_ep8_dispatch_and_combine_against_a_hand_computation():
    link = A.get_interconnect("b300")
    got = {c.kind: c for c in A.forward_collectives(KIMI, A.get_layout("ep8"), link, 65)}
    assert set(got) == {"dispatch", "combine", "reduce_scatter", "all_gather"}
    # attention tp: the busiest rank owns ceil(65 / 8) = 9 tokens and sends 7/8 of their 8 copies each way
    sent = 9 * 8 * 7 / 8 * ACT
    for kind in ("dispatch", "combine"):
        assert got[kind].count == 60 and got[kind].bytes == pytest.approx(sent)
        assert got[kind].seconds == pytest.approx(10.8e-6 + sent / 900e9)
    share = 7 / 8 * 65 * ACT
    for kind in ("reduce_scatter", "all_gather"):
        assert got[kind].count == 61 and got[kind].seconds == pytest.approx(10.8e-6 + share / 900e9)
    # attention dp: one rank holds all 65 tokens and sends 7/8 of their 520 copies; no attention collective
    dp = A.forward_collectives(KIMI, A.get_layout("ep8", "dp"), link, 65)
    assert [c.kind for c in dp] == ["dispatch", "combine"]
    assert dp[0].bytes == pytest.approx(65 * 8 * 7 / 8 * ACT)


# ----------------------------------------------------------------------------- the slowest rank's experts
def _simulated_max(experts, top_k, ranks, tokens, n, rng):
    """Each token picks top_k distinct experts of E uniformly; the largest count of distinct experts on a rank."""
    picks = np.argpartition(rng.random((n, tokens, experts)), top_k, axis=-1)[..., :top_k]   # [n, T, k]
    hit = np.zeros((n, experts), bool)
    np.put_along_axis(hit, picks.reshape(n, -1), True, axis=1)
    per_rank = hit.reshape(n, ranks, experts // ranks).sum(-1)                               # [n, R]
    return per_rank.max(-1)


@pytest.mark.parametrize("experts, top_k, tokens", [(384, 8, 1), (384, 8, 4), (384, 8, 17), (384, 8, 65),
                                                    (128, 8, 1), (128, 8, 9), (128, 8, 33)])
def test_expected_max_over_ranks_matches_a_seeded_simulation(experts, top_k, tokens):
    draws = _simulated_max(experts, top_k, 8, tokens, 1500, np.random.default_rng(tokens))
    mc, se = draws.mean(), draws.std() / math.sqrt(len(draws))
    got = A.expected_max_touched(experts, top_k, 8, tokens)
    assert abs(got - mc) <= 0.015 * mc + 3 * se, (got, mc, se)
    mean = experts / 8 * A.hit_probability(experts, top_k, tokens)
    assert got > mean or tokens > 60                       # the slowest rank serves more than the mean one


def test_expected_max_at_its_ends_and_the_rank_load():
    assert A.hit_probability(384, 8, 1) == pytest.approx(8 / 384)
    assert A.expected_max_touched(384, 8, 8, 0) == 0 and A.expected_max_touched(8, 8, 8, 1) == 1
    assert A.expected_max_touched(384, 8, 8, 1025) == pytest.approx(48, abs=1e-6)
    ep = A.get_layout("ep8")
    load = A.rank_load(KIMI, ep, [1, 65])
    assert load.touched[65] == pytest.approx(A.expected_max_touched(384, 8, 8, 65))
    assert load.row_blocks[65] == pytest.approx(load.touched[65] * KIMI.expert_row_blocks(65) / KIMI.experts_touched(65))
    measured = A.rank_load(KIMI, ep, [16], max_touched={16: 20.0})
    assert measured.touched[16] == 20.0
    assert A.rank_load(KIMI, A.get_layout("tp8"), [65]) is None


def test_the_slowest_ranks_experts_set_its_weights_read():
    """An ep8 rank's verify reads the expected-max experts at INT4 bytes: one more expert costs its 3·H·I weights
    at 0.5625 bytes each, every MoE layer."""
    rank, cal = A.rank_shape(KIMI, A.get_layout("ep8")), A.load_calibration()
    base = A.verify_terms(rank, 65, 512, cal, load=A.ExpertLoad({65: 30.0}, {65: 30.0})).weights
    more = A.verify_terms(rank, 65, 512, cal, load=A.ExpertLoad({65: 31.0}, {65: 31.0})).weights
    assert more - base == pytest.approx(60 * 3 * 7168 * 2048 * 0.5625)


# ----------------------------------------------------------------------------- the machine table
def test_the_8_gpu_profiles_have_their_figures_and_sources():
    table = A.machines_data()
    for name, kind, nvls in (("h200", "nvlink", True), ("b300", "nvlink", True), ("rtx-pro-6000-server", "pcie", False)):
        m = table["machines"][name]
        link = m["interconnect"]
        assert name in A.profile_names() and link["kind"] == kind and link["nvls"] is nvls
        assert link["source"] and link["url"].startswith("https://") and m["url"].startswith("https://")
        assert table["interconnects"][kind]["source"] and table["interconnects"][kind]["url"].startswith("https://")
    assert table["machines"]["rtx-pro-6000-server"]["fp4_dense_flops"] == 2.0e15
    assert A.machine_for_device("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtx-pro-6000-server"
    assert A.machine_for_device("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") == "rtx-pro-6000"
    assert A.get_interconnect("b200") is None


def test_the_users_figures_override_the_table_and_are_recorded(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("link_gbps: 40\nall_reduce_latency_us: 30\nbandwidth_gbps: 1400\n")
    values = A.read_machine_file(mine)
    values["link_gbps"] = 25.0                                   # a --set after the file wins
    m, link, fig = A.machine_profile("rtx-pro-6000-server", values, {"link_gbps": "--set",
                                                                     "all_reduce_latency_us": str(mine),
                                                                     "bandwidth_gbps": str(mine)})
    assert (m.bandwidth, link.bandwidth, link.all_reduce_latency) == pytest.approx((1400e9, 25e9, 30e-6))
    assert link.all_to_all_latency == 13.6e-6                    # not given: the table's
    assert fig["link_gbps"] == {"value": 25.0, "table": 64.0, "origin": "--set"}
    assert fig["all_reduce_latency_us"]["origin"] == str(mine) and fig["flops_tflops"]["origin"] == "machines.json"
    # a GPU of the table without interconnect figures gets them from the user
    _, own, _ = A.machine_profile("b200", {"link_gbps": 400.0, "all_reduce_latency_us": 12.0,
                                           "all_to_all_latency_us": 9.0})
    assert own.bandwidth == 400e9 and not own.nvls


# ----------------------------------------------------------------------------- advise end to end
def _exit_code(argv) -> int:
    """main's status, or argparse's when it refuses an argument at parse (one line on stderr, then exit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _advise(tmp_path, *args) -> dict:
    out = tmp_path / "advice.json"
    assert main(["advise", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_advise_with_tau_numbers_end_to_end(tmp_path, capsys):
    doc = _advise(tmp_path, "--model", "kimi-k2.6", "--layout", "ep8", "--machine", "b300",
                  "--tau", "8:4.48", "16:5.3-6.4", "64:3-4")
    text = capsys.readouterr().out
    assert doc["schema"] == "ddtree_lab.layout_advice/1" and doc["projection"] and "A PROJECTION" in text
    assert doc["layout"] == {"name": "ep8", "attention": "tp", "ranks": 8} and doc["routing"] == "uniform"
    assert doc["rank_shape"] == "kimi-k2.6 (ep8 (attention tp) rank)" and doc["context_tokens"] == 512
    rows = {r["budget"]: r for r in doc["rows"]}
    assert sorted(rows) == [8, 16, 64] and doc["machine"]["interconnect"]["kind"] == "nvlink"
    link = A.get_interconnect("b300")
    for b, r in rows.items():
        rnd = r["round"]
        assert rnd["measured"] is None                            # no rank bench: every part is modelled
        comm = sum(c["count"] * c["seconds_each"] for c in rnd["modelled"]["collectives"])
        assert rnd["modelled"]["comm_seconds"] == pytest.approx(comm)
        assert comm == pytest.approx(A.comm_seconds(A.forward_collectives(KIMI, A.get_layout("ep8"), link, b + 1)))
        assert rnd["seconds"] == pytest.approx(rnd["modelled"]["rank"]["rank_seconds"] + comm)
        assert r["tokens_per_second"] == pytest.approx(r["tau"] / rnd["seconds"])
        assert r["band"] == pytest.approx([t / rnd["seconds"] for t in r["tau_band"]])
        assert r["vs_ar"]["ratio"] == pytest.approx(r["tokens_per_second"] * doc["ar"]["round"]["seconds"])
    assert rows[16]["tau"] == pytest.approx(5.85) and rows[16]["tau_band"] == [5.3, 6.4]
    assert rows[8]["vs_budget8"]["verdict"] == "reference"
    lo16 = 5.3 / rows[16]["round"]["seconds"] / rows[8]["tokens_per_second"]
    assert rows[16]["vs_budget8"]["band"][0] == pytest.approx(lo16)
    assert rows[16]["vs_budget8"]["verdict"] == ("better" if lo16 > 1 else "within noise")
    assert rows[64]["vs_budget8"]["verdict"] == "worse"           # τ 3–4 at a round dearer than budget 8's
    assert doc["best_budget"] == max(rows, key=lambda b: rows[b]["tokens_per_second"])
    assert doc["machine"]["figures"]["link_gbps"] == {"value": 900.0, "table": 900.0, "origin": "machines.json"}


def test_advise_takes_the_users_figures_and_a_measured_rank(tmp_path, capsys):
    base = _advise(tmp_path, "--model", "kimi-k2.6", "--layout", "tp8", "--machine", "h200", "--tau", "16:5.5")
    slow = _advise(tmp_path, "--model", "kimi-k2.6", "--layout", "tp8", "--machine", "h200", "--tau", "16:5.5",
                   "--set", "link_gbps=45", "--set", "all_reduce_latency_us=40", "--set", "nvls=false")
    assert "your figures: link_gbps 45 (--set; table 450" in capsys.readouterr().out
    c = slow["rows"][0]["round"]["modelled"]["collectives"][0]
    assert c["algorithm"] == "ring" and c["seconds_each"] == pytest.approx(40e-6 + 1.75 * 17 * ACT / 45e9)
    assert slow["rows"][0]["round"]["modelled"]["rank"] == base["rows"][0]["round"]["modelled"]["rank"]
    assert slow["machine"]["figures"]["all_reduce_latency_us"] == {"value": 40.0, "table": 15.0, "origin": "--set"}
    # a bench of the rank on that machine is the round's measured part, where it has the budget
    doc = _advise(tmp_path, "--model", "kimi-k2.6", "--layout", "tp8", "--machine", "h200",
                  "--tau", "8:4.4", "16:5.5", "--rank-bench", str(H200_8B))
    bench = {r["budget"]: r["round_seconds"] for r in json.loads(H200_8B.read_text())["rows"] if r["method"] == "ddtree"}
    rows = {r["budget"]: r["round"] for r in doc["rows"]}
    assert rows[16]["measured"]["rank_seconds"] == bench[16] and rows[16]["modelled"]["rank"] is None
    assert rows[16]["seconds"] == pytest.approx(bench[16] + rows[16]["modelled"]["comm_seconds"])
    assert 8 not in bench and rows[8]["measured"] is None and rows[8]["modelled"]["rank"]["rank_seconds"] > 0
    assert doc["rank_bench"]["model"] == "random:qwen3-8b"


def test_advise_reads_tau_from_ingested_serving_runs(tmp_path):
    run = {"file": "b.jsonl", "line": 1, "engine": "sglang", "verdict": "ok", "method": "ddtree", "model": "kimi"}
    ext = tmp_path / "external.json"
    ext.write_text(json.dumps({"schema": 1, "unrecognised": [], "runs": [
        {**run, "budget": 8, "accept_length": 4.4}, {**run, "budget": 8, "accept_length": 4.6},
        {**run, "budget": 16, "accept_length": 5.5}, {**run, "budget": 32, "accept_length": 9.0, "verdict": "failed"},
        {**run, "method": "ar", "budget": None, "accept_length": None}]}))
    doc = _advise(tmp_path, "--model", "kimi-k2.6", "--layout", "tp8", "--machine", "h200", "--external", str(ext))
    rows = {r["budget"]: r for r in doc["rows"]}
    assert sorted(rows) == [8, 16] and rows[8]["tau"] == pytest.approx(4.5) and rows[8]["tau_band"] == [4.4, 4.6]
    assert len(doc["tau_source"]["runs"]) == 3 and doc["tau_source"]["model"] == "kimi"
    ext.write_text(json.dumps({"runs": [{**run, "budget": 8, "accept_length": 4.4},
                                        {**run, "budget": 16, "accept_length": 5.0, "model": "other"}]}))
    with pytest.raises(A.AdvisorError, match="runs of 2 models"):
        A.taus_from_external(ext)


def _study(tmp_path: Path) -> Path:
    """AR and three DDTree budgets over three prompts (τ grows with the budget, prompt p2 gains most)."""
    d = tmp_path / "study"
    for name, method, budget, per in (("ar-t0", "ar", None, [1] * 10), ("ddtree-b8-k0-t0", "ddtree", 8, None),
                                      ("ddtree-b16-k0-t0", "ddtree", 16, None), ("ddtree-b64-k0-t0", "ddtree", 64, None)):
        i = {None: 0, 8: 0, 16: 1, 64: 2}[budget]
        taus = {p: per or [2 + i + (i if p == "p2" else 0)] * 5 for p in ("p0", "p1", "p2")}
        (d / name).mkdir(parents=True)
        prompts = [{"id": p, "n_prompt_tokens": 100, "tokens": [1] * sum(t), "acceptance_lengths": t}
                   for p, t in taus.items()]
        (d / name / "results.json").write_text(json.dumps({
            "run": name, "status": "complete", "prompts": prompts, "device": {"device": "cpu"},
            "config": {"method": method, "budget": budget, "topk": 0, "temperature": 0.0, "pair": "lab",
                       "max_new_tokens": 40, "dtype": "float32"},
            "summary": {"rounds": 15, "stage_seconds": {"verify": 0.1}}}))
    return d


def test_advise_projects_a_studys_tau_with_its_bootstrap(tmp_path):
    d = _study(tmp_path)
    doc = _advise(tmp_path, str(d), "--model", "kimi-k2.6", "--layout", "ep8", "--attention-layout", "dp",
                  "--machine", "rtx-pro-6000-server", "--boot", "200")
    rows = {r["budget"]: r for r in doc["rows"]}
    assert doc["context_tokens"] == 120 and doc["tau_source"]["n_boot"] == 200
    assert rows[16]["tau"] == pytest.approx((3 + 3 + 4) / 3)
    lo, hi = rows[16]["tau_band"]
    assert lo < rows[16]["tau"] < hi                               # the prompts disagree: a band
    assert rows[16]["vs_budget8"]["band"][0] <= rows[16]["vs_budget8"]["ratio"] <= rows[16]["vs_budget8"]["band"][1]
    assert doc["layout"]["attention"] == "dp" and not (d / "advice.json").exists()  # --out elsewhere


@pytest.mark.parametrize("args, message", [
    (["--machine", "v100"], "unknown machine 'v100'"),
    (["--machine", "b200", "--layout", "tp8"], "machine 'b200' (NVIDIA B200 (HGX B200, per GPU)) has no interconnect"),
    (["--layout", "pp8"], "argument --layout: invalid choice: 'pp8'"),
    (["--tau", "8=4.4"], "give BUDGET:TAU or BUDGET:LO-HI"),
    (["--tau", "8:abc"], "'abc' is neither a number nor a range"),
    (["--tau", "8:5-4"], "low end is above its high end"),
    (["--tau", "2000:5"], "budget 2000 is out of range 1..1024"),
    (["--tau", "auto:5"], "budget 'auto' has no one τ"),
    (["--tau", "4:6"], "1..5 at budget 4"),
    (["--tau", "8:4", "8:5"], "gives budget 8 twice"),
    (["--layout", "tp8", "--attention-layout", "dp"], "--attention-layout goes with --layout ep8"),
    (["--set", "speed=3"], "unknown machine figure 'speed'"),
    (["--set", "link_gbps=-1"], "give a positive number"),
    (["--set", "nvls=maybe"], "give true or false"),
    (["--machine", "h200", "--machine", "b300"], "a projection prices one machine"),
    (["--model", "random:qwen3-8b", "--layout", "ep8"], "is dense: ep8 places experts"),
])
def test_each_refusal_is_one_line(tmp_path, capsys, args, message):
    base = {"--machine": ["--machine", "h200"], "--tau": ["--tau", "8:4.48"], "--model": ["--model", "kimi-k2.6"]}
    for flag, default in base.items():
        if flag not in args:
            args = [*default, *args]
    assert _exit_code(["advise", *args, "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--model", "kimi-k2.6", "--machine", "h200"], "give τ per budget"),
    (["--machine", "h200", "--tau", "8:4"], "give --model"),
    (["--model", "kimi-k2.6", "--machine", "h200", "--tau", "8:4", "--external", "x.json"], "give τ one way"),
    (["--model", "kimi-k2.6", "--machine", "b300", "--tau", "8:4", "--rank-bench", str(H200_8B)],
     "measured on 'NVIDIA H200', not on b300"),
])
def test_each_missing_input_is_one_line(tmp_path, capsys, args, message):
    assert main(["advise", *args, "--out", str(tmp_path / "a.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_machine_file_that_is_no_mapping_is_refused(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("[1, 2]")
    with pytest.raises(A.AdvisorError, match="give a mapping of figures"):
        A.read_machine_file(bad)
    bad.write_text('{"link_gbps": "fast"}')
    with pytest.raises(A.AdvisorError, match="link_gbps='fast': give a positive number"):
        A.read_machine_file(bad)
