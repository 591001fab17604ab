"""`ddtree-lab bench` on the CPU: the JSON each subcommand writes, on small pairs (timings are not checked)."""
import argparse
import json
import shlex

import pytest
import torch

from ddtree_lab import options
from ddtree_lab.bench.cli import add_bench_args, run_bench_cli
from ddtree_lab.environment import source_digest
from ddtree_lab.testing import make_tiny_pair


def bench(tmp_path, *argv) -> dict:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    out = tmp_path / "bench.json"
    assert run_bench_cli(p.parse_args([*argv, "--out", str(out)])) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    make_tiny_pair(d)  # writes d/target and d/drafter
    return d


def test_e2e_rows_per_method_and_budget(tmp_path, tiny_dir):
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--budgets", "4", "16", "--rounds", "3",
                "--prompt-len", "12", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa")
    assert res["kind"] == "e2e" and len(res["environment"]["source_sha256"]) == 64
    assert [(r["method"], r["budget"]) for r in res["rows"]] == [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16)]
    for r in res["rows"]:
        stages = r["stage_seconds_per_round"]
        assert r["round_seconds"] == pytest.approx(sum(stages.values())) and r["round_seconds"] > 0
        assert (stages["draft"] > 0) == (r["method"] != "ar")
    assert "roofline" not in res  # only on a GPU, where the copy bandwidth can be measured


def test_e2e_refuses_a_run_with_no_round_to_time(tmp_path, tiny_dir, capsys):
    """--rounds counts new tokens, and the prompt's forward gives the first: 1 would time no round (a division by
    zero, once); the command line refuses it in one line, and bench_e2e itself by name."""
    from ddtree_lab.bench.e2e import bench_e2e

    p = argparse.ArgumentParser()
    add_bench_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["e2e", "--model", str(tiny_dir), "--rounds", "1"])
    assert "--rounds 1 must be at least 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rounds=1"):
        bench_e2e(None, rounds=1)


def test_e2e_times_the_methods_asked_for(tmp_path, tiny_dir):
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--methods", "ddtree", "--budgets", "4", "--rounds", "2",
                "--prompt-len", "12", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa")
    assert [(r["method"], r["budget"]) for r in res["rows"]] == [("ddtree", 4)]
    assert "--methods ddtree" in res["command"] and "round_over_ar_step" not in res["rows"][0]


