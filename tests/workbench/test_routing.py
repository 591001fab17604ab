"""Routing dumps: the expert-union math against direct computation, each engine's format read into
routing.json, broken dumps refused in one line each, and the report's figures from routing.json."""
import ast
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the sample builders beside this file
import routing_samples as RS  # noqa: E402
from ddtree_lab import cli  # noqa: E402
from ddtree_lab.workbench import ingest as I, ingest_report, report, routing as R, routing_dumps as D  # noqa: E402
from ddtree_lab.workbench import routing_formats as F, routing_report  # noqa: E402
from ddtree_lab.workbench.jsonstream import MAX_BUILT_VALUES  # noqa: E402


# ----------------------------------------------------------------------------- direct computations
def slow_windows(seqs, T, bounds=None):
    """Per layer, Σ over windows of distinct experts and of the most on one rank, and the window count: sets."""
    layers = seqs[0].shape[1]
    touched, most, n = np.zeros(layers), np.zeros(layers), 0
    for ids in seqs:
        for s in range(len(ids) - T + 1):
            n += 1
            for l in range(layers):
                seen = set(ids[s:s + T, l, :].ravel().tolist())
                touched[l] += len(seen)
                if bounds is not None:
                    most[l] += max(sum(bounds[r] <= e < bounds[r + 1] for e in seen) for r in range(len(bounds) - 1))
    return n, touched, most


def exact_uniform(E, k, T, ranks):
    """(E[distinct], E[most on one rank]) by enumerating every T-tuple of k-subsets."""
    subsets = list(itertools.combinations(range(E), k))
    b = R.rank_bounds(E, ranks)
    total = top = 0.0
    for combo in itertools.product(subsets, repeat=T):
        seen = set().union(*combo)
        total += len(seen)
        top += max(sum(b[r] <= e < b[r + 1] for e in seen) for r in range(ranks))
    n = len(subsets) ** T
    return total / n, top / n


def monte_carlo(E, k, T, ranks, samples, seed=0):
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((samples * T, E)), axis=1)[:, :k].reshape(samples, T * k)
    hit = np.zeros((samples, E), dtype=bool)
    np.put_along_axis(hit, picks, True, axis=1)
    per_rank = np.add.reduceat(hit, R.rank_bounds(E, ranks)[:-1], axis=1)
    return hit.sum(axis=1).mean(), per_rank.max(axis=1).mean()


# ----------------------------------------------------------------------------- the math
@pytest.mark.parametrize("tokens,layers,k,experts,ranks", [(1, 1, 1, 4, 2), (7, 2, 2, 8, 4), (40, 3, 3, 12, 5),
                                                           (65, 2, 4, 32, 8)])
def test_window_sums_match_sets(tokens, layers, k, experts, ranks):
    ids = RS.routed(tokens, layers, k, experts, seed=tokens)
    bounds = R.rank_bounds(experts, ranks)
    got = R.window_sums(ids, R.WINDOWS, bounds)
    for T in (1, 2, 3, 4, 16, 64, tokens, tokens + 1):
        if T not in got:
            got[T] = R.window_sums(ids, (T,), bounds)[T]
        n, touched, most = slow_windows([ids], T, bounds)
        assert got[T].windows == n
        np.testing.assert_allclose(got[T].touched, touched)
        np.testing.assert_allclose(got[T].rank_max, most)


def test_windows_union_and_rank_max_are_means_and_never_cross_sequences():
    a, b = RS.routed(9, 2, 2, 8, seed=1), RS.routed(5, 2, 2, 8, seed=2)
    n, touched, most = slow_windows([a], 4, R.rank_bounds(8, 2))
    np.testing.assert_allclose(R.windows_union(a, 4), touched / n)
    np.testing.assert_allclose(R.windows_rank_max(a, 4, 8, 2), most / n)
    assert np.isnan(R.windows_union(b, 6)).all()  # shorter than the window
    joined = np.concatenate([a, b])
    sa, sb = R.window_sums(a, (4,))[4], R.window_sums(b, (4,))[4]
    assert sa.windows + sb.windows == 8 < R.window_sums(joined, (4,))[4].windows  # 3 windows span the seam


