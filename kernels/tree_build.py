"""Draft-tree construction in Triton: by counting (`beam_tree`, L + 1 launches, beams up to 128 wide)
and with in-register sorts (`fused_tree`, one launch, beams up to 256 wide).

`ddtree_lab.tree.build_tree` (torch) is the reference: per depth a stable descending sort of the
beam's children, then one stable sort over all depths. Here nothing is sorted. Both inputs of a depth
step are sorted (the beam by score, the drafter's top-K by log-probability), so the children that
precede a given child (a larger score, or an equal one and a smaller parent-major index) are, for
every parent slot, a prefix of its ranks: counting them gives the child's position in the sorted
order. A child whose position is below W writes itself there. The global selection counts the same
way over the L sorted beams, and gives each node its parent's node index too.

Why: small trees are launch-bound. The torch build spends ~14 radix sorts and ~150 small kernels on a
budget-64 tree; here a depth is one launch and the selection another. Counting costs W·K comparisons
per child, so wide beams keep the sort (`tree.COUNTING_MAX_WIDTH` decides).

`fused_tree` runs the torch build's own algorithm in one program: each depth's candidates (the children
that can reach the beam, ≈ W·(1 + ln W)) and then the L·W beam entries are sorted in registers with
`tl.sort`. A sort key is one int64: the score's float bits made order-preserving in the high half, the
candidate's index (inverted) in the low half, so a descending sort puts larger scores first and breaks
exact ties by the smaller index, which is what the stable sorts of the torch build do. Steps hand their
beams over through a small scratch buffer, with a barrier between writing and reading.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _beam_step_kernel(Prev, Lp, CandSlot, CandRank, OutScore, OutFlat, M, W, K,
                      BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    # Prev [W]: the beam at depth d-1 (descending, -inf = empty); Lp [K]: depth d's top-K log-probs
    # (descending). Children (slot i, rank r) listed in CandSlot/CandRank; each finds its position.
    pid = tl.program_id(0)
    offs = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    live = offs < M
    i = tl.load(CandSlot + offs, mask=live, other=0).to(tl.int32)
    r = tl.load(CandRank + offs, mask=live, other=0).to(tl.int32)
    v = tl.load(Prev + i, mask=live, other=0.0) + tl.load(Lp + r, mask=live, other=0.0)  # [C]
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < K
    t = tl.load(Lp + ks, mask=kmask, other=0.0)  # [BK]
    pos = tl.zeros([BLOCK_C], dtype=tl.int32)
    for ip in range(0, W):
        x = tl.load(Prev + ip) + t  # [BK]: the children of slot ip, same float adds as v
        above = ((x[None, :] > v[:, None]) & kmask[None, :]).to(tl.int32)
        level = ((x[None, :] >= v[:, None]) & kmask[None, :]).to(tl.int32)
        # slots before i: ties precede too; slot i: exactly its ranks before r; slots after: only larger
        pos += tl.where(ip < i, tl.sum(level, axis=1), tl.where(ip == i, r, tl.sum(above, axis=1)))
    take = live & (pos < W)
    tl.store(OutScore + pos, v, mask=take)
    tl.store(OutFlat + pos, i * K + r, mask=take)


@triton.jit
def _rank_in_beams(Beam, v, d, j, L, W, ws, wmask):
    # node order of beam entries (d, j) with score v: larger scores first, then depth-major index
    g = tl.zeros_like(j)
    for dp in range(0, L):
        row = tl.load(Beam + dp * W + ws, mask=wmask, other=0.0)  # [BW]
        above = ((row[None, :] > v[:, None]) & wmask[None, :]).to(tl.int32)
        level = ((row[None, :] >= v[:, None]) & wmask[None, :]).to(tl.int32)
        g += tl.where(dp < d, tl.sum(level, axis=1), tl.where(dp == d, j, tl.sum(above, axis=1)))
    return g


@triton.jit
def _select_kernel(Beam, BeamFlat, TopLp, TopTok, Tokens, Depths, Parents, Scores, Logprobs, Ranks,
                   L, W, K, n, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr):
    # Beam/BeamFlat [L, W]; TopLp/TopTok [L, K]. Entry e = d*W + j becomes node g+1 if its order g < n.
    pid = tl.program_id(0)
    e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    live = e < L * W
    d = e // W
    j = e % W
    v = tl.load(Beam + e, mask=live, other=0.0)
    ws = tl.arange(0, BLOCK_W)
    wmask = ws < W
    g = _rank_in_beams(Beam, v, d, j, L, W, ws, wmask)
    take = live & (g < n)
    flat = tl.load(BeamFlat + e, mask=take, other=0).to(tl.int32)
    pslot = flat // K
    rank = flat % K
    # the parent is entry (d-1, pslot), itself chosen (a parent outscores its children)
    pe = tl.maximum(d - 1, 0) * W + pslot
    pv = tl.load(Beam + pe, mask=take, other=0.0)
    pg = _rank_in_beams(Beam, pv, d - 1, pslot, L, W, ws, wmask)
    tl.store(Tokens + g, tl.load(TopTok + d * K + rank, mask=take, other=0), mask=take)
    tl.store(Depths + g, (d + 1).to(tl.int64), mask=take)
    tl.store(Parents + g, tl.where(d == 0, 0, pg + 1).to(tl.int64), mask=take)
    tl.store(Scores + g, v, mask=take)
    tl.store(Logprobs + g, tl.load(TopLp + d * K + rank, mask=take, other=0.0), mask=take)
    tl.store(Ranks + g, rank.to(tl.int64), mask=take)


@triton.jit
def _sort_key(score, idx):
    # descending int64 order == (score descending, idx ascending); +0.0 folds -0.0 into 0.0
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse the magnitude's order
    return (hi.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _from_key(key):
    hi = (key >> 32).to(tl.int32)
    score = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return score, 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _fused_tree_kernel(TopLp, TopTok, CandSlot, CandRank, BeamScore, BeamSlot, BeamRank, NodeOf,
                       Tokens, Depths, Parents, Scores, Logprobs, Ranks, L, W, K, M, n,
                       BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_G: tl.constexpr):
    # One program. TopLp/TopTok [L, K] (rows descending); CandSlot/CandRank [M]: the (parent slot, rank)
    # children that can reach a beam; scratch BeamScore/BeamSlot/BeamRank/NodeOf [L*W]; outputs [n].
    NEG = float("-inf")
    ws = tl.arange(0, BLOCK_W)
    first = tl.minimum(K, W)
    tl.store(BeamScore + ws, tl.load(TopLp + ws, mask=ws < first, other=NEG), mask=ws < W)  # depth 1: rank j
    tl.store(BeamSlot + ws, ws * 0, mask=ws < W)
    tl.store(BeamRank + ws, tl.minimum(ws, first - 1), mask=ws < W)
    cs = tl.arange(0, BLOCK_M)
    live = cs < M
    ci = tl.load(CandSlot + cs, mask=live, other=0).to(tl.int32)
    cr = tl.load(CandRank + cs, mask=live, other=0).to(tl.int32)
    pad_m = _sort_key(tl.full([BLOCK_M], NEG, tl.float32), tl.full([BLOCK_M], 0x7FFFFFFF, tl.int32))
    for d in range(1, L):
        tl.debug_barrier()  # depth d-1's beam is in memory for every thread
        v = tl.load(BeamScore + (d - 1) * W + ci, mask=live, other=NEG) + tl.load(TopLp + d * K + cr, mask=live,
                                                                                  other=0.0)
        score, c = _from_key(tl.sort(tl.where(live, _sort_key(v, cs), pad_m), descending=True))
        top = cs < W  # sorted position p holds the p-th best child
        tl.store(BeamScore + d * W + cs, score, mask=top)
        tl.store(BeamSlot + d * W + cs, tl.load(CandSlot + c, mask=top, other=0).to(tl.int32), mask=top)
        tl.store(BeamRank + d * W + cs, tl.load(CandRank + c, mask=top, other=0).to(tl.int32), mask=top)
    tl.debug_barrier()
    # the best n of all L*W beam entries, depth-major index e = d*W + slot
    gs = tl.arange(0, BLOCK_G)
    gl = gs < L * W
    pad_g = _sort_key(tl.full([BLOCK_G], NEG, tl.float32), tl.full([BLOCK_G], 0x7FFFFFFF, tl.int32))
    key = tl.where(gl, _sort_key(tl.load(BeamScore + gs, mask=gl, other=NEG), gs), pad_g)
    score, e = _from_key(tl.sort(key, descending=True))
    take = gs < n
    tl.store(NodeOf + e, gs + 1, mask=take)
    tl.debug_barrier()  # every chosen entry's node index is in memory
    d0 = e // W
    pslot = tl.load(BeamSlot + e, mask=take, other=0)
    rank = tl.load(BeamRank + e, mask=take, other=0)
    # the parent, entry (d0-1, pslot), is itself chosen: a child never outscores its parent
    parent = tl.load(NodeOf + (d0 - 1) * W + pslot, mask=take & (d0 > 0), other=0)
    tl.store(Tokens + gs, tl.load(TopTok + d0 * K + rank, mask=take, other=0), mask=take)
    tl.store(Depths + gs, (d0 + 1).to(tl.int64), mask=take)
    tl.store(Parents + gs, parent.to(tl.int64), mask=take)
    tl.store(Scores + gs, score, mask=take)
    tl.store(Logprobs + gs, tl.load(TopLp + d0 * K + rank, mask=take, other=0.0), mask=take)
    tl.store(Ranks + gs, rank.to(tl.int64), mask=take)


def fused_num_warps(block_g: int) -> int:
    """Warps for the one program: its sorts are all the work, so wider sorts want more threads (the sweep
    behind these choices: docs/kernels.md, `python -m ddtree_lab.bench.tree_build`)."""
    return 8 if block_g <= 1024 else 16 if block_g <= 2048 else 32


def fused_tree(top_lp: torch.Tensor, top_tok: torch.Tensor, W: int, n: int,
               cand_slot: torch.Tensor, cand_rank: torch.Tensor, num_warps: int | None = None):
    """As `beam_tree`, in one launch (`tree.FUSED_MAX_WIDTH` bounds the beam: every L·W entry is one
    program's register). num_warps: default `fused_num_warps`."""
    L, K = top_lp.shape
    device = top_lp.device
    M = cand_slot.shape[0]
    scratch = [torch.empty(L * W, device=device)] + [torch.empty(L * W, dtype=torch.int32, device=device)
                                                     for _ in range(3)]
    long = dict(dtype=torch.long, device=device)
    out = [torch.empty(n, **long), torch.empty(n, **long), torch.empty(n, **long),
           torch.empty(n, device=device), torch.empty(n, device=device), torch.empty(n, **long)]
    BLOCK_G = max(16, triton.next_power_of_2(L * W))
    _fused_tree_kernel[(1,)](top_lp.float().contiguous(), top_tok.contiguous(), cand_slot, cand_rank, *scratch,
                             *out, L, W, K, M, n, BLOCK_M=max(16, triton.next_power_of_2(M)),
                             BLOCK_W=max(16, triton.next_power_of_2(W)), BLOCK_G=BLOCK_G,
                             num_warps=num_warps or fused_num_warps(BLOCK_G))
    return tuple(out)


def beam_tree(top_lp: torch.Tensor, top_tok: torch.Tensor, W: int, n: int,
              cand_slot: torch.Tensor, cand_rank: torch.Tensor):
    """top_lp/top_tok [L, K] (each row descending) -> (tokens, depths, parents, scores, logprobs, ranks),
    each [n], the same as the torch build. W: beam width; cand_*: the children that can reach a beam
    (tree.beam_candidates). L + 1 launches, no host synchronisation."""
    L, K = top_lp.shape
    device = top_lp.device
    top_lp = top_lp.float().contiguous()
    first = min(K, W)
    beam = torch.full((L, W), float("-inf"), device=device)
    beam[0, :first] = top_lp[0, :first]
    beam_flat = torch.arange(W, device=device).clamp(max=first - 1).repeat(L, 1)  # depth 1: rank j
    M = cand_slot.shape[0]
    BLOCK_K = max(16, triton.next_power_of_2(K))
    BLOCK_C = max(16, min(128, 4096 // BLOCK_K))
    for d in range(1, L):
        _beam_step_kernel[(triton.cdiv(M, BLOCK_C),)](beam[d - 1], top_lp[d], cand_slot, cand_rank,
                                                      beam[d], beam_flat[d], M, W, K,
                                                      BLOCK_C=BLOCK_C, BLOCK_K=BLOCK_K)
    long = dict(dtype=torch.long, device=device)
    out = [torch.empty(n, **long), torch.empty(n, **long), torch.empty(n, **long),
           torch.empty(n, device=device), torch.empty(n, device=device), torch.empty(n, **long)]
    BLOCK_W = max(16, triton.next_power_of_2(W))
    BLOCK_E = max(16, min(128, 4096 // BLOCK_W))
    _select_kernel[(triton.cdiv(L * W, BLOCK_E),)](beam, beam_flat, top_lp, top_tok.contiguous(), *out,
                                                   L, W, K, n, BLOCK_E=BLOCK_E, BLOCK_W=BLOCK_W)
    return tuple(out)
