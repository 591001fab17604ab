"""DeepSeek-V3 / Kimi K2 targets (MLA, grouped sigmoid routing, shared experts, dense first layers) against
transformers' DeepseekV3 on tiny random checkpoints it builds and saves (fp32), and the engine's invariants on them."""
import json

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.attention import TreeMask
from ddtree_lab.checkpoint import load_target, save_drafter
from ddtree_lab.config import ConfigError, target_config_from_hf
from ddtree_lab.drafter import Drafter
from ddtree_lab.kernels.moe_layout import route_grouped_reference
from ddtree_lab.moe import Float32Router
from ddtree_lab.testing import random_init, tiny_drafter_config
from ddtree_lab.tree import ancestor_matrix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

transformers = pytest.importorskip("transformers")

VOCAB = 160
HF_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24,
               qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
               norm_topk_prob=True, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "rope_theta": 10000.0})
CASES = {
    "q-lora-yarn-grouped": {},
    "plain-q-halves-rope": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def hf_deepseek(seed: int, **overrides):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**HF_BASE, **overrides})).eval()
    with torch.no_grad():  # random norms and a non-zero correction bias, so a missed one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.3)  # routing spread over the experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(transformers model, its directory, a random DFlash drafter's directory) for the first case."""
    root = tmp_path_factory.mktemp("deepseek")
    model = hf_deepseek(seed=0)
    model.save_pretrained(root / "target")
    target = load_target(root / "target")
    drafter = Drafter(tiny_drafter_config(target.cfg, target_layer_ids=[0, 2], block_size=8))
    random_init(drafter, 1)
    save_drafter(drafter, root / "drafter", dtype=torch.float32)
    return model, root / "target", root / "drafter"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref = hf_deepseek(seed=len(case), **CASES[case])
    ref.save_pretrained(tmp_path)
    ours = load_target(tmp_path)
    T = 90  # past yarn's original context of 64
    tokens = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens[None], output_hidden_states=True)
        ours.setup_cache(T)
        logits, hidden = ours(tokens, torch.arange(T), 0, TreeMask.causal(T, "cpu"), hidden_layers=[0, 1])
        train_logits, _ = ours.forward_train(tokens[None])
    assert (logits - want.logits[0]).abs().max() < 2e-4
    assert torch.allclose(hidden[:, :64], want.hidden_states[1][0], atol=1e-4)
    assert torch.allclose(hidden[:, 64:], want.hidden_states[2][0], atol=1e-4)
    assert (train_logits[0] - want.logits[0]).abs().max() < 2e-4


def test_incremental_steps_match_one_prefill(hf_pair):
    """The latent cache: a prefill then AR steps give the logits of one long prefill."""
    _, tdir, _ = hf_pair
    ours = load_target(tdir)
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours.setup_cache(64)
        full, _ = ours(tokens, torch.arange(40), 0, TreeMask.causal(40, "cpu"))
        ours.setup_cache(64)
        first, _ = ours(tokens[:30], torch.arange(30), 0, TreeMask.causal(30, "cpu"))
        rest = [ours(tokens[i:i + 1], torch.tensor([i]), i, TreeMask.causal(1, "cpu"))[0] for i in range(30, 40)]
    assert ours.kv.shape == (3, 1, 1, 64, 32 + 16)  # one latent + RoPE key row a token and layer
    assert torch.allclose(torch.cat([first, *rest]), full, atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_the_prompts_expanded_attention_equals_the_absorbed_form(hf_pair, causal):
    """A forward with nothing cached runs MLA expanded (keys and values per head from its own rows); the same
    queries, rows and visibility give the absorbed form's layer output, for a causal prompt and a tree alike."""
    _, tdir, _ = hf_pair
    attn = load_target(tdir).layers[1].self_attn
    T = 9
    h = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(3))
    cos, sin = load_target(tdir).rotary(torch.arange(T), h.dtype)
    mask = TreeMask.causal(T, "cpu") if causal else TreeMask(ancestor_matrix(torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 5])))
    with torch.no_grad():
        q_lat, rows = attn.queries_and_cache_rows(h, cos, sin)
        q, rows_expanded = attn.queries_and_cache_rows(h, cos, sin, expanded=True)
        absorbed = attn.output(dl.attention.mla_attention(q_lat[0], rows[0], 0, mask, "sdpa", 32, attn.scale)[None])
        expanded = attn.output(attn.expanded_attention(q[0], rows[0], mask)[None], expanded=True)
    assert torch.equal(rows, rows_expanded)  # the cache holds the same rows either way
    assert q.shape[-1] == 16 + 16 and expanded.shape == absorbed.shape == (1, T, 64)
    assert torch.allclose(expanded, absorbed, atol=1e-5)


