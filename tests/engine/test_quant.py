"""ddtree_lab/quant.py: compressed-tensors pack-quantized INT4 checkpoints. The config read (what it accepts,
each scheme it refuses in one line naming it), the target/ignore matching, one linear's tensors with their
checks, experts stacked for the kernel (equal to compressed-tensors' own decompression), and checkpoints
written by compressed-tensors itself."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402

from ddtree_lab import quant  # noqa: E402
from ddtree_lab.config import CheckpointError, ConfigError  # noqa: E402
from ddtree_lab.kernels.int4 import dequantize  # noqa: E402

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
KIMI_LIKE = {  # the shape of a Kimi K2 thinking config: every Linear, the non-expert ones ignored by pattern
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None,
                                              "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$"],
    "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "version": "0.20.1"}


def ct_config(preset: str, fmt: str, **extra) -> dict:
    """A config.json's quantization_config for one of compressed-tensors' preset schemes, as it writes them."""
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt,
                            quantization_status="compressed").model_dump(mode="json")
    return {**qc, **extra}


def test_no_quantization_config_is_none_and_a_wrappers_text_config_is_read():
    assert quant.read_quantization({"model_type": "deepseek_v3"}, "d") is None
    spec = quant.read_quantization({"model_type": "kimi_k25", "text_config": {"quantization_config": KIMI_LIKE}}, "d")
    assert spec.schemes == (quant.Int4Scheme(("Linear",), True, 32),) and spec.ignore == tuple(KIMI_LIKE["ignore"])
    assert (spec.num_bits, spec.type, spec.strategy, spec.format) == (4, "int", "group", "pack-quantized")


@pytest.mark.parametrize("preset,symmetric,group", [("W4A16", True, 128), ("W4A16_ASYM", False, 128)])
def test_the_int4_presets_are_read(preset, symmetric, group):
    spec = quant.read_quantization({"quantization_config": ct_config(preset, "pack-quantized")}, "d")
    assert spec.schemes == (quant.Int4Scheme(("Linear",), symmetric, group),)
    # a group named by its preset and listing its targets, as compressed-tensors also reads them
    named = {**ct_config(preset, "pack-quantized"), "config_groups": {preset: ["Linear"]}}
    assert quant.read_quantization({"quantization_config": named}, "d") == spec


REFUSED = [  # (quantization_config, words the one line must hold)
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "FP8 block-quantized weights"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "AWQ"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "GPTQ with act-order"),
    ({"quant_method": "mxfp4"}, "MXFP4"),
    (ct_config("FP8_BLOCK", "float-quantized"), "FP8 weights in [128, 128] blocks"),
    (ct_config("FP8_DYNAMIC", "float-quantized"), "FP8 weights (per channel)"),
    (ct_config("NVFP4", "nvfp4-pack-quantized"), "NVFP4 weights"),
    (ct_config("MXFP4A16", "mxfp4-pack-quantized"), "MXFP4 weights"),
    (ct_config("W8A8", "int-quantized"), "int8 weights"),
    (ct_config("W8A16", "pack-quantized"), "int8 weights"),
    (ct_config("W4A8", "int-quantized"), "dynamic input activation quantization (int8, with int4 weights)"),
    (ct_config("W4A16", "naive-quantized"), "format 'naive-quantized'"),
    (ct_config("W4A16", "pack-quantized", kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV-cache"),
    (ct_config("W4A16", "pack-quantized", sparsity_config={"format": "sparse-24-bitmask"}), "sparsity"),
    (ct_config("W4A16", "pack-quantized", quantization_status="frozen"), "quantization_status 'frozen'"),
]


def _with_weights(**weights) -> dict:
    qc = json.loads(json.dumps(KIMI_LIKE))
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


REFUSED += [
    (_with_weights(actorder="group"), "activation ordering actorder 'group'"),
    (_with_weights(strategy="channel", group_size=None), "strategy 'channel'"),
    (_with_weights(strategy="tensor", group_size=None), "strategy 'tensor'"),
    (_with_weights(group_size=48), "group_size 48"),
    (_with_weights(num_bits=8), "int8 weights (num_bits 8"),
]


@pytest.mark.parametrize("qc,words", REFUSED, ids=[w for _, w in REFUSED])
def test_every_scheme_not_run_is_refused_in_one_line_naming_it(qc, words):
    with pytest.raises(ConfigError) as e:
        quant.read_quantization({"quantization_config": qc}, "/ckpt/config.json")
    message = str(e.value)
    assert message.startswith("/ckpt/config.json: quantization_config") and "\n" not in message
    assert words in message and "pack-quantized INT4" in message, message


def test_weight_ordered_actorder_keeps_the_format_and_is_read():
    """actorder 'weight' only orders GPTQ's calibration: the stored groups are the plain ones."""
    assert quant.read_quantization({"quantization_config": _with_weights(actorder="weight")}, "d") is not None


