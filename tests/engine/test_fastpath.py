"""The fixed-shape round on its backends: Triton verify attention (interpreter on the CPU) and, on a
GPU, CUDA-graph replay against eager execution over the whole budget sweep."""
import importlib.util

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.testing import make_tiny_pair

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GRAPH_BUDGETS = [1, 2, 8, 9, 15, 16, 17, 64, 256, 1024]


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_triton_attention_in_the_engine_matches_sdpa(tmp_path, arch, use_options, monkeypatch):
    """CPU twin of the GPU path: the Triton kernel (interpreter here; for DeepSeek-V3 the MLA kernel, and on a GPU
    the routed fused-MoE kernel) inside real decoding; with launch_pdl (bench --pdl) the attention kernels are
    asked to launch as programmatic dependents (kernels/pdl.py), and the tokens stay the same."""
    from ddtree_lab.kernels import mla_attention, tree_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t, d = make_tiny_pair(tmp_path, arch=arch, seed=4, tokenizer=False)
    ref = dl.load_pair(target=t, drafter=d, device=device)
    tri = dl.load_pair(target=t, drafter=d, device=device, attention="triton")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = dl.generate(ref, prompt, method="ar", max_new_tokens=10, stop=[], cuda_graphs=False)
    for budget in (7, 40):
        got = dl.generate(tri, prompt, budget=budget, max_new_tokens=10, stop=[], cuda_graphs=False)
        assert got.tokens == want.tokens
    asked = []
    for module, name in ((tree_attention, "tree_attention"), (mla_attention, "mla_tree_attention")):
        call = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _call=call, **kw: asked.append(kw["config"]) or _call(*a, **kw))
    use_options(launch_pdl=True)
    got = dl.generate(tri, prompt, budget=7, max_new_tokens=10, stop=[], cuda_graphs=False)
    assert got.tokens == want.tokens and asked and all(c["pdl"] is True for c in asked)


@cuda
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_skinny_dense_products_in_the_engine(tmp_path, arch, use_options, monkeypatch):
    """options.dense_products="skinny" (bench --dense-products skinny): an AR step's and a small tree's linears
    (and DeepSeek's router) run kernels/skinny_gemm.py, compiled and graph-replayed; in fp32 every budget still
    emits AR's tokens (torch's matmul), and trees wider than its rows keep the library's."""
    from ddtree_lab.kernels import skinny_gemm

    t, d = make_tiny_pair(tmp_path, arch=arch, seed=4, tokenizer=False)
    ref = dl.load_pair(target=t, drafter=d, device="cuda", dtype="float32", attention="triton")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = dl.generate(ref, prompt, method="ar", max_new_tokens=16, stop=[], cuda_graphs=False).tokens
    rows = []
    call = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda x, *a, **kw: rows.append(x.shape[0]) or call(x, *a, **kw))
    use_options(dense_products="skinny")
    pair = dl.load_pair(target=t, drafter=d, device="cuda", dtype="float32", attention="triton", compile=True)
    for budget in (None, 4, 40):
        method = dict(method="ar") if budget is None else dict(budget=budget)
        assert dl.generate(pair, prompt, max_new_tokens=16, stop=[], cuda_graphs=True, **method).tokens == want
    assert rows and max(rows) <= skinny_gemm.MAX_ROWS


@pytest.mark.parametrize("compiled", [False, True])
def test_shared_expert_beside_the_routed_ones_changes_no_token(tmp_path, compiled, use_options, monkeypatch):
    """options.overlap_shared (the default; bench --no-overlap-shared turns it off): on a GPU each MoE layer
    forks its shared expert onto a stream of its own and joins it before the sum, eager and inside captured graphs,
    compiled or not, and every budget's tokens stay those of the layer run in order; on the CPU (no streams) the
    option leaves the layer as it is."""
    from ddtree_lab import moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t, d = make_tiny_pair(tmp_path, arch="deepseek_v3", seed=4, tokenizer=False)
    pair = dl.load_pair(target=t, drafter=d, device=device, dtype="float32", compile=compiled,
                        attention="triton" if device == "cuda" else "sdpa")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    graphs = [False, True] if device == "cuda" else [False]
    use_options(overlap_shared=False)
    want = {(b, g): dl.generate(pair, prompt, max_new_tokens=12, stop=[], cuda_graphs=g,
                                **(dict(method="ar") if b is None else dict(budget=b))).tokens
            for b in (None, 5) for g in graphs}
    side_streams = {}
    monkeypatch.setattr(moe, "_SIDE_STREAMS", side_streams)  # filled where a layer forks
    use_options(overlap_shared=True)
    for (b, g), tokens in want.items():
        got = dl.generate(pair, prompt, max_new_tokens=12, stop=[], cuda_graphs=g,
                          **(dict(method="ar") if b is None else dict(budget=b)))
        assert got.tokens == tokens, (b, g)
    assert bool(side_streams) == (device == "cuda")