def test_tree_logits_match_transformers_on_the_same_4d_mask(hf_pair):
    model, tdir, _ = hf_pair
    ours = load_target(tdir)
    P = 12
    prompt = torch.randint(0, VOCAB, (P,), generator=torch.Generator().manual_seed(3))
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 0])
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 1])
    toks = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    anc = ancestor_matrix(parents)                                              # [T, T]
    T = len(toks)
    with torch.no_grad():
        ours.setup_cache(P + T)
        ours(prompt, torch.arange(P), 0, TreeMask.causal(P, "cpu"))
        tree_logits, _ = ours(toks, P + depths, P, TreeMask(anc))
        visible = torch.zeros(P + T, P + T, dtype=torch.bool)
        visible[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
        visible[P:, :P] = True
        visible[P:, P:] = anc
        mask = torch.zeros(P + T, P + T).masked_fill(~visible, float("-inf"))[None, None]
        positions = torch.cat([torch.arange(P), P + depths])[None]
        want = model(torch.cat([prompt, toks])[None], attention_mask=mask, position_ids=positions).logits[0, P:]
    assert (tree_logits - want).abs().max() < 2e-4


def test_ar_equals_transformers_greedy_and_ddtree_equals_ar(hf_pair):
    model, tdir, ddir = hf_pair
    pair = dl.load_pair(target=str(tdir), drafter=str(ddir))
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 10:].tolist()
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=24)
    assert ar.tokens == want
    for method, budget in (("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64),
                           ("ddtree", "auto")):
        res = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=24)
        assert res.tokens == ar.tokens, (method, budget)


def test_sampling_is_seeded_and_traces_count_routed_experts(hf_pair):
    _, tdir, ddir = hf_pair
    pair = dl.load_pair(target=str(tdir), drafter=str(ddir))
    runs = [dl.generate(pair, [3, 5, 7], method="ddtree", budget=16, max_new_tokens=20, temperature=0.8, seed=11,
                        trace=True) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 20
    touched = runs[0].rounds[0].experts_touched
    assert len(touched) == 2  # the two sparse layers (layer 0 is dense); the shared expert is not counted
    assert all(2 <= n <= 8 for n in touched)


def test_grouped_routing_matches_the_reference_router(hf_pair):
    model, _, _ = hf_pair
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, want_w, want_ids = gate(x)
        weights, ids = route_grouped_reference(x @ gate.weight.t(), gate.e_score_correction_bias, 2, 4, 2, "sigmoid",
                                               True, 2.5)
    order = want_ids.sort(-1).indices  # the reference's top-k is unsorted
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert torch.allclose(weights.gather(1, ids.sort(-1).indices), want_w.gather(1, order), atol=1e-6)
    groups = ids // 2  # four groups of two experts: at most topk_group = 2 of them open
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_a_multimodal_wrapper_loads_its_text_model(hf_pair, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _, tdir, _ = hf_pair
    inner = json.loads((tdir / "config.json").read_text())
    inner["model_type"] = "kimi_k2"
    del inner["architectures"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "model_type": "kimi_k25", "text_config": inner}))
    tensors = {f"language_model.{k}": v for k, v in load_file(tdir / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    tensors["mm_projector.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    wrapped, plain = load_target(tmp_path), load_target(tdir)
    assert "skipped 2 tensors outside the text model" in capsys.readouterr().err
    tokens = torch.arange(20) % VOCAB
    with torch.no_grad():
        wrapped.setup_cache(20)
        plain.setup_cache(20)
        a, _ = wrapped(tokens, torch.arange(20), 0, TreeMask.causal(20, "cpu"))
        b, _ = plain(tokens, torch.arange(20), 0, TreeMask.causal(20, "cpu"))
    assert torch.equal(a, b)


def _config(**overrides) -> dict:
    cfg = json.loads(json.dumps(transformers.DeepseekV3Config(**HF_BASE).to_dict()))
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v != "DROP"}


@pytest.mark.parametrize("overrides, field", [
    (dict(kv_lora_rank="DROP"), "kv_lora_rank"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(scoring_func="sqrtsoftplus"), "scoring_func"),
    (dict(topk_method="group_limited_greedy"), "topk_method"),
    (dict(n_group=3), "n_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(routed_scaling_factor=-1), "routed_scaling_factor"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25"), "architectures"),
])
def test_each_field_that_changes_the_math_is_read_or_refused_by_name(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field) as err:
        target_config_from_hf(_config(**overrides), tmp_path / "config.json")
    assert "\n" not in str(err.value)


def test_config_reads_every_field(tmp_path):
    cfg = target_config_from_hf(_config(moe_layer_freq=2, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0}), tmp_path)
    assert cfg.arch == "deepseek_v3" and cfg.mla.q_lora_rank == 48 and cfg.mla.cache_width == 48
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.n_shared_experts) == (4, 2, 2.5, 1)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, False, True]  # dense below 1, then every 2nd
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 32.0 and cfg.rope.beta_fast == 1.0
    mscale = 0.1 * torch.log(torch.tensor(32.0)).item() + 1
    assert cfg.attention_scale == pytest.approx(32 ** -0.5 * mscale ** 2)