def test_e2e_cut_short_keeps_the_runs_it_finished(tmp_path, tiny_dir, monkeypatch, use_options):
    """Each run's row is on disk when it ends: a bench stopped during its third run (a time limit, a device lost)
    leaves a JSON of the first two, marked incomplete; a finished bench's file has no such mark."""
    use_options()
    import ddtree_lab.bench.e2e as e2e

    real, calls = e2e.generate, []

    def generate(pair, prompt, **kw):
        calls.append(kw["method"])
        if len(calls) > 4:  # a dense pair's run is two calls (warm-up, timed): the third run stops in its first
            raise KeyboardInterrupt("stopped")
        return real(pair, prompt, **kw)

    monkeypatch.setattr(e2e, "generate", generate)
    p = argparse.ArgumentParser()
    add_bench_args(p)
    out = tmp_path / "cut.json"
    args = p.parse_args(["e2e", "--model", str(tiny_dir), "--budgets", "4", "16", "--rounds", "2", "--prompt-len",
                         "12", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa", "--out", str(out)])
    with pytest.raises(KeyboardInterrupt):
        run_bench_cli(args)
    res = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in res["rows"]] == [("ar", None), ("dflash", None)]
    assert res["incomplete"].startswith("2 of 4 runs") and res["kind"] == "e2e"
    assert res["command"].startswith("ddtree-lab bench e2e") and len(res["environment"]["source_sha256"]) == 64
    monkeypatch.setattr(e2e, "generate", real)
    assert run_bench_cli(args) == 0 and "incomplete" not in json.loads(out.read_text())


def test_e2e_out_of_gpu_memory_is_one_line_and_keeps_the_runs_it_finished(tmp_path, tiny_dir, monkeypatch, capsys,
                                                                          use_options):
    """A run that outgrows the GPU (a long prompt on a deep model) ends in one line naming it, exit code 2, and the
    runs finished before it stay on disk for the next command to resume."""
    use_options()
    import ddtree_lab.bench.e2e as e2e
    from ddtree_lab.cli import main

    real, calls = e2e.generate, []

    def generate(pair, prompt, **kw):
        calls.append(kw["method"])
        if len(calls) > 4:  # the third run, in its warm-up
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.12 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 758.19 MiB is free. Including non-PyTorch")
        return real(pair, prompt, **kw)

    monkeypatch.setattr(e2e, "generate", generate)
    out = tmp_path / "oom.json"
    argv = ["bench", "e2e", "--model", str(tiny_dir), "--budgets", "4", "16", "--rounds", "2", "--prompt-len", "12",
            "--device", "cpu", "--dtype", "float32", "--attention", "sdpa", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "GPU 0 has" not in err  # after the finished runs' lines, one of its own
    assert err.splitlines()[-1].startswith("ddtree-lab bench: error: out of GPU memory (CUDA out of memory. "
                                           "Tried to allocate 1.12 GiB.)")
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["ar", "dflash"]
    monkeypatch.setattr(e2e, "generate", real)
    assert main(argv) == 0 and json.loads(out.read_text())["resumed_rows"] == 2


def test_profile_attributes_kernels_to_stages(tmp_path, tiny_dir):
    res = bench(tmp_path, "profile", "--model", str(tiny_dir), "--methods", "ar", "ddtree", "--budgets", "8",
                "--rounds", "2", "--prompt-len", "10", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa")
    ar, tree = res["rows"]
    assert set(ar["stages"]) == {"verify"}
    assert set(tree["stages"]) == {"draft", "tree_build", "verify", "commit"}
    assert tree["kernels_per_round"] == pytest.approx(sum(s["kernels_per_round"] for s in tree["stages"].values()))
    assert all(s["kernels_per_round"] >= 1 for s in tree["stages"].values())
    shares = [k["us_per_round"] for k in tree["top_kernels"]]
    assert shares == sorted(shares, reverse=True) and {k["stage"] for k in tree["top_kernels"]} <= set(tree["stages"])
    for row in (ar, tree):  # every kernel listed: per stage, their counts sum to the stage's
        for stage, v in row["stages"].items():
            listed = sum(k["per_round"] for k in row["top_kernels"] if k["stage"] == stage)
            assert listed == pytest.approx(v["kernels_per_round"])


def test_e2e_and_profile_serve_an_mla_moe_target(tmp_path, use_options):
    """A DeepSeek-V3 target (MLA, grouped sigmoid routing, shared expert, a dense first layer) through both
    benches: rows per method, each round's kernels attributed to its stages, the MoE rows' experts counted."""
    use_options()  # run_bench_cli sets process-wide choices: restore them after this test
    d = tmp_path / "pair"
    make_tiny_pair(d, arch="deepseek_v3", seed=4)
    common = ["--model", str(d), "--budgets", "8", "--rounds", "2", "--prompt-len", "10", "--device", "cpu",
              "--dtype", "float32", "--attention", "sdpa"]
    e2e = bench(tmp_path, "e2e", *common, "--routing", "uniform", "--declared-routing", "torch")
    assert e2e["routing"] == "uniform" and e2e["declared_routing"] == "torch"
    assert [(r["method"], r["budget"]) for r in e2e["rows"]] == [("ar", None), ("dflash", None), ("ddtree", 8)]
    ar, _, tree = e2e["rows"]
    assert ar["experts_touched_mean"] <= tree["experts_touched_mean"]  # a tree reads the union of its tokens'
    prof = bench(tmp_path, "profile", *common, "--methods", "ar", "ddtree")
    assert set(prof["rows"][1]["stages"]) == {"draft", "tree_build", "verify", "commit"}
    assert all(s["kernels_per_round"] >= 1 for s in prof["rows"][1]["stages"].values())


def test_prompts_speedup_and_equality_counts(tmp_path):
    res = bench(tmp_path, "prompts", "--pair", "lab", "--prompts", "lab:code", "--n-prompts", "2", "--budgets", "8",
                "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa",
                "--repeats", "3")
    rows = {(r["method"], r["budget"]): r for r in res["rows"]}
    for r in rows.values():  # the median of three interleaved repeats
        assert len(r["tokens_per_second_per_repeat"]) == 3 and res["repeats"] == 3
        assert sorted(r["tokens_per_second_per_repeat"])[1] == r["tokens_per_second"]
    assert set(rows) == {("ar", None), ("dflash", None), ("ddtree", 8)}
    orders = res["order_per_repeat"]  # rotated: over three repeats each method ran once in each slot
    assert orders[0] == ["ar", "dflash", "ddtree 8"]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    assert all(len({o[slot] for o in orders}) == 3 for slot in range(3))
    assert rows[("ar", None)]["speedup_over_ar"] == 1.0
    for r in rows.values():  # float32: every method reproduces AR's tokens
        assert r["lossless"] and r["prompts_equal_to_ar"] == 2
    assert res["best_budget"] == 8 and res["compile"] is False
    for r in rows.values():  # the time of the median repeat, split: prefill apart, stages by events
        i = r["tokens_per_second_per_repeat"].index(r["tokens_per_second"])
        wall = r["seconds_per_repeat"][i]
        assert 0 < r["prefill_seconds"] < wall and r["decode_tokens_per_second"] > r["tokens_per_second"]
        assert r["decode_tokens_per_second"] == r["tokens"] / (wall - r["prefill_seconds"])
        assert set(r["stage_seconds"]) >= {"verify", "other"} and r["stage_seconds"]["verify"] > 0
    assert rows[("ar", None)]["stage_seconds"]["draft"] == 0 < rows[("dflash", None)]["stage_seconds"]["draft"]


def test_prompts_with_auto_against_the_best_fixed_budget(tmp_path):
    res = bench(tmp_path, "prompts", "--pair", "lab", "--prompts", "lab:code", "--n-prompts", "2", "--budgets", "4",
                "16", "auto", "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa",
                "--repeats", "2")
    rows = {(r["method"], r["budget"]): r for r in res["rows"]}
    auto, best = rows[("ddtree", "auto")], rows[("ddtree", res["best_budget"])]
    assert res["best_budget"] in (4, 16) and auto["auto"]["budgets"] == [4, 16]
    assert sum(auto["round_budget_counts"].values()) > 0 and set(auto["round_budget_counts"]) <= {"4", "16"}
    assert res["auto_vs_best_fixed"] == auto["tokens_per_second"] / best["tokens_per_second"]
    same = res["auto_vs_best_fixed_same_outputs"]  # float32: both emit AR's tokens on every prompt
    assert same["prompts"] == same["of"] == 2 and len(same["per_repeat"]) == 2
    want = [sum(b) / sum(a) for a, b in zip(auto["seconds_per_prompt_per_repeat"], best["seconds_per_prompt_per_repeat"])]
    assert same["per_repeat"] == pytest.approx(want)
    band = res["auto_vs_best_fixed_band"]  # prompts resampled: the whole-set ratio lies inside its own band
    assert band["low"] <= band["high"] and 0.0 <= band["at_least_floor"] <= 1.0 and band["at_least_best"] <= band["at_least_floor"]
    assert band["centre"] > 0
    assert all(r["tokens_per_prompt"] and sum(r["tokens_per_prompt"]) == r["tokens"] for r in res["rows"])
    with pytest.raises(ValueError, match="fixed budgets beside it"):  # refused before the pair loads
        bench(tmp_path, "prompts", "--pair", "no-such-pair", "--budgets", "auto", "--device", "cpu")


def test_prompts_with_auto_variants_side_by_side(tmp_path, capsys):
    """'auto:key=value,…' runs another auto with those settings in the same run; each auto row carries its own
    ratio to the best fixed budget; the plain auto stays the run's verdict. Bad labels are refused by name."""
    res = bench(tmp_path, "prompts", "--pair", "lab", "--prompts", "lab:code", "--n-prompts", "1", "--budgets", "4",
                "16", "auto", "AUTO:Memory=64,explore=0.5", "--max-new-tokens", "8", "--device", "cpu", "--dtype",
                "float32", "--attention", "sdpa", "--repeats", "1")
    rows = {r["budget"]: r for r in res["rows"] if r["method"] == "ddtree"}
    assert set(rows) == {4, 16, "auto", "auto:memory=64,explore=0.5"}
    plain, variant = rows["auto"], rows["auto:memory=64,explore=0.5"]
    assert variant["auto"]["memory"] == 64 and variant["auto"]["explore"] == 0.5 and plain["auto"]["memory"] == 2048
    best = rows[res["best_budget"]]
    for r in (plain, variant):
        assert r["vs_best_fixed"] == r["tokens_per_second"] / best["tokens_per_second"]
        assert r["vs_best_fixed_same_outputs"]["prompts"] == 1 and r["vs_best_fixed_band"]["centre"] > 0
    assert res["auto_vs_best_fixed"] == plain["vs_best_fixed"]
    for bad, needle in (("auto:memory=0", "memory must be"), ("auto:depth=3", "key one of"),
                        ("auto:memory=lots", "memory wants int")):
        with pytest.raises(SystemExit):
            bench(tmp_path, "prompts", "--pair", "no-such-pair", "--budgets", "16", bad, "--device", "cpu")
        assert needle in capsys.readouterr().err


def test_prompts_says_when_a_text_differs_from_ar_and_what_gives_ar_text(tmp_path, capsys, monkeypatch):
    """A method whose text differs from AR's (as bf16 numerics do) is counted, and the line names the cure."""
    import ddtree_lab.bench.e2e as e2e

    real = e2e.generate

    def one_token_off_for_dflash(pair, prompt, **kw):
        res = real(pair, prompt, **kw)
        if kw["method"] == "dflash" and len(res.tokens) > 2:
            res.tokens = res.tokens[:2] + [(res.tokens[2] + 1) % pair.target.cfg.vocab_size] + res.tokens[3:]
        return res

    monkeypatch.setattr(e2e, "generate", one_token_off_for_dflash)
    res = bench(tmp_path, "prompts", "--pair", "lab", "--prompts", "lab:code", "--n-prompts", "1", "--budgets", "4",
                "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa",
                "--repeats", "1")
    rows = {r["method"]: r for r in res["rows"]}
    assert not rows["dflash"]["lossless"] and rows["ddtree"]["lossless"]
    err = capsys.readouterr().err
    assert "texts: 1 of 2 methods differ from AR's" in err and "--attention invariant" in err


def test_source_digest_is_stable():
    assert source_digest() == source_digest()


def test_tree_kernels_choice_reaches_the_engine(tmp_path, tiny_dir, monkeypatch, use_options):
    from ddtree_lab import tree

    use_options()  # run_bench_cli sets process-wide choices: restore them after this test
    calls, topk_calls = [], []
    real = tree.beam_candidates
    monkeypatch.setattr(tree, "beam_candidates", lambda *a: calls.append(a) or real(*a))
    from ddtree_lab.kernels import vocab_topk
    real_topk = vocab_topk.vocab_topk
    monkeypatch.setattr(vocab_topk, "vocab_topk", lambda *a: topk_calls.append(a) or real_topk(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton kernels: a GPU, or the interpreter
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--budgets", "4", "--rounds", "2", "--prompt-len", "8",
                "--device", device, "--dtype", "float32", "--attention", "sdpa", "--tree-kernels", "triton",
                "--tree-build", "fused", "--tree-topk", "triton")
    chosen = options.current()
    assert res["tree_kernels"] == "triton" and chosen.tree_kernels == "triton" and calls
    assert res["tree_build"] == "fused" and chosen.tree_build == "fused"
    assert res["tree_topk"] == "triton" and chosen.tree_topk == "triton" and topk_calls
    use_options(tree_build=None)
    assert tree.use_triton("cpu")  # chosen explicitly: the interpreter runs the kernels here
    a = torch.randn(3, 50)
    assert torch.equal(tree.build_tree(a, 8).tokens, tree.build_tree(a, 8, method="sort").tokens)
    assert tree.build_tree(torch.randn(2, 300), 200).tokens.shape[0] == 200  # too wide to count: sorts


def test_device_kernels_go_to_the_stage_running_when_they_start():
    """GPU events (Triton's too, launched outside torch ops) are attributed by their GPU start time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from ddtree_lab.bench.e2e import _device_work
    from ddtree_lab.trace import STAGES

    def ev(name, dev, start, end, kind="kernel"):
        return SimpleNamespace(name=lambda: name, device_type=lambda: dev, start_ns=lambda: start,
                               end_ns=lambda: end, duration_ns=lambda: end - start, activity_type=lambda: kind)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [ev("prefill", cpu, 0, 10), ev("draft", cpu, 20, 25), ev("tree_build", cpu, 40, 45),
              ev("aten::mm", cpu, 21, 22),                                   # a host op: not device work
              ev("prefill_gemm", gpu, 5, 15), ev("drafter_gemm", gpu, 26, 35),  # runs after draft's span ends
              ev("_beam_step_kernel", gpu, 41, 50), ev("empty", gpu, 60, 60),
              ev("draft", gpu, 20, 39, "gpu_user_annotation"), ev("sync", gpu, 36, 39, "cuda_sync")]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    work = _device_work(prof, STAGES)
    assert work == [("draft", "drafter_gemm", 0.009), ("tree_build", "_beam_step_kernel", 0.009)]


def test_attention_launch_choices_for_a_whole_run(tmp_path, tiny_dir, monkeypatch, use_options):
    """--attn-config sets Triton attention's launch choices for the run (options.attention_launch, which the
    verify path passes to the kernel); --host-read-lag the decoding loop's."""
    from ddtree_lab.bench.cli import parse_attn_config
    from ddtree_lab.decode import host_read_lag
    from ddtree_lab.kernels import tree_attention as ta

    use_options(host_read_lag=0)
    assert parse_attn_config(["min_chunk=128", "waves=4"]) == {"min_chunk": 128, "waves": 4.0}
    with pytest.raises(ValueError, match="min_chunks=1"):
        parse_attn_config(["min_chunks=1"])
    with pytest.raises(ValueError, match="'split_target=x': split_target takes an integer"):
        parse_attn_config(["split_target=x"])
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--budgets", "4", "--rounds", "2", "--prompt-len", "8",
                "--device", "cpu", "--dtype", "float32", "--attention", "sdpa", "--attn-config", "num_splits=3",
                "--host-read-lag", "1")
    launch = dict(options.current().attention_launch)
    assert res["attn_config"] == {"num_splits": 3} and launch == {"num_splits": 3}
    assert res["host_read_lag"] == 1 and host_read_lag("cpu") == 1
    cpu = torch.device("cpu")
    assert ta.launch_config(1, 4, 64, 4096, 8, cpu, launch)["num_splits"] == 3


def test_moe_launch_choices_for_a_whole_run(tmp_path, tiny_dir, use_options):
    """--moe-config sets the fused-MoE launch overrides for the run (options.moe_launch) and --pdl the launches as
    programmatic dependents (options.launch_pdl), both recorded in the JSON; a key the kernel does not take is
    refused by name."""
    from ddtree_lab.bench.cli import parse_moe_config

    use_options()
    assert parse_moe_config(["SPLIT_K_UP=1", "BLOCK_N_DOWN=128"]) == {"SPLIT_K_UP": 1, "BLOCK_N_DOWN": 128}
    with pytest.raises(ValueError, match="--moe-config 'SPLIT_K=2'"):
        parse_moe_config(["SPLIT_K=2"])
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--budgets", "4", "--rounds", "2", "--prompt-len", "8",
                "--device", "cpu", "--dtype", "float32", "--attention", "sdpa", "--moe-config", "SPLIT_K_UP=3",
                "--pdl")
    assert res["moe_config"] == {"SPLIT_K_UP": 3} and dict(options.current().moe_launch) == {"SPLIT_K_UP": 3}
    assert res["pdl"] is True and options.current().launch_pdl is True


def test_e2e_variants_take_turns_on_one_model_and_report_their_ratios(tmp_path, tiny_dir, monkeypatch, use_options):
    """--variants: each run again under other engine choices, on the same model, every variant once a repeat in an
    order rotated by one (so none always runs first); the rows are the run's own choices at their median repeat;
    each variant's over_base is the median of its per-repeat ratios to the run's own. The choices hold only
    during their variant's runs."""
    from ddtree_lab.bench import e2e

    use_options()
    seen = []
    real = e2e.generate
    monkeypatch.setattr(e2e, "generate", lambda pair, prompt, **kw: seen.append(
        (options.current().launch_pdl, dict(options.current().moe_launch), kw["method"], kw["trace"]))
        or real(pair, prompt, **kw))
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--methods", "ar", "ddtree", "--budgets", "4",
                "--rounds", "3", "--prompt-len", "8", "--device", "cpu", "--dtype", "float32", "--attention", "sdpa",
                "--variants", "pdl", "moe-config SPLIT_K_UP=2 pdl", "--repeats", "3")
    assert [(v["label"], v["options"]) for v in res["variants"]] == [
        ("pdl", {"launch_pdl": True}), ("moe-config SPLIT_K_UP=2 pdl", {"moe_launch": {"SPLIT_K_UP": 2},
                                                                     "launch_pdl": True})]
    assert "--variants pdl 'moe-config SPLIT_K_UP=2 pdl' --repeats 3" in res["command"]
    assert options.current().launch_pdl is False and not options.current().moe_launch  # restored after each
    # per repeat: 3 variants x 2 runs x (warm-up + timed); who ran when, from the choices each generate saw
    per_run = [seen[i] for i in range(0, len(seen), 2)]
    kinds = [(pdl, moe.get("SPLIT_K_UP")) for pdl, moe, method, _ in per_run if method == "ar"]
    base, pdl, both = (False, None), (True, None), (True, 2)
    assert kinds == [base, pdl, both, pdl, both, base, both, base, pdl]  # rotated by one each repeat
    for r in res["rows"]:
        reps = r["round_seconds_repeats"]
        assert len(reps) == 3 and r["round_seconds"] == sorted(reps)[1]
    for v in res["variants"]:
        for r, own in zip(v["rows"], res["rows"], strict=True):
            ratios = sorted(a / b for a, b in zip(r["round_seconds_repeats"], own["round_seconds_repeats"]))
            assert r["over_base"] == pytest.approx(ratios[1]) and r["over_base_range"] == pytest.approx(
                [ratios[0], ratios[-1]])


