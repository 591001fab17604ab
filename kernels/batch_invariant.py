"""Batch-invariant target ops: a row's result has the same bits whatever else is in the batch.

    linear(x, weight, bias=None) -> x @ weight.T (+ bias)   linear_reference: torch in float64
    rms_norm(x, weight, eps)     -> the model's RMSNorm      rms_norm_reference: torch in float64
    chain_attention(q, k_cache, v_cache, past_len, chain, chain_len)   chain_attention_reference

Why: a verify over T tree tokens and an AR step over one token are different launches of a cuBLAS GEMM
(other tiles, split-K), of a reduction and of the split attention kernel, so in bf16 the target's logits
for one token differ in the last bits between budgets, and a near tie can flip the greedy token: two
budgets then emit different texts, and neither equals AR's. These ops fix every choice that decides a
row's arithmetic, so a token computed alone, in any tree, or in a prefill gets the same bits:
- `linear`: one tile shape for every M, the K loop in one order, fp32 accumulation, and a split of K only
  where the matrix's shape alone asks for one. A row's dot products never meet another row's (an MMA's
  per-element sum does not depend on its neighbours).
- `rms_norm`: one program per row, one block over the whole row.
- `chain_attention`: one program per (query, KV head), the head group as the dot's rows. Query i's keys
  are walked in *logical* order: committed slots 0 … past_len-1, then its ancestors root first
  (`chain`), in blocks of BLOCK_N aligned at logical position 0 (and, past ATTENTION_CHUNK positions, in
  chunks aligned there too, merged in order). An AR step at position p walks slots 0 … p, the same keys in
  the same blocks and chunks, so the online softmax makes the same roundings.
The cost is speed (no tuned tiles per shape, one query per program): docs/kernels.md has the figures.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tiles() -> dict:
    # One shape for every call of a process; the interpreter pays per op, so it takes larger ones.
    # K_CHUNK: the K each split sums (0: never split), for long, narrow matrices (more K than outputs, and fewer
    # than SPLIT_BELOW_N_TILES column tiles: a down projection of a small model; None: every matrix). A split
    # fixed by the matrix's shape (then a sum of the splits in order) gives them more programs and leaves a
    # row's arithmetic a function of N and K alone. Measured in docs/kernels.md.
    if _interpret():
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, K_CHUNK=0, SPLIT_BELOW_N_TILES=0, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, K_CHUNK=256, SPLIT_BELOW_N_TILES=32, num_warps=4, num_stages=3)


def k_chunk(N: int, K: int, tiles: dict) -> int:
    """The K one program sums: K itself (one pass) unless the tile rule above splits this shape."""
    c, below = tiles["K_CHUNK"], tiles["SPLIT_BELOW_N_TILES"]
    narrow = below is None or (K > N and triton.cdiv(N, tiles["BLOCK_N"]) < below)
    return c if 0 < c < K and narrow else K


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, ORDERED: tl.constexpr):
    """acc + a @ b, in fp32. ORDERED (under the interpreter): the products summed over K by a reduction whose
    order the tile's shape alone fixes, since there a tl.dot is the host BLAS's matmul, and some BLAS kernels
    round one row differently depending on the tile's other rows. On the GPU an MMA's per-element sum already
    ignores its neighbours."""
    if ORDERED:
        out = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


ATTENTION_BLOCK_N = 64  # keys per step of chain_attention, the same for every call (the blocks' alignment)
ATTENTION_CHUNK = 512   # logical positions per program beyond which chain_attention splits a query's sequence


# --------------------------------------------------------------------------------------------
# linear
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, Bias, Y, M, N, K, k_chunk, s_xm, s_wn, s_ym, s_ys,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, ORDERED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of weight (output columns)
    split = tl.program_id(2)                                  # this program sums K in [lo, lo + k_chunk)
    lo = split * k_chunk
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, tl.minimum(lo + k_chunk, K), BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * s_xm + kk[None, :], mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(W + rn[:, None] * s_wn + kk[None, :], mask=(rn < N)[:, None] & (kk < K)[None, :], other=0.0)
        acc = _dot(x, tl.trans(w), acc, IEEE, ORDERED)  # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    # one split: the output itself; several: this split's fp32 partial sum, at plane `split` of Y
    tl.store(Y + split * s_ys + rm[:, None] * s_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _sum_splits_kernel(Part, Bias, Y, MN, N, splits, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):  # in split order, whatever M is
        acc += tl.load(Part + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: dict | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] (its rows contiguous), bias [N] or None -> [..., N] in x's dtype.
    `tiles` overrides _tiles() (a benchmark's A/B; one process must keep one choice)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not M:
        return y.view(*x.shape[:-1], N)
    t = {**_tiles(), **(tiles or {})}
    chunk = k_chunk(N, K, t)
    splits = triton.cdiv(K, chunk)
    part = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, t["BLOCK_M"]), triton.cdiv(N, t["BLOCK_N"]), splits)
    has_bias = bias is not None and splits == 1
    _linear_kernel[grid](x2, w, bias if has_bias else w, part, M, N, K, chunk, x2.stride(0), w.stride(0), N, M * N,
                         HAS_BIAS=has_bias, IEEE=x.dtype == torch.float32, ORDERED=_interpret(),
                         BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
                         num_warps=t["num_warps"], num_stages=t["num_stages"])
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](part, w if bias is None else bias, y, M * N, N, splits,
                                                          HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], N)


def linear_reference(x, weight, bias=None):
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(X, W, Y, N, s_x, s_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * s_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(x.dtype)  # the model normalises in fp32, then rounds to the input's dtype …
    w = tl.load(W + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)  # … and scales in the weight's and input's common dtype
    tl.store(Y + row * s_y + cols, out.to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in the dtype torch gives `weight * x` (layers.RMSNorm's arithmetic)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, N, x2.stride(0), y.stride(0), eps,
                                         BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return y.view(x.shape)


def rms_norm_reference(x, weight, eps):
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.double() * normed.double()).to(torch.promote_types(weight.dtype, x.dtype))


# --------------------------------------------------------------------------------------------
# attention over each query's logical sequence
# --------------------------------------------------------------------------------------------

def ancestor_chain(anc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """anc bool [T, T] -> (chain int32 [T, T]: row i's ancestors-or-self by index, then zeros;
    chain_len int32 [T]). Parents precede children, so index order is depth order: chain[i, d] is i's
    ancestor at depth d. Vectorised, no host sync (a rank by cumsum, then one scatter)."""
    T = anc.shape[0]
    rank = anc.to(torch.int32).cumsum(1) - 1                                       # [T, T]
    slot = torch.where(anc, rank, T).to(torch.int64)                               # non-ancestors -> a spare column
    cols = torch.arange(T, device=anc.device, dtype=torch.int32).expand(T, T)
    chain = torch.zeros(T, T + 1, dtype=torch.int32, device=anc.device).scatter_(1, slot, cols)
    return chain[:, :T].contiguous(), anc.sum(1).to(torch.int32)


@triton.jit
def _sequence(ChainLen, PastPtr, past_val, i, PAST_ON_DEVICE: tl.constexpr):
    """-> (past_len, the length of query i's logical sequence: the past slots, then its ancestors-or-self)."""
    if PAST_ON_DEVICE:
        past = tl.load(PastPtr).to(tl.int32)
    else:
        past = past_val
    return past, past + tl.load(ChainLen + i)


@triton.jit(do_not_specialize=["past_val"])
def _chain_attn_kernel(Q, K, V, Out, Part, PartM, PartL, Chain, ChainLen, PastPtr, past_val,
                       s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_oh, s_ot, s_chain, n_chunks, qk_scale,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                       CHUNK: tl.constexpr, SPLIT: tl.constexpr, PAST_ON_DEVICE: tl.constexpr, IEEE: tl.constexpr,
                       ORDERED: tl.constexpr):
    i = tl.program_id(0)  # the query (tree node)
    h = tl.program_id(1)  # the KV head; its G query heads are the dot's rows
    c = tl.program_id(2)  # SPLIT: the chunk of CHUNK logical positions this program sums
    past, length = _sequence(ChainLen, PastPtr, past_val, i, PAST_ON_DEVICE)
    if SPLIT:
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, length)
    else:
        lo = 0
        hi = length
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_D)
    q = tl.load(Q + (h * G + g)[:, None] * s_qh + i * s_qt + d[None, :], mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # [BN] logical positions
        valid = t < hi
        in_tree = valid & (t >= past)
        node = tl.load(Chain + i * s_chain + (t - past), mask=in_tree, other=0)
        slot = tl.where(in_tree, past + node, t)
        k = tl.load(K + h * s_kh + slot[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)  # [BN, D]
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32), IEEE, ORDERED)  # [BG, BN]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + h * s_vh + slot[:, None] * s_vs + d[None, :], mask=valid[:, None], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, ORDERED)
        m_i = m_new
    if SPLIT:  # this chunk's running max, sum and numerator, for _chain_merge_kernel
        row = (i * tl.num_programs(1) + h) * n_chunks + c
        tl.store(PartM + row * BLOCK_G + g, m_i)
        tl.store(PartL + row * BLOCK_G + g, l_i)
        tl.store(Part + (row * BLOCK_G + g)[:, None] * HEAD_D + d[None, :], acc)
    else:
        out = acc / l_i[:, None]
        tl.store(Out + (h * G + g)[:, None] * s_oh + i * s_ot + d[None, :], out.to(Out.dtype.element_ty),
                 mask=(g < G)[:, None])


