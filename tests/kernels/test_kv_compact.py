"""KV compaction Triton kernel vs the torch reference and a plain loop.

Without a GPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1 is set here,
before the kernels are imported).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels import kv_compact as kc  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loop_compact(cache, past, src, count):
    """Obvious version: ascending i, one slot at a time."""
    out = cache.clone()
    for i in range(count):
        out[:, :, :, past + i] = out[:, :, :, past + int(src[i])]
    return out


def random_src(M, span, gen):
    """M sorted distinct slots in [0, span): the i-th smallest is >= i."""
    return torch.randperm(span, generator=gen)[:M].sort().values


CASES = [
    # L, Hkv, D, past, M, span, count, dtype
    (2, 2, 64, 0, 1, 1, 1, torch.float32),
    (3, 2, 128, 7, 5, 20, 4, torch.float16),
    (2, 4, 64, 300, 33, 130, 33, torch.float32),
    (1, 2, 128, 300, 33, 130, 20, torch.float16),
    (2, 1, 64, 7, 70, 130, 70, torch.float32),
    (2, 2, 64, 0, 16, 40, 0, torch.float32),
]


@pytest.mark.parametrize("L,Hkv,D,past,M,span,count,dtype", CASES)
@pytest.mark.parametrize("on_device", [False, True])
def test_compact_kv_matches_reference(L, Hkv, D, past, M, span, count, dtype, on_device):
    gen = torch.Generator().manual_seed(L * 1000 + M * 10 + count)
    S_max = past + span + 3
    cache = torch.randn(L, 2, Hkv, S_max, D, generator=gen).to(dtype).to(DEVICE)
    src = random_src(M, span, gen).to(DEVICE)
    want = loop_compact(cache, past, src, count)
    p, c = past, count
    if on_device:  # graph-safe path: past_len and count as device tensors
        p = torch.tensor(past, device=DEVICE)
        c = torch.tensor(count, dtype=torch.int32, device=DEVICE)
    ref = kc.compact_kv_reference(cache.clone(), p, src, c)
    assert torch.equal(ref, want)
    got = kc.compact_kv(cache.clone(), p, src, c)
    assert torch.equal(got, want)


def test_compact_kv_shift_chain_and_strided_cache():
    # src = [0, 2, 3, ..., M]: every slot is read by one index and written by the next, the case
    # where a block that stored before loading would corrupt its own sources
    gen = torch.Generator().manual_seed(9)
    M, past = 100, 11
    src = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(2, M + 1)]).to(DEVICE)
    big = torch.randn(2, 3, 2, past + M + 8, 64, generator=gen).to(DEVICE)
    cache = big[:, 1:]  # [L, 2, Hkv, S, D], non-contiguous over layers
    want = loop_compact(cache, past, src, M)
    kc.compact_kv(cache, past, src, M)
    assert torch.equal(cache, want)
    assert torch.equal(big[:, 1:], want)  # written through the view