def test_e2e_variants_are_refused_in_one_line_unless_they_change_an_engine_choice(tiny_dir, capsys):
    from ddtree_lab.bench.cli import variant_arg

    assert variant_arg("no-overlap-shared") == {"label": "no-overlap-shared", "options": {"overlap_shared": False}}
    assert variant_arg("overlap-shared")["options"] == {"overlap_shared": True}
    assert variant_arg("--dense-products skinny")["options"] == {"dense_products": "skinny"}  # dashes may stay
    p = argparse.ArgumentParser()
    add_bench_args(p)
    for bad, why in ((["pdl --bogus"], "not an engine choice: --bogus"), ([""], "changes no engine choice"),
                     (["tree-build bad"], "invalid choice: 'bad'"), (["moe-config FOO=1"], "'FOO=1'"),
                     (["compile-mode default"], "not an engine choice: compile-mode")):
        with pytest.raises(SystemExit):
            p.parse_args(["e2e", "--model", str(tiny_dir), "--variants", *bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert why in err[-1] and "Traceback" not in "".join(err)
    # a variant the run's own choices already make (here the default) is refused before anything runs
    from ddtree_lab.cli import main

    out = tiny_dir / "same.json"
    assert main(["bench", "e2e", "--model", str(tiny_dir), "--device", "cpu", "--variants", "overlap-shared",
                 "--out", str(out)]) == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert "'overlap-shared' changes nothing" in err[-1] and "Traceback" not in "".join(err)


def test_compile_mode_reaches_every_compiled_function(tmp_path, tiny_dir, monkeypatch, use_options):
    use_options()  # restored after the test
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn.__qualname__, kw)) or fn)
    res = bench(tmp_path, "e2e", "--model", str(tiny_dir), "--budgets", "4", "--rounds", "2", "--prompt-len", "8",
                "--device", "cpu", "--dtype", "float32", "--attention", "sdpa", "--compile",
                "--compile-mode", "max-autotune-no-cudagraphs")
    assert res["compile_mode"] == "max-autotune-no-cudagraphs"
    names = {name for name, _ in seen}
    assert {"DecoderLayer.attention_inputs_into", "DecoderLayer.attention_output", "RMSNorm.forward",
            "DrafterLayer.context_kv"} <= names
    assert all(kw.get("mode") == "max-autotune-no-cudagraphs" for _, kw in seen)


