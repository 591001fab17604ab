"""The command line: generate on a checkpoint directory, and bad input as one clear line."""
import json
import os
import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ddtree_lab.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_generate_json_and_trace(tiny_dirs, tmp_path):
    t, d = tiny_dirs
    trace = tmp_path / "rounds.jsonl"
    out = run_cli("generate", "def add(a, b):", "--target", str(t), "--drafter", str(d), "--budget", "8",
                  "--max-new-tokens", "12", "--json", "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["method"] == "ddtree" and 1 <= len(res["tokens"]) <= 12
    rounds = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rounds) == len(res["acceptance_lengths"]) and rounds[0]["tree"]["tokens"]


def test_generate_with_budget_auto(tiny_dirs):
    t, d = tiny_dirs
    out = run_cli("generate", "def add(a, b):", "--target", str(t), "--drafter", str(d), "--budget", "auto",
                  "--max-new-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["settings"]["budget"] == "auto" and len(res["round_budgets"]) == len(res["acceptance_lengths"])
    assert set(res["round_budgets"]) <= set(res["settings"]["auto"]["budgets"])
    for bad, says in (("best", "neither an integer budget nor 'auto'"), ("auto --method ar", "has no budget to choose")):
        out = run_cli("generate", "x", "--target", str(t), "--drafter", str(d), "--budget", *bad.split())
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert says in out.stderr


def test_bad_budget_is_one_line_without_traceback(tiny_dirs):
    t, d = tiny_dirs
    out = run_cli("generate", "x", "--target", str(t), "--drafter", str(d), "--budget", "5000")
    assert out.returncode == 2
    assert "budget 5000 is out of range" in out.stderr and "Traceback" not in out.stderr


def test_runtime_the_machine_lacks_is_one_line(tiny_dirs, tmp_path):
    """--device cuda without a GPU (generate, and the README's bench e2e), --attention triton on the
    CPU without the interpreter, a trace file that cannot be written: one line each, exit 2, no traceback."""
    import torch

    t, d = tiny_dirs
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cases = [(["generate", "x", "--target", str(t), "--drafter", str(d), "--attention", backend],
              f"attention={backend!r} needs a CUDA device (or TRITON_INTERPRET=1") for backend in ("triton", "invariant")]
    if not torch.cuda.is_available():
        cases += [(["generate", "x", "--target", str(t), "--drafter", str(d), "--device", "cuda"],
                   "device='cuda': no CUDA device is visible"),
                  (["bench", "e2e", "--model", "random:qwen3-8b"], "device='cuda': no CUDA device is visible")]
    for args, words in cases:
        out = subprocess.run([sys.executable, "-m", "ddtree_lab.cli", *args], capture_output=True, text=True,
                             timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 2 and words in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    trace = run_cli("generate", "x", "--target", str(t), "--drafter", str(d), "--max-new-tokens", "2",
                    "--trace", str(tmp_path / "missing" / "dir" / "t.jsonl"))
    assert trace.returncode == 2 and "No such file or directory" in trace.stderr and "Traceback" not in trace.stderr


def test_a_cut_bench_e2e_resumes_where_it_stopped(tmp_path):
    """The same command on the same code and device takes over the runs a cut bench e2e left on disk and times the
    rest; another command starts afresh."""
    out = tmp_path / "e2e.json"
    cmd = ("bench", "e2e", "--model", "lab", "--device", "cpu", "--budgets", "4", "8", "--rounds", "2",
           "--prompt-len", "8", "--methods", "ar", "ddtree", "--out", str(out))
    first = run_cli(*cmd)
    assert first.returncode == 0, first.stderr
    whole = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in whole["rows"]] == [("ar", None), ("ddtree", 4), ("ddtree", 8)]
    cut = dict(whole, rows=whole["rows"][:2], incomplete="2 of 3 runs: the bench stopped before the rest")
    cut["rows"][1] = dict(cut["rows"][1], round_seconds=123.0)  # a mark: a run taken over is not timed again
    out.write_text(json.dumps(cut))
    again = run_cli(*cmd)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(out.read_text())
    assert "incomplete" not in resumed and resumed["resumed_rows"] == 2
    assert [r["round_seconds"] for r in resumed["rows"]][1] == 123.0 and len(resumed["rows"]) == 3
    out.write_text(json.dumps(cut))
    other = run_cli(*[a if a != "2" else "3" for a in cmd])  # --rounds 3: another bench, timed whole
    assert other.returncode == 0, other.stderr
    fresh = json.loads(out.read_text())
    assert "resumed_rows" not in fresh and all(r["round_seconds"] != 123.0 for r in fresh["rows"])
