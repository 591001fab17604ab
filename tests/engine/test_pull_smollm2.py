"""The smollm2 pair's package side: prompt sets and the registry entry (no network, no gguf extra)."""
import json

import pytest

import ddtree_lab as dl
from ddtree_lab import pairs
from ddtree_lab.train import smollm2
from ddtree_lab.checkpoint import CheckpointError


def test_prompt_sets_are_chat_messages_and_distinct():
    seen = set()
    for name in smollm2.PROMPT_SETS:
        rows = smollm2.load_prompts(name)
        assert len(rows) >= 24
        for row in rows:
            assert row["id"].startswith(f"{name}-")
            msgs = row["messages"]
            assert msgs and all(m["role"] in ("system", "user", "assistant") and m["content"].strip() for m in msgs)
            text = json.dumps(msgs)
            assert text not in seen, row["id"]
            seen.add(text)
    with open(smollm2.PROMPTS_DIR / "all.jsonl") as f:
        all_rows = [json.loads(line) for line in f if line.strip()]
    # all.jsonl interleaves the three sets, so its first n prompts cover them evenly
    want = [r for triple in zip(*(smollm2.load_prompts(n) for n in smollm2.PROMPT_SETS)) for r in triple]
    assert all_rows == want


def test_named_pair_errors_say_what_to_do(tmp_path, monkeypatch):
    assert pairs.PAIRS["smollm2"].pull is pairs.PULLABLE["smollm2"]
    monkeypatch.setenv("DDTREE_LAB_CACHE", str(tmp_path))
    assert smollm2.target_dir() == tmp_path / "smollm2-135m-instruct"
    with pytest.raises(CheckpointError, match="ddtree-lab pull smollm2"):
        dl.load_pair("smollm2")
    (smollm2.target_dir()).mkdir()
    (smollm2.target_dir() / "config.json").write_text("{}")
    if not (smollm2.DRAFTER_DIR / "config.json").is_file():
        with pytest.raises(CheckpointError, match="not trained yet"):
            pairs.resolve("smollm2")
    else:
        assert pairs.resolve("smollm2") == (smollm2.target_dir(), smollm2.DRAFTER_DIR)
