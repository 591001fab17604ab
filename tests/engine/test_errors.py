"""Bad input is refused before any work, with a message naming what is wrong."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

import ddtree_lab as dl
from ddtree_lab.checkpoint import CheckpointError
from ddtree_lab.testing import make_tiny_pair


@pytest.mark.parametrize("kwargs,field", [
    (dict(budget=0), "budget"), (dict(budget=1025), "budget"), (dict(topk=0), "topk"),
    (dict(method="beam"), "method"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(max_new_tokens=3000), "max_position_embeddings"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(seed=2 ** 64), "seed"), (dict(seed=1.5), "seed"),
])
def test_generate_refuses_bad_arguments(tiny_pair, kwargs, field):
    with pytest.raises(ValueError, match=field):
        dl.generate(tiny_pair, [1, 2, 3], **kwargs)


def test_prompt_longer_than_context(tiny_pair):
    with pytest.raises(ValueError, match="context"):
        dl.generate(tiny_pair, [1] * 2048, max_new_tokens=1)
    with pytest.raises(ValueError, match="vocabulary"):
        dl.generate(tiny_pair, [1, 5000])
    with pytest.raises(ValueError, match="chat template"):
        dl.generate(tiny_pair, [{"role": "user", "content": "hi"}])


@pytest.fixture
def dirs(tmp_path):
    return make_tiny_pair(tmp_path, seed=1)


def test_missing_tensor_named(dirs):
    t, d = dirs
    tensors = load_file(d / "model.safetensors")
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.mlp.up_proj.weight'"):
        dl.load_pair(target=t, drafter=d)


def test_wrong_shape_named(dirs):
    t, d = dirs
    tensors = load_file(t / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:-1]
    save_file(tensors, t / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight' has shape"):
        dl.load_pair(target=t, drafter=d)


def test_unsupported_architecture_and_missing_field(dirs):
    t, d = dirs
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ValueError, match="architectures"):
        dl.load_pair(target=t, drafter=d)
    cfg.pop("hidden_size")
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        dl.load_pair(target=t, drafter=d)


def test_drafter_that_does_not_fit_the_target(dirs):
    t, d = dirs
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, dflash_config=dict(cfg["dflash_config"],
                                                                          target_layer_ids=[0, 9]))))
    with pytest.raises(ValueError, match="target_layer_ids"):
        dl.load_pair(target=t, drafter=d)
    other_t, _ = make_tiny_pair(d.parent / "other", seed=2, hidden_size=32, tokenizer=False)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        dl.load_pair(target=other_t, drafter=d)


def test_sharded_checkpoint_loads_identically(dirs, tmp_path):
    t, d = dirs
    sharded = tmp_path / "sharded"
    shutil.copytree(t, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, sharded / fname)
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = dl.generate(dl.load_pair(target=t, drafter=d), [4, 5], max_new_tokens=10, stop=[])
    b = dl.generate(dl.load_pair(target=sharded, drafter=d), [4, 5], max_new_tokens=10, stop=[])
    assert a.tokens == b.tokens
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        dl.load_pair(target=sharded, drafter=d)


def test_unknown_pair_name_and_dtype():
    with pytest.raises(ValueError, match="unknown pair name"):
        dl.load_pair("nonesuch")
    with pytest.raises(ValueError, match="dtype"):
        dl.load_pair("lab", dtype="float8")


def test_config_that_disagrees_with_its_weights_is_refused(dirs):
    """One layer fewer, or Llama's architecture on Qwen3 weights (its q/k norms unread), would load a
    different model: every stored tensor must be read."""
    t, d = dirs
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=cfg["num_hidden_layers"] - 1)))
    last = cfg["num_hidden_layers"] - 1
    with pytest.raises(CheckpointError, match=rf"does not describe \(model.layers.{last}\."):
        dl.load_pair(target=t, drafter=d)
    (t / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama")))
    with pytest.raises(CheckpointError, match=r"self_attn.k_norm.weight"):
        dl.load_pair(target=t, drafter=d)


def _corrupt(dirs, tmp_path, edit):
    t, d = dirs
    bad = tmp_path / "bad_target"
    shutil.copytree(t, bad)
    edit(bad)
    return bad, d


@pytest.mark.parametrize("edit, words", [
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
     "model.safetensors: not a readable safetensors file"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00" + b"garbage!" * 20),
     "model.safetensors: not a readable safetensors file"),
    (lambda p: (p / "tokenizer.json").write_text('{"version": '), "tokenizer.json: not a readable tokenizer file"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), "config.json: holds a JSON list"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                         "rope_theta": "big"})), "field 'rope_theta' should be a number"),
])
def test_damaged_checkpoint_files_named(dirs, tmp_path, edit, words):
    t, d = _corrupt(dirs, tmp_path, edit)
    with pytest.raises(ValueError, match=words):
        dl.load_pair(target=t, drafter=d)


def test_bad_prompt_text_and_roles(tiny_pair):
    with pytest.raises(ValueError, match="not valid UTF-8"):
        dl.generate(tiny_pair, "abc\udcff", max_new_tokens=2)
    with pytest.raises(ValueError, match="role 'wizard'"):
        dl.generate(tiny_pair, [{"role": "wizard", "content": "hi"}], max_new_tokens=2)
