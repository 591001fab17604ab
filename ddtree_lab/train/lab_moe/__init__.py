"""The lab-moe pair's training pipeline: a DeepSeek-V3-architecture target on the lab corpus with balanced learned
routing, its DFlash drafter, the INT4 copy of its experts and the card.

The pair itself is the `lab-moe` row of ddtree_lab/pairs (pairs.LAB_MOE_DIR is where export and card write it).
"""