def test_a_token_naming_an_expert_twice_counts_it_once():
    ids = np.array([[[3, 3]], [[3, 1]]])
    np.testing.assert_allclose(R.windows_union(ids, 1), [1.5])
    np.testing.assert_allclose(R.windows_union(ids, 2), [2.0])


def test_bad_ids_are_refused():
    with pytest.raises(ValueError, match="tokens, layers, k"):
        R.window_sums(np.zeros((3, 4)), (1,))
    with pytest.raises(ValueError, match="≥ 0"):
        R.window_sums(-np.ones((3, 1, 2), dtype=int), (1,))


@pytest.mark.parametrize("E,k,T,ranks", [(4, 2, 1, 2), (4, 2, 2, 2), (6, 2, 2, 3), (5, 2, 3, 2), (7, 3, 2, 3),
                                         (6, 1, 3, 4)])
def test_uniform_exact_small_cases(E, k, T, ranks):
    union, most = exact_uniform(E, k, T, ranks)
    assert R.uniform_union(E, k, T) == pytest.approx(union, rel=1e-12)
    assert R.uniform_rank_max(E, k, T, ranks) == pytest.approx(most, rel=1e-9)
    assert R.uniform_rank_mean(E, k, T, ranks) == pytest.approx(union / ranks, rel=1e-12)


@pytest.mark.parametrize("E,k,T,ranks", [(384, 8, 1, 8), (384, 8, 33, 8), (384, 8, 1025, 8), (128, 8, 16, 8),
                                         (64, 6, 4, 6)])
