"""KV-cache compaction after a verify round: keep the accepted tree slots, in path order.

For every layer, K and V, and KV head: slot past_len + src_index[i] -> slot past_len + i, for
i < count. src_index is sorted ascending with src_index[i] >= i, so a copy in ascending i never
reads a slot that an earlier i already overwrote. The Triton kernel gives one program to each
(layer, K|V, head) and walks i ascending in blocks: a block loads all its sources, waits at a
barrier, then stores, so one thread's store cannot clobber another thread's pending load.
count and past_len may be device tensors: nothing here synchronises with the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _interpret() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compact_kv_reference(kv_cache, past_len, src_index, count):
    """Torch version (also graph-safe, no host sync). kv_cache [L, 2, Hkv, S_max, D], in place."""
    M = src_index.shape[0]
    if M == 0:
        return kv_cache
    dev = kv_cache.device
    past = past_len.reshape(()).to(device=dev, dtype=torch.int64) if isinstance(past_len, torch.Tensor) else past_len
    cnt = count.reshape(()).to(device=dev, dtype=torch.int64) if isinstance(count, torch.Tensor) else count
    ar = torch.arange(M, device=dev)  # [M]
    src = src_index.to(device=dev, dtype=torch.int64) + past  # [M] slots to read
    dst = ar + past  # [M] slots to write (< S_max since src_index[i] >= i)
    moved = kv_cache.index_select(3, src)  # [L, 2, Hkv, M, D], all reads before any write
    kept = kv_cache.index_select(3, dst)
    keep = (ar < cnt).view(1, 1, 1, M, 1)
    kv_cache.index_copy_(3, dst, torch.where(keep, moved, kept))
    return kv_cache


@triton.jit(do_not_specialize=["past_val", "count_val"])
def _compact_kv_kernel(KV, Src, PastPtr, CountPtr, past_val, count_val, M, n_heads,
                       s_l, s_c, s_h, s_s,
                       HEAD_D: tl.constexpr, BLOCK_I: tl.constexpr,
                       PAST_FROM_PTR: tl.constexpr, COUNT_FROM_PTR: tl.constexpr):
    # grid: (L * 2 * Hkv,). One program owns one [S_max, D] plane, so planes never race.
    pid = tl.program_id(0)
    l = pid // (2 * n_heads)
    c = (pid // n_heads) % 2
    h = pid % n_heads
    base = KV + l.to(tl.int64) * s_l + c.to(tl.int64) * s_c + h.to(tl.int64) * s_h
    if PAST_FROM_PTR:
        past = tl.load(PastPtr).to(tl.int64)
    else:
        past = tl.full([], past_val, tl.int64)
    if COUNT_FROM_PTR:
        count = tl.load(CountPtr).to(tl.int32)
    else:
        count = tl.full([], count_val, tl.int32)
    count = tl.minimum(count, M)
    offs_d = tl.arange(0, HEAD_D)
    for i0 in range(0, count, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)  # [BI]
        ok = i < count
        src = tl.load(Src + i, mask=ok, other=0).to(tl.int64)
        move = ok & (src != i)  # slots already in place are skipped
        vals = tl.load(base + (past + src)[:, None] * s_s + offs_d[None, :], mask=move[:, None])
        tl.debug_barrier()  # every source of this block is read before any of its stores
        tl.store(base + (past + i)[:, None] * s_s + offs_d[None, :], vals, mask=move[:, None])


def compact_kv(kv_cache, past_len, src_index, count):
    """kv_cache [L, 2, Hkv, S_max, D] (all layers), in place; past_len, count: int or device
    int tensor; src_index int64 [M] sorted, src_index[i] >= i. Returns kv_cache."""
    L, two, Hkv, S_max, D = kv_cache.shape
    assert two == 2 and kv_cache.stride(4) == 1
    assert D in (16, 32, 64, 128, 256), "head dim must be a power of two in 16..256"
    M = src_index.shape[0]
    if M == 0:
        return kv_cache
    src_index = src_index.contiguous()
    if isinstance(past_len, torch.Tensor):
        past_ptr, past_val, past_dev = past_len.reshape(1), 0, True
    else:
        past_ptr, past_val, past_dev = src_index, int(past_len), False  # dummy pointer
    if isinstance(count, torch.Tensor):
        count_ptr, count_val, count_dev = count.reshape(1), 0, True
    else:
        count_ptr, count_val, count_dev = src_index, int(count), False
    block_i = 16 if not _interpret() else 64
    _compact_kv_kernel[(L * 2 * Hkv,)](
        kv_cache, src_index, past_ptr, count_ptr, past_val, count_val, M, Hkv,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_D=D, BLOCK_I=block_i, PAST_FROM_PTR=past_dev, COUNT_FROM_PTR=count_dev,
        num_warps=4,
    )
    return kv_cache
