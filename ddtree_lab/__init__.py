"""ddtree_lab: a research workbench for DDTree (Diffusion Draft Tree) speculative decoding.

The public names load on first use (`dl.load_pair` imports the engine), so `import ddtree_lab.cli` or the
vocabulary in `ddtree_lab.names` costs no torch import, and the command line can answer a Ctrl-C during
its imports in one line."""
from __future__ import annotations

import importlib

from .names import MAX_BUDGET, METHODS

__version__ = "0.1.0"

_EXPORTS = {"AutoBudget": ".auto_budget", "Pair": ".checkpoint", "generate": ".decode", "load_pair": ".pairs",
            "GenerationResult": ".trace", "RoundTrace": ".trace", "DraftTree": ".tree", "build_tree": ".tree"}
__all__ = ["load_pair", "generate", "AutoBudget", "build_tree", "DraftTree", "Pair", "GenerationResult", "RoundTrace",
           "METHODS", "MAX_BUDGET"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ddtree_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
