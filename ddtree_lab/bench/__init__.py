"""`ddtree-lab bench` (cli.py) and the micro-benchmarks: speed measured side by side in one run, as JSON.

  e2e.py         rounds end to end: stage times, tokens/s, the AR step's roofline; prompts; profiles
  attention.py   verify attention: triton vs sdpa vs flex (python -m ddtree_lab.bench.attention)
  tree_build.py  the one-launch tree build's warps (python -m ddtree_lab.bench.tree_build)
  vocab_topk.py  the per-depth top-K kernel vs torch (python -m ddtree_lab.bench.vocab_topk)
  fused_moe.py   the MoE block vs torch's grouped path vs its floor (python -m ddtree_lab.bench.fused_moe)
"""