def test_prompts_band_resamples_prompts_and_rechooses_the_best():
    from ddtree_lab.bench.e2e import prompts_band

    def row(secs):
        return {"tokens_per_prompt": [10] * len(secs), "seconds_per_prompt_per_repeat": [secs, [3 * x for x in secs], secs]}

    a = row([1.0, 1.0, 1.0, 1.0])
    band = prompts_band(row([1.0, 1.0, 1.0, 1.0]), [a], n_boot=300)       # auto = the one fixed budget
    assert band["low"] == band["high"] == 1.0 and band["at_least_best"] == 1.0
    band = prompts_band(row([1.25] * 4), [a], n_boot=300)                 # 1.25 × slower on every prompt
    assert band["low"] == band["high"] == pytest.approx(0.8) and band["at_least_floor"] == 0.0
    # budget b is faster on two prompts of four: which fixed budget is best changes with the resample
    b = row([0.5, 0.5, 2.0, 2.0])
    band = prompts_band(row([1.0, 1.0, 1.0, 1.0]), [a, b], n_boot=300)
    assert band["high"] == pytest.approx(1.0) and band["low"] < 0.9 and 0.0 < band["at_least_best"] < 1.0
    assert band["centre"] == pytest.approx(1.0)  # the whole set: a 40 tokens in 4 s, b in 5 s, so a is the best