@triton.jit(do_not_specialize=["past_val"])
def _chain_merge_kernel(Part, PartM, PartL, Out, ChainLen, PastPtr, past_val, s_oh, s_ot, n_chunks,
                        G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, CHUNK: tl.constexpr,
                        PAST_ON_DEVICE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    past, length = _sequence(ChainLen, PastPtr, past_val, i, PAST_ON_DEVICE)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_D)
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_D], dtype=tl.float32)
    # the query's own chunks, in order (one chunk: acc and l pass through unchanged, as without a split)
    for c in range(0, tl.cdiv(length, CHUNK)):
        row = (i * tl.num_programs(1) + h) * n_chunks + c
        m_c = tl.load(PartM + row * BLOCK_G + g)
        m_new = tl.maximum(m, m_c)
        a = tl.math.exp2(m - m_new)
        b = tl.math.exp2(m_c - m_new)
        l_sum = l_sum * a + tl.load(PartL + row * BLOCK_G + g) * b
        acc = acc * a[:, None] + tl.load(Part + (row * BLOCK_G + g)[:, None] * HEAD_D + d[None, :]) * b[:, None]
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(Out + (h * G + g)[:, None] * s_oh + i * s_ot + d[None, :], out.to(Out.dtype.element_ty),
             mask=(g < G)[:, None])


