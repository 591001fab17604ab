"""Tree attention for DDTree verify: T tree queries over a static KV cache.

Query i (of T) sees every committed slot < past_len and tree slot past_len + j iff bit j of its
row in `mask_bits` is set (j is an ancestor-or-self of i). Layout and split-K design: docs/kernels.md.

    tree_attention(q, k_cache, v_cache, past_len, mask_bits)   Triton kernel (+ merge kernel)
    tree_attention_reference(q, k_cache, v_cache, past_len, anc) dense torch ground truth
    ancestor_matrix(parents) -> anc [T, T];  pack_mask(anc) -> int32 [T, ceil(T/32)]

Nothing here synchronises with the host: past_len may live on the device, so a CUDA graph that
captured one call can be replayed for another context length.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from .pdl import _pdl_start, launch_options, pdl_applies
except ImportError:  # loaded as a lone file (tests/kernels/test_compile.py): its neighbours
    from pdl import _pdl_start, launch_options, pdl_applies

LOG2E = 1.4426950408889634


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------
# mask helpers (plain torch, vectorised, no host sync)
# --------------------------------------------------------------------------------------------

PACK_STAGING = 1 << 25  # int64 elements pack_mask stages at once (256 MiB); a 32k-token prefill's mask whole: 8 GiB


def pack_mask(anc: torch.Tensor, rows_at_once: int | None = None) -> torch.Tensor:
    """anc bool [T, T] -> int32 [T, ceil(T/32)]; bit (j % 32) of word j // 32 of row i = anc[i, j].
    Rows are packed `rows_at_once` at a time (default: PACK_STAGING's worth), so a long prefill's mask packs in
    bounded memory; a verify tree's packs in one go (the same few launches)."""
    T, Tc = anc.shape
    W = (Tc + 31) // 32
    rows = rows_at_once or max(1, PACK_STAGING // (W * 32))
    if T > rows:
        return torch.cat([pack_mask(anc[i:i + rows], rows) for i in range(0, T, rows)])
    bits = torch.zeros(T, W * 32, dtype=torch.int64, device=anc.device)
    bits[:, :Tc] = anc.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=anc.device) << torch.arange(32, device=anc.device)
    words = (bits.view(T, W, 32) * weights).sum(-1)  # [T, W] in [0, 2^32)
    words = words - (words >= 2**31).to(torch.int64) * 2**32  # two's complement wrap into int32
    return words.to(torch.int32)


def unpack_mask(mask_bits: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of pack_mask: int32 [T, W] -> bool [T, T]."""
    shifts = torch.arange(32, device=mask_bits.device, dtype=torch.int32)
    bits = (mask_bits[:, :, None] >> shifts) & 1  # [T, W, 32]
    return bits.reshape(mask_bits.shape[0], -1)[:, :T].bool()


def causal_matrix(T: int, device=None) -> torch.Tensor:
    """The ancestor relation of a chain (prefill / AR): lower-triangular bool [T, T]."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------

def tree_attention_reference(q, k_cache, v_cache, past_len, anc_bool, scale=None):
    """Dense torch ground truth, fp32 math. q [Hq, T, D], caches [Hkv, S_max, D], anc [T, T]."""
    Hq, T, D = q.shape
    Hkv = k_cache.shape[0]
    P = int(past_len)  # host sync is fine here
    scale = D ** -0.5 if scale is None else scale
    k = k_cache[:, : P + T].float().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, P+T, D]
    v = v_cache[:, : P + T].float().repeat_interleave(Hq // Hkv, dim=0)
    visible = torch.cat(
        [torch.ones(T, P, dtype=torch.bool, device=q.device), anc_bool.to(q.device).bool()], dim=1
    )  # [T, P+T]
    s = (q.float() @ k.transpose(1, 2)) * scale  # [Hq, T, P+T]
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives 0
    return (p @ v).to(q.dtype)  # [Hq, T, D]


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _attend(acc, l_i, m_i, q, k_ptr, v_ptr, s_ks, s_vs, lo, hi, n_valid,
            mask_ptr, mask_words, t_idx, row_ok, qk_scale,
            MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over key columns [lo, hi) of one KV head.

    MODE 0: full past blocks, no bounds checks.  MODE 1: past tail, columns >= n_valid masked.
    MODE 2: tree slots, column j visible iff bit j of the query's mask row (j < n_valid = T).
    acc [BM, D] fp32, l_i/m_i [BM] fp32 (m_i in log2 units), q [BM, D].
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n  # [BN]
        k_ptrs = k_ptr + cols[:, None] * s_ks + offs_d[None, :]  # [BN, D]
        v_ptrs = v_ptr + cols[:, None] * s_vs + offs_d[None, :]
        if MODE == 0:
            k = tl.load(k_ptrs)
        else:
            valid = cols < n_valid
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BN] fp32, unscaled
        else:
            qk = tl.dot(q, tl.trans(k))
        if MODE == 1:
            qk = tl.where(valid[None, :], qk, float("-inf"))
        if MODE == 2:
            # BLOCK_N // 32 words per row ([BM] loads each), expanded to [BM, BN] bits in registers
            bit = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for w in tl.static_range(BLOCK_N // 32):
                word_ok = (t_idx * 0 + start + 32 * w) < n_valid  # [BM]: word exists
                word = tl.load(mask_ptr + t_idx * mask_words + (start // 32 + w),
                               mask=row_ok & word_ok, other=0)  # [BM] int32
                in_word = (offs_n // 32) == w  # [BN]
                bit = tl.where(in_word[None, :], (word[:, None] >> (offs_n % 32)[None, :]) & 1, bit)
            qk = tl.where(bit != 0, qk, float("-inf"))
        # scale folded into one multiply-add per score (qk_scale > 0 keeps the max in place)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # stays >= -1e30, finite
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MODE == 0:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["past_val", "T", "mask_words", "num_splits", "split_target", "min_chunk"])
def _tree_attn_fwd(Q, K, V, Out, OPart, LPart, Mask, PastPtr,
                   past_val, T, mask_words, num_splits, split_target, min_chunk,
                   s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_oh, s_ot,
                   qk_scale,
                   G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                   PAST_FROM_PTR: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # grid: (cdiv(T*G, BLOCK_M), Hkv, num_splits); SINGLE = (num_splits == 1): write out directly. Tile rows
    # r = t*G + g: the G query heads that share KV head `hkv`, for tree queries t; K/V tiles are read once for all
    # of them. PDL: a programmatic dependent launch's wait first (kernels/pdl.py)
    _pdl_start(PDL)
    pid_m = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    if PAST_FROM_PTR:
        past = tl.load(PastPtr).to(tl.int32)
    else:
        past = past_val

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    t_idx = rows // G
    h = hkv * G + rows % G  # query head of each row
    row_ok = t_idx < T
    offs_d = tl.arange(0, HEAD_D)
    q = tl.load(Q + h[:, None] * s_qh + t_idx[:, None] * s_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BM, D]

    k_ptr = K + hkv.to(tl.int64) * s_kh
    v_ptr = V + hkv.to(tl.int64) * s_vh
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # finite running-max start: a fully masked block then gives p = 0 and alpha = 1, never NaN
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # committed context: this split's chunk [lo, hi). The chunk follows the device past and the split
    # target only, never the launched split count (which follows the cache's size), so a result does not
    # depend on how large the cache is; splits past the last chunk are empty. Chunks are whole BLOCK_Ns
    # (min_chunk is one), so only the last non-empty one has a ragged tail.
    chunk = tl.maximum(tl.cdiv(tl.cdiv(past, split_target), BLOCK_N) * BLOCK_N, min_chunk)
    tree_split = tl.maximum(tl.cdiv(past, chunk) - 1, 0)  # the last non-empty chunk's split
    lo = split * chunk
    hi = tl.minimum(lo + chunk, past)
    hi_full = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_ptr, v_ptr, s_ks, s_vs, lo, hi_full, hi,
                            Mask, mask_words, t_idx, row_ok, qk_scale,
                            0, BLOCK_M, BLOCK_N, HEAD_D, IEEE)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_ptr, v_ptr, s_ks, s_vs, hi_full, hi, hi,
                            Mask, mask_words, t_idx, row_ok, qk_scale,
                            1, BLOCK_M, BLOCK_N, HEAD_D, IEEE)

    # tree slots, done by the split of the last committed chunk (so they always follow the same context
    # blocks). Ancestors precede descendants, so this row block only needs tree columns <= its largest query index.
    t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T * G - 1) // G
    tree_hi = tl.where(split == tree_split, t_last + 1, 0)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_ptr + past * s_ks, v_ptr + past * s_vs,
                            s_ks, s_vs, 0, tree_hi, T,
                            Mask, mask_words, t_idx, row_ok, qk_scale,
                            2, BLOCK_M, BLOCK_N, HEAD_D, IEEE)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BM, D] normalised (0 for a row that saw nothing)
    if SINGLE:
        tl.store(Out + h[:, None] * s_oh + t_idx[:, None] * s_ot + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partials: OPart [S, Hq, T, D] fp32, LPart [S, Hq, T] fp32 log2-sum-exp
        Hq = tl.num_programs(1) * G
        prow = (split * Hq + h).to(tl.int64) * T + t_idx  # [BM]
        tl.store(OPart + prow[:, None] * HEAD_D + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LPart + prow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["T", "num_splits"])
def _tree_attn_merge(OPart, LPart, Out, T, Hq, s_oh, s_ot, num_splits,
                     HEAD_D: tl.constexpr, SPLIT_PAD: tl.constexpr, PDL: tl.constexpr):
    # grid: (Hq * T,), one output row each: out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max)
    _pdl_start(PDL)
    row = tl.program_id(0)  # = h * T + t
    h = row // T
    t = row % T
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, HEAD_D)
    s_ok = offs_s < num_splits
    prow = offs_s.to(tl.int64) * Hq * T + row  # [SP]
    lse = tl.load(LPart + prow, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(lse - mx)  # [SP], 0 for empty splits
    den = tl.sum(w, 0)
    o = tl.load(OPart + prow[:, None] * HEAD_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)  # [D]
    tl.store(Out + h * s_oh + t * s_ot + offs_d, out.to(Out.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# launch configuration
# --------------------------------------------------------------------------------------------

_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few splits, so the merge path is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def whole_wave_splits(programs_per_split: int, sm: int, waves: float) -> int:
    """The split count a launch aims at: floor(waves x SMs / programs a split), at most 64; 1 once one split's
    programs fill the SMs. Rounded down because a tile's buffered stages fill an SM's shared memory (head dim
    128, an MLA latent), so programs run one an SM and a count rounded up starts a third, part-full wave."""
    if programs_per_split >= sm:
        return 1
    return max(1, min(int(waves * sm // programs_per_split), 64))


def launch_config(T: int, G: int, D: int, past_bound: int, Hkv: int, device: torch.device,
                  overrides: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Static tile sizes and split count, from an upper bound of past_len (so graph-safe).

    Keys: block_m (rows = tree queries x packed heads), block_n (key slots per step; a multiple
    of 32), num_warps, num_stages, num_splits (programs launched on the split axis), pdl (both kernels launched
    as programmatic dependents, kernels/pdl.py; off unless asked); and the split
    heuristic's inputs: waves (aim for this many programs per SM), min_chunk (fewest past slots worth
    a split; rounded up to whole block_ns) and split_target (the split count the chunk size aims at:
    from waves and the row tiles by whole_wave_splits, or an overridden num_splits); overrides win.

    Only num_splits depends on past_bound: the kernel sizes each chunk from the device past_len,
    split_target and min_chunk, so the same past gives the same reduction order, bit for bit,
    whatever the cache's size (the text of a run does not change with max_new_tokens or budget="auto"'s
    largest candidate). num_splits covers the chunks of any past up to past_bound; the rest exit empty.
    """
    o = overrides or {}
    M = T * G
    if _interpret():
        # the interpreter pays per op, not per element: big tiles, few programs
        cfg = dict(block_m=max(16, min(64, triton.next_power_of_2(M))), block_n=32,
                   num_warps=4, num_stages=1, waves=1.0, min_chunk=64)
    else:
        bm = max(16, min(128, triton.next_power_of_2(M)))
        # One query (an AR step) gains from short splits, a tree loses from them (measured in docs/kernels.md).
        cfg = dict(block_m=bm, block_n=64, num_warps=8 if bm == 128 else 4,
                   num_stages=3 if (bm == 128 and D >= 128) else 4, waves=2.0, min_chunk=64 if T == 1 else 512)
    cfg.update({k: v for k, v in o.items() if k not in ("num_splits", "split_target")})
    cfg["min_chunk"] = triton.cdiv(int(cfg["min_chunk"]), cfg["block_n"]) * cfg["block_n"]
    # shared memory: q tile + num_stages buffered K and V tiles (+ mask words); stay under the
    # 227 KiB a Hopper block may use
    elt = 4 if dtype == torch.float32 else 2
    def smem(st):
        return elt * D * (cfg["block_m"] + 2 * cfg["block_n"] * st) + 8 * cfg["block_m"] * st
    while cfg["num_stages"] > 1 and smem(cfg["num_stages"]) > 216 * 1024:
        cfg["num_stages"] -= 1
    n_m = triton.cdiv(M, cfg["block_m"])
    base = n_m * Hkv  # programs per split
    target = whole_wave_splits(base, _sm_count(device), cfg["waves"])
    target = max(1, int(o.get("split_target", o.get("num_splits", target))))
    cfg["split_target"] = target
    splits = 1 if past_bound <= 0 else min(target, triton.cdiv(past_bound, cfg["min_chunk"]))
    cfg["num_splits"] = max(1, int(o.get("num_splits", splits)))
    if cfg["num_splits"] < splits:
        raise ValueError(f"num_splits={cfg['num_splits']} leaves chunks undone: split_target={target} and "
                         f"min_chunk={cfg['min_chunk']} need {splits} splits for a past of {past_bound}")
    return cfg


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------

def tree_attention(q, k_cache, v_cache, past_len, mask_bits, scale=None, *,
                   max_past_len=None, config=None):
    """q [Hq, T, D] (RoPE applied); k_cache, v_cache [Hkv, S_max, D] with the T new tokens at
    slots past_len .. past_len+T-1; past_len: int or 0-dim/1-elem int32/int64 device tensor;
    mask_bits int32 [T, ceil(T/32)] (see pack_mask; rows must be lower-triangular: a tree node
    sees only nodes that precede it). Returns [Hq, T, D] in q's dtype.

    max_past_len bounds a device past_len for choosing the split count (default S_max - T).
    config overrides launch_config's choices (tuning and tests).
    """
    Hq, T, D = q.shape
    Hkv, S_max, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape, "k/v cache must be [Hkv, S_max, D]"
    assert Hq % Hkv == 0, "Hq must be a multiple of Hkv"
    assert D in (16, 32, 64, 128, 256), "head dim must be a power of two in 16..256"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert mask_bits.dtype == torch.int32 and mask_bits.shape[0] == T
    assert mask_bits.shape[1] >= (T + 31) // 32
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    assert scale > 0, "scale must be positive"
    mask_bits = mask_bits.contiguous()

    if isinstance(past_len, torch.Tensor):
        assert past_len.numel() == 1 and past_len.device == q.device
        past_ptr, past_val, from_ptr = past_len.reshape(1), 0, True
        bound = S_max - T if max_past_len is None else int(max_past_len)
    else:
        past_ptr, past_val, from_ptr = mask_bits, int(past_len), False  # dummy pointer
        bound = past_val
        assert past_val + T <= S_max, "cache too small for past_len + T"

    cfg = launch_config(T, G, D, bound, Hkv, q.device, config, q.dtype)
    assert cfg["block_n"] % 32 == 0, "block_n must be a multiple of 32 (one mask word)"
    S = cfg["num_splits"]
    pdl = pdl_applies(cfg.get("pdl"), q)

    out = torch.empty_like(q)
    if S > 1:
        o_part = torch.empty(S, Hq, T, D, device=q.device, dtype=torch.float32)
        l_part = torch.empty(S, Hq, T, device=q.device, dtype=torch.float32)
    else:
        o_part = l_part = out  # unused
    grid = (triton.cdiv(T * G, cfg["block_m"]), Hkv, S)
    _tree_attn_fwd[grid](
        q, k_cache, v_cache, out, o_part, l_part, mask_bits, past_ptr,
        past_val, T, mask_bits.stride(0), S, cfg["split_target"], cfg["min_chunk"],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        scale * LOG2E,
        G=G, HEAD_D=D, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], SINGLE=(S == 1),
        PAST_FROM_PTR=from_ptr, IEEE=(q.dtype == torch.float32), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(pdl),
    )
    if S > 1:
        _tree_attn_merge[(Hq * T,)](
            o_part, l_part, out, T, Hq, out.stride(0), out.stride(1), S,
            HEAD_D=D, SPLIT_PAD=max(2, triton.next_power_of_2(S)), PDL=pdl,
            num_warps=4 if D >= 128 else 2, **launch_options(pdl),
        )
    return out