def test_timed_passes_warm_up_then_rotate_the_runs(tmp_path, monkeypatch):
    """The one loop of the timing benches: untimed, the caches grown, each prompt length once and a pass of every
    run; then each repeat runs every run over all prompts, in an order rotated by one, under the run's options."""
    import ddtree_lab as dl
    import ddtree_lab.bench.e2e as e2e

    pair = dl.load_pair("lab")
    calls = []
    real = e2e.generate

    def counted(pair, prompt, **kw):
        calls.append((kw.get("method"), kw.get("budget"), kw.get("max_new_tokens"), options.current().candidate_pools))
        return real(pair, prompt, **kw)

    monkeypatch.setattr(e2e, "generate", counted)
    runs = [e2e.Run("ar", "ar"), e2e.Run("ddtree 4", budget=4),
            e2e.Run("shared", budget=dl.AutoBudget(budgets=(2, 4)), options=(("candidate_pools", "shared"),))]
    passes, orders = e2e.timed_passes(pair, ["def f(x):", "class A:"], runs, repeats=3, max_new_tokens=5,
                                      round_times=True)
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert calls[0] == ("ddtree", 4, 5, None)                                    # the caches grown
    assert calls[1:3] == [("ar", None, 2, None)] * 2                            # each prompt length once
    assert [c[:2] for c in calls[3:9]] == [("ar", None)] * 2 + [("ddtree", 4)] * 2 + [("ddtree", runs[2].budget)] * 2
    assert len(calls) == 9 + 3 * 3 * 2 and {c[3] for c in calls if c[1] is runs[2].budget} == {"shared"}
    assert options.current().candidate_pools is None                            # put back after each call
    for run_passes in passes:
        assert len(run_passes) == 3 and all(len(p.results) == 2 for p in run_passes)
        p = run_passes[0]
        assert p.tokens == 10 and p.captures == {"round": 0, "prefill": 0}     # the CPU captures nothing
        assert p.seconds == sum(r.wall_seconds for r in p.results) and p.rounds == len(p.taus)
        assert all(len(r.round_stage_seconds) == len(r.acceptance_lengths) for r in p.results)
    per_repeat, median, nearest = e2e.median_repeat(passes[1])
    assert sorted(per_repeat)[1] == median == per_repeat[nearest]


