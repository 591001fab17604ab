"""What a new user meets first: the CPU path without the optional libraries, values checked before anything
runs (never replaced), the API's checks equal to the CLI's, and one report under torchrun."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab import cli, runtime

# Runs a script with `triton` unimportable, as after `pip install -e .` (the base install has no triton).
WITHOUT_TRITON = textwrap.dedent("""
    import sys
    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoTriton())
""")


def run_python(code: str, **env):
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", WITHOUT_TRITON + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**clean, "OMP_NUM_THREADS": "1", **env})


def test_the_cpu_path_needs_no_triton(tmp_path):
    """Every subcommand the quickstart and the CPU docs use imports and runs without triton; asking for a
    Triton backend then names the extra that installs it."""
    out = run_python(f"""
        import importlib, json
        from ddtree_lab import cli
        for name, module, *_ in cli.SUBCOMMANDS:
            if name in ("study", "report", "ingest", "advise", "bench", "pull"):
                importlib.import_module(module, "ddtree_lab")  # raises if it reaches triton
        import ddtree_lab as dl
        pair = dl.load_pair("lab")
        res = dl.generate(pair, "def parse(line):", method="ddtree", budget=8, max_new_tokens=6)
        assert len(res.tokens) >= 1 and "triton" not in sys.modules
        cli.main(["bench", "e2e", "--model", "lab", "--device", "cpu", "--budgets", "4", "--rounds", "2",
                  "--prompt-len", "8", "--out", {str(tmp_path / "e2e.json")!r}])
        try:
            dl.load_pair("lab", attention="triton")
        except ValueError as e:
            print("REFUSED", e)
    """)
    assert out.returncode == 0, out.stderr
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    assert "'triton'" in refused and ".[triton]" in refused
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["attention"] == "sdpa" and e2e["dtype"] == "float32"  # --device cpu picked a CPU path itself
    assert [r["budget"] for r in e2e["rows"] if r["method"] == "ddtree"] == [4]


def test_a_missing_extra_names_the_smallest_extra_that_holds_it():
    assert runtime.extra_for("triton") == "triton"        # not "test", which holds it too
    assert runtime.extra_for("gguf") == "gguf"
    assert runtime.extra_for("ray") == "ray"
    assert runtime.extra_for("jupyterlab") == "lab"
    assert runtime.extra_for("no-such-library") is None
    assert "pip install -e '.[gguf]'" in runtime.missing_library("'ddtree-lab import-gguf'", "gguf")


@pytest.mark.parametrize("args,names", [
    (["bench", "e2e", "--budgets", "0"], "--budgets"), (["bench", "e2e", "--budgets", "16", "4000"], "4000"),
    (["bench", "e2e", "--rounds", "0"], "--rounds"), (["bench", "e2e", "--prompt-len", "-3"], "--prompt-len"),
    (["bench", "profile", "--budgets", "2000"], "2000"), (["bench", "prompts", "--budgets", "0"], "--budgets"),
    (["bench", "prompts", "--repeats", "0"], "--repeats"), (["bench", "e2e", "--host-read-lag", "-1"], "--host-read-lag"),
    (["generate", "x", "--topk", "0"], "--topk"), (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_bench_and_generate_values_are_refused_before_anything_runs(args, names, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and names in err[0], err


def test_a_run_without_a_budget_is_not_given_one(tiny_pair):
    """AR and DFlash take budget=None; DDTree without a budget is refused rather than given a default."""
    ar = dl.generate(tiny_pair, [1, 2, 3], method="ar", budget=None, max_new_tokens=4)
    dflash = dl.generate(tiny_pair, [1, 2, 3], method="dflash", budget=None, max_new_tokens=4)
    assert ar.settings["budget"] is None and dflash.tokens == ar.tokens
    with pytest.raises(ValueError, match="needs a budget"):
        dl.generate(tiny_pair, [1, 2, 3], method="ddtree", budget=None)


def test_the_api_checks_what_the_cli_checks(monkeypatch):
    with pytest.raises(ValueError, match="is not a loaded pair.*load_pair\\('lab'\\)"):
        dl.generate("lab", "def parse(line):")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention='triton' needs a CUDA device"):
        dl.load_pair("lab", attention="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': no CUDA device is visible"):
            dl.load_pair("lab", device="cuda")
    with pytest.raises(ValueError, match="device='cuda:9'"):  # no such GPU here, with or without CUDA
        dl.load_pair("lab", device="cuda:9")


def test_under_torchrun_rank_zero_reports_alone(tiny_dirs):
    t, d = tiny_dirs
    args = [sys.executable, "-m", "ddtree_lab.cli", "generate", "def f(x):", "--target", str(t), "--drafter", str(d),
            "--max-new-tokens", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rank0 = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, "RANK": "0"})
    rank1 = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, "RANK": "1"})
    assert rank0.returncode == rank1.returncode == 0
    assert "mean tau" in rank0.stderr and rank1.stdout == rank1.stderr == ""
    failed = subprocess.run(args[:5] + ["--target", str(t / "missing")], capture_output=True, text=True,
                            timeout=300, env={**env, "RANK": "3"})
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and "(rank 3)" in failed.stderr


def test_ctrl_c_is_one_line_whenever_it_comes():
    """A Ctrl-C while the command imports torch, or while it decodes: exit 130, one line, no traceback."""
    import signal
    import time

    cmd = [sys.executable, "-m", "ddtree_lab.cli", "generate", "def parse(line):", "--max-new-tokens", "900"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    during_imports = []
    for delay in (0.3, 0.9):  # torch alone takes longer than either to import; an interrupt inside its import
        p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        time.sleep(delay)  # once ended the process by SIGINT (exit -2) after the one line
        p.send_signal(signal.SIGINT)
        during_imports.append(p)
    decoding = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in decoding.stderr:
        if line.startswith("--- generating"):
            break
    time.sleep(0.5)
    decoding.send_signal(signal.SIGINT)
    for p in (*during_imports, decoding):
        _, err = p.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert p.returncode == 130 and "Traceback" not in err and lines[-1] == "ddtree-lab: interrupted", err
        assert not [x for x in lines[:-1] if not x.startswith("---")], err  # only the progress lines before it