def test_compiled_layers_give_the_same_tokens(tmp_path):
    """compile=True fuses each layer's elementwise ops; decoding must not change."""
    t, d = make_tiny_pair(tmp_path, seed=4, tokenizer=False)
    ref = dl.load_pair(target=t, drafter=d)
    fused = dl.load_pair(target=t, drafter=d, compile=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = dl.generate(ref, prompt, method="ar", max_new_tokens=16, stop=[]).tokens
    assert dl.generate(fused, prompt, budget=12, max_new_tokens=16, stop=[]).tokens == want
    assert dl.generate(fused, prompt, method="ar", max_new_tokens=16, stop=[]).tokens == want


@pytest.fixture(scope="module")
def gpu_pairs(tmp_path_factory):
    t, d = make_tiny_pair(tmp_path_factory.mktemp("gpu"), vocab_size=64, seed=8, tokenizer=False)
    return {a: dl.load_pair(target=t, drafter=d, device="cuda", dtype="float32", attention=a)
            for a in ("sdpa", "triton")}


@cuda
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_cuda_graphs_equal_eager_for_every_budget(gpu_pairs, attention):
    pair = gpu_pairs[attention]
    prompt = [5, 7, 11, 13, 17]
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=64, stop=[], cuda_graphs=False)
    assert dl.generate(pair, prompt, method="ar", max_new_tokens=64, stop=[], cuda_graphs=True).tokens == ar.tokens
    for method in ("dflash",):
        for graphs in (False, True):
            assert dl.generate(pair, prompt, method=method, max_new_tokens=64, stop=[],
                               cuda_graphs=graphs).tokens == ar.tokens
    for budget in GRAPH_BUDGETS:
        eager = dl.generate(pair, prompt, budget=budget, max_new_tokens=64, stop=[], cuda_graphs=False)
        graph = dl.generate(pair, prompt, budget=budget, max_new_tokens=64, stop=[], cuda_graphs=True)
        again = dl.generate(pair, prompt, budget=budget, max_new_tokens=64, stop=[], cuda_graphs=True,
                            trace=False, sync_every=4)
        assert eager.tokens == ar.tokens == graph.tokens == again.tokens, budget
        assert eager.acceptance_lengths == graph.acceptance_lengths


@cuda
def test_cuda_graph_sampling_reproducible(gpu_pairs):
    pair = gpu_pairs["triton"]
    a = dl.generate(pair, [1, 2, 3], budget=32, max_new_tokens=40, temperature=1.0, seed=3, stop=[])
    b = dl.generate(pair, [1, 2, 3], budget=32, max_new_tokens=40, temperature=1.0, seed=3, stop=[])
    c = dl.generate(pair, [1, 2, 3], budget=32, max_new_tokens=40, temperature=1.0, seed=4, stop=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens


@cuda
@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_captured_prefill_equals_eager(gpu_pairs, prompt_len):
    """The prefill replayed from a graph at the padded length leaves the caches as the eager one does."""
    pair = gpu_pairs["triton"]
    prompt = [(5 * i + 1) % 60 + 2 for i in range(prompt_len)]
    for method, budget in (("ar", 1), ("ddtree", 16)):
        eager = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=24, stop=[], cuda_graphs=False)
        for _ in range(2):  # the first call captures the prefill, the second replays it
            graph = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=24, stop=[],
                                cuda_graphs=True)
            assert graph.tokens == eager.tokens and graph.acceptance_lengths == eager.acceptance_lengths


@cuda
def test_captures_survive_garbage_collection(gpu_pairs):
    """More round programs than the pair keeps (its cache is cleared past 16), with the collector running as
    often as it can: a dropped program holds tensors of its graphs' memory pool, and collecting it in the
    middle of another capture would free that pool there and invalidate the capture (graphs.capturing)."""
    import gc

    pair = gpu_pairs["sdpa"]
    prompt = [5, 7, 11, 13, 17]
    want = dl.generate(pair, prompt, method="ar", max_new_tokens=16, stop=[], cuda_graphs=False).tokens
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for budget in range(1, 25):
            assert dl.generate(pair, prompt, budget=budget, max_new_tokens=16, stop=[]).tokens == want, budget
    finally:
        gc.set_threshold(*threshold)


def test_the_capture_counter_counts_by_kind():
    from ddtree_lab import graphs

    counts = graphs.captures()
    assert set(counts) == {"round", "prefill"} and all(n >= 0 for n in counts.values())
    counts["round"] += 100  # a copy: the counter is read, not handed out
    assert graphs.captures()["round"] == counts["round"] - 100


