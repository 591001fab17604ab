"""MLA tree attention in the absorbed form: T tree queries of H heads over one shared latent cache.

A cache row is [c ; k_pe]: the RMS-normed latent (C = latent_dim values) then the RoPE key (R values), one row
per slot shared by every head. Head h of query i scores slot j as scale * (q_lat . c_j + q_pe . k_pe_j) and
returns sum_j softmax_j c_j (the latent is the value; the model applies W_UV after). Visibility is the tree
contract of kernels/tree_attention.py: every slot < past_len, and tree slot past_len + j iff bit j of the
query's row of `mask_bits` (pack_mask). Layout and design: docs/kernels.md.

    mla_tree_attention(q, cache, past_len, mask_bits, latent_dim, scale)   Triton kernel (+ merge kernel)
    mla_tree_attention_reference(q, cache, past_len, anc, latent_dim, scale) dense fp32 torch ground truth
    launch_config(T, H, C, R, past_bound, device, overrides, dtype)         tiles and split count

Nothing here synchronises with the host: past_len may live on the device (CUDA graphs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from .pdl import _pdl_start, launch_options, pdl_applies
    from .tree_attention import LOG2E, _interpret, _sm_count, whole_wave_splits
except ImportError:  # loaded as a lone file beside tree_attention.py (tests/kernels/test_compile.py)
    from pdl import _pdl_start, launch_options, pdl_applies
    from tree_attention import LOG2E, _interpret, _sm_count, whole_wave_splits

SMEM_BUDGET = 216 * 1024   # bytes of shared memory a block may plan on (Hopper allows 227 KiB)
ACC_REGS = 128             # fp32 accumulator registers a thread may hold before the tile rows shrink
# The calls that take 64-row tiles (8 warps, Hopper's warpgroup MMA) for a model's latent: each cache block then
# serves 64 rows instead of 32, which pays over a long past, but not over a long tree, whose loop spills
# (docs/kernels.md)
WIDE_MIN_ROWS = 320   # (query, head) rows: 5 queries of 64 heads, 40 of 8
WIDE_MAX_T = 65       # queries
WIDE_PAST = 32768
MERGE_UNROLL = tl.constexpr(8)  # splits the merge reads at once


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------

def mla_tree_attention_reference(q, cache, past_len, anc, latent_dim, scale):
    """Dense torch ground truth in fp32. q [H, T, C + R], cache [S_max, C + R], anc bool [T, T] -> [H, T, C]."""
    H, T, _ = q.shape
    P = int(past_len)  # host sync is fine here
    rows = cache[: P + T].float()  # [P+T, C+R]
    visible = torch.cat([torch.ones(T, P, dtype=torch.bool, device=q.device), anc.to(q.device).bool()], 1)  # [T, P+T]
    s = (q.float() @ rows.T) * scale  # [H, T, P+T]: q_lat . c + q_pe . k_pe in one product
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives 0
    return (p @ rows[:, :latent_dim]).to(q.dtype)  # [H, T, C]


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _mla_attend(acc, l_i, m_i, q_lat, q_pe, row_ptr, s_cs, lo, hi, n_valid,
                mask_ptr, mask_words, t_idx, row_ok, qk_scale,
                MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr,
                R: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over cache slots [lo, hi) for every (query, head) row of the tile.

    MODE 0: whole past blocks, no slot checks.  MODE 1: past tail, slots >= n_valid masked.
    MODE 2: tree slots, slot j visible iff bit j of the query's mask row (j < n_valid = T).
    acc [BM, C_PAD] fp32, l_i/m_i [BM] fp32 (m_i in log2 units), q_lat [BM, C_PAD], q_pe [BM, R_PAD].
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, R_PAD)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n  # [BN]
        valid = cols < n_valid
        base = row_ptr + cols.to(tl.int64)[:, None] * s_cs  # [BN, 1]
        # one load of the latent serves the score and the output
        if MODE == 0 and C == C_PAD:
            lat = tl.load(base + offs_c[None, :])  # [BN, C_PAD]
        else:
            lat = tl.load(base + offs_c[None, :], mask=valid[:, None] & (offs_c < C)[None, :], other=0.0)
        if MODE == 0 and R == R_PAD:
            kpe = tl.load(base + C + offs_r[None, :])  # [BN, R_PAD]
        else:
            kpe = tl.load(base + C + offs_r[None, :], mask=valid[:, None] & (offs_r < R)[None, :], other=0.0)
        if IEEE:
            qk = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")  # [BM, BN] fp32, unscaled
            qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision="ieee")
        else:
            qk = tl.dot(q_lat, tl.trans(lat))
            qk = tl.dot(q_pe, tl.trans(kpe), qk)
        if MODE == 1:
            qk = tl.where(valid[None, :], qk, float("-inf"))
        if MODE == 2:
            # BLOCK_N // 32 words per row ([BM] loads each), expanded to [BM, BN] bits in registers
            bit = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for w in tl.static_range(BLOCK_N // 32):
                word_ok = (t_idx * 0 + start + 32 * w) < n_valid  # [BM]: the word exists
                word = tl.load(mask_ptr + t_idx * mask_words + (start // 32 + w),
                               mask=row_ok & word_ok, other=0)  # [BM] int32
                in_word = (offs_n // 32) == w  # [BN]
                bit = tl.where(in_word[None, :], (word[:, None] >> (offs_n % 32)[None, :]) & 1, bit)
            qk = tl.where(bit != 0, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # stays >= -1e30, finite
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(lat.dtype), lat, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(lat.dtype), lat, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["past_val", "T", "mask_words", "split_target", "min_chunk"])
def _mla_fwd(Q, Cache, Out, OPart, LPart, Mask, PastPtr,
             past_val, T, mask_words, split_target, min_chunk,
             s_qh, s_qt, s_cs, s_oh, s_ot, qk_scale,
             H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
             PAST_FROM_PTR: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # grid: (cdiv(T*H, BLOCK_M), num_splits). Tile rows r = t*H + h: all heads of a query side by side, so each
    # cache block is read once for every head of the tile's queries, and a query's H rows share a mask row.
    _pdl_start(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    if PAST_FROM_PTR:
        past = tl.load(PastPtr).to(tl.int32)
    else:
        past = past_val

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    t_idx = rows // H
    h = rows % H
    row_ok = t_idx < T
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, R_PAD)
    q_row = Q + h.to(tl.int64)[:, None] * s_qh + t_idx[:, None] * s_qt  # [BM, 1]
    q_lat = tl.load(q_row + offs_c[None, :], mask=row_ok[:, None] & (offs_c < C)[None, :], other=0.0)  # [BM, C_PAD]
    q_pe = tl.load(q_row + C + offs_r[None, :], mask=row_ok[:, None] & (offs_r < R)[None, :], other=0.0)  # [BM, R_PAD]

    acc = tl.zeros([BLOCK_M, C_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # finite running-max start: a fully masked block then gives p = 0 and alpha = 1, never NaN
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30

    # committed context: this split's chunk [lo, hi), sized from the device past and split_target alone (as in
    # tree_attention), so the launched split count never changes the reduction order
    chunk = tl.maximum(tl.cdiv(tl.cdiv(past, split_target), BLOCK_N) * BLOCK_N, min_chunk)
    tree_split = tl.maximum(tl.cdiv(past, chunk) - 1, 0)  # the last non-empty chunk's split
    lo = split * chunk
    hi = tl.minimum(lo + chunk, past)
    hi_full = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _mla_attend(acc, l_i, m_i, q_lat, q_pe, Cache, s_cs, lo, hi_full, hi,
                                Mask, mask_words, t_idx, row_ok, qk_scale,
                                0, BLOCK_M, BLOCK_N, C, R, C_PAD, R_PAD, IEEE)
    acc, l_i, m_i = _mla_attend(acc, l_i, m_i, q_lat, q_pe, Cache, s_cs, hi_full, hi, hi,
                                Mask, mask_words, t_idx, row_ok, qk_scale,
                                1, BLOCK_M, BLOCK_N, C, R, C_PAD, R_PAD, IEEE)

    # tree slots, by the split of the last committed chunk; ancestors precede descendants, so only tree slots
    # up to the tile's last query
    t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, T * H - 1) // H
    tree_hi = tl.where(split == tree_split, t_last + 1, 0)
    acc, l_i, m_i = _mla_attend(acc, l_i, m_i, q_lat, q_pe, Cache + past.to(tl.int64) * s_cs, s_cs, 0, tree_hi, T,
                                Mask, mask_words, t_idx, row_ok, qk_scale,
                                2, BLOCK_M, BLOCK_N, C, R, C_PAD, R_PAD, IEEE)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BM, C_PAD] normalised (0 for a row that saw nothing)
    c_ok = (offs_c < C)[None, :]
    if SINGLE:
        o_row = Out + h.to(tl.int64)[:, None] * s_oh + t_idx[:, None] * s_ot
        tl.store(o_row + offs_c[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None] & c_ok)
    else:
        # partials in tile-row order: OPart [S, T*H, C] fp32, LPart [S, T*H] fp32 log2-sum-exp
        prow = split * T * H + rows.to(tl.int64)  # [BM]
        tl.store(OPart + prow[:, None] * C + offs_c[None, :], o, mask=row_ok[:, None] & c_ok)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(LPart + prow, lse, mask=row_ok)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _mla_merge(OPart, LPart, Out, M, s_oh, s_ot, num_splits,
               H: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               SPLIT_PAD: tl.constexpr, PDL: tl.constexpr):
    # grid: (cdiv(M, BLOCK_R), cdiv(C, BLOCK_C)): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max). Splits
    # are summed in order and empty ones (always the last) add exact zeros, so the split count changes no bit.
    _pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] tile-row order, r = t*H + h
    rows64 = rows.to(tl.int64)  # S * M * C may pass 2^31
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    row_ok = rows < M
    ok = row_ok[:, None] & (offs_c < C)[None, :]
    # the rows' largest log-sum-exp over every split in one load (SPLIT_PAD ≥ num_splits; a maximum is exact in any
    # order, so this is the value a loop over the splits gives, without its chain of dependent loads)
    offs_s = tl.arange(0, SPLIT_PAD)
    lse = tl.load(LPart + offs_s[None, :] * M + rows64[:, None],
                  mask=row_ok[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))  # [BR, SPLIT_PAD]
    mx = tl.max(lse, axis=1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    # then MERGE_UNROLL splits a step, their loads issued together (one split after another, each waiting on its
    # load, made an AR step's merge a chain of num_splits loads); a split past the last adds exact zeros
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_UNROLL):
        for j in tl.static_range(MERGE_UNROLL):
            live = row_ok & (rows * 0 + s0 + j < num_splits)
            prow = (s0 + j) * M + rows64  # [BR]
            w = tl.math.exp2(tl.load(LPart + prow, mask=live, other=float("-inf")) - mx)  # [BR], 0 if empty
            den += w
            acc += w[:, None] * tl.load(OPart + prow[:, None] * C + offs_c[None, :], mask=live[:, None] & ok,
                                        other=0.0)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    t = rows // H
    h = rows % H
    o_row = Out + h.to(tl.int64)[:, None] * s_oh + t[:, None] * s_ot
    tl.store(o_row + offs_c[None, :], out.to(Out.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# launch configuration
# --------------------------------------------------------------------------------------------

def _pad(n: int) -> int:
    """A tile width for n values: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def shared_bytes(block_m: int, block_n: int, num_stages: int, C: int, R: int, elt: int) -> int:
    """The shared memory a launch plans on: the query tile and num_stages buffered cache blocks (the softmax's p
    feeds the value dot from registers)."""
    width = _pad(C) + _pad(R)
    return elt * (block_m * width + num_stages * block_n * width)


