"""bench census: an eager round's kernels and activation bytes counted on the meta device. The counting rule
against a direct count on small ops; the census's invariants on real shapes (a layer adds the same kernels,
Triton's declared routing is one launch, trees move more bytes than AR steps); the CLI and its refusal."""
import json

import pytest
import torch

from ddtree_lab.bench import census as C
from ddtree_lab.cli import main


def _count(fn):
    stage, sink = C.StageCensus(), []
    with C._CountOps(sink):
        sink.append(stage)
        fn()
    return stage


def test_an_op_is_a_kernel_and_its_bytes_are_its_tensors():
    x = torch.ones(4, 8, device="meta", dtype=torch.bfloat16)
    w = torch.ones(16, 8, device="meta", dtype=torch.bfloat16)
    s = _count(lambda: (x * 2 + 1).view(32))
    assert s.kernels == 2 and s.by_op == {"aten.mul": 1, "aten.add": 1}  # the view launches nothing
    assert s.activation_bytes == 2 * (64 + 64)                          # each reads x's size and writes it
    s = _count(lambda: torch.nn.functional.linear(x, w))                # a matmul: activations and output
    assert s.kernels == 1 and s.activation_bytes == 64 + 4 * 16 * 2
    table, idx = torch.ones(1000, 8, device="meta"), torch.zeros(3, dtype=torch.long, device="meta")
    assert _count(lambda: table[idx]).activation_bytes == 2 * 3 * 8 * 4  # a gather moves its rows, not the table
    cache, rows = torch.ones(100, 8, device="meta"), torch.ones(2, 8, device="meta")
    s = _count(lambda: cache.index_copy_(0, idx[:2], rows))               # an in-place write: what it writes
    assert s.kernels == 1 and s.activation_bytes == 2 * (2 * 8 + 2 * 8 * 4)


def test_compile_fuses_the_runs_between_the_kernels_it_leaves_alone():
    """A matmul (or a sort, a Triton launch) ends a run of fusible ops; each run counts once however long."""
    x = torch.ones(4, 8, device="meta", dtype=torch.bfloat16)
    w = torch.ones(16, 8, device="meta", dtype=torch.bfloat16)
    s = _count(lambda: torch.nn.functional.linear((x * 2 + 1).exp(), w).neg().topk(2))
    assert (s.kernels, s.extern, s.fused_runs) == (6, 2, 2)  # [mul add exp] linear [neg] topk
    s = _count(lambda: (x * 2).sum())
    assert (s.extern, s.fused_runs) == (0, 1)


@pytest.mark.parametrize("shape", ["qwen3-8b", "kimi-k2.6-ep8-rank"])
def test_a_layers_extern_kernels_are_its_matmuls_and_triton_launches(shape):
    """layer_census: what each further layer adds. The kernels compile leaves alone are the layer's matmuls and
    its Triton launches outside the PRICED modules (a Kimi layer's MLA and MoE kernels are priced apart); the
    fusible ones come in runs between them, fewer than the fusible ops."""
    extern, runs = C.layer_census(shape, "verify")
    a, b = (C.round_census(f"random:{shape}@{n}", "ddtree", C.LAYER_BUDGET, 512)["verify"] for n in C.LAYER_DEPTHS)
    layers = C.LAYER_DEPTHS[1] - C.LAYER_DEPTHS[0]
    triton = sum(b.by_op[k] - a.by_op[k] for k in b.by_op if k.startswith("triton.")
                 and k.split(".")[1] not in C.PRICED)
    assert extern == ((b.matmuls - a.matmuls) + triton) / layers
    fusible = (b.kernels - a.kernels) / layers - extern
    assert 1 <= runs < fusible / 4


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3-30b-a3b", "kimi-k2.6-tp8-rank"])
def test_each_layer_adds_the_same_kernels(shape):
    """Depths 2, 3 and 4 of one shape: an AR step's kernels grow by one layer's worth each time (a MoE or MLA
    layer launches a fixed set, whatever its depth; a DDTree verify also gathers the drafter's layers, which
    move with the depth), and nothing in the census depends on data."""
    counts = [C.round_census(f"random:{shape}@{n}", "ar", None, 512)["verify"] for n in (2, 3, 4)]
    total = [s.kernels + sum(s.priced.values()) for s in counts]
    assert total[2] - total[1] == total[1] - total[0] > 10
    assert counts[2].activation_bytes - counts[1].activation_bytes == counts[1].activation_bytes - counts[0].activation_bytes


