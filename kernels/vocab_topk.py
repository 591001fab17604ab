"""The tree build's first step in one launch: per depth, log-softmax over the vocabulary and its top K.

    vocab_topk(draft_logits, K) -> (top_lp [L, K] fp32, top_tok [L, K] int64), rows descending
    vocab_topk_reference(draft_logits, K)  the torch ground truth (log_softmax, then topk)

One program per depth holds the whole row in registers: its max and log-sum-exp, then one `tl.sort` of
(score, index) keys (`tree_build._sort_key`: larger scores first, exact ties by the smaller index), whose
first K entries are the answer. That fits small vocabularies (`MAX_VOCAB`); larger ones keep torch's topk.

Why: on small vocabularies torch's log-softmax and top-K are 3–4 small kernels, most of a tree-build stage.
Timed on a GPU this kernel is slower (docs/kernels.md): one program sorting a whole row loses to a radix
select spread over the GPU. It stays opt-in (options.tree_topk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from .tree_build import _from_key, _sort_key
except ImportError:  # loaded as a lone file beside tree_build.py (tests/kernels/test_compile.py)
    from tree_build import _from_key, _sort_key

MAX_VOCAB = 16384  # one program sorts next_power_of_2(V) int64 keys in registers


@triton.jit
def _vocab_topk_kernel(Logits, TopLp, TopTok, V, K, s_row, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    ok = offs < V
    x = tl.load(Logits + row * s_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    log_sum = tl.log(tl.sum(tl.exp(x - m), 0))
    score, tok = _from_key(tl.sort(_sort_key(x, offs), descending=True))  # padding (-inf) sorts last
    keep = offs < K
    tl.store(TopLp + row * K + offs, (score - m) - log_sum, mask=keep)  # torch's order: x - max - log-sum
    tl.store(TopTok + row * K + offs, tok.to(tl.int64), mask=keep)


def vocab_topk_num_warps(block_v: int) -> int:
    return 4 if block_v <= 2048 else 8 if block_v <= 8192 else 16


def vocab_topk(draft_logits: torch.Tensor, K: int):
    """draft_logits [L, V] (any float dtype, V <= MAX_VOCAB, 1 <= K <= V) -> (top_lp, top_tok) [L, K]."""
    L, V = draft_logits.shape
    assert V <= MAX_VOCAB, f"vocab_topk takes vocabularies up to {MAX_VOCAB}, not {V}"
    assert 1 <= K <= V, f"K={K} must be in 1 … V={V}"
    logits = draft_logits if draft_logits.stride(1) == 1 else draft_logits.contiguous()
    top_lp = torch.empty(L, K, device=logits.device)
    top_tok = torch.empty(L, K, dtype=torch.long, device=logits.device)
    BLOCK_V = max(16, triton.next_power_of_2(V))
    _vocab_topk_kernel[(L,)](logits, top_lp, top_tok, V, K, logits.stride(0), BLOCK_V=BLOCK_V,
                             num_warps=vocab_topk_num_warps(BLOCK_V))
    return top_lp, top_tok


def vocab_topk_reference(draft_logits: torch.Tensor, K: int):
    return torch.log_softmax(draft_logits.float(), dim=-1).topk(K, dim=-1)