def launch_config(T: int, H: int, C: int, R: int, past_bound: int, device: torch.device,
                  overrides: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Static tile sizes and split count, from an upper bound of past_len (so graph-safe).

    Keys: block_m (rows = (query, head) pairs), block_n (cache slots per step; a multiple of 32), num_warps,
    num_stages, num_splits, merge_rows / merge_cols (the merge kernel's tile), pdl (both kernels launched as
    programmatic dependents, kernels/pdl.py: an override, off by default); the split rule's inputs waves,
    min_chunk and split_target mean what they do in tree_attention.launch_config. Overrides win; on a GPU the
    defaults shrink until the fp32 accumulator fits ACC_REGS registers a thread and shared_bytes SMEM_BUDGET.
    """
    o = overrides or {}
    M = T * H
    c_pad = _pad(C)
    elt = torch.tensor([], dtype=dtype).element_size()
    if _interpret():
        # the interpreter pays per op, not per element: big tiles, few programs
        cfg = dict(block_m=max(16, min(128, triton.next_power_of_2(M))), block_n=64, num_warps=4, num_stages=1,
                   waves=1.0, min_chunk=64, merge_rows=max(16, min(256, triton.next_power_of_2(M))),
                   merge_cols=c_pad)
    else:
        if c_pad >= 256:
            # a model's latent (512 wide): 16 rows up to 255 (query, head) pairs, else 32, 64 slots a step, 4
            # warps, 2 stages; the fastest tiles of the H200 sweep at T 1…129, H 8 and 64, contexts 4k and 32k
            # (docs/bench/mla_kimi_config_sweep.json), though 32 rows fill the accumulator's registers; 64 rows
            # and 8 warps over a long past (WIDE_MIN_ROWS, WIDE_MAX_T, WIDE_PAST)
            bm, bn, warps, stages = (16 if M < 256 else 32), 64, 4, 2
            if M >= WIDE_MIN_ROWS and T <= WIDE_MAX_T and past_bound >= WIDE_PAST:
                bm, warps = 64, 8
        else:
            bm = max(16, min(128, triton.next_power_of_2(M)))
            while bm > 16 and bm * c_pad > ACC_REGS * 32 * 8:  # even 8 warps could not hold the accumulator
                bm //= 2
            warps = 4 if bm * c_pad < ACC_REGS * 32 * 4 else 8  # 4 warps at the limit spilled
            bn, stages = 64, 3
        # one query (an AR step) gets short splits, as in tree_attention; each split also writes H x C fp32.
        # The merge reads every split's partial in a chain of loads: 32-wide column tiles spread that chain over
        # twice the programs of 64-wide ones (timed: docs/performance.md, Session 21)
        cfg = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                   waves=2.0, min_chunk=128 if T == 1 else 512, merge_rows=16, merge_cols=min(32, c_pad))
        while (cfg["num_stages"] > 1
               and shared_bytes(cfg["block_m"], cfg["block_n"], cfg["num_stages"], C, R, elt) > SMEM_BUDGET):
            cfg["num_stages"] -= 1
        while cfg["block_m"] > 16 and shared_bytes(cfg["block_m"], cfg["block_n"], 1, C, R, elt) > SMEM_BUDGET:
            cfg["block_m"] //= 2
    cfg.update({k: v for k, v in o.items() if k not in ("num_splits", "split_target")})
    for key in ("block_m", "block_n", "merge_rows", "merge_cols"):
        v = cfg[key]
        if v < 1 or v & (v - 1) or (key in ("block_m", "block_n") and v < 16):
            raise ValueError(f"{key}={v} must be a power of two" + (" of at least 16" if key[0] == "b" else ""))
    if cfg["block_n"] % 32:
        raise ValueError(f"block_n={cfg['block_n']} must be a multiple of 32 (one mask word)")
    cfg["min_chunk"] = triton.cdiv(int(cfg["min_chunk"]), cfg["block_n"]) * cfg["block_n"]
    base = triton.cdiv(M, cfg["block_m"])  # programs per split
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

def _check(q, cache, mask_bits, latent_dim, scale):
    """One line naming what is wrong with the arguments, or None."""
    if q.dim() != 3 or cache.dim() != 2:
        return f"q must be [H, T, C + R] and cache [S_max, C + R]; got {tuple(q.shape)} and {tuple(cache.shape)}"
    H, T, width = q.shape
    if cache.shape[1] != width:
        return f"q's last dim {width} differs from the cache row's {cache.shape[1]}"
    if not 0 < latent_dim < width:
        return f"latent_dim={latent_dim} must leave RoPE dims in a row of {width} (0 < latent_dim < {width})"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or cache.dtype != q.dtype:
        return f"q and cache must share a float32/float16/bfloat16 dtype; got {q.dtype} and {cache.dtype}"
    if q.stride(2) != 1 or cache.stride(1) != 1:
        return "q and cache must be contiguous along their last dim (rows may be strided)"
    if cache.device != q.device or mask_bits.device != q.device:
        return f"q, cache and mask_bits must be on one device; got {q.device}, {cache.device}, {mask_bits.device}"
    if mask_bits.dtype != torch.int32 or mask_bits.dim() != 2 or mask_bits.shape[0] != T \
            or mask_bits.shape[1] < (T + 31) // 32:
        return f"mask_bits must be int32 [T, >= ceil(T/32)] = [{T}, {(T + 31) // 32}] (pack_mask); " \
               f"got {mask_bits.dtype} {tuple(mask_bits.shape)}"
    if not scale > 0:
        return f"scale={scale} must be positive"
    return None


def mla_tree_attention(q, cache, past_len, mask_bits, latent_dim, scale, *, max_past_len=None, config=None):
    """q [H, T, C + R] (q_lat = W_UK^T q_nope, then the roped q_pe); cache [S_max, C + R] (latent, then k_pe; rows
    may be strided, e.g. one layer of [L, S, C + R]) with the T new tokens at slots past_len .. past_len+T-1;
    past_len: int or one-element int32/int64 device tensor; mask_bits int32 [T, ceil(T/32)] (pack_mask; rows
    lower-triangular). Returns [H, T, latent_dim] in q's dtype.

    max_past_len bounds a device past_len for the split count (default S_max - T); config overrides
    launch_config's choices (tuning and tests).
    """
    problem = _check(q, cache, mask_bits, latent_dim, float(scale))
    if problem:
        raise ValueError(problem)
    H, T, width = q.shape
    S_max = cache.shape[0]
    C, R = int(latent_dim), width - int(latent_dim)
    mask_bits = mask_bits.contiguous()

    if isinstance(past_len, torch.Tensor):
        if past_len.numel() != 1 or past_len.device != q.device or past_len.is_floating_point():
            raise ValueError(f"a tensor past_len must be one integer on {q.device}; got {past_len.dtype} "
                             f"{tuple(past_len.shape)} on {past_len.device}")
        past_ptr, past_val, from_ptr = past_len.reshape(1), 0, True
        bound = S_max - T if max_past_len is None else int(max_past_len)
    else:
        past_ptr, past_val, from_ptr = mask_bits, int(past_len), False  # dummy pointer
        bound = past_val
        if past_val < 0 or past_val + T > S_max:
            raise ValueError(f"past_len={past_val} with T={T} needs {past_val + T} cache slots; the cache has {S_max}")

    cfg = launch_config(T, H, C, R, bound, q.device, config, q.dtype)
    S = cfg["num_splits"]
    M = T * H
    pdl = pdl_applies(cfg.get("pdl"), q)
    out = torch.empty(H, T, C, device=q.device, dtype=q.dtype)
    if S > 1:
        o_part = torch.empty(S, M, C, device=q.device, dtype=torch.float32)
        l_part = torch.empty(S, M, device=q.device, dtype=torch.float32)
    else:
        o_part = l_part = out  # unused
    _mla_fwd[(triton.cdiv(M, cfg["block_m"]), S)](
        q, cache, out, o_part, l_part, mask_bits, past_ptr,
        past_val, T, mask_bits.stride(0), cfg["split_target"], cfg["min_chunk"],
        q.stride(0), q.stride(1), cache.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E,
        H=H, C=C, R=R, C_PAD=_pad(C), R_PAD=_pad(R), BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        SINGLE=(S == 1), PAST_FROM_PTR=from_ptr, IEEE=(q.dtype == torch.float32), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(pdl),
    )
    if S > 1:
        _mla_merge[(triton.cdiv(M, cfg["merge_rows"]), triton.cdiv(C, cfg["merge_cols"]))](
            o_part, l_part, out, M, out.stride(0), out.stride(1), S,
            H=H, C=C, BLOCK_R=cfg["merge_rows"], BLOCK_C=cfg["merge_cols"], SPLIT_PAD=max(2, triton.next_power_of_2(S)),
            PDL=pdl, num_warps=4,
            **launch_options(pdl),
        )
    return out
