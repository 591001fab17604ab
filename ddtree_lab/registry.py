"""Named pairs whose checkpoints live outside the package (pulled into a cache directory)."""
from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import CheckpointError


def cache_dir() -> Path:
    """Where pulled checkpoints live: $DDTREE_LAB_CACHE, else ~/.cache/ddtree_lab."""
    return Path(os.environ.get("DDTREE_LAB_CACHE", Path.home() / ".cache" / "ddtree_lab"))


# name -> (target directory, drafter directory); filled by the modules that pull or ship them
NAMED: dict[str, callable] = {}


def resolve(name: str) -> tuple[Path, Path]:
    if name not in NAMED:
        known = ", ".join(["lab", *NAMED]) or "lab"
        raise CheckpointError(f"unknown pair name {name!r}; known: {known}")
    return NAMED[name]()


from . import smollm2  # noqa: E402,F401  registers "smollm2" (target pulled by `ddtree-lab pull smollm2`)