def test_an_mla_target_refuses_the_gqa_only_backends(hf_pair):
    _, tdir, _ = hf_pair
    target = load_target(tdir)
    for backend in ("flex", "invariant"):
        with pytest.raises(ValueError, match="MLA target runs 'sdpa' or 'triton'"):
            target.set_attention(backend)


@pytest.mark.parametrize("symmetric", [True, False])
def test_an_int4_copy_equals_its_dequantized_weights(hf_pair, tmp_path, symmetric):
    """Experts written INT4 by compressed-tensors load packed; the logits equal those of the same model with the
    dequantized experts in fp32, and the tokens match."""
    pytest.importorskip("compressed_tensors")
    import shutil

    from ddtree_lab.kernels.int4 import dequantize
    from ddtree_lab.moe import Int4Experts, SparseMoE
    from ddtree_lab.quant import write_int4_checkpoint

    _, tdir, ddir = hf_pair
    shutil.copytree(tdir, tmp_path / "int4")
    done = write_int4_checkpoint(tmp_path / "int4", targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                                 group_size=16, symmetric=symmetric)
    assert len(done) == 2 * 8 * 3  # two sparse layers of 8 experts, three projections each
    packed, dense = load_target(tmp_path / "int4"), load_target(tdir)
    assert packed.cfg.expert_int4_group == 16 and packed.cfg.expert_int4_asymmetric == (not symmetric)
    with torch.no_grad():
        for p_blk, d_blk in zip(packed.layers, dense.layers):
            if isinstance(p_blk.mlp, SparseMoE):
                assert isinstance(p_blk.mlp.gate_up, Int4Experts)
                d_blk.mlp.gate_up.copy_(dequantize(p_blk.mlp.gate_up.weights(), torch.float32))
                d_blk.mlp.down.copy_(dequantize(p_blk.mlp.down.weights(), torch.float32))
    tokens = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for m in (packed, dense):
            m.setup_cache(30)
        a, _ = packed(tokens, torch.arange(30), 0, TreeMask.causal(30, "cpu"))
        b, _ = dense(tokens, torch.arange(30), 0, TreeMask.causal(30, "cpu"))
    assert torch.equal(a, b)
    pair = dl.load_pair(target=str(tmp_path / "int4"), drafter=str(ddir))
    ar = dl.generate(pair, tokens[:8].tolist(), method="ar", max_new_tokens=16)
    tree = dl.generate(pair, tokens[:8].tolist(), budget=32, max_new_tokens=16, trace=True)
    assert tree.tokens == ar.tokens
    # traces say the experts are INT4, so readers take the row blocks at INT4's height
    assert all(r.expert_int4 for r in tree.rounds) and dense.expert_routing()["expert_int4"] is False


def test_int4_refusals(hf_pair, tmp_path):
    pytest.importorskip("compressed_tensors")
    import shutil

    from safetensors.torch import load_file, save_file

    from ddtree_lab.config import CheckpointError
    from ddtree_lab.quant import write_int4_checkpoint

    _, tdir, _ = hf_pair
    shutil.copytree(tdir, tmp_path / "attn")
    write_int4_checkpoint(tmp_path / "attn", targets=[r"re:.*self_attn\.o_proj$"], group_size=16)
    with pytest.raises(ConfigError, match=r"INT4 'model.layers.0.self_attn.o_proj' is not run here"):
        load_target(tmp_path / "attn")
    shutil.copytree(tdir, tmp_path / "scale")
    write_int4_checkpoint(tmp_path / "scale", targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], group_size=16)
    path = tmp_path / "scale" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight_scale'"):
        load_target(tmp_path / "scale")
    cfg = json.loads((tmp_path / "scale" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (tmp_path / "scale" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quantization_config") as err:
        load_target(tmp_path / "scale")
    assert "\n" not in str(err.value)


def test_a_router_stored_in_bf16_stays_bf16_and_routes_as_transformers(tmp_path):
    """A checkpoint's bf16 router (every value a bf16) loads as bf16, half the bytes; its logits are the fp32
    router's (same products, fp32 sums), so the model still matches transformers."""
    ref = hf_deepseek(seed=3)
    with torch.no_grad():
        for layer in ref.model.layers[1:]:
            layer.mlp.gate.weight.copy_(layer.mlp.gate.weight.to(torch.bfloat16))
    ref.save_pretrained(tmp_path)
    ours = load_target(tmp_path)
    routers = [m for m in ours.modules() if isinstance(m, Float32Router)]
    assert len(routers) == 2 and all(r.weight.dtype == torch.bfloat16 for r in routers)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)
    T = 40
    tokens = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
        ours.setup_cache(T)
        logits, _ = ours(tokens, torch.arange(T), 0, TreeMask.causal(T, "cpu"))
    assert (logits - want).abs().max() < 2e-4


def test_a_router_narrows_only_when_exact_and_keeps_its_dtype_through_moves():
    router = Float32Router(64, 8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=g))
    assert not router.narrow() and router.weight.dtype == torch.float32  # fp32 values: nothing to lose
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(router.weight.to(torch.bfloat16))
        before = router(x)
        assert router.narrow() and router.weight.dtype == torch.bfloat16
        after = router(x)
    assert before.dtype == after.dtype == torch.float32 and torch.equal(before, after)
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        router.to(dtype)
        assert router.weight.dtype == torch.bfloat16 and router.e_score_correction_bias.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor-core product runs on a GPU; its CPU twin: "
                    "test_a_router_narrows_only_when_exact_and_keeps_its_dtype_through_moves")