def test_auto_overhead_against_fixed_b_repeat_by_repeat(tmp_path):
    res = bench(tmp_path, "auto-overhead", "--pair", "lab", "--n-prompts", "1", "--budget", "4", "--max-new-tokens",
                "6", "--repeats", "2", "--pools", "--device", "cpu")
    assert res["kind"] == "auto-overhead" and res["budget"] == 4 and res["n_prompts"] == 1
    assert res["command"].startswith("ddtree-lab bench auto-overhead ") and "--pools" in res["command"]
    assert "--budget 4" in res["command"] and f"--out {tmp_path / 'bench.json'}" in res["command"]
    runs = res["runs"]
    assert list(runs)[:4] == ["fixed 4", "fixed 8", "auto over (4,)", "auto over (4,), one pool"]
    assert len(runs) == 2 + 2 * 5 and len(res["order_per_repeat"]) == 2
    for row in runs.values():
        assert len(row["vs_fixed_per_repeat"]) == 2 and row["tokens_per_second"] > 0
        assert row["prompts_alike_first_run"] == 1  # float32: every run emits fixed 4's tokens
    assert runs["fixed 4"]["vs_fixed"] == 1.0
    assert set(runs["auto over (4, 32), 32 priced out"]["budget_rounds"]) == {"4"}  # 32 priced out: never run
    with pytest.raises(ValueError, match="--budget 256: bench auto-overhead also runs 128 and 2048; give 2..128"):
        bench(tmp_path, "auto-overhead", "--pair", "no-such-pair", "--budget", "256", "--device", "cpu")