def test_moe_and_mla_kernels_are_counted_apart_and_declared_routing_in_triton_is_one_launch():
    """The census counts the MoE and MLA launches apart; a declared routing in Triton is one launch a layer, which
    in AR's step sorts the pairs too."""
    model = "random:kimi-k2.6-ep8-rank@3"  # one dense layer, two MoE layers
    torch_, triton_ = (C.round_census(model, "ar", None, 4096, declared_routing=d)["verify"]
                       for d in ("torch", "triton"))
    assert triton_.by_op["triton.declared_route._declared_route_kernel"] == 2
    assert "triton.declared_route._declared_route_kernel" not in torch_.by_op
    assert torch_.kernels - triton_.kernels > 2 * 10                      # torch's routing: many small launches
    assert triton_.priced["attention"] == torch_.priced["attention"]
    # AR's one token: the routing launch also sorts its pairs, so each MoE layer launches one expert kernel fewer
    assert triton_.by_op["triton.fused_moe._align_kernel"] == 0 and torch_.by_op["triton.fused_moe._align_kernel"] == 2
    assert triton_.priced["moe"] == torch_.priced["moe"] - 2
    assert triton_.priced["attention"] % 3 == 0 and triton_.priced["moe"] % 2 == 0  # per layer, per MoE layer


def test_a_tree_moves_more_activation_bytes_than_an_ar_step():
    ar = C.round_census("random:qwen3-8b@2", "ar", None, 512)["verify"]
    small, big = (C.round_census("random:qwen3-8b@2", "ddtree", b, 512)["verify"] for b in (16, 256))
    assert ar.activation_bytes < small.activation_bytes < big.activation_bytes
    # the elementwise traffic is per token: 16 times the tokens moves about 16 times the bytes (the LM head's
    # weight-free output and the fixed parts keep it from exact)
    assert 8 < big.activation_bytes / small.activation_bytes < 17