def test_a_config_that_does_not_parse_says_where_in_one_line():
    qc = _with_weights(type="fixed")
    with pytest.raises(ConfigError, match=r"^d: quantization_config\.config_groups\.group_0\.weights\.type"):
        quant.read_quantization({"quantization_config": qc}, "d")


def test_a_missing_library_names_what_installs_it(monkeypatch):
    from ddtree_lab import runtime

    monkeypatch.setattr(quant, "has_library", lambda module: module != "compressed_tensors")
    with pytest.raises(ConfigError) as e:
        quant.read_quantization({"quantization_config": KIMI_LIKE}, "d")
    assert str(e.value) == runtime.missing_library("d: a compressed-tensors checkpoint", "compressed-tensors")
    assert "'compressed-tensors'" in str(e.value) and "\n" not in str(e.value)


def test_targets_and_ignore_by_compressed_tensors_rules():
    spec = quant.read_quantization({"quantization_config": KIMI_LIKE}, "d")
    layer = "model.layers.3"
    assert quant.is_quantized(spec, f"{layer}.mlp.experts.7.gate_proj")
    assert quant.is_quantized(spec, f"language_model.{layer}.mlp.experts.0.down_proj")
    for name in (f"{layer}.mlp.shared_experts.up_proj", f"{layer}.self_attn.kv_b_proj", "lm_head",
                 "model.layers.0.mlp.down_proj"):
        assert not quant.is_quantized(spec, name), name
    # the router is not a Linear in the reference model: its class decides, or the module itself
    assert not quant.is_quantized(spec, f"{layer}.mlp.gate", "DeepseekV3TopkRouter")
    assert not quant.is_quantized(spec, f"{layer}.mlp.gate", torch.nn.Module())
    assert quant.is_quantized(spec, f"{layer}.mlp.experts.1.up_proj", torch.nn.Linear(2, 2))
    assert not quant.is_quantized(spec, f"{layer}.mlp.experts.1.up_proj", None)  # by name only: no "Linear"
    assert not quant.is_quantized(None, f"{layer}.mlp.experts.1.up_proj")


def test_an_exact_name_wins_over_a_pattern_over_a_class():
    qc = json.loads(json.dumps(KIMI_LIKE))
    group = qc["config_groups"]["group_0"]
    qc["config_groups"] = {
        "by_class": group,
        "by_pattern": {**group, "targets": [EXPERTS], "weights": {**group["weights"], "group_size": 64}},
        "by_name": {**group, "targets": ["model.layers.1.mlp.experts.0.up_proj"],
                    "weights": {**group["weights"], "group_size": 128, "symmetric": False}}}
    spec = quant.read_quantization({"quantization_config": qc}, "d")
    assert spec.scheme_for("model.layers.1.mlp.experts.0.up_proj").group_size == 128
    assert spec.scheme_for("model.layers.1.mlp.experts.1.up_proj").group_size == 64
    assert spec.scheme_for("model.layers.1.mlp.experts_x").group_size == 32


# ----------------------------------------------------------------------------- tensors