@pytest.mark.parametrize("T", [1, 17, 257])
def test_a_bf16_router_on_the_gpu_sums_its_exact_products_in_fp32(T):
    g = torch.Generator().manual_seed(T)
    router = Float32Router(7168, 384)
    with torch.no_grad():
        router.weight.copy_(0.02 * torch.randn(384, 7168, generator=g))
        router.weight.copy_(router.weight.to(torch.bfloat16))
    assert router.narrow()
    router.cuda()
    x = torch.randn(T, 7168, generator=g).to("cuda", torch.bfloat16)
    with torch.no_grad():
        got = router(x)
        want = x.double() @ router.weight.double().t()  # the exact sums of the same products
    assert got.dtype == torch.float32 and got.shape == (T, 384)
    scale = x.double().abs() @ router.weight.double().abs().t()
    assert ((got.double() - want).abs() <= 1e-5 * scale).all()  # fp32 sums over 7168 products


def test_launch_pdl_reaches_the_moe_and_mla_kernels_and_changes_no_token(hf_pair, use_options, monkeypatch):
    """options.launch_pdl (bench --pdl): the MoE block's kernels get the launch option PDL, its routing kernel
    pdl=True and MLA's kernels {"pdl": True}. Where programmatic dependent launch cannot run (here, Triton's
    interpreter: kernels/pdl.pdl_applies) the launches stay plain, and the tokens are the same either way."""
    from ddtree_lab.kernels import declared_route, fused_moe, mla_attention

    _, tdir, ddir = hf_pair
    pair = dl.load_pair(target=str(tdir), drafter=str(ddir), attention="triton", device=DEVICE)
    use_options(tree_kernels="triton")  # the GPU's path (on the CPU, under the interpreter)
    want = dl.generate(pair, [3, 5, 7], budget=4, max_new_tokens=6, stop=[]).tokens
    seen = []

    def record(module, name, what):
        call = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: seen.append((name, what(kw))) or call(*a, **kw))

    record(fused_moe, "fused_moe_routed", lambda kw: (kw.get("config") or {}).get("PDL"))
    record(declared_route, "grouped_route", lambda kw: kw.get("pdl"))
    record(mla_attention, "mla_tree_attention", lambda kw: (kw.get("config") or {}).get("pdl"))
    use_options(launch_pdl=True)
    assert dl.generate(pair, [3, 5, 7], budget=4, max_new_tokens=6, stop=[]).tokens == want
    assert {name for name, _ in seen} == {"fused_moe_routed", "grouped_route", "mla_tree_attention"}
    assert all(value is True for _, value in seen)
    assert fused_moe.pdl_applies(True, torch.zeros(1, device=DEVICE)) == (DEVICE == "cuda")  # CPU: plain launches


def test_compiled_layers_give_the_same_tokens(hf_pair):
    """compile=True: each layer's compiled function computes the queries and writes the new latent rows into the
    cache (MlaBlock.attention_inputs_into), the prompt's expanded form and the absorbed steps alike; decoding does
    not change."""
    _, tdir, ddir = hf_pair
    prompt = [3, 5, 7, 11, 13]
    eager = dl.load_pair(target=str(tdir), drafter=str(ddir))
    fused = dl.load_pair(target=str(tdir), drafter=str(ddir), compile=True)
    for method, budget in (("ar", None), ("ddtree", 8)):
        want = dl.generate(eager, prompt, method=method, budget=budget, max_new_tokens=12, stop=[]).tokens
        assert dl.generate(fused, prompt, method=method, budget=budget, max_new_tokens=12, stop=[]).tokens == want
