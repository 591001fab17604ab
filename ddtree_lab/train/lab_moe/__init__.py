"""The lab-moe pair's training pipeline: a DeepSeek-V3-architecture target on the lab corpus with balanced learned
routing, its DFlash drafter, the INT4 copy of its experts and the card.

The pair itself is the `lab-moe` row of ddtree_lab/pairs (pairs.LAB_MOE_DIR is where export and card write it);
its tokenizer and prompt sets are the lab pair's.
"""
from __future__ import annotations

from ...pairs import PAIRS

LAB_TOKENIZER_DIR = PAIRS["lab"].prompt_dir.parent / "target"
LAB_PROMPT_DIR = PAIRS["lab-moe"].prompt_dir
CACHE_DIR = ".cache/lab_moe_corpus"  # the corpus cache without --run-dir or --cache
