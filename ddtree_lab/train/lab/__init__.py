"""The lab pair's training pipeline: corpus, tokenizer, prompt sets, target, drafter, card.

The pair itself is the `lab` row of ddtree_lab/pairs; LAB_PAIR_DIR is where export and card write it.
"""
from __future__ import annotations

from ...pairs import PAIRS

LAB_PAIR_DIR = PAIRS["lab"].prompt_dir.parent
