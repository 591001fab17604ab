"""ddtree_lab: a research workbench for DDTree (Diffusion Draft Tree) speculative decoding."""
from .auto_budget import AutoBudget
from .checkpoint import Pair
from .decode import generate
from .names import MAX_BUDGET, METHODS
from .pairs import load_pair
from .trace import GenerationResult, RoundTrace
from .tree import DraftTree, build_tree

__version__ = "0.1.0"
__all__ = ["load_pair", "generate", "AutoBudget", "build_tree", "DraftTree", "Pair", "GenerationResult", "RoundTrace",
           "METHODS", "MAX_BUDGET"]