def test_auto_rounds_per_round_stage_medians_by_budget(tmp_path):
    res = bench(tmp_path, "auto-rounds", "--pair", "lab", "--n-prompts", "1", "--budget", "4", "--max-new-tokens",
                "8", "--repeats", "2", "--device", "cpu")
    runs = res["runs"]
    assert list(runs) == ["fixed 4", "fixed 8", "fixed 2", "auto over (2, 4, 8)", "auto over (4,)",
                          "auto over (4, 8), 8 priced out"]
    for name, row in runs.items():
        assert row["captures_in_timed_passes"] == 0 == row["prefill_captures_in_timed_passes"]  # no graphs on a CPU
        for budget, cell in row["by_budget"].items():
            assert cell["rounds"] > 0 and set(cell["us_median"]) == {"draft", "tree_build", "verify", "commit", "other"}
            assert cell["us_median"]["verify"] > 0 and cell["us_median_of_the_four_stages"] > 0
    assert set(runs["fixed 8"]["by_budget"]) == {"8"} and set(runs["auto over (4, 8), 8 priced out"]["by_budget"]) == {"4"}


def test_moe_counting_reads_the_expert_counts_of_a_traced_round(tmp_path, tmp_path_factory, tiny_dir):
    moe = tmp_path_factory.mktemp("moe_pair")
    make_tiny_pair(moe, arch="qwen3_moe")
    res = bench(tmp_path, "moe-counting", "--model", str(moe), "--budget", "8", "--prompt-len", "12",
                "--max-new-tokens", "6", "--repeats", "2", "--reads", "3", "--device", "cpu")
    assert len(res["rows"]) == 2 and all(r["round_ms"] > 0 and r["count_ms"] > 0 for r in res["rows"])
    assert res["median_share"] == pytest.approx(sorted(r["share"] for r in res["rows"])[0] / 2
                                                + sorted(r["share"] for r in res["rows"])[1] / 2)
    with pytest.raises(ValueError, match="no MoE layer"):
        bench(tmp_path, "moe-counting", "--model", str(tiny_dir), "--device", "cpu")


