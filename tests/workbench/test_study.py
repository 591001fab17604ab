"""Study files: validation (refused before anything runs, field named), grid expansion, atomic
writes, CLI pieces. No papermill here: see test_study_run.py for executed studies."""
import argparse
import json
import os
from pathlib import Path

import pytest
import yaml

from ddtree_lab import atomic, pairs
from ddtree_lab.names import AUTO_CANDIDATES
from ddtree_lab import prompts as P
from ddtree_lab.workbench import runner
from ddtree_lab.workbench import runs as study_runs
from ddtree_lab.workbench import spec as study_spec


@pytest.fixture
def env(tmp_path, tiny_dirs):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):\n"}) for i in range(3)))
    t, d = tiny_dirs
    base = {
        "name": "unit",
        "models": {"target": str(t), "drafter": str(d), "device": "cpu", "dtype": "float32"},
        "prompts": {"set": str(prompts), "n_prompts": 2},
        "methods": ["ar", "dflash", "ddtree"],
        "grid": {"budget": [4, 16], "topk": [0, 8], "temperature": [0.0], "max_new_tokens": 8, "seed": 0},
        "notebooks": {"per_run": ["accepted_paths"], "per_study": ["budget_sweep"]},
        "report": True,
    }
    return tmp_path, base


def write(tmp_path: Path, data, name="s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def refused(tmp_path, data, field):
    with pytest.raises(study_spec.StudyError) as e:
        study_spec.load_study(write(tmp_path, data))
    assert e.value.field == field, str(e.value)
    assert field in str(e.value)
    return str(e.value)


def test_valid_study_loads(env):
    tmp, base = env
    st = study_spec.load_study(write(tmp, base))
    assert st.name == "unit" and st.grid.topk == [None, 8] and st.models.pair is None
    assert Path(st.models.target).is_absolute()


def test_shipped_study_files_validate():
    # Structure only (the lab pair and GPU-only settings may be absent on this machine).
    for p in sorted((study_spec.REPO_DIR / "params").glob("*.yaml")):
        study_spec.load_study(p, check_files=False)


@pytest.mark.parametrize("mutate, field, words", [
    (lambda d: d.update(budgets=[1]), "budgets", "unknown key"),
    (lambda d: d["grid"].update(budgets=[1]), "grid.budgets", "did you mean 'budget'"),
    (lambda d: d["models"].update(precision="fp8"), "models.precision", "unknown key"),
    (lambda d: d["grid"].update(budget=[4, 2048]), "grid.budget[1]", "out of range 1..1024"),
    (lambda d: d["grid"].update(budget=[0]), "grid.budget[0]", "out of range"),
    (lambda d: d["grid"].update(budget=["big"]), "grid.budget[0]", "must be an integer"),
    (lambda d: d["grid"].update(budget=[8, "best"]), "grid.budget[1]", "must be an integer or 'auto'"),
    (lambda d: d["grid"].update(budget=["auto", "auto"]), "grid.budget[1]", "'auto' is listed twice"),
    (lambda d: d["grid"].update(budget=[*range(1, 10), "auto"]), "grid.budget[9]", "at most 8 budgets"),
    (lambda d: d["grid"].update(max_new_tokens="many"), "grid.max_new_tokens", "must be an integer"),
    (lambda d: d["grid"].update(temperature=[True]), "grid.temperature[0]", "must be a number"),
    (lambda d: d["prompts"].update(n_prompts=True), "prompts.n_prompts", "must be an integer"),
    (lambda d: d.update(report="yes please"), "report", "true/false"),
    (lambda d: d.update(methods=["ddtree", "beam"]), "methods[1]", "must be one of"),
    (lambda d: d["models"].update(dtype="fp8"), "models.dtype", "must be one of"),
    (lambda d: d["models"].update(device="tpu"), "models.device", "cpu, cuda"),
    (lambda d: d["models"].update(attention="flash"), "models.attention", "must be one of"),
    (lambda d: d["models"].update(device="cuda:99"), "models.device", "CUDA device"),
    (lambda d: d["notebooks"].update(per_run=["accepted_paths", "no_such_notebook"]),
     "notebooks.per_run[1]", "not found"),
    (lambda d: d["notebooks"].update(report="missing_report"), "notebooks.report", "not found"),
    (lambda d: d["models"].update(target="/nonexistent/target"), "models.target", "not found"),
    (lambda d: d["models"].pop("drafter"), "models.drafter", "required"),
    (lambda d: d["models"].update(pair="lab"), "models.pair", "not both"),
    (lambda d: d["prompts"].update(set="lab:no_such_set"), "prompts.set", "not found"),
    (lambda d: d["prompts"].update(set="missing.jsonl"), "prompts.set", "not found"),
    (lambda d: d["prompts"].update(n_prompts=50), "prompts.n_prompts", "has 3"),
    (lambda d: d.pop("methods"), "methods", "required"),
    (lambda d: d.update(name="bad name/x"), "name", "letters"),
    (lambda d: d.update(grid=[1, 2]), "grid", "mapping"),
    # refused by --check because every run would fail (issue 15)
    (lambda d: d["grid"].update(max_new_tokens=2045), "grid.max_new_tokens", "exceeds the model's context of 2048"),
    (lambda d: d["grid"].update(max_new_tokens=5000), "grid.max_new_tokens", "leaves no room"),
    (lambda d: d["grid"].update(seed=2 ** 63), "grid.seed", "out of range"),
    (lambda d: d["grid"].update(seed=-1), "grid.seed", "out of range"),
    (lambda d: d["grid"].update(repeats=0), "grid.repeats", "out of range 1..100"),
])
def test_bad_study_refused_with_field(env, mutate, field, words):
    tmp, base = env
    mutate(base)
    msg = refused(tmp, base, field)
    assert words in msg


def test_duplicate_yaml_keys_refused(env):
    """Case 4: a key given twice (top level or in a section) is refused with its line, not last-wins."""
    tmp, base = env
    text = yaml.safe_dump(base)
    twice = text + "grid:\n  budget: [8]\n"
    with pytest.raises(study_spec.StudyError, match=r"line \d+, column 1.: key 'grid' appears twice"):
        study_spec.load_study(write(tmp, twice))
    inner = text.replace("  budget:\n", "  budget: [2]\n  budget:\n", 1)
    assert inner != text
    with pytest.raises(study_spec.StudyError, match="key 'budget' appears twice"):
        study_spec.load_study(write(tmp, inner))
    assert study_spec.load_study(write(tmp, text)).grid.budget == [4, 16]


def _prompt_file(tmp, rows, name="p2.jsonl"):
    f = tmp / name
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(f)


def test_check_refuses_what_every_run_would_fail(env, monkeypatch):
    tmp, base = env
    base["prompts"]["n_prompts"] = 1
    cases = [
        ([{"id": "c", "messages": [{"role": "user", "content": "hi"}]}], "prompts.set", "no chat template"),
        ([{"id": "e", "prompt": ""}], "prompts.set", "prompt is empty"),
        ([{"id": "r", "messages": [{"role": "wizard", "content": "hi"}]}], "prompts.set", "role 'wizard'"),
        ([{"id": "long", "prompt": "word " * 3000}], "grid.max_new_tokens", "prompt 'long'"),
    ]
    for rows, field, words in cases:
        base["prompts"]["set"] = _prompt_file(tmp, rows)
        assert words in refused(tmp, base, field)
    base["prompts"]["set"] = _prompt_file(tmp, [{"id": "ok", "prompt": "def f():"}])
    fake = tmp / "fake.ipynb"
    fake.write_text("print('not a notebook')\n")
    base["notebooks"]["per_run"] = [str(fake)]
    assert "is not a notebook" in refused(tmp, base, "notebooks.per_run[0]")
    base["notebooks"]["per_run"] = ["accepted_paths"]
    base["models"]["attention"] = "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in refused(tmp, base, "models.attention")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # then its kernels run under the interpreter
    assert study_spec.load_study(write(tmp, base)).models.attention == "triton"
    base["models"]["attention"] = "invariant"  # the batch-invariant target: dense targets only
    assert study_spec.load_study(write(tmp, base)).models.attention == "invariant"
    base["models"]["pair"] = "random:qwen3-30b-a3b"
    base["models"].pop("target", None), base["models"].pop("drafter", None)
    assert "has MoE layers" in refused(tmp, base, "models.attention")
    base["models"]["attention"] = "sdpa"  # a random shape's depth and weight sets are part of its name
    base["models"]["pair"] = "random:kimi-k2.6-ep8-rank@4~2"
    assert study_spec.load_study(write(tmp, base)).models.pair == "random:kimi-k2.6-ep8-rank@4~2"
    base["models"]["pair"] = "random:kimi-k2.6-ep8-rank@4~1"  # layer 1 (MoE) would have no weights to read
    assert "layer 1 is an MoE layer and none of the first 1 is" in refused(tmp, base, "models.pair")


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(study_spec.StudyError, match="not valid YAML.*line"):
        study_spec.load_study(write(tmp_path, "name: x\ngrid: [1, 2\n"))
    with pytest.raises(study_spec.StudyError, match="file not found"):
        study_spec.load_study(tmp_path / "nope.yaml")
    with pytest.raises(study_spec.StudyError, match="empty"):
        study_spec.load_study(write(tmp_path, ""))


def test_cli_refuses_before_running(env, capsys):
    tmp, base = env
    base["grid"]["budget"] = [4096]
    p = write(tmp, base)
    parser = argparse.ArgumentParser()
    runner.add_study_args(parser)
    args = parser.parse_args([str(p), "--out", str(tmp / "out")])
    assert runner.run_study_cli(args) == 2
    err = capsys.readouterr().err
    assert "grid.budget[0]: 4096 is out of range 1..1024" in err and "Traceback" not in err
    assert not (tmp / "out").exists()  # refused before anything ran


def test_cli_check_lists_runs(env, capsys):
    tmp, base = env
    parser = argparse.ArgumentParser()
    runner.add_study_args(parser)
    assert runner.run_study_cli(parser.parse_args([str(write(tmp, base)), "--check"])) == 0
    assert "ddtree-b16-k8-t0" in capsys.readouterr().out


def test_grid_expansion_names_and_order(env):
    tmp, base = env
    base["grid"]["temperature"] = [0.0, 0.7]
    st = study_spec.load_study(write(tmp, base))
    names = [r.run_name for r in study_runs.expand_grid(st, tmp / "out")]
    # AR first (the reference), then DFlash, then DDTree by budget; topk >= budget deduplicated.
    assert names == ["ar-t0", "ar-t0.7", "dflash-t0", "dflash-t0.7",
                     "ddtree-b4-k0-t0", "ddtree-b16-k0-t0", "ddtree-b16-k8-t0",
                     "ddtree-b4-k0-t0.7", "ddtree-b16-k0-t0.7", "ddtree-b16-k8-t0.7"]
    runs = study_runs.expand_grid(st, tmp / "out")
    assert all(r.run_dir == "." and r.study_dir == str(tmp / "out") for r in runs)
    assert len({r.fingerprint() for r in runs}) == len(runs)
    # The fingerprint ignores where a run lives but not what it computes.
    r = runs[-1]
    assert r.fingerprint() == study_runs.RunParams(**{**r.to_json(), "run_dir": "/elsewhere"}).fingerprint()
    assert r.fingerprint() != study_runs.RunParams(**{**r.to_json(), "max_new_tokens": 9}).fingerprint()


def test_grid_with_auto_expands_to_one_auto_run_per_topk(env):
    """`auto` runs after the integer budgets and chooses among them (AUTO_CANDIDATES without any)."""
    tmp, base = env
    base["grid"].update(budget=[16, "Auto", 4], topk=[0, 8, 32])
    st = study_spec.load_study(write(tmp, base))
    assert st.grid.budget == [16, "auto", 4]
    runs = [r for r in study_runs.expand_grid(st, tmp / "out") if r.method == "ddtree"]
    # topk 32 is K = budget for every candidate (the widest is 16): the same run as topk 0
    assert [r.run_name for r in runs] == ["ddtree-b4-k0-t0", "ddtree-b16-k0-t0", "ddtree-b16-k8-t0",
                                          "ddtree-auto-k0-t0", "ddtree-auto-k8-t0"]
    auto = runs[-2]
    assert auto.budget == "auto" and auto.budgets == [4, 16] and study_runs.auto_candidates(auto) == (4, 16)
    base["grid"]["budget"] = ["auto"]
    only = [r for r in study_runs.expand_grid(study_spec.load_study(write(tmp, base))) if r.method == "ddtree"]
    assert study_runs.auto_candidates(only[0]) == AUTO_CANDIDATES


def test_run_params_from_namespace_and_resolved(tmp_path):
    ns = {"budget": 8, "method": "ddtree", "study_dir": str(tmp_path), "unrelated": 1, "np": object()}
    p = study_runs.RunParams.from_namespace(ns).resolved()
    assert p.budget == 8 and p.run_dir == str(tmp_path / p.run_name) and Path(p.run_dir).is_dir()


def test_load_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n\n{"prompt": "y"}\n')
    assert P.read_prompt_set(str(f)) == [{"id": "a", "prompt": "x"}, {"id": "1", "prompt": "y"}]
    assert len(P.read_prompt_set(str(f), 1)) == 1


def test_atomic_writes_and_dirs(tmp_path):
    p = atomic.atomic_write_json(tmp_path / "a" / "x.json", {"v": 1})
    assert json.loads(p.read_text()) == {"v": 1} and oct(p.stat().st_mode & 0o777) == "0o644"
    assert [q.name for q in p.parent.iterdir()] == ["x.json"]  # no temp file left behind
    dst = tmp_path / "run"
    with atomic.atomic_dir(dst) as d:
        (d / "f").write_text("one")
        assert not dst.exists()  # invisible until finished
    assert (dst / "f").read_text() == "one"
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(dst) as d:
            (d / "f").write_text("two")
            raise RuntimeError("boom")
    assert (dst / "f").read_text() == "one"  # the old run survives a failed rewrite
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith(".")] == []