def test_bench_census_writes_rows_and_refuses_what_it_cannot_count(tmp_path, capsys):
    out = tmp_path / "census.json"
    assert main(["bench", "census", "--model", "random:qwen3-30b-a3b@2", "--methods", "ar", "ddtree",
                 "--budgets", "16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "census" and data["compile"] is False and data["declared_routing"] == "auto"
    ar, tree = data["rows"]
    assert "ar verify, kernels ÷ 2 layers by op: aten." in capsys.readouterr().err  # where the launches go
    assert set(tree["stages"]) == {"draft", "tree_build", "verify", "commit"} and set(ar["stages"]) == {"verify"}
    assert tree["kernels_per_round"] == sum(s["kernels"] + sum(s["priced_kernels"].values())
                                            for s in tree["stages"].values())
    assert main(["bench", "census", "--model", "lab", "--methods", "ar", "--out", str(tmp_path / "lab.json")]) == 0
    assert json.loads((tmp_path / "lab.json").read_text())["rows"][0]["stages"]["verify"]["kernels"] > 0
    assert main(["bench", "census", "--model", "no-such-pair", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no-such-pair" in err and "random:" in err and "Traceback" not in err


def test_a_census_is_the_same_warmed_up_once_or_for_every_round():
    """The census warms a pair up once per method (one-time tables); a fresh pair's count of the same round, or
    of a budget counted after others, is the same."""
    model = "random:qwen3-30b-a3b@2"
    first = {b: C.round_census(model, "ddtree", b, 512) for b in (64, 16)}
    C._PAIRS.clear()
    again = {b: C.round_census(model, "ddtree", b, 512) for b in (16, 64)}
    for b in first:
        assert {k: v.as_json() for k, v in first[b].items()} == {k: v.as_json() for k, v in again[b].items()}


def test_annotate_counts_each_row_of_an_e2e_file_under_its_own_settings(tmp_path, capsys):
    """An eager bench e2e JSON gains each row's census, counted with the file's model, context and routing (a
    file without `declared_routing` predates its kernel: torch); a budget="auto" row gets none, a compiled file
    of a random shape a layer's kernels instead."""
    e2e = {"kind": "e2e", "model": "random:qwen3-30b-a3b@2", "compile": False, "prompt_len": 256,
           "attention": "triton", "routing": "uniform",
           "rows": [{"method": "ar", "budget": None}, {"method": "ddtree", "budget": 16},
                    {"method": "ddtree", "budget": "auto"}]}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(e2e))
    assert main(["bench", "census", "--annotate", str(path), "--out", str(tmp_path / "c.json")]) == 0
    ar, tree, auto = json.loads(path.read_text())["rows"]
    assert "census" not in auto and set(ar["census"]) == {"verify"} and set(tree["census"]) == {"verify", "draft"}
    want = C.round_census("random:qwen3-30b-a3b@2", "ddtree", 16, 256, declared_routing="torch")
    for stage in ("verify", "draft"):
        got = tree["census"][stage]
        assert (got["kernels"], got["matmuls"], got["activation_bytes"]) == (
            want[stage].kernels, want[stage].matmuls, want[stage].activation_bytes)
    assert ar["census"]["verify"]["matmuls"] >= 2 * 3  # two layers' projections at least
    path.write_text(json.dumps({**e2e, "compile": True}))  # compiled: a layer's kernels, under its routing
    assert main(["bench", "census", "--annotate", str(path), "--out", str(tmp_path / "c.json")]) == 0
    annotated = json.loads(path.read_text())
    assert annotated["layer_census"] == {s: list(C.layer_census("qwen3-30b-a3b", s)) for s in ("ar", "verify")}
    assert "census" not in annotated["rows"][0]
    path.write_text(json.dumps({**e2e, "compile": True, "model": "lab"}))  # a pair's layers are not counted
    assert main(["bench", "census", "--annotate", str(path), "--out", str(tmp_path / "c.json")]) == 2
    assert "no random shape" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_a_checkpoint_is_counted_from_its_configs_as_the_loader_builds_it(tmp_path, arch):
    """A checkpoint directory's census builds its models from config.json alone (INT4 experts from its
    quantization_config), on the meta device: the same configs the loader builds from its tensors, and a round
    whose MoE and MLA kernels are counted apart."""
    from ddtree_lab.checkpoint import load_pair_dirs
    from ddtree_lab.testing import make_tiny_pair

    t, d = make_tiny_pair(tmp_path / arch, arch=arch, seed=1, tokenizer=False)
    if arch == "deepseek_v3":  # its routed experts INT4, as a Kimi checkpoint ships them
        from ddtree_lab import quant

        quant.write_int4_checkpoint(t, [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"])
    loaded = load_pair_dirs(t, d, device="cpu", dtype="float32")
    built = C._pair_from_configs(str(tmp_path / arch), "triton", "router")
    assert built.target.cfg == loaded.target.cfg and built.drafter.cfg == loaded.drafter.cfg
    counted = C.round_census(str(tmp_path / arch), "ddtree", 8, 24)["verify"]
    assert counted.kernels > 0 and counted.matmuls > 0
    if arch == "deepseek_v3":
        assert built.target.cfg.expert_int4_group == 32
        assert counted.priced["moe"] > 0 and counted.priced["attention"] > 0
    with pytest.raises(ValueError, match="no random shape"):
        C.round_census(str(tmp_path / "nothing"), "ar", None, 24)


def test_an_eager_gpu_bench_result_gets_each_rows_census_or_says_why_not(use_options):
    """bench e2e's annotation (run after the timing on a GPU): each fixed-budget row counted under the run's
    declared-routing choice; a routing it cannot count leaves the rows as timed and says why."""
    from ddtree_lab.bench.e2e import attach_census

    use_options(declared_routing="torch")
    out = {"model": "random:qwen3-30b-a3b@2", "compile": False, "prompt_len": 128, "attention": "triton",
           "routing": "uniform", "rows": [{"method": "ar", "budget": None}, {"method": "ddtree", "budget": "auto"}]}
    attach_census(out)
    want = C.round_census("random:qwen3-30b-a3b@2", "ar", None, 128, declared_routing="torch")["verify"]
    assert out["rows"][0]["census"]["verify"]["kernels"] == want.kernels and "census" not in out["rows"][1]
    traced = {**out, "routing": "trace:dump.jsonl", "rows": [{"method": "ar", "budget": None}]}
    attach_census(traced)
    assert "census" not in traced["rows"][0] and "trace:dump.jsonl" in traced["census_skipped"]
