"""The SmolLM2 drafter's training pipeline; the pair itself is the `smollm2` row of ddtree_lab/pairs."""
from __future__ import annotations

import json
from pathlib import Path

from ..pairs import PAIRS, SMOLLM2_PULL, cache_dir

TARGET_DIRNAME = SMOLLM2_PULL.dirname
PAIR_DIR = PAIRS["smollm2"].prompt_dir.parent
DRAFTER_DIR = PAIR_DIR / "drafter"
PROMPTS_DIR = PAIRS["smollm2"].prompt_dir
PROMPT_SETS = ("chat", "code", "math")  # plus "all": the three interleaved (chat-00, code-00, math-00, …)


def target_dir() -> Path:
    return cache_dir() / TARGET_DIRNAME


def prompt_path(name: str) -> Path:
    if name not in (*PROMPT_SETS, "all"):
        raise ValueError(f"prompt set {name!r} is not one of {', '.join(PROMPT_SETS)}, all")
    return PROMPTS_DIR / f"{name}.jsonl"


def load_prompts(name: str) -> list[dict]:
    """-> [{"id", "messages"}]: chat prompts to pass to dl.generate as they are."""
    with open(prompt_path(name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
