"""An MoE routing in one launch: each token's experts (uniform's hash, given, or a grouped router's choice) and
their weights.

    declared_route(logits, top_k, scoring, renormalize, scaling, keys=, layer=)  uniform: hash, top-k, weights
    declared_route(logits, top_k, scoring, renormalize, scaling, ids=)           given experts (a trace): weights
    grouped_route(logits, bias, top_k, n_group, topk_group, scoring, ...)       DeepSeek-V3's grouped router
        each with local_index= / ids_dtype=: the ids as the expert kernels take them (an expert-parallel rank's
        places, int32), in the same launch
    references (moe_layout.py): uniform_ids_reference, then declared_weights_reference; route_grouped_reference
    (and local_index[ids])

Uniform routing scores expert e of token t by hash(key_t, layer, e), a few multiply-xorshift rounds modulo the
prime 2^31 − 1, and takes the top_k, best first. The scores are integers, so the kernel's experts equal the
reference's exactly: it takes the maximum top_k times, the smallest index among equal maxima first (the
reference's stable descending sort), and strikes each pick. Every product is of two residues below 2^31, exact in
int64. The weights are the router's own scores at those experts (softmax over the row, or sigmoid), in fp32 as
the reference computes them; the sums run in another order, so they agree to rounding, not bit for bit.

A grouped router (DeepSeek-V3, Kimi K2) packs each expert's corrected score, as an int32 in the floats' order,
above its index the same way: the groups' sums of their best two, then the open groups' top_k, are the same
repeated maximum. The choice is as exact as the scores: on a GPU the sigmoid is torch's (expf, a correctly
rounded division), so the experts are torch's bit for bit; under the interpreter (no libdevice) numpy's, which
may round otherwise, so the CPU tests keep the experts' scores apart.

Why: in torch a declared routing is about twenty launches in every MoE layer of every forward (the hash's
elementwise steps and sort, then the scores, gather and normalisation), where a trained router's top-k is fused
into the expert kernel's routing; here it is one after the router's matmul (docs/performance.md, Session 8, times
both side by side). A token a program, in one warp: with 8–16 tokens a program, a tree's tokens ran one after
another and the kernel was a large share of a verify (the rank profiles of Session 8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from .fused_moe import _align_pairs, align_blocks
    from .pdl import _pdl_start, launch_options, pdl_applies
    from .moe_layout import ROUTE_IN_ALIGN_MAX_T, UNIFORM_MIX, UNIFORM_PRIME  # noqa: F401
    from .moe_layout import declared_weights_reference, route_grouped_reference, uniform_ids_reference  # noqa: F401
    from .tree_attention import _interpret
except ImportError:  # loaded as a lone file (tests/kernels/test_compile.py): its neighbours
    from fused_moe import _align_pairs, align_blocks
    from pdl import _pdl_start, launch_options, pdl_applies
    from moe_layout import ROUTE_IN_ALIGN_MAX_T, UNIFORM_MIX, UNIFORM_PRIME  # noqa: F401
    from moe_layout import declared_weights_reference, route_grouped_reference, uniform_ids_reference  # noqa: F401
    from tree_attention import _interpret

MAX_EXPERTS = 4096  # a token's row of logits sits in registers
_INDEX_BITS = tl.constexpr(12)  # an expert index below MAX_EXPERTS, packed under its score (the top-k's one max)
_INDEX_MASK = tl.constexpr(MAX_EXPERTS - 1)
_NONE = tl.constexpr(-(1 << 62))  # below every packed key (an int32 key shifted by _INDEX_BITS): struck, or padding
assert MAX_EXPERTS == 1 << 12
SCORINGS = ("softmax", "sigmoid")


@triton.jit
def _mod_prime(x, PRIME: tl.constexpr):
    """x mod 2^31 − 1 for 0 ≤ x < 2^62, exactly, without a 64-bit division: 2^31 ≡ 1, so x ≡ (x & P) + (x >> 31);
    twice brings it below P + 2, one subtraction below P."""
    x = (x & PRIME) + (x >> 31)
    x = (x & PRIME) + (x >> 31)
    return tl.where(x >= PRIME, x - PRIME, x)


@triton.jit
def _float_order(v):
    """fp32 values -> int32 keys in the same order (negative floats' magnitude bits flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _score(logits, row_max, row_sum, SIGMOID: tl.constexpr, PRECISE: tl.constexpr):
    """The router's scores of logits [BT, n]: sigmoid, or softmax given its row's max and sum of exponentials."""
    if SIGMOID:
        if PRECISE:  # as torch computes it on a GPU: expf, then a correctly rounded division (the same bits)
            return tl.math.div_rn(1.0, 1.0 + tl.extra.libdevice.exp(-logits))
        return 1.0 / (1.0 + tl.exp(-logits))
    return tl.exp(logits - row_max[:, None]) / row_sum[:, None]


@triton.jit
def _declared_route_kernel(Logits, Keys, Ids, Weights, Local, Out, Bias, T, E, s_lt, layer_term, M0, M2, M3,
                           scaling, group_size, Counts, SlotExpert, SlotStart, SortedPairs, E_SORT, S_SORT,
                           PRIME: tl.constexpr, HASH: tl.constexpr, CHOOSE: tl.constexpr, SIGMOID: tl.constexpr,
                           RENORM: tl.constexpr, LOCAL: tl.constexpr, STORE: tl.constexpr, TOP_K: tl.constexpr,
                           N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, PRECISE: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_G: tl.constexpr, SORT: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_SE: tl.constexpr, PDL: tl.constexpr):
    # one program: BLOCK_T tokens × every expert; SORT (one program holding all T tokens): then the pairs' ids as
    # stored (Out) sorted over E_SORT experts, as fused_moe's moe_align sorts them, in the same launch
    _pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                       # [BT]
    e = tl.arange(0, BLOCK_E).to(tl.int64)                                        # [BE]
    j = tl.arange(0, BLOCK_K)                                                     # [BK]
    live = t < T
    row = tl.minimum(t, T - 1)  # rows past T repeat the last (stored nowhere): no -inf row to make NaN of
    logits = tl.load(Logits + row[:, None] * s_lt + e[None, :], mask=e[None, :] < E,
                     other=float("-inf")).to(tl.float32)                         # [BT, BE]
    row_max = tl.zeros([BLOCK_T], dtype=tl.float32)                               # [BT]: softmax's only
    row_sum = row_max + 1.0
    if not SIGMOID:
        row_max = tl.max(logits, axis=1)
        row_sum = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    if CHOOSE:  # the choice compares every expert's score
        scores = _score(logits, row_max, row_sum, SIGMOID, PRECISE)              # [BT, BE]
    picks = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    if HASH or CHOOSE:
        if HASH:  # uniform: the hash of (key, layer, expert), a residue below 2^31
            key = tl.load(Keys + t, mask=live, other=0).to(tl.int64)
            x = _mod_prime(((key % PRIME) * M0 + layer_term)[:, None] + e[None, :] * M2, PRIME)   # [BT, BE]
            x = _mod_prime((x ^ (x >> 13)) * M3, PRIME)
            x = _mod_prime((x ^ (x >> 7)) * M0, PRIME)
        else:  # a grouped router: the scores plus the correction bias, in fp32 order
            choice = scores + tl.load(Bias + e, mask=e < E, other=0.0).to(tl.float32)[None, :]  # [BT, BE]
            x = _float_order(choice).to(tl.int64)
        # score and index in one int64, so one max takes the best score and, among equals, the smallest index;
        # padding never wins
        x = tl.where(e[None, :] < E, (x << _INDEX_BITS) | (_INDEX_MASK - e[None, :]), _NONE)
        if CHOOSE and N_GROUP > 1:  # only the TOPK_GROUP groups whose best two choices sum highest stay open
            group = e // group_size                                               # [BE]
            g_idx = tl.arange(0, BLOCK_G)
            gx = tl.full([BLOCK_T, BLOCK_G], _NONE, tl.int64)
            for g in tl.static_range(N_GROUP):
                in_g = (group == g)[None, :]
                m1 = tl.max(tl.where(in_g, x, _NONE), axis=1)                     # [BT]: each x is unique
                m2 = tl.max(tl.where(in_g & (x != m1[:, None]), x, _NONE), axis=1)
                top2 = (tl.sum(tl.where(x == m1[:, None], choice, 0.0), axis=1)
                        + tl.sum(tl.where(x == m2[:, None], choice, 0.0), axis=1))  # [BT], as torch sums the two
                packed = (_float_order(top2).to(tl.int64) << _INDEX_BITS) | (_INDEX_MASK - g)
                gx = tl.where(g_idx[None, :] == g, packed[:, None], gx)
            open_ = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(gx, axis=1)
                g_best = _INDEX_MASK - (best & _INDEX_MASK)                       # [BT]
                open_ = open_ | (group[None, :] == g_best[:, None]).to(tl.int32)
                gx = tl.where(gx == best[:, None], _NONE, gx)
            x = tl.where(open_ != 0, x, _NONE)
        for k in tl.static_range(TOP_K):
            best = tl.max(x, axis=1)                                              # [BT]
            pick = _INDEX_MASK - (best & _INDEX_MASK)
            picks = tl.where(j[None, :] == k, pick[:, None], picks)
            x = tl.where(x == best[:, None], _NONE, x)
    else:
        picks = tl.load(Ids + t[:, None] * TOP_K + j[None, :], mask=live[:, None] & (j[None, :] < TOP_K),
                        other=0).to(tl.int64)
    if STORE:  # the experts as the caller takes them: an expert-parallel rank's places in its stack, its dtype
        out = tl.load(Local + picks) if LOCAL else picks                         # [BT, BK]
        tl.store(Out + t[:, None] * TOP_K + j[None, :], out.to(Out.dtype.element_ty),
                 mask=live[:, None] & (j[None, :] < TOP_K))
    if SORT:
        tl.debug_barrier()  # the ids stored above are read back by other threads of this program
        _align_pairs(Out, Counts, SlotExpert, SlotStart, SortedPairs, T * TOP_K, E_SORT, S_SORT,
                     BLOCK_P, BLOCK_SE, BLOCK_SE)
    # each pick's score from its own logit, as the row's scores are computed (the same bits): a gather, not a
    # reduction over the experts for each of the top_k
    kept = live[:, None] & (j[None, :] < TOP_K) & (picks >= 0) & (picks < E)     # [BT, BK]: else 0, as no expert
    picked = tl.load(Logits + row[:, None] * s_lt + picks, mask=kept, other=0.0).to(tl.float32)
    w = tl.where(kept, _score(picked, row_max, row_sum, SIGMOID, PRECISE), 0.0)  # [BT, BK]
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    tl.store(Weights + t[:, None] * TOP_K + j[None, :], w * scaling, mask=live[:, None] & (j[None, :] < TOP_K))


def routing_warps(E: int) -> int:
    """The routing kernel's warps for E experts (a token a program): one up to 128, then twice as many for twice the
    experts, up to 8; a Kimi layer's 384 take four, the fastest of 1, 2, 4 and 8 at every token count timed, for
    declared and grouped routing alike (docs/kernels.md; bench/declared_route.py's `--warps` times others)."""
    return min(8, max(1, triton.next_power_of_2(E) // 128))


def declared_route(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, scaling: float = 1.0, *,
                   keys: torch.Tensor | None = None, layer: int = 0, ids: torch.Tensor | None = None,
                   local_index: torch.Tensor | None = None, ids_dtype: torch.dtype = torch.int64,
                   routed: tuple[torch.Tensor, ...] | None = None, pdl: bool = False,
                   num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the router's) -> (weights [T, top_k] fp32, ids [T, top_k] ids_dtype). The experts are uniform
    routing's for `keys` [T] int64 (≥ 0) at `layer`, or the given `ids` [T, top_k]; the weights are their
    scores (`scoring`: softmax or sigmoid), normalised when `renormalize`, times `scaling`. `local_index` [E]
    int64 (an expert-parallel rank's place for each expert) maps the ids returned, in the same launch (reference:
    local_index[ids]); the weights stay the routed experts'. `routed` (up to ROUTE_IN_ALIGN_MAX_T tokens):
    fused_moe.align_outputs' four tensors, filled with the sort of the ids returned, as moe_align(ids, E') would
    (E' = their counts' length), in the same launch. `pdl`: launched as a programmatic dependent of the kernel
    before (kernels/pdl.py), on a GPU. `num_warps`: a launch override (default `routing_warps(E)`). Fixed shapes,
    no host read (graph-safe)."""
    assert (keys is None) != (ids is None), "give keys (uniform routing) or ids (given experts), one of them"
    T = logits.shape[0]
    if keys is not None:
        assert keys.shape == (T,), (tuple(keys.shape), T)
    else:
        assert ids.shape == (T, top_k), (tuple(ids.shape), T, top_k)
    return _route(logits, top_k, scoring, renormalize, scaling, keys=keys, layer=layer, ids=ids,
                  local_index=local_index, ids_dtype=ids_dtype, routed=routed, pdl=pdl, num_warps=num_warps)


def grouped_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  scoring: str, renormalize: bool, scaling: float = 1.0, *, local_index: torch.Tensor | None = None,
                  ids_dtype: torch.dtype = torch.int64, routed: tuple[torch.Tensor, ...] | None = None,
                  pdl: bool = False, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped router in one launch (reference: moe_layout.route_grouped_reference): logits [T, E]
    fp32, correction bias [E] -> (weights [T, top_k] fp32, ids [T, top_k] ids_dtype, best first). The experts
    are the top_k of scores + bias among the topk_group groups whose best two sum highest, ties to the lower
    index; the weights are the scores at them, normalised when `renormalize`, times `scaling`; `local_index`,
    `routed`, `pdl` and `num_warps` as for declared_route. The choice compares the kernel's scores, which round as torch's may
    not: experts within an ulp of each other can swap places."""
    E = logits.shape[1]
    assert bias.shape == (E,), (tuple(bias.shape), E)
    assert n_group >= 1 and E % n_group == 0, f"{E} experts do not split into {n_group} groups"
    assert 1 <= topk_group <= n_group and topk_group * (E // n_group) >= top_k, \
        f"{topk_group} of {n_group} groups hold fewer than top_k={top_k} experts"
    return _route(logits, top_k, scoring, renormalize, scaling, bias=bias.contiguous(), n_group=n_group,
                  topk_group=topk_group, local_index=local_index, ids_dtype=ids_dtype, routed=routed, pdl=pdl,
                  num_warps=num_warps)


def _route(logits, top_k, scoring, renormalize, scaling, *, keys=None, layer=0, ids=None, bias=None, n_group=1,
           topk_group=1, local_index=None, ids_dtype=torch.int64, routed=None, pdl=False, num_warps=None):
    """One launch of the kernel: experts hashed (keys), chosen (bias) or given (ids), then their weights (and with
    `routed`, the pairs sorted)."""
    T, E = logits.shape
    assert scoring in SCORINGS, f"scoring={scoring!r} is not one of {SCORINGS}"
    assert 1 <= top_k <= E <= MAX_EXPERTS, (top_k, E)
    assert local_index is None or local_index.shape == (E,), "local_index: one place for each of the E experts"
    assert num_warps is None or num_warps in (1, 2, 4, 8, 16), f"num_warps={num_warps}: a power of two up to 16"
    if routed is not None:
        assert T <= ROUTE_IN_ALIGN_MAX_T, f"routed=: one program sorts up to {ROUTE_IN_ALIGN_MAX_T} tokens, not {T}"
        assert len(routed) == 4 and routed[3].numel() == T * top_k and routed[1].numel() == min(
            routed[0].numel(), T * top_k), "routed: fused_moe.align_outputs(T·top_k, experts) for these tokens"
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    picked = ids is None  # hashed (keys) or chosen (bias) here, else given
    ids = None if ids is None else ids.contiguous()
    keys = None if keys is None else keys.contiguous()
    # given experts come back as they were, unless mapped or of another dtype; picked ones are always written
    store = picked or local_index is not None or ids.dtype != ids_dtype
    out = torch.empty(T, top_k, dtype=ids_dtype, device=x.device) if store else ids
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    if T == 0:
        if routed is not None:
            routed[0].zero_()  # no pairs: every count 0, the rest empty
        return weights, out
    BLOCK_E = triton.next_power_of_2(E)
    M = UNIFORM_MIX
    unused = x  # the pointers a mode does not read: the logits, which nothing writes
    pdl = pdl_applies(pdl, x)
    if routed is None:  # (the sort's arguments fixed, so they compile no variant)
        sort_args, sort_const, block_t = (unused,) * 4 + (1, 1), dict(SORT=False, BLOCK_P=16, BLOCK_SE=16), 1
    else:  # one program holds every token, then sorts their pairs
        e_sort, s_sort = routed[0].numel(), routed[1].numel()
        blocks = align_blocks(T * top_k, e_sort)
        sort_args = (*routed, e_sort, s_sort)
        sort_const, block_t = dict(SORT=True, BLOCK_P=blocks["BLOCK_P"], BLOCK_SE=blocks["BLOCK_E"]), \
            triton.next_power_of_2(T)
    _declared_route_kernel[(triton.cdiv(T, block_t),)](
        x, keys if keys is not None else unused, ids if ids is not None else unused, weights,
        local_index if local_index is not None else unused, out, bias if bias is not None else unused,
        T, E, x.stride(0), (layer + 1) * M[1], M[0], M[2], M[3], float(scaling), E // n_group, *sort_args,
        PRIME=UNIFORM_PRIME, HASH=keys is not None, CHOOSE=bias is not None,
        SIGMOID=scoring == "sigmoid", RENORM=bool(renormalize), LOCAL=local_index is not None, STORE=store,
        TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, PRECISE=not _interpret(), BLOCK_T=block_t,
        BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(n_group),
        **sort_const, PDL=pdl, num_warps=num_warps or routing_warps(E), **launch_options(pdl))
    return weights, out
