"""GGUF import round trip, offline: a tiny random Llama -> GGUF (llama.cpp layout) -> HF dir -> our engine.

Skipped only when the optional `gguf` extra (gguf, transformers, accelerate) is not installed.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.pairs import gguf_import  # noqa: E402
from ddtree_lab.attention import TreeMask  # noqa: E402
from ddtree_lab.atomic import MARKER  # noqa: E402
from ddtree_lab.pairs.gguf_import import GGUFImportError, HashMismatchError, import_gguf  # noqa: E402
from ddtree_lab.prompts import encode_prompt  # noqa: E402
from ddtree_lab.testing import TINY_TEXT  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the sample builders beside this file
from gguf_samples import CHAT_TEMPLATE, export_llama_gguf, make_tiny_llama  # noqa: E402


def our_logits(directory, ids):
    pair = dl.load_pair(target=directory)
    T = len(ids)
    pair.target.setup_cache(T + 4)
    with torch.no_grad():
        logits, _ = pair.target(torch.tensor(ids), torch.arange(T), 0, TreeMask.causal(T, "cpu"))
    return logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{tied, untied}: (hf dir, model, f32 gguf, q8 gguf, imported f32 dir, imported q8 dir)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for tied in (True, False):
        tag = "tied" if tied else "untied"
        hf = root / f"hf-{tag}"
        hf.mkdir()
        model = make_tiny_llama(hf, tied)
        f32 = export_llama_gguf(hf, root / f"tiny-{tag}-f32.gguf", "F32")
        q8 = export_llama_gguf(hf, root / f"tiny-{tag}-q8.gguf", "Q8_0")
        out[tag] = dict(hf=hf, model=model, f32=f32, q8=q8,
                        imp_f32=import_gguf(f32, root / f"imp-{tag}-f32", log=lambda *_: None),
                        imp_q8=import_gguf(q8, root / f"imp-{tag}-q8", log=lambda *_: None))
    return out


@pytest.mark.parametrize("tag", ["tied", "untied"])
def test_f32_round_trip_restores_the_weights(tiny, tag):
    t = tiny[tag]
    cfg = json.loads((t["imp_f32"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is (tag == "tied")
    assert cfg["rope_theta"] == 100000.0 and cfg["eos_token_id"] == 0
    assert "quantization_config" not in cfg
    ours = load_file(str(t["imp_f32"] / "model.safetensors"))
    orig = load_file(str(t["hf"] / "model.safetensors"))
    if tag == "tied":
        orig.pop("lm_head.weight", None)
        assert "lm_head.weight" not in ours
    assert set(ours) == set(orig)
    for name in orig:  # exact: the q/k permutation is undone, nothing is rounded
        assert torch.equal(ours[name], orig[name]), name


@pytest.mark.parametrize("tag", ["tied", "untied"])
def test_engine_matches_transformers_on_imported_dirs(tiny, tag):
    from transformers import LlamaForCausalLM

    t = tiny[tag]
    pair = dl.load_pair(target=t["imp_q8"])
    ids = encode_prompt(pair, TINY_TEXT[:120])
    assert len(ids) > 20
    for key in ("imp_f32", "imp_q8"):
        ref = LlamaForCausalLM.from_pretrained(t[key], dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = our_logits(t[key], ids)
        assert (got - want).abs().max().item() < 1e-4, key
    with torch.no_grad():  # and the f32 import is the original model
        orig = t["model"](torch.tensor([ids])).logits[0]
    assert (our_logits(t["imp_f32"], ids) - orig).abs().max().item() < 1e-4
    # Q8_0 is close to the original, not equal
    assert 0 < (our_logits(t["imp_q8"], ids) - orig).abs().max().item() < 0.1


def test_tokenizer_and_chat_template_survive(tiny):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    t = tiny["tied"]
    orig = Tokenizer.from_file(str(t["hf"] / "tokenizer.json"))
    pair = dl.load_pair(target=t["imp_q8"])
    assert pair.encode(TINY_TEXT) == orig.encode(TINY_TEXT, add_special_tokens=False).ids
    assert pair.decode(pair.encode(TINY_TEXT)) == TINY_TEXT
    assert pair.chat_template == CHAT_TEMPLATE
    assert pair.eos_token_ids == [0]
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    ids = encode_prompt(pair, msgs)
    hf_tok = AutoTokenizer.from_pretrained(t["imp_q8"])
    hf_ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)
    assert ids[0] == orig.token_to_id("<|mask|>")  # a special token stays whole
    res = dl.generate(pair, msgs, method="ar", max_new_tokens=8)
    assert 1 <= len(res.tokens) <= 8


def test_dtype_option_and_provenance(tiny, tmp_path):
    out = import_gguf(tiny["tied"]["f32"], tmp_path / "bf16", dtype="bfloat16", log=lambda *_: None)
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    prov = gguf_import.read_provenance(out)
    assert prov["sha256"] == hashlib.sha256(tiny["tied"]["f32"].read_bytes()).hexdigest()
    assert prov["sha256_verified"] is False and prov["architecture"] == "llama"
    assert dl.load_pair(target=out, dtype="bfloat16").target.cfg.arch == "llama"


def test_known_file_with_wrong_hash_is_refused(tiny, tmp_path, monkeypatch):
    path = tiny["tied"]["q8"]
    monkeypatch.setitem(gguf_import.KNOWN_SHA256, path.name, "0" * 64)
    with pytest.raises(HashMismatchError) as e:
        import_gguf(path, tmp_path / "out", log=lambda *_: None)
    msg = str(e.value)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.name in msg and "0" * 64 in msg and actual in msg
    assert not (tmp_path / "out").exists()
    with pytest.raises(HashMismatchError):  # an explicit expectation is checked too
        import_gguf(tiny["untied"]["q8"], tmp_path / "out", expected_sha256="1" * 64, log=lambda *_: None)


def test_a_caller_verified_file_is_not_hashed_again(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_import, "file_digest", lambda path: pytest.fail(f"{path} hashed again"))
    path = tiny["tied"]["q8"]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    out = import_gguf(path, tmp_path / "out", expected_sha256=sha, already_verified=True, log=lambda *_: None)
    assert gguf_import.read_provenance(out)["sha256"] == sha and gguf_import.read_provenance(out)["sha256_verified"]
    with pytest.raises(GGUFImportError, match="needs the expected_sha256"):
        import_gguf(path, tmp_path / "other", already_verified=True)


def test_the_shipped_module_holds_no_test_exporter():
    assert not hasattr(gguf_import, "export_llama_gguf") and "export_llama_gguf" not in gguf_import.__all__


def test_bad_inputs_are_refused(tiny, tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(not_gguf, tmp_path / "a")
    with pytest.raises(GGUFImportError, match="file not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    with pytest.raises(GGUFImportError, match="not empty"):
        import_gguf(tiny["tied"]["q8"], tiny["tied"]["imp_q8"])
    with pytest.raises(GGUFImportError, match="dtype"):
        import_gguf(tiny["tied"]["q8"], tmp_path / "b", dtype="int8")


@pytest.mark.parametrize("installed,says", [
    ({"gguf": None}, r"gguf>=[0-9.]+,<[0-9.]+ \(not installed\)"),
    ({"transformers": "5.17.0"}, r"transformers>=5\.18,<6 \(5\.17\.0 is installed\)"),  # misreads a GGUF tokenizer
])
def test_a_missing_or_untested_extra_names_the_version_and_the_install_command(monkeypatch, installed, says):
    from ddtree_lab import runtime

    real = runtime.md.version

    def version(name):
        if name in installed:
            if installed[name] is None:
                raise runtime.md.PackageNotFoundError(name)
            return installed[name]
        return real(name)
    monkeypatch.setattr(runtime.md, "version", version)
    with pytest.raises(GGUFImportError, match=says + r".*pip install -e '\.\[gguf\]'"):
        gguf_import.require_extra()


def test_cli(tiny, tmp_path, capsys):
    p = argparse.ArgumentParser()
    gguf_import.add_import_gguf_args(p)
    args = p.parse_args([str(tiny["tied"]["q8"]), str(tmp_path / "cli"), "--dtype", "float16"])
    assert gguf_import.run_import_gguf_cli(args) == 0
    assert "load_pair(target=" in capsys.readouterr().out
    assert gguf_import.run_import_gguf_cli(args) == 1  # exists, no --force
    assert "--force" in capsys.readouterr().err
    args.force = True
    assert gguf_import.run_import_gguf_cli(args) == 0
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["cli"]  # no temp dirs left behind
    assert not (tmp_path / "cli" / MARKER).exists()  # atomic_dir's temp marker went with the rename