def test_a_kernel_bench_smoke_run_needs_no_interpreter_flag_from_the_user(tmp_path):
    """`python -m ddtree_lab.bench.fused_moe --smoke` on a machine without a GPU runs the kernels under Triton's
    interpreter without being told to (the README's CPU machine), and writes its rows."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, "-m", "ddtree_lab.bench.fused_moe", "--smoke", "--tokens", "1", "--out",
                          str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [r["T"] for r in json.loads(out.read_text())["rows"]] == [1]


def test_a_choice_that_is_on_unless_turned_off_keeps_its_off_in_the_recorded_command(tiny_dir):
    """--no-overlap-shared (the shared expert after the routed ones) is spelled out in a JSON's `command`, so
    running that command again makes the same choice; left alone, the choice stays the engine's default."""
    from ddtree_lab.bench.cli import command_line, run_options

    p = argparse.ArgumentParser()
    add_bench_args(p)
    off = p.parse_args(["e2e", "--model", str(tiny_dir), "--no-overlap-shared"])
    assert run_options(off)["overlap_shared"] is False and "--no-overlap-shared" in command_line(off)
    again = p.parse_args(shlex.split(command_line(off))[2:])  # after "ddtree-lab bench"
    assert run_options(again)["overlap_shared"] is False
    plain = p.parse_args(["e2e", "--model", str(tiny_dir)])
    assert "overlap_shared" not in run_options(plain) and "overlap-shared" not in command_line(plain)