def chain_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len,
                    chain: torch.Tensor, chain_len: torch.Tensor, scale: float | None = None,
                    max_past: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """q [Hq, T, D], k_cache/v_cache [Hkv, S, D] -> [Hq, T, D]. Query i sees slots < past_len and tree
    slots past_len + chain[i, :chain_len[i]] (from `ancestor_chain`); past_len an int or a one-element
    device tensor (no host sync: graph-safe), bounded by max_past (default S − T).

    A query whose logical sequence is longer than `chunk` (default ATTENTION_CHUNK) sums it in chunks of that
    many positions, aligned at position 0, each its own program, merged in order: the chunks are a
    function of the query's position alone, so the result still is. A launch whose bound fits one chunk
    skips the merge, with the same bits (a merge of one chunk changes nothing)."""
    Hq, T, D = q.shape
    Hkv, S = k_cache.shape[0], k_cache.shape[1]
    G = Hq // Hkv
    BG = max(16, triton.next_power_of_2(G))
    out = torch.empty_like(q)
    on_device = isinstance(past_len, torch.Tensor)
    scale = D ** -0.5 if scale is None else scale
    chain = chain if chain.stride(1) == 1 else chain.contiguous()
    chunk = chunk or ATTENTION_CHUNK
    assert chunk % ATTENTION_BLOCK_N == 0, f"chunk {chunk} is not a multiple of {ATTENTION_BLOCK_N}"
    bound = (max_past if max_past is not None else S - T) + T if on_device else int(past_len) + T
    n_chunks = triton.cdiv(bound, chunk)
    split = n_chunks > 1
    # the chunks' partial numerators, maxima and sums (one unused element each when one chunk does it all)
    rows = T * Hkv * n_chunks * BG if split else 1
    part = torch.empty(rows, D if split else 1, dtype=torch.float32, device=q.device)
    part_m, part_l = torch.empty(2, rows, dtype=torch.float32, device=q.device)
    past_ptr, past_val = (past_len, 0) if on_device else (chain_len, int(past_len))
    _chain_attn_kernel[(T, Hkv, n_chunks if split else 1)](
        q, k_cache, v_cache, out, part, part_m, part_l, chain, chain_len, past_ptr, past_val,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), chain.stride(0), n_chunks, scale * LOG2E,
        G=G, BLOCK_G=BG, BLOCK_N=ATTENTION_BLOCK_N, HEAD_D=D, CHUNK=chunk, SPLIT=split,
        PAST_ON_DEVICE=on_device, IEEE=q.dtype == torch.float32, ORDERED=_interpret(), num_warps=4, num_stages=2)
    if split:
        _chain_merge_kernel[(T, Hkv)](part, part_m, part_l, out, chain_len, past_ptr, past_val,
                                      out.stride(0), out.stride(1), n_chunks, G=G, BLOCK_G=BG, HEAD_D=D,
                                      CHUNK=chunk, PAST_ON_DEVICE=on_device, num_warps=4)
    return out


def chain_attention_reference(q, k_cache, v_cache, past_len, anc, scale=None):
    """Dense torch in float64: query i sees slots < past_len and tree slot past_len + j iff anc[i, j]."""
    Hq, T, D = q.shape
    Hkv = k_cache.shape[0]
    P = int(past_len)
    scale = D ** -0.5 if scale is None else scale
    k = k_cache[:, :P + T].double().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, P+T, D]
    v = v_cache[:, :P + T].double().repeat_interleave(Hq // Hkv, dim=0)
    visible = torch.cat([torch.ones(T, P, dtype=torch.bool, device=q.device), anc.bool()], dim=1)  # [T, P+T]
    s = (q.double() @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ v).to(q.dtype)