def test_uniform_against_monte_carlo(E, k, T, ranks):
    union, most = monte_carlo(E, k, T, ranks, samples=max(200, 40_000 // T))
    assert R.uniform_union(E, k, T) == pytest.approx(union, rel=0.01)
    assert R.uniform_rank_max(E, k, T, ranks) == pytest.approx(most, rel=0.02)


def test_union_size_distribution():
    pmf = R.union_size_pmf(384, 8, (1, 2, 33, 1025))
    assert pmf[1][8] == pytest.approx(1.0) and pmf[1].sum() == pytest.approx(1.0)
    for T, p in pmf.items():
        assert p.sum() == pytest.approx(1.0, abs=1e-12) and (p >= -1e-15).all()
        assert p @ np.arange(385) == pytest.approx(R.uniform_union(384, 8, T), rel=1e-10)
    # everything touched: every rank then holds its whole block
    assert R.max_given_size(384, 8)[384] == pytest.approx(48.0)
    assert R.uniform_rank_max(8, 8, 1, 4) == pytest.approx(2.0)


def test_rank_placement():
    b = R.rank_bounds(384, 8)
    e = np.arange(384)
    assert (R.rank_of(e, b) == e // 48).all()
    sizes = np.diff(R.rank_bounds(10, 4))
    assert sizes.sum() == 10 and sizes.max() - sizes.min() <= 1
    with pytest.raises(ValueError, match="at least as many experts"):
        R.rank_bounds(4, 8)


def test_windows_are_the_budgets_with_their_root():
    assert R.WINDOWS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1025)


def test_routing_math_is_torch_free_and_dumps_load_torch_only_inside():
    for mod, banned in ((R, {"torch", "triton", "plotly"}), (D, {"torch", "triton", "plotly"}),
                        (F, {"torch", "triton", "plotly"})):
        tree = ast.parse(Path(mod.__file__).read_text())
        top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not top & banned, (mod.__name__, top)
    for mod in (R, D):
        tree = ast.parse(Path(mod.__file__).read_text())
        anywhere = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "torch" not in anywhere, mod.__name__


# ----------------------------------------------------------------------------- formats
def _entry(doc, name):
    return next(e for e in doc["files"] if Path(e["file"]).name == name)


def _check_windows(entry, seqs, experts, k, ranks=8, live=None):
    """Every window row of an entry against the set-based computation over the file's sequences."""
    bounds = R.rank_bounds(experts, ranks)
    live = list(range(seqs[0].shape[1])) if live is None else live
    assert [r["tokens"] for r in entry["windows"]] == [T for T in R.WINDOWS if T <= max(len(s) for s in seqs)]
    for row in entry["windows"][:6]:
        n, touched, most = slow_windows(seqs, row["tokens"], bounds)
        assert row["windows"] == n
        np.testing.assert_allclose(row["per_layer"], touched[live] / n, rtol=1e-5)
        assert row["touched"] == pytest.approx((touched[live] / n).mean(), rel=1e-5)
        assert row["rank_max"] == pytest.approx((most[live] / n).mean(), rel=1e-5)
        assert row["rank_mean"] == pytest.approx(row["touched"] / ranks, rel=1e-5)
        assert row["uniform"] == pytest.approx(R.uniform_union(experts, k, row["tokens"]), rel=1e-5)
        assert row["uniform_rank_max"] == pytest.approx(R.uniform_rank_max(experts, k, row["tokens"], ranks), rel=1e-5)


def test_vllm_responses_npy_and_nested_lists(tmp_path):
    """JSON lines of chat completions (the server's .npy base64, and nested lists), the dense layer 0 dropped."""
    a, b = RS.routed(70, 4, 2, 16, seed=1, dense=(0,)), RS.routed(30, 4, 2, 16, seed=2, dense=(0,))
    c = RS.routed(20, 4, 2, 16, seed=3, dense=(0,))
    request_output = {"request_id": "0", "prompt": "def", "prompt_token_ids": [1, 2], "finished": True,
                      "outputs": [{"index": 0, "text": " parse", "token_ids": [3], "routed_experts": c.tolist()}]}
    (tmp_path / "vllm.jsonl").write_text(RS.jsonl(RS.vllm_chat(a, b), request_output))
    ext, doc = I.ingest_all([tmp_path])
    assert ext["runs"] == [] and ext["unrecognised"] == [] and doc["unread"] == []
    e = _entry(doc, "vllm.jsonl")
    assert (e["format"], e["kind"], e["model"], e["sequences"], e["tokens"]) == \
           ("vllm routed_experts", "windows", "Qwen/Qwen3-30B-A3B", 3, 120)
    assert (e["layers"], e["moe_layers"], e["dense_layers"], e["top_k"], e["top_k_source"]) == (4, 3, [0], 2, "file")
    assert (e["experts"], e["experts_source"], e["ep_ranks"], e["truncated"], e["refused"]) == \
           (16, "inferred", 8, False, [])
    _check_windows(e, [a, b, c], 16, 2, live=[1, 2, 3])


@pytest.mark.parametrize("layout", ["array", "pretty", "one"])
def test_sglang_generate_responses_flat_int32(tmp_path, layout):
    """SGLang's flat base64 int32 ids, shaped by meta_info's token counts, k inferred (or --top-k)."""
    seqs = [RS.routed(40, 3, 4, 24, seed=s, dense=(2,)) for s in range(3)]
    responses = [RS.sglang_generate(s, prompt_tokens=12) for s in seqs]
    text = {"array": json.dumps(responses), "pretty": "\n".join(json.dumps(r, indent=2) for r in responses),
            "one": json.dumps(responses[0], indent=1)}[layout]
    (tmp_path / "sglang.json").write_text(text)
    e = _entry(I.ingest_all([tmp_path])[1], "sglang.json")
    used = seqs if layout != "one" else seqs[:1]
    assert (e["format"], e["sequences"], e["top_k"], e["top_k_source"], e["moe_layers"], e["dense_layers"]) == \
           ("sglang routed_experts", len(used), 4, "inferred", 2, [2])
    _check_windows(e, used, 24, 4, live=[0, 1])
    with_k = _entry(I.ingest_all([tmp_path], options=D.RoutingOptions(top_k=4, experts=24))[1], "sglang.json")
    assert (with_k["top_k_source"], with_k["experts_source"]) == ("--top-k", "--experts") or \
           with_k["top_k_source"] == "file"


def test_sglang_recorder_per_token_and_stat(tmp_path):
    import torch
    phys = np.tile(np.arange(16), (3, 1))
    ids = RS.routed(12, 3, 2, 16, seed=4, dense=(0,))
    torch.save(RS.recorder_per_token([(ids, [8, 4], list(range(8)) + [0, 1, 2, 3]), (ids[:5], None, [9] * 5)], phys),
               tmp_path / "expert_distribution_recorder_1.0_0.pt")
    counts = np.zeros((4, 3, 16), dtype=int)
    counts[:, 1:, :5] = 2  # 4 passes, 5 tokens × k 2 over 10 experts... counts sum to tokens·k per MoE layer
    counts[:, 1:, 5] = 0
    torch.save(RS.recorder_stat(counts), tmp_path / "expert_distribution_recorder_2.0.pt")
    doc = I.ingest_all([tmp_path])[1]
    e = _entry(doc, "expert_distribution_recorder_1.0_0.pt")
    assert (e["format"], e["kind"], e["experts"], e["experts_source"], e["top_k"]) == \
           ("sglang expert distribution", "windows+forwards", 16, "file", 2)
    assert (e["sequences"], e["forwards"], e["moe_layers"]) == (2, 2, 2)  # the pass's two prefill chunks
    _check_windows(e, [ids[:8], ids[8:12]], 16, 2, live=[1, 2])
    fw = {r["tokens"]: r for r in e["forward_passes"]}
    assert set(fw) == {12, 5}
    assert fw[12]["touched"] == pytest.approx(np.mean([len(set(ids[:, l].ravel())) for l in (1, 2)]))
    assert [u["file"] for u in doc["unread"]] == [str(tmp_path / "expert_distribution_recorder_2.0.pt")]
    assert "--top-k" in doc["unread"][0]["reason"]
    stat = _entry(I.ingest_all([tmp_path], options=D.RoutingOptions(top_k=2))[1], "expert_distribution_recorder_2.0.pt")
    assert (stat["experts"], stat["experts_source"], stat["forwards"], stat["dense_layers"]) == (16, "file", 4, [0])
    assert [(r["tokens"], r["forwards"], r["touched"]) for r in stat["forward_passes"]] == [(5, 4, 5.0)]


def test_sglang_recorder_per_pass_counts_physical_slots_to_experts(tmp_path):
    """per_pass mode: tokens per physical slot per pass, mapped to experts (a redundant copy of expert 3 in slot 8)."""
    import torch
    to_logical = np.tile(np.r_[np.arange(8), 3], (2, 1))   # 2 layers, 9 slots holding experts 0..7 and 3 again
    counts = np.zeros((2, 9), dtype=np.int32)
    counts[1, [0, 3, 5, 8]] = [2, 1, 2, 1]                  # layer 0 dense; 3 tokens × k 2 in layer 1
    rec = {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
           "global_physical_count": torch.from_numpy(counts)}
    torch.save({"records": [rec], "last_physical_to_logical_map": torch.from_numpy(to_logical)}, tmp_path / "pp.pt")
    e = _entry(I.ingest_all([tmp_path], options=D.RoutingOptions(top_k=2, ep_ranks=2))[1], "pp.pt")
    assert (e["experts"], e["dense_layers"], e["moe_layers"], e["ep_ranks"]) == (8, [0], 1, 2)
    [row] = e["forward_passes"]
    assert (row["tokens"], row["touched"], row["rank_max"]) == (3, 3.0, 2.0)  # experts 0, 3 on rank 0; 5 on rank 1


def test_our_traces_are_forwards_at_the_rounds_tokens(tmp_path):
    rows = [RS.trace_row(0, [8, 8], 0, accepted=1), RS.trace_row(1, [40, 50], 16), RS.trace_row(2, [44, 46], 16),
            RS.trace_row(3, [60, 70], 32)]
    run = tmp_path / "ddtree-b16"
    run.mkdir()
    (run / "traces.jsonl").write_text(RS.jsonl(*rows))
    e = _entry(I.ingest_all([tmp_path], options=D.RoutingOptions(experts=128))[1], "traces.jsonl")
    assert (e["format"], e["kind"], e["windows"], e["top_k"], e["top_k_source"], e["experts"]) == \
           ("ddtree-lab traces", "forwards", [], 8, "inferred", 128)
    got = {r["tokens"]: (r["forwards"], r["per_layer"], r["uniform"]) for r in e["forward_passes"]}
    assert got == {1: (1, [8.0, 8.0], 8.0), 17: (2, [42.0, 48.0], pytest.approx(R.uniform_union(128, 8, 17))),
                   33: (1, [60.0, 70.0], pytest.approx(R.uniform_union(128, 8, 33)))}
    assert e["forward_passes"][1]["rank_max"] is None  # counts only: no per-rank figures
    (run / "traces.jsonl").write_text(RS.jsonl(*(RS.trace_row(i, None, 8) for i in range(3))))
    dense = _entry(I.ingest_all([tmp_path])[1], "traces.jsonl")
    assert dense["kind"] is None and "dense target" in " ".join(dense["notes"])


def test_a_routing_field_after_the_first_mib_is_still_found(tmp_path):
    ids = RS.routed(20, 2, 2, 8, seed=5)
    resp = RS.vllm_chat(ids, content="x" * (F.SNIFF_BYTES + 10))
    (tmp_path / "long.json").write_text(json.dumps(resp))
    ext, doc = I.ingest_all([tmp_path])
    assert ext["unrecognised"] == [] and _entry(doc, "long.json")["sequences"] == 1


def test_a_large_response_streams(tmp_path):
    """Nested-list routing past the record builder's value cap, and a large logprobs field, in bounded memory."""
    import tracemalloc
    ids = RS.routed(1700, 16, 8, 64, seed=6)
    assert ids.size > MAX_BUILT_VALUES
    resp = RS.vllm_chat(ids, encoding="list")
    resp["choices"][0]["logprobs"] = {"content": [{"token": "x", "logprob": -0.1, "bytes": [120]}] * 20_000}
    (tmp_path / "big.json").write_text(json.dumps(resp))
    tracemalloc.start()
    try:
        doc = I.ingest_all([tmp_path])[1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    e = _entry(doc, "big.json")
    assert e["sequences"] == 1 and e["tokens"] == 1700 and e["refused"] == []
    assert peak < 8e6, peak  # the ids are 0.9 MB as int32; the response built as Python objects takes more


# ----------------------------------------------------------------------------- broken dumps
def test_broken_dumps_refused_one_line_each_and_the_rest_kept(tmp_path, capsys):
    good = RS.routed(30, 3, 2, 16, seed=7)
    neg = good.copy()
    neg[4, 1, 0] = -2
    big = good.copy()
    big[2, 2, 1] = 99
    ragged = good.tolist()
    ragged[5][1] = ragged[5][1][:1]
    layers = RS.routed(30, 2, 2, 16, seed=8)
    lines = [RS.vllm_chat(good), RS.vllm_chat(good[:, 0, :]), RS.vllm_chat([[[[1]]]], encoding="list"),
             RS.vllm_chat(neg), RS.vllm_chat(big), RS.vllm_chat(ragged, encoding="list"), RS.vllm_chat(layers)]
    text = RS.jsonl(*lines) + RS.jsonl(RS.vllm_chat(good))[:-400]
    (tmp_path / "mixed.jsonl").write_text(text)
    out = tmp_path / "out"
    assert cli.main(["ingest", str(tmp_path / "mixed.jsonl"), "--out", str(out), "--experts", "32"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    doc = json.loads((out / "routing.json").read_text())
    e = doc["files"][0]
    assert e["sequences"] == 1 and e["truncated"] is True and e["cut"] == ["line 8"]
    reasons = {r["where"][0]: r["reason"] for r in e["refused"]}
    assert "wrong rank" in reasons["line 2, choices[0]"] and "[30, 2]" in reasons["line 2, choices[0]"]
    assert "4 lists deep" in reasons["line 3, choices[0]"]
    assert reasons["line 4, choices[0]"] == "negative expert id -2"
    assert "inconsistent k" in reasons["line 6, choices[0]"] and "token 5, layer 1" in reasons["line 6, choices[0]"]
    assert "2 layers where the file's first routing has 3" == reasons["line 7, choices[0]"]
    assert "out of range" in reasons["line 5, choices[0]"] and "32 experts (--experts)" in reasons["line 5, choices[0]"]
    printed = [l for l in err.splitlines() if "mixed.jsonl" in l]
    assert len(printed) == len(e["refused"]) + 1 and any("line 8: cut off here" in l for l in printed)
    _check_windows(e, [good], 32, 2)  # the one whole sequence, E from --experts


def test_a_truncated_document_keeps_what_was_complete(tmp_path):
    seqs = [RS.routed(25, 2, 2, 8, seed=s) for s in range(3)]
    text = json.dumps([RS.vllm_chat(s) for s in seqs], indent=1)
    cut = text.rindex('"routed_experts"') + 40  # inside the third response's routing
    (tmp_path / "cut.json").write_text(text[:cut])
    e = _entry(I.ingest_all([tmp_path])[1], "cut.json")
    assert e["sequences"] == 2 and e["truncated"] and e["cut"] == ["value 1"]
    _check_windows(e, seqs[:2], 8, 2)
    (tmp_path / "cut.json").write_text(text[: text.rindex('"usage"')])  # the last response cut after its ids
    e = _entry(I.ingest_all([tmp_path])[1], "cut.json")
    assert e["sequences"] == 3 and e["truncated"]
    _check_windows(e, seqs, 8, 2)
    (tmp_path / "cut.json").write_text(text[: text.index('"routed_experts"') + 40])  # nothing whole
    ext, doc = I.ingest_all([tmp_path])
    assert doc["files"] == [] and ext["unrecognised"] == []
    assert doc["unread"][0]["reason"] == "cut off (value 1) before its first complete routing"


def test_a_file_that_only_mentions_the_field_is_no_routing_dump(tmp_path):
    from ingest_samples import details, jsonl, serving
    texts = ['the "routed_experts" field of a response'] * 4
    (tmp_path / "bench.jsonl").write_text(jsonl(serving(detail=details(4, 4, texts=texts))))
    ext, doc = I.ingest_all([tmp_path])
    assert [r["verdict"] for r in ext["runs"]] == ["ok"] and doc["files"] == [] and doc["unread"] == []


def test_a_zip_that_is_no_torch_file_is_binary_not_a_dump(tmp_path):
    import zipfile
    with zipfile.ZipFile(tmp_path / "logs.zip", "w") as z:
        z.writestr("a.txt", "hello")
    ext, doc = I.ingest_all([tmp_path])
    assert doc["files"] == [] and ext["unrecognised"][0]["reason"].startswith("binary")


@pytest.mark.parametrize("argv,message", [(["--experts", "0"], "--experts must be a positive integer"),
                                          (["--ep-ranks", "x"], "--ep-ranks must be a positive integer"),
                                          (["--top-k", "-3"], "--top-k must be a positive integer"),
                                          (["--experts", "4"], "--ep-ranks 8 needs at least as many experts")])
def test_bad_options_one_line_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "x.json").write_text(json.dumps(RS.vllm_chat(RS.routed(4, 1, 1, 8))))
    try:  # argparse refuses a bad value at parse (its usage, then one error line); the rest is main's one line
        rc = cli.main(["ingest", str(tmp_path / "x.json"), "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert message in err.strip().splitlines()[-1] and err.count(message) == 1
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the report
@pytest.fixture
def routing_doc(tmp_path):
    a = RS.routed(80, 3, 2, 16, seed=9, pool=5)
    (tmp_path / "vllm.jsonl").write_text(RS.jsonl(RS.vllm_chat(a)))
    (tmp_path / "traces.jsonl").write_text(RS.jsonl(RS.trace_row(0, [2, 2, 2], 0, 1), RS.trace_row(1, [6, 7, 8], 8)))
    return I.ingest_all([tmp_path], options=D.RoutingOptions(experts=16, ep_ranks=4))[1]


def test_the_figures_draw_routing_json(routing_doc):
    fig = routing_report.touched_figure(routing_doc)
    by = {t.name: t for t in fig.data}
    v = _entry(routing_doc, "vllm.jsonl")
    w = by["vllm.jsonl (Qwen/Qwen3-30B-A3B): windows"]
    assert list(w.x) == [r["tokens"] for r in v["windows"]] and list(w.y) == [r["touched"] for r in v["windows"]]
    uni = by["uniform routing, E 16, k 2"]
    assert list(uni.y) == [r["uniform"] for r in v["windows"]] and uni.line.dash == "dot"
    assert all(m < u for m, u in zip(w.y[2:], uni.y[2:]))  # a sticky router touches fewer than uniform
    t = by["traces.jsonl: per forward"]
    assert (list(t.x), list(t.y), t.mode) == ([1, 9], [2.0, 7.0], "markers")
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [1, 2, 4, 8, 16, 32, 64]
    ranks = {t.name: t for t in routing_report.ranks_figure(routing_doc).data}
    most = ranks["vllm.jsonl (Qwen/Qwen3-30B-A3B): windows, most on one rank"]
    assert list(most.y) == [r["rank_max"] for r in v["windows"]]
    for name, key in (("mean over ranks", "uniform_rank_mean"), ("most on one rank", "uniform_rank_max")):
        assert list(ranks[f"uniform, E 16, k 2, 4 ranks: {name}"].y) == [r[key] for r in v["windows"]]
    assert not any(name.startswith("traces.jsonl") and "most" in name for name in ranks)  # counts only


def test_the_ingest_page_and_a_study_report_show_routing(routing_doc, tmp_path):
    page = ingest_report.write_page({"schema": 1, "runs": [], "unrecognised": []}, tmp_path / "r.html", I.THRESHOLDS,
                                    routing=routing_doc)
    figs = report.page_figures(page.read_text())
    titles = [f["layout"]["title"]["text"] for f in figs]
    assert titles[-2:] == [routing_report.touched_figure(routing_doc).layout.title.text,
                           routing_report.ranks_figure(routing_doc).layout.title.text]
    study = tmp_path / "study"
    study.mkdir()
    (study / D.ROUTING_FILE).write_text(json.dumps(routing_doc))
    ext, got = I.study_sources(study, {"study": {"name": "s"}})
    assert ext is None and got == routing_doc
    (study / D.ROUTING_FILE).write_text("{")
    assert "unreadable" in I.study_sources(study, {})[1]["unread"][0]["reason"]


def test_routing_json_is_written_beside_external_json(tmp_path, capsys):
    a = RS.routed(10, 2, 2, 8, seed=10)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "v.json").write_text(json.dumps(RS.vllm_chat(a)))
    out = tmp_path / "out"
    assert cli.main(["ingest", str(tmp_path / "in"), "--out", str(out), "--ep-ranks", "2"]) == 0
    assert "1 routing dump(s); 0 message(s)" in capsys.readouterr().out
    doc = json.loads((out / "routing.json").read_text())
    assert set(doc) == {"schema", "ep_ranks", "windows", "files", "unread"} and doc["ep_ranks"] == 2
    assert doc["files"][0]["ep_ranks"] == 2 and (out / "external.json").is_file()
    assert not list(out.glob(".*tmp*"))
