"""ddtree_lab: a research workbench for DDTree (Diffusion Draft Tree) speculative decoding."""
from .checkpoint import Pair, load_pair
from .decode import METHODS, generate
from .trace import GenerationResult, RoundTrace
from .tree import MAX_BUDGET, DraftTree, build_tree

__version__ = "0.1.0"
__all__ = ["load_pair", "generate", "build_tree", "DraftTree", "Pair", "GenerationResult", "RoundTrace",
           "METHODS", "MAX_BUDGET"]
