"""kernels/row_argmax.py (the greedy choice per row in one launch) vs torch.argmax, across tree sizes,
vocabularies and dtypes, ties included. Without a GPU the kernel runs under the interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


from ddtree_lab.decode import argmax_rows  # noqa: E402
from ddtree_lab.kernels.row_argmax import BLOCK_V, MAX_VOCAB_BLOCKS, row_argmax, row_argmax_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("T,V", [(1, 7), (17, 1000), (65, 4096), (3, BLOCK_V + 1), (2, BLOCK_V * MAX_VOCAB_BLOCKS)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_argmax_matches_torch(T, V, dtype):
    g = torch.Generator().manual_seed(T * 7919 + V)
    logits = (torch.randn(T, V, generator=g) * 4).to(DEVICE, dtype)
    assert torch.equal(row_argmax(logits), row_argmax_reference(logits))


def test_row_argmax_ties_take_the_first_index_across_blocks():
    V = 3 * BLOCK_V
    logits = torch.zeros(4, V, device=DEVICE)
    logits[0, [5, 9]] = 1.0                          # a tie inside the first block
    logits[1, [BLOCK_V + 3, 2 * BLOCK_V + 1]] = 1.0  # a tie across blocks
    logits[2, [V - 1]] = 1.0                         # the last column
    # row 3: all equal, so column 0
    want = [5, BLOCK_V + 3, V - 1, 0]
    assert row_argmax(logits).tolist() == want == row_argmax_reference(logits).tolist()
    assert row_argmax(logits[:, ::1].t().contiguous().t()).tolist() == want  # a column-major view is made contiguous


def test_argmax_rows_falls_back_to_torch_beyond_its_width(monkeypatch, use_options):
    use_options(tree_kernels="triton")  # the kernel's path, on the CPU too (interpreter)
    narrow = torch.randn(3, 100, device=DEVICE)
    assert torch.equal(argmax_rows(narrow), narrow.argmax(-1))
    wide = torch.randn(2, BLOCK_V * MAX_VOCAB_BLOCKS + 1, device=DEVICE)
    assert torch.equal(argmax_rows(wide), wide.argmax(-1))
    with pytest.raises(AssertionError, match="rows up to"):
        row_argmax(wide)
