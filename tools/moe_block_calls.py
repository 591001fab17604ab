"""One MoE random shape's block called a few times on the GPU, for a profiler to look inside its kernels.

Inputs are the fused-MoE bench's (`bench.fused_moe.block_inputs`: independent routing, INT4 experts in groups
of 32 unless --dense); the kernel's launch configuration can be overridden as in the bench's --config. Under
Nsight Compute, skip the first calls (compilation) and profile the expert kernels of a later one:

    ncu --clock-control none --kernel-name regex:"_gate_up_kernel|_down_kernel" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python tools/moe_block_calls.py --shape kimi-k2.6 --tokens 33 BLOCK_M=16
"""
from __future__ import annotations

import argparse

import torch

from ddtree_lab.bench.fused_moe import block_inputs, block_shape, parse_overrides
from ddtree_lab.kernels.fused_moe import fused_moe


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="kimi-k2.6", help="an MoE random shape (pairs/random.py)")
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="bf16 experts instead of INT4")
    ap.add_argument("config", nargs="*", metavar="KEY=INT", help="launch_config overrides, e.g. BLOCK_M=16")
    a = ap.parse_args(argv)
    try:
        config = parse_overrides(a.config) or None
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    sh = block_shape(a.shape)
    x, router, w_gate_up, w_down = block_inputs(a.tokens, sh["experts"], sh["hidden"], sh["width"], torch.bfloat16,
                                                "cuda", 0.0, seed=a.tokens, int4_group=0 if a.dense else 32)
    for _ in range(a.calls):
        fused_moe(x, router, w_gate_up, w_down, sh["top_k"], True, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
