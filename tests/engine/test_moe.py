"""Qwen3Moe targets: our model against transformers' Qwen3MoeForCausalLM on random tiny checkpoints (fp32),
both expert layouts, the Triton path against the torch path, losslessness of DDTree, the experts-touched
telemetry, and bad MoE input refused with the field or tensor named."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.attention import TreeMask  # noqa: E402
from ddtree_lab.checkpoint import CheckpointError, load_target  # noqa: E402
from ddtree_lab.config import ConfigError, target_config_from_hf  # noqa: E402
from ddtree_lab.moe import SparseMoE, moe_torch  # noqa: E402
from ddtree_lab.testing import exact_first_tokens, make_tiny_pair  # noqa: E402
from ddtree_lab.trace import RoundTrace  # noqa: E402
from ddtree_lab.tree import ancestor_matrix  # noqa: E402

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, rope_theta=1e6)

CASES = {  # (config overrides, save in transformers' stacked in-memory layout, shard size or None)
    "renorm-per-expert": (dict(norm_topk_prob=True, tie_word_embeddings=False), False, None),
    "plain-stacked": (dict(norm_topk_prob=False, tie_word_embeddings=True), True, None),
    "dense-layer-1-sharded": (dict(norm_topk_prob=True, mlp_only_layers=[1]), False, "100KB"),
    "sparse-step-2-sharded": (dict(norm_topk_prob=True, decoder_sparse_step=2, num_experts_per_tok=3), True, "100KB"),
}


def hf_moe(extra, seed):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **extra})).eval()
    with torch.no_grad():  # random norms, and routers sharp enough to spread tokens over the experts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def save_hf(model, directory, stacked, shard=None):
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(directory, safe_serialization=True, save_original_format=not stacked, **kw)
    index = directory / "model.safetensors.index.json"
    if shard is None:
        names = load_file(directory / "model.safetensors").keys()
    else:  # the layout this case tests: shards listed in the index
        names = json.loads(index.read_text())["weight_map"]
        assert len(set(names.values())) > 1
    assert any("experts.gate_up_proj" in n for n in names) == stacked  # the expert layout this case tests
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_ar_and_tree_logits_match_transformers(case, tmp_path):
    extra, stacked, shard = CASES[case]
    ref = hf_moe(extra, seed=len(case))
    ours = load_target(save_hf(ref, tmp_path, stacked, shard))
    kinds = [type(b.mlp).__name__ for b in ours.layers]
    assert kinds == [type(b.mlp).__name__.replace("Qwen3MoeSparseMoeBlock", "SparseMoE")
                     .replace("Qwen3MoeMLP", "GatedMLP") for b in ref.model.layers]
    T = 40
    tokens = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens[None], output_hidden_states=True)
        ours.setup_cache(T + 16)
        logits, hidden = ours(tokens, torch.arange(T), 0, TreeMask.causal(T, "cpu"), hidden_layers=[0, 1])
        assert torch.allclose(logits, want.logits[0], atol=1e-4, rtol=1e-4), (logits - want.logits[0]).abs().max()
        assert torch.allclose(hidden[:, 64:], want.hidden_states[2][0], atol=1e-4)
        # AR: the prompt's first 30 tokens, then one token per step
        ours.setup_cache(T + 16)
        first, _ = ours(tokens[:30], torch.arange(30), 0, TreeMask.causal(30, "cpu"))
        steps = [ours(tokens[i:i + 1], torch.tensor([i]), i, TreeMask.causal(1, "cpu"))[0] for i in range(30, T)]
        assert torch.allclose(torch.cat([first, *steps]), want.logits[0], atol=1e-4, rtol=1e-4)
        # verify: a tree after a 12-token prefix; each node's logits are transformers' on its root path
        parents = torch.tensor([0, 0, 0, 1, 1, 2, 3, 5])
        depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3])
        nodes = torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(4))
        ours.setup_cache(40)
        ours(tokens[:12], torch.arange(12), 0, TreeMask.causal(12, "cpu"))
        anc = ancestor_matrix(parents, 4)
        tree_logits, _ = ours(nodes, 12 + depths, 12, TreeMask(anc))
        for i in range(8):
            path = torch.cat([tokens[:12], nodes[anc[i].nonzero().flatten()]])
            assert torch.allclose(tree_logits[i], ref(path[None]).logits[0, -1], atol=1e-4, rtol=1e-4), i


def test_reads_transformers_4_expert_key(tmp_path):
    new = {"architectures": ["Qwen3MoeForCausalLM"], **BASE, "num_local_experts": 8}
    del new["num_experts"]
    old = {"architectures": ["Qwen3MoeForCausalLM"], **BASE}
    a, b = target_config_from_hf(new, tmp_path), target_config_from_hf(old, tmp_path)
    assert a == b and a.num_experts == 8 and a.is_moe and a.arch == "qwen3_moe" and a.qk_norm


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", seed=2, tokenizer=False)


@pytest.fixture(scope="module")
def moe_pair(moe_dirs):
    return dl.load_pair(target=moe_dirs[0], drafter=moe_dirs[1])


def test_tiny_moe_pair_round_trips_through_the_checkpoint(moe_dirs, moe_pair):
    names = load_file(moe_dirs[0] / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer (mlp_only_layers)
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dirs[0]).eval()
    tokens = torch.tensor([[5, 7, 9, 11, 13]])
    moe_pair.target.setup_cache(8)
    with torch.no_grad():
        ours, _ = moe_pair.target(tokens[0], torch.arange(5), 0, TreeMask.causal(5, "cpu"))
        assert torch.allclose(ours, ref(tokens).logits[0], atol=1e-4)
    assert moe_pair.drafter.cfg.intermediate_size == 128  # the drafter stays dense


def test_torch_paths_and_triton_kernel_agree():
    """The engine's fixed-shape torch path (per-token gather) and the Triton kernels (interpreter on the CPU)
    give one block's output and counts alike."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: a GPU, or the interpreter
    moe = SparseMoE(48, 24, 6, 2, True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    moe = moe.to(device)
    from ddtree_lab.kernels.fused_moe import fused_moe, fused_moe_reference

    x = torch.randn(17, 48, generator=g).to(device)
    want, want_counts = fused_moe_reference(x, moe.router.weight, moe.gate_up, moe.down, 2, True)
    counts = torch.zeros(6, dtype=torch.int32, device=device)
    got = moe_torch(x, moe.router.weight, moe.gate_up, moe.down, 2, True, counts=counts)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(counts, want_counts)
    kernel, kcounts = fused_moe(x, moe.router.weight.detach(), moe.gate_up.detach(), moe.down.detach(), 2, True)
    assert torch.allclose(kernel, want, atol=1e-5) and torch.equal(kcounts, want_counts)


def test_torch_gather_past_its_limit_is_refused():
    """Without a grouped matmul each (token, expert) pair gathers its expert's weights: a Qwen3-30B-A3B block
    verifying a tree of 1024 in fp16 would take tens of GiB, so it is refused, naming the size and the limit
    (meta tensors: no memory is touched either way)."""
    x, router = torch.empty(1025, 2048, device="meta"), torch.empty(128, 2048, device="meta")
    w_gate_up, w_down = torch.empty(128, 1536, 2048, device="meta"), torch.empty(128, 2048, 768, device="meta")
    x, router, w_gate_up, w_down = (t.half() for t in (x, router, w_gate_up, w_down))
    with pytest.raises(ValueError, match=r"1025 tokens × 8 experts needs 72\.1 GiB, over the 4 GiB limit"):
        moe_torch(x, router, w_gate_up, w_down, 8, True)


def test_triton_path_in_the_engine_gives_the_same_tokens(moe_dirs, use_options):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels on a GPU, the interpreter without
    pair = dl.load_pair(target=moe_dirs[0], drafter=moe_dirs[1], device=device)
    prompt = [3, 1, 4, 1, 5, 9]
    want = dl.generate(pair, prompt, method="ar", max_new_tokens=8, stop=[])
    use_options(tree_kernels="triton")  # the GPU's kernels, under the interpreter
    got = dl.generate(pair, prompt, budget=12, max_new_tokens=8, stop=[])
    assert got.tokens == want.tokens
    assert all(r.experts_touched is not None and len(r.experts_touched) == 3 for r in got.rounds)


def test_moe_launch_choices_reach_every_block(moe_dirs, use_options, monkeypatch):
    """options.moe_launch (bench --moe-config, bench e2e --variants) is each MoE block's fused-kernel launch override:
    a split K walk forced on every block gives the same tokens, and every launch saw the override."""
    import ddtree_lab.kernels.fused_moe as fm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair = dl.load_pair(target=moe_dirs[0], drafter=moe_dirs[1], device=device)
    prompt = [3, 1, 4, 1, 5, 9]
    use_options(tree_kernels="triton")
    want = dl.generate(pair, prompt, method="ar", max_new_tokens=6, stop=[])
    seen, real = [], fm._config
    monkeypatch.setattr(fm, "_config", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    use_options(tree_kernels="triton", moe_launch={"SPLIT_K_UP": 2})
    got = dl.generate(pair, prompt, method="ar", max_new_tokens=6, stop=[])
    assert got.tokens == want.tokens and seen and all(c == {"SPLIT_K_UP": 2} for c in seen)


@pytest.mark.parametrize("prompt", [[7], [3, 9, 27, 81, 243]])
def test_greedy_ddtree_and_dflash_equal_ar(moe_pair, prompt):
    ar = dl.generate(moe_pair, prompt, method="ar", max_new_tokens=32, stop=[])
    assert len(ar.tokens) == 32
    runs = [("dflash", 1, None)] + [("ddtree", b, k) for b in (1, 7, 64, 256) for k in (None, 1, 4)]
    for method, budget, topk in runs:
        res = dl.generate(moe_pair, prompt, method=method, budget=budget, topk=topk, max_new_tokens=32, stop=[])
        assert res.tokens == ar.tokens, (method, budget, topk)


def test_experts_touched_per_round(moe_pair, tiny_pair):
    k, E = 2, 8
    ar = dl.generate(moe_pair, [5, 6, 7], method="ar", max_new_tokens=6, stop=[])
    assert [r.experts_touched for r in ar.rounds] == [[k] * 3] * len(ar.rounds)  # one token: exactly k each
    res = dl.generate(moe_pair, [5, 6, 7], budget=64, max_new_tokens=12, stop=[])
    for r in res.rounds:
        T = 1 + len(r.tree)
        assert len(r.experts_touched) == 3 and all(k <= n <= min(E, T * k) for n in r.experts_touched)
        assert RoundTrace.from_json(json.loads(json.dumps(r.to_json()))).experts_touched == r.experts_touched
    assert max(max(r.experts_touched) for r in res.rounds) > k  # a 65-node tree reaches past one token's experts
    dense = dl.generate(tiny_pair, [5, 6, 7], budget=8, max_new_tokens=4, stop=[])
    assert all(r.experts_touched is None for r in dense.rounds)


def test_experts_touched_is_the_verify_forwards(moe_pair):
    """Recount from the routing of the traced round's own tree tokens at their positions."""
    prompt = [5, 6, 7, 8]
    res = dl.generate(moe_pair, prompt, budget=16, max_new_tokens=2, stop=[])
    r = res.rounds[0]
    target = moe_pair.target
    target.setup_cache(64)
    with torch.inference_mode():
        target(torch.tensor(prompt), torch.arange(4), 0, TreeMask.causal(4, "cpu"))
        parents = torch.cat([torch.zeros(1, dtype=torch.long), r.tree.parents])
        depths = torch.cat([torch.zeros(1, dtype=torch.long), r.tree.depths])
        tokens = torch.cat([torch.tensor([r.root_token]), r.tree.tokens])
        target(tokens, 4 + depths, 4, TreeMask(ancestor_matrix(parents, int(depths.max()))))
    routing = target.expert_routing()
    touched, busiest, blocks = routing["experts_touched"], routing["expert_tokens_max"], routing["expert_row_blocks"]
    assert touched == r.experts_touched and busiest == r.expert_tokens_max and blocks == r.expert_row_blocks
    assert routing["expert_int4"] is False and r.expert_int4 is False  # dense experts
    assert all(1 <= b <= len(tokens) for b in busiest)  # one expert gets at most every token of the forward
    pairs = len(tokens) * moe_pair.target.cfg.num_experts_per_tok
    for h, per_layer in blocks.items():  # each expert: ceil(tokens / h) blocks, between the touched and the pairs
        h = int(h)
        for u, b, n in zip(touched, busiest, per_layer):
            assert max(u, -(-pairs // h)) <= n <= u + pairs // h
            assert n >= u - 1 + -(-b // h)  # the busiest expert alone needs ceil(b / h)
    assert all(blocks["16"][i] >= blocks["32"][i] >= blocks["64"][i] for i in range(len(touched)))


@pytest.mark.parametrize("method,budget", [("ddtree", 12), ("ddtree", 200)])
def test_sampling_matches_target_distribution(tmp_path_factory, method, budget):
    from scipy.stats import chisquare

    t, d = make_tiny_pair(tmp_path_factory.mktemp("moe_v8"), arch="qwen3_moe", vocab_size=8, seed=5,
                          tokenizer=False)
    pair = dl.load_pair(target=t, drafter=d)
    prompt = [1, 5, 2]
    with torch.inference_mode():
        joint, p3 = exact_first_tokens(pair, prompt)
        N = 1000
        c12, c3 = torch.zeros(64), torch.zeros(8)
        for seed in range(N):
            out = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=3, temperature=1.0,
                              seed=seed, trace=False, stop=[]).tokens
            c12[out[0] * 8 + out[1]] += 1
            c3[out[2]] += 1
    for counts, probs in ((c12, joint.flatten()), (c3, p3)):
        assert chisquare(counts.double().numpy(), (probs * counts.sum()).numpy()).pvalue > 1e-3


# ----------------------------------------------------------------------------- bad input

@pytest.fixture
def bad_dirs(tmp_path):
    return make_tiny_pair(tmp_path, arch="qwen3_moe", seed=1, tokenizer=False)


def _rewrite_tensors(directory, fn):
    tensors = load_file(directory / "model.safetensors")
    fn(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_missing_expert_tensor_named(bad_dirs):
    t, d = bad_dirs
    _rewrite_tensors(t, lambda ts: ts.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"):
        dl.load_pair(target=t, drafter=d)


@pytest.mark.parametrize("name,cut", [("model.layers.0.mlp.experts.3.down_proj.weight", 1),
                                      ("model.layers.3.mlp.gate.weight", 0)])
def test_misshaped_expert_tensor_named(bad_dirs, name, cut):
    t, d = bad_dirs

    def shrink(ts):
        ts[name] = (ts[name][:, :-1] if cut else ts[name][:-1]).contiguous()
    _rewrite_tensors(t, shrink)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape"):
        dl.load_pair(target=t, drafter=d)


def test_misshaped_stacked_experts_named(tmp_path):
    ref = hf_moe(dict(norm_topk_prob=True), seed=3)
    save_hf(ref, tmp_path, stacked=True)
    _rewrite_tensors(tmp_path, lambda ts: ts.update({"model.layers.1.mlp.experts.down_proj":
                                                     ts["model.layers.1.mlp.experts.down_proj"][:7]}))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.down_proj' has shape \(7, 64, 32\)"):
        load_target(tmp_path)


@pytest.mark.parametrize("change,field", [
    (dict(shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
])
def test_unsupported_router_options_refused(bad_dirs, change, field):
    t, d = bad_dirs
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=field):
        dl.load_pair(target=t, drafter=d)


def test_drafter_reading_past_the_targets_layers_refused(bad_dirs):
    t, d = bad_dirs
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 4]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\]"):
        dl.load_pair(target=t, drafter=d)


def test_random_qwen3_30b_a3b_shape():
    """The bench's random MoE shape: its public sizes, a dense drafter, and an AR step that reads top-k experts."""
    from ddtree_lab.bench.e2e import weight_bytes_per_step
    from ddtree_lab.config import check_pair
    from ddtree_lab.model import Target
    from ddtree_lab.pairs.random import RANDOM_SHAPES, shape_configs

    tcfg, dcfg = shape_configs("qwen3-30b-a3b")
    check_pair(tcfg, dcfg)
    assert "qwen3-30b-a3b" in RANDOM_SHAPES and dcfg.intermediate_size == 6144 and dcfg.num_hidden_layers == 5
    with torch.device("meta"):
        target = Target(tcfg).to(torch.bfloat16)
    assert all(isinstance(b.mlp, SparseMoE) for b in target.layers) and target.layers[0].mlp.gate_up.shape == (128, 1536, 2048)
    total = sum(p.numel() for p in target.parameters())
    assert 30.0e9 < total < 31.0e9
    active = weight_bytes_per_step(target) / 2  # bf16: one token reads about 3B of the 30.5B parameters
    assert 2.9e9 < active < 3.4e9


def test_e2e_bench_records_experts_touched(moe_pair):
    from ddtree_lab.bench.e2e import bench_e2e, weight_bytes_per_step

    out = bench_e2e(moe_pair, budgets=(4, 32), prompt_len=8, rounds=4, methods=("ar", "ddtree"), progress=False)
    ar, small, large = out["rows"]
    assert ar["experts_touched_per_layer"] == [2, 2, 2]  # one token: its top-2 in each of the 3 MoE layers
    assert all(2 <= n <= 8 for n in large["experts_touched_per_layer"])
    assert large["experts_touched_mean"] >= small["experts_touched_mean"] > 2
    for row in (ar, small, large):  # row blocks per height: at least the touched experts, more at low heights
        blocks = row["expert_row_blocks_mean"]
        assert blocks["16"] >= blocks["32"] >= blocks["64"] >= row["experts_touched_mean"]
    assert ar["expert_row_blocks_mean"] == {"16": 2.0, "32": 2.0, "64": 2.0}
    target = moe_pair.target
    assert weight_bytes_per_step(target, [2, 2, 2]) == weight_bytes_per_step(target)
    assert weight_bytes_per_step(target, [8, 8, 8]) > weight_bytes_per_step(target)


# ----------------------------------------------------------------------------- GPU only

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@gpu
@pytest.mark.parametrize("T", [1, 65, 1025])
def test_gpu_grouped_torch_path_matches_reference(T):
    """The torch path on CUDA in bf16 (pairs sorted by expert, torch's grouped matmul) against the reference."""
    from ddtree_lab.kernels.fused_moe import fused_moe_reference

    g = torch.Generator().manual_seed(T)
    x, router = torch.randn(T, 2048, generator=g), torch.randn(128, 2048, generator=g) * 0.05
    w_gate_up, w_down = torch.randn(128, 1536, 2048, generator=g) * 0.02, torch.randn(128, 2048, 768, generator=g) * 0.04
    x, router, w_gate_up, w_down = (t.to("cuda", torch.bfloat16) for t in (x, router, w_gate_up, w_down))
    counts = torch.zeros(128, dtype=torch.int32, device="cuda")
    got = moe_torch(x, router, w_gate_up, w_down, 8, True, counts=counts)
    want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, 8, True)
    assert torch.equal(counts, want_counts)
    assert (got.float() - want.float()).abs().max() / want.float().abs().max() < 2e-2


@gpu
def test_gpu_moe_graph_rounds_equal_ar_and_count_alike(moe_dirs):
    """CUDA graphs over the whole budget range on an MoE target: DDTree == AR, and the experts touched that a
    replayed round records equal those of the same round run eagerly."""
    pair = dl.load_pair(target=moe_dirs[0], drafter=moe_dirs[1], device="cuda", attention="triton")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=24, stop=[])
    assert [r.experts_touched for r in ar.rounds] == [[2] * 3] * len(ar.rounds)
    for budget in (1, 16, 64, 256, 1024):
        graphs = dl.generate(pair, prompt, budget=budget, max_new_tokens=24, stop=[], cuda_graphs=True)
        eager = dl.generate(pair, prompt, budget=budget, max_new_tokens=24, stop=[], cuda_graphs=False)
        assert graphs.tokens == ar.tokens == eager.tokens, budget
        assert [r.experts_touched for r in graphs.rounds] == [r.experts_touched for r in eager.rounds], budget


@pytest.mark.parametrize("shape", ["kimi-k2.6", "kimi-k2.6@2", "kimi-k2.6-ep8-rank@3", "qwen3-8b@1", "qwen3-8b"])
def test_random_shapes_drafters_tap_distinct_target_layers(shape):
    """Every random shape's drafter, at any depth, taps distinct layers of its target (a shape too shallow for the
    spread rule taps each layer once), and a drafter listing a layer twice is refused."""
    import dataclasses

    from ddtree_lab.config import check_pair
    from ddtree_lab.pairs.random import shape_configs

    tcfg, dcfg = shape_configs(shape)
    check_pair(tcfg, dcfg)
    assert len(set(dcfg.target_layer_ids)) == len(dcfg.target_layer_ids) >= 1
    if len(dcfg.target_layer_ids) > 1:
        twice = dataclasses.replace(dcfg, target_layer_ids=[dcfg.target_layer_ids[0]] * 2)
        with pytest.raises(ValueError, match=r"target_layer_ids lists layer\(s\) \[\d+\] more than once"):
            check_pair(tcfg, twice)