def dense_experts(E=4, H=64, I=32, seed=0, dtype=torch.float32, prefix="model.layers.1.mlp.experts"):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[f"{prefix}.{e}.gate_proj.weight"] = torch.randn(I, H, generator=g).to(dtype)
        out[f"{prefix}.{e}.up_proj.weight"] = torch.randn(I, H, generator=g).to(dtype)
        out[f"{prefix}.{e}.down_proj.weight"] = torch.randn(H, I, generator=g).to(dtype)
    out["model.layers.1.mlp.gate.weight"] = torch.randn(E, H, generator=g)
    return out


def quantized(symmetric=True, group=32, dtype=torch.float32, **kw):
    qconfig = quant.int4_config([EXPERTS], group_size=group, symmetric=symmetric)
    tensors, done = quant.quantize_state_dict(dense_experts(dtype=dtype, **kw), qconfig)
    spec = quant.read_quantization({"quantization_config": qconfig.model_dump(mode="json")}, "ckpt")
    return tensors, done, spec, qconfig


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_dequantize_to_compressed_tensors_decompression(symmetric, dtype):
    """load_int4 then stack_int4 (gate rows, then up rows): each expert's dequantized rows are compressed-tensors'
    own decompression of its gate and up (down) linears, bit for bit."""
    tensors, done, spec, qconfig = quantized(symmetric, dtype=dtype)
    assert len(done) == 12 and "model.layers.1.mlp.gate.weight" in tensors  # the router stays dense
    scheme = qconfig.config_groups["group_0"]
    p = "model.layers.1.mlp.experts.{}.{}_proj"
    gate_up = quant.stack_int4([[quant.load_int4(tensors, p.format(e, "gate"), spec, "ckpt"),
                                 quant.load_int4(tensors, p.format(e, "up"), spec, "ckpt")] for e in range(4)])
    down = quant.stack_int4([quant.load_int4(tensors, p.format(e, "down"), spec, "ckpt") for e in range(4)])
    assert gate_up.shape == (4, 64, 64) and down.shape == (4, 64, 32) and (gate_up.zero is None) == symmetric
    assert gate_up.scale.dtype == dtype

    def decompressed(name):
        local = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == name}
        return PackedQuantizationCompressor.decompress(local, scheme)["weight"]

    for e in range(4):
        want = torch.cat([decompressed(p.format(e, "gate")), decompressed(p.format(e, "up"))])
        assert torch.equal(dequantize(gate_up)[e], want)
        assert torch.equal(dequantize(down)[e], decompressed(p.format(e, "down")))


def test_a_missing_or_misshapen_tensor_is_named():
    tensors, _, spec, _ = quantized(symmetric=False)
    name = "model.layers.1.mlp.experts.2.gate_proj"
    for missing in ("weight_scale", "weight_packed", "weight_shape", "weight_zero_point"):
        broken = {k: v for k, v in tensors.items() if k != f"{name}.{missing}"}
        with pytest.raises(CheckpointError, match=rf"^/ckpt: missing tensor '{name}\.{missing}'$"):
            quant.load_int4(broken, name, spec, "/ckpt")
    # a get(name) works as the mapping does: None (or KeyError) for an absent tensor
    got = quant.load_int4(tensors.get, name, spec, "/ckpt")
    assert got.shape == (32, 64) and got.packed.shape == (32, 8) and got.zero.shape == (4, 2)
    with pytest.raises(CheckpointError, match="missing tensor"):
        quant.load_int4(lambda n: None if n.endswith("scale") else tensors[n], name, spec, "/ckpt")
    bad = {**tensors, f"{name}.weight_scale": tensors[f"{name}.weight_scale"][:, :1]}
    with pytest.raises(CheckpointError, match=rf"'{name}\.weight_scale' has shape \(32, 1\), expected \(32, 2\)"):
        quant.load_int4(bad, name, spec, "/ckpt")
    with pytest.raises(CheckpointError, match="is not INT4"):
        quant.load_int4(tensors, "model.layers.1.mlp.gate", spec, "/ckpt")


