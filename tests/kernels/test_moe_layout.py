"""kernels/moe_layout.py: the fused-MoE kernel's row heights and row-block counting, the routing statistics the
traces record, and that the module (with the advisor that prices these facts) imports without torch or Triton.
The kernel's own routing against `route_reference` is tests/kernels/test_fused_moe.py's."""
import os
import subprocess
import sys

import pytest
import torch

from ddtree_lab.kernels.moe_layout import (ROW_HEIGHTS, WIDE_ROWS_FROM_T, at_kernel_height, blocks_at_height,
                                           routing_stats, row_blocks, row_height)


def test_row_height_pads_a_crowded_expert_least():
    """16 up to 16 tokens, 64 from WIDE_ROWS_FROM_T; between, whichever of 32 and 64 pads T tokens on one expert
    least, the taller on a tie. Only ROW_HEIGHTS are ever picked (the heights the telemetry counts at)."""
    assert [row_height(T) for T in (1, 16, 17, 32, 33, 64, 65, 96, 97, 129, 256)] == [
        16, 16, 32, 32, 64, 64, 32, 32, 64, 32, 64]
    assert all(row_height(T) == 64 for T in (WIDE_ROWS_FROM_T, 513, 1025, 4096))
    assert {row_height(T) for T in range(1, 2048)} == set(ROW_HEIGHTS)
    assert at_kernel_height({"16": "a", "32": "b", "64": "c"}, 65) == "b" and at_kernel_height(None, 65) is None


def test_int4_experts_take_short_rows_at_every_size():
    """INT4 experts unpack their weights once per row block whatever its height, so every T takes 16 rows; the
    telemetry's pick follows."""
    assert {row_height(T, int4=True) for T in range(1, 2048)} == {16}
    assert at_kernel_height({"16": "a", "32": "b", "64": "c"}, 65, int4=True) == "a"


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_row_blocks_bounds_any_routing(block_m):
    """The grid's bound on row blocks covers the blocks any routing of P pairs over min(E, P) experts runs."""
    gen = torch.Generator().manual_seed(block_m)
    for P, E in [(8, 128), (80, 4), (520, 128), (8200, 128), (3, 8)]:
        S = min(E, P)
        for _ in range(50):  # random loads, with the crowded extremes among them
            n = torch.multinomial(torch.rand(E, generator=gen) ** 8, P, replacement=True, generator=gen)
            assert int(blocks_at_height(torch.bincount(n, minlength=E), block_m)) <= row_blocks(P, S, block_m)
        one = torch.tensor([P] + [0] * (E - 1))  # every pair on one expert (top_k = 1)
        assert int(blocks_at_height(one, block_m)) <= row_blocks(P, S, block_m)


def test_routing_stats_per_layer_and_for_one_call():
    counts = torch.tensor([[0, 3, 40, 1, 0, 2], [5, 0, 0, 0, 0, 0]], dtype=torch.int32)  # [L, E]
    assert routing_stats(counts) == {"experts_touched": [4, 1], "expert_tokens_max": [40, 5],
                                     "expert_row_blocks": {"16": [6, 1], "32": [5, 1], "64": [4, 1]}}
    assert routing_stats(counts[0]) == {"experts_touched": 4, "expert_tokens_max": 40,
                                        "expert_row_blocks": {"16": 6, "32": 5, "64": 4}}


def test_imports_without_torch_or_triton():
    """The advisor runs where torch is absent; the facts it prices come from here."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "import ddtree_lab.kernels.moe_layout as L, ddtree_lab.workbench.advisor\n"
            "assert L.row_height(65) == 32\nprint('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
