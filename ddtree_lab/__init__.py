"""ddtree_lab: a research workbench for DDTree (Diffusion Draft Tree) speculative decoding.

The public names load on first use (`dl.load_pair` imports the engine), so `import ddtree_lab.cli` or the
vocabulary in `ddtree_lab.names` costs no torch import, and the command line can answer a Ctrl-C during
its imports in one line."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .names import MAX_BUDGET, METHODS


def _checkout_kernels() -> None:
    """A source checkout on sys.path, not installed (`python -m` from its root, a copy on a GPU machine): the
    kernels sit beside this folder in kernels/, which only an install maps to ddtree_lab.kernels
    (pyproject.toml's package-dir); bound here to the same name, so imports read alike either way."""
    root = Path(__file__).resolve().parent.parent
    here, beside = root / "ddtree_lab" / "kernels", root / "kernels" / "__init__.py"
    if here.exists() or not beside.is_file() or not (root / "pyproject.toml").is_file():
        return
    spec = importlib.util.spec_from_file_location(__name__ + ".kernels", beside,
                                                  submodule_search_locations=[str(beside.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module  # as an import of a subpackage binds it on its parent


_checkout_kernels()

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
