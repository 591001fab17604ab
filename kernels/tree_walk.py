"""Walking a draft tree's parent pointers on the GPU: its attention masks, and the accepted path.

A tree of T nodes (node 0 the root, parents[i] < i, the root its own parent, depth ≤ L) is walked
upward at most L steps from any node. Two stages of a round do only that, and in torch each is a
chain of ~15 small kernels; here each is one launch.

    tree_masks(parents, L) -> anc bool [T, T], bits int32 [T, ceil(T/32)]
        anc[i, j]: j is i's ancestor or i itself; bits: the same rows packed 32 to a word (the verify
        kernel's mask). References: ddtree_lab.tree.ancestor_matrix and tree_attention.pack_mask.
    accept_path(tokens, parents, depths, choice, L) -> path [L+1], a [1]
        a node is accepted when every node on its root path (root aside) carries its parent's target
        choice; the path runs from the root to the deepest accepted node (a nodes), then repeats T-1.
        Reference: the torch walk of ddtree_lab.tree.accept_path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _masks_kernel(Parents, Anc, Bits, T, n_words, L, BLOCK_J: tl.constexpr):
    # grid (T, column tiles): row i, columns j0 … j0+BLOCK_J; a column is set if the walk from i meets it
    i = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    hit = j == i
    node = i.to(tl.int64)  # loads of parents are int64: the loop variable keeps one type
    for _ in range(0, L):
        node = tl.load(Parents + node)
        hit = hit | (j == node)
    tl.store(Anc + i * T + j, hit.to(tl.int8), mask=j < T)
    shifted = hit.to(tl.uint32) << (j % 32).to(tl.uint32)  # bits of one word are disjoint: a sum is an OR
    words = tl.sum(tl.reshape(shifted, (BLOCK_J // 32, 32)), axis=1)
    w = tl.program_id(1) * (BLOCK_J // 32) + tl.arange(0, BLOCK_J // 32)
    tl.store(Bits + i * n_words + w, words.to(tl.int32, bitcast=True), mask=w < n_words)


def tree_masks(parents: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [T] (root at 0, its own parent; depth ≤ L) -> (anc bool [T, T], bits int32 [T, W])."""
    T = parents.shape[0]
    n_words = (T + 31) // 32
    anc = torch.empty(T, T, dtype=torch.bool, device=parents.device)
    bits = torch.empty(T, n_words, dtype=torch.int32, device=parents.device)
    BLOCK_J = min(1024, max(32, triton.next_power_of_2(T)))
    _masks_kernel[(T, triton.cdiv(T, BLOCK_J))](parents, anc.view(torch.int8), bits, T, n_words, L,
                                                BLOCK_J=BLOCK_J)
    return anc, bits


@triton.jit
def _accept_kernel(Tokens, Parents, Depths, Choice, Path, A, T, L,
                   BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    # one program: every node walks to the root checking its ancestors' matches; then the deepest
    # accepted node walks up once more, writing the path by depth
    t = tl.arange(0, BLOCK_T)
    live = t < T
    ok = tl.full([BLOCK_T], 1, tl.int1)
    node = t.to(tl.int64)
    for _ in range(0, L):
        par = tl.load(Parents + node, mask=live, other=0)
        matched = (tl.load(Tokens + node, mask=live, other=0) == tl.load(Choice + par, mask=live, other=-1)) | (node == 0)
        ok = ok & matched
        node = par
    depth = tl.load(Depths + t, mask=live, other=0)
    key = tl.where(live & ok, depth * BLOCK_T + (BLOCK_T - 1 - t), -1)  # deepest, then lowest index
    best = tl.max(key, axis=0)
    deepest = BLOCK_T - 1 - best % BLOCK_T
    a = best // BLOCK_T + 1
    p = tl.arange(0, BLOCK_P)
    path = tl.full([BLOCK_P], T - 1, tl.int64)
    node = deepest.to(tl.int64)
    for _ in range(0, L + 1):
        d = tl.load(Depths + node)
        path = tl.where(p == d, node, path)
        node = tl.load(Parents + node).to(tl.int64)
    tl.store(Path + p, path, mask=p < L + 1)
    tl.store(A, a.to(tl.int64))


def accept_path(tokens, parents, depths, choice, L: int, path=None, a=None):
    """All [T] on one device -> (path [L+1], a [1]), written into `path`/`a` when given."""
    T = tokens.shape[0]
    path = torch.empty(L + 1, dtype=torch.long, device=tokens.device) if path is None else path
    a = torch.empty(1, dtype=torch.long, device=tokens.device) if a is None else a
    _accept_kernel[(1,)](tokens, parents, depths, choice, path, a, T, L,
                         BLOCK_T=max(16, triton.next_power_of_2(T)), BLOCK_P=max(16, triton.next_power_of_2(L + 1)))
    return path, a