@cuda
def test_a_new_shape_is_captured_once_then_replayed(gpu_pairs):
    """graphs.captures() counts a round program's capture and a padded prefill's, once each, as a bench reads it
    around its timed passes."""
    from ddtree_lab import graphs

    pair = gpu_pairs["triton"]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    before = graphs.captures()
    dl.generate(pair, prompt, budget=23, max_new_tokens=40, stop=[])
    after = graphs.captures()
    assert after["round"] - before["round"] == 1 and after["prefill"] - before["prefill"] <= 1
    dl.generate(pair, prompt, budget=23, max_new_tokens=40, stop=[])
    assert graphs.captures() == after


# ---------------------------------------------------------------- DeepSeek-V3 (MLA, grouped routing, INT4 experts)

@pytest.fixture(scope="module")
def mla_gpu_pairs(tmp_path_factory):
    """A DeepSeek-V3 pair in fp32 (sdpa, triton) and bf16 (triton), dense and with INT4 experts."""
    root = tmp_path_factory.mktemp("mla-gpu")
    t, d = make_tiny_pair(root, arch="deepseek_v3", vocab_size=64, seed=8, tokenizer=False)
    pairs = {(a, "float32", "dense"): dl.load_pair(target=t, drafter=d, device="cuda", dtype="float32", attention=a)
             for a in ("sdpa", "triton")}
    pairs[("triton", "bfloat16", "dense")] = dl.load_pair(target=t, drafter=d, device="cuda", dtype="bfloat16",
                                                          attention="triton")
    if importlib.util.find_spec("compressed_tensors") is not None:
        import shutil

        from ddtree_lab.quant import write_int4_checkpoint

        shutil.copytree(t, root / "int4")
        write_int4_checkpoint(root / "int4", targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], group_size=32)
        pairs[("triton", "bfloat16", "int4")] = dl.load_pair(target=root / "int4", drafter=d, device="cuda",
                                                             dtype="bfloat16", attention="triton")
    return pairs


@cuda
@pytest.mark.parametrize("key", [("sdpa", "float32", "dense"), ("triton", "float32", "dense"),
                                 ("triton", "bfloat16", "dense"), ("triton", "bfloat16", "int4")])
def test_mla_cuda_graphs_equal_eager_for_every_budget(mla_gpu_pairs, key):
    """Graph replay == eager at every budget for MLA targets, bf16 and INT4 included; in fp32 every budget also
    gives AR's tokens (in bf16 a tree's batch shapes round otherwise than AR's, so only replay == eager holds)."""
    if key not in mla_gpu_pairs:
        pytest.skip("compressed-tensors is not installed: no INT4 copy")
    pair = mla_gpu_pairs[key]
    prompt = [5, 7, 11, 13, 17]
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=48, stop=[], cuda_graphs=False)
    assert dl.generate(pair, prompt, method="ar", max_new_tokens=48, stop=[], cuda_graphs=True).tokens == ar.tokens
    for budget in GRAPH_BUDGETS:
        eager = dl.generate(pair, prompt, budget=budget, max_new_tokens=48, stop=[], cuda_graphs=False)
        graph = dl.generate(pair, prompt, budget=budget, max_new_tokens=48, stop=[], cuda_graphs=True)
        assert eager.tokens == graph.tokens and eager.acceptance_lengths == graph.acceptance_lengths, budget
        if key[1] == "float32":
            assert eager.tokens == ar.tokens, budget


@cuda
@pytest.mark.parametrize("shape", ["kimi-k2.6-ep8-rank@2", "kimi-k2.6-tp8-rank@2", "kimi-k2.6-ep8-rank@3~2"])
def test_rank_shapes_cuda_graphs_equal_eager_for_every_budget(shape):
    """One GPU's share of Kimi K2.6 over 8 (EP: 48 of 384 experts at full width; TP: 1/8 of every width and head),
    bf16 with INT4 experts, declared uniform routing, two of its layers (one dense, one MoE): graph replay ==
    eager at every budget, as the MLA sweep above. Also three layers on two weight sets (~2: the third reads the
    second's weights, through its own cache and routing)."""
    pair = dl.load_pair(f"random:{shape}", device="cuda", dtype="bfloat16", attention="triton")
    prompt = list(range(100, 140))
    for budget in GRAPH_BUDGETS:
        eager = dl.generate(pair, prompt, budget=budget, max_new_tokens=24, stop=[], cuda_graphs=False)
        graph = dl.generate(pair, prompt, budget=budget, max_new_tokens=24, stop=[], cuda_graphs=True)
        assert eager.tokens == graph.tokens and eager.acceptance_lengths == graph.acceptance_lengths, budget
