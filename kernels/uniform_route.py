"""Declared uniform routing's experts in one launch: each token's top-k of a hash over (token key, layer, expert).

    uniform_ids(keys, layer, experts, top_k) -> [T, top_k] int64   Triton kernel
    uniform_ids_reference(keys, layer, experts, top_k)             the torch ground truth and the CPU path
                                                                   (moe_layout.py, with the hash's constants)

Expert e of token t scores hash(key_t, layer, e), a few multiply-xorshift rounds modulo the prime 2^31 − 1; the
token's experts are its top_k scores, best first. Scores are integers, so the kernel equals the reference exactly:
it takes the maximum top_k times, the smallest index among equal maxima first (the reference's stable descending
sort), and strikes each pick. Every product is of two residues below 2^31, so int64 holds it exactly.

Why: in torch the hash is about fifteen launches (the reference's elementwise steps and its sort) in every MoE
layer of every forward of a random shape, where a trained router's top-k is fused into the expert kernel's
routing; here it is one. Not yet timed on a GPU: docs/performance.md, Session 6, has the AR step it may explain.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from .moe_layout import UNIFORM_MIX, UNIFORM_PRIME, uniform_ids_reference  # noqa: F401 (the reference, beside)
except ImportError:  # loaded as a lone file (tests/kernels/test_compile.py): its neighbour
    from moe_layout import UNIFORM_MIX, UNIFORM_PRIME, uniform_ids_reference  # noqa: F401

MAX_EXPERTS = 4096  # a token's scores are one row of registers


@triton.jit
def _uniform_ids_kernel(Keys, Ids, T, E, layer_term, M0, M2, M3, PRIME_: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program: BLOCK_T tokens × every expert
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                       # [BT]
    e = tl.arange(0, BLOCK_E).to(tl.int64)                                        # [BE]
    key = tl.load(Keys + t, mask=t < T, other=0).to(tl.int64)
    x = ((key % PRIME_) * M0 + layer_term)[:, None] + e[None, :] * M2            # [BT, BE]
    x = x % PRIME_
    x = ((x ^ (x >> 13)) * M3) % PRIME_
    x = ((x ^ (x >> 7)) * M0) % PRIME_
    x = tl.where(e[None, :] < E, x, -1)                                           # padding never wins
    for j in tl.static_range(TOP_K):
        best = tl.max(x, axis=1)                                                  # [BT]
        pick = tl.min(tl.where(x == best[:, None], e[None, :], BLOCK_E), axis=1)  # smallest index of the max
        tl.store(Ids + t * TOP_K + j, pick, mask=t < T)
        x = tl.where(e[None, :] == pick[:, None], -1, x)


def uniform_ids(keys: torch.Tensor, layer: int, experts: int, top_k: int) -> torch.Tensor:
    """keys [T] int64 (≥ 0) -> ids [T, top_k] int64, equal to uniform_ids_reference's. Fixed shapes, no host
    read (graph-safe)."""
    assert keys.dim() == 1 and 1 <= top_k <= experts <= MAX_EXPERTS, (tuple(keys.shape), top_k, experts)
    T = keys.shape[0]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=keys.device)
    if T == 0:
        return ids
    BLOCK_E = triton.next_power_of_2(experts)
    BLOCK_T = max(1, min(16, 4096 // BLOCK_E))
    M = UNIFORM_MIX
    _uniform_ids_kernel[(triton.cdiv(T, BLOCK_T),)](keys.contiguous(), ids, T, experts, (layer + 1) * M[1],
                                                    M[0], M[2], M[3], PRIME_=UNIFORM_PRIME, TOP_K=top_k,
                                                    BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, num_warps=4)
    return ids
