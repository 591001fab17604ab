"""The target's greedy choice per tree node in one launch: the argmax of each row of logits.

    row_argmax(logits) -> [T] int64, the first index of each row's maximum (torch.argmax's rule)
    row_argmax_reference(logits)  the torch ground truth

One program per row walks it in blocks of BLOCK_V, keeping the best value and its index; a later block wins
only with a strictly larger value, and `tl.argmax(..., tie_break_left=True)` takes the first index within a
block, so ties go to the smaller index as in torch. Rows are assumed free of NaN (torch would return a NaN's
index; logits here never hold one).

Why: the commit stage takes the argmax over the verify's logits, [tree size, vocabulary], and torch's generic
reduction is several times slower for a few rows than for one (measured in docs/kernels.md). One program per
row reads its row once. Wide vocabularies (up to
MAX_VOCAB_BLOCKS blocks) loop; beyond that torch's split reduction uses the GPU better, and the caller
(`decode.argmax_rows`) keeps torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
MAX_VOCAB_BLOCKS = 16  # rows up to 16,384 logits; wider ones keep torch's argmax
MAX_VOCAB = BLOCK_V * MAX_VOCAB_BLOCKS


@triton.jit
def _row_argmax_kernel(Logits, Out, V, s_row, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    best = tl.load(Logits + row * s_row).to(tl.float32)  # column 0 starts the race
    best_idx = tl.zeros([], dtype=tl.int64)
    for b in tl.static_range(N_BLOCKS):
        cols = b * BLOCK + offs
        x = tl.load(Logits + row * s_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        i = tl.argmax(x, 0, tie_break_left=True).to(tl.int64) + b * BLOCK
        better = m > best  # strictly: an equal value in a later block loses to the earlier index
        best_idx = tl.where(better, i, best_idx)
        best = tl.where(better, m, best)
    tl.store(Out + row, best_idx)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] (any float dtype, V <= MAX_VOCAB) -> [T] int64."""
    T, V = logits.shape
    assert V <= MAX_VOCAB, f"row_argmax takes rows up to {MAX_VOCAB}, not {V}"
    n_blocks = triton.cdiv(V, BLOCK_V)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(T, dtype=torch.long, device=x.device)
    _row_argmax_kernel[(T,)](x, out, V, x.stride(0), BLOCK=BLOCK_V, N_BLOCKS=n_blocks, num_warps=4)
    return out


def row_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)