def test_cleaning_removes_only_what_the_study_made(tmp_path):
    """Case 7: a user's hidden `.x.tmp-` / `.x.old-` entries (dirs and files) survive a study start;
    only a killed run's own temp directory (this code's marker inside, a run name of the study) goes."""
    mine = tmp_path / ".ar-t0.tmp-stale"
    mine.mkdir()  # what atomic_dir leaves when its process is killed: the marker inside
    (mine / atomic.MARKER).write_text("1\n")
    users = [tmp_path / ".notes.tmp-2024", tmp_path / ".ar-t0.old-backup", tmp_path / ".cache.old-x"]
    users[0].mkdir()
    users[1].mkdir()
    users[2].write_text("keep me")
    removed = atomic.clean_stale_temps(tmp_path, ["ar-t0", "ddtree-b4-k0-t0"])
    assert removed == [mine] and not mine.exists()
    assert all(p.exists() for p in users)
    assert atomic.clean_stale_temps(tmp_path, []) == []


def test_file_digests_find_a_truncated_file(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "results.json").write_text('{"a": 1}')
    (tmp_path / "figures" / "f.json").write_text("{}")
    rec = atomic.digest_tree(tmp_path, exclude=["run.json"])
    assert set(rec) == {"results.json", "figures/f.json"} and atomic.changed_files(tmp_path, rec) == []
    (tmp_path / "results.json").write_text('{"a": 1')
    (tmp_path / "figures" / "f.json").write_text("[]")
    assert atomic.changed_files(tmp_path, rec) == ["figures/f.json: content changed", "results.json: 7 bytes, was 8"]


def test_chat_prompts_and_shipped_sets(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"id": "c0", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
                 + json.dumps({"id": "c1", "prompt": [{"role": "user", "content": "yo"}]}) + "\n")
    rows = P.read_prompt_set(str(f))
    assert rows[0]["prompt"] == [{"role": "user", "content": "hi"}] and P.prompt_text(rows[1]["prompt"]) == "yo"
    f.write_text('{"id": "bad", "messages": "not a list"}\n')
    with pytest.raises(ValueError, match="chat 'messages'"):
        P.read_prompt_set(str(f))
    # <pair>:<set> names a set shipped with a pair of ddtree_lab/pairs
    assert pairs.PAIRS["lab"].prompt_dir == pairs.PAIRS_DIR / "lab" / "prompts"
    for name in pairs.available_prompt_sets():
        assert P.resolve_prompt_set(name) is not None and P.read_prompt_set(name, 1)