def test_k_not_a_multiple_of_the_group_is_refused():
    tensors, _, spec, _ = quantized()
    name = "model.layers.1.mlp.experts.0.down_proj"
    bad = {**tensors, f"{name}.weight_shape": torch.tensor([64, 48])}
    with pytest.raises(CheckpointError, match=rf"'{name}' has K=48 columns, not a multiple of its group size 32"):
        quant.load_int4(bad, name, spec, "/ckpt")
    with pytest.raises(ValueError, match="K=48 is not a multiple of the group size 32"):
        quant.quantize_linear(torch.zeros(8, 48), quant.int4_config(["x"]).config_groups["group_0"])


def test_zero_points_stack_along_n_only_in_whole_words():
    qconfig = quant.int4_config([EXPERTS], symmetric=False)
    p = "model.layers.1.mlp.experts.0.{}_proj"
    dense = {f"{p.format(w)}.weight": torch.randn(12, 64) for w in ("gate", "up")}  # up would start mid-word
    tensors, _ = quant.quantize_state_dict(dense, qconfig)
    spec = quant.read_quantization({"quantization_config": qconfig.model_dump(mode="json")}, "ckpt")
    parts = [quant.load_int4(tensors, p.format(w), spec, "ckpt") for w in ("gate", "up")]
    with pytest.raises(ValueError, match="N a multiple of 8"):
        quant.stack_int4([parts])
    assert quant.stack_int4([parts[:1]]).shape == (1, 12, 64)  # one linear alone is fine


def test_class_targets_cannot_quantize_tensors_by_name():
    with pytest.raises(ValueError, match="target 'Linear' names a module class"):
        quant.quantize_state_dict(dense_experts(), quant.int4_config(["Linear"]))


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("sharded", [False, True])
def test_write_int4_checkpoint_round_trips(tmp_path, sharded):
    """A saved directory rewritten in place: the targeted linears packed, config.json's quantization_config
    written by compressed-tensors and read back as the same scheme; a sharded index keeps its map."""
    dense = dense_experts()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    if sharded:
        names = sorted(dense)
        halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for fname, keys in halves.items():
            save_file({k: dense[k] for k in keys}, str(tmp_path / fname))
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    else:
        save_file(dense, str(tmp_path / "model.safetensors"))
    done = quant.write_int4_checkpoint(tmp_path, [EXPERTS], group_size=32, symmetric=False)
    assert len(done) == 12
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    spec = quant.read_quantization(cfg, tmp_path)
    assert spec.schemes == (quant.Int4Scheme((EXPERTS,), False, 32),)
    if sharded:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        stored = {k: v for f in ("a.safetensors", "b.safetensors") for k, v in load_file(str(tmp_path / f)).items()}
        assert set(weight_map) == set(stored)
    else:
        stored = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj"
    assert f"{name}.weight" not in stored and stored[f"{name}.weight_packed"].dtype == torch.int32
    one = quant.load_int4(stored, name, spec, tmp_path)
    assert one.shape == (64, 32)
    err = (dequantize(quant.stack_int4([one]))[0] - dense[f"{name}.weight"]).abs().max()
    assert err <= one.scale.max() * 1.05  # within a quantization step


def test_write_int4_checkpoint_on_a_tiny_deepseek_target(tmp_path):
    """The engine's own tiny DeepSeek-V3 directory (per-expert tensors): only the routed experts are packed."""
    from ddtree_lab.testing import make_tiny_pair

    target, _ = make_tiny_pair(tmp_path, arch="deepseek_v3", tokenizer=False)
    done = quant.write_int4_checkpoint(target, [EXPERTS])
    assert done and all(".mlp.experts." in m for m in done)
    stored = load_file(str(target / "model.safetensors"))
    spec = quant.read_quantization(json.loads((target / "config.json").read_text()), target)
    assert {quant.is_quantized(spec, m) for m in done} == {True}
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in stored
    assert "model.layers.1.mlp.gate.weight" in stored
