"""A mixture-of-experts MLP for decode and verify, in fixed shapes: routing, the token→expert sort, the experts.

    fused_moe(x, router_weight, w_gate_up, w_down, top_k, renormalize, counts=None)
        -> (out [T, H] in x's dtype, counts [E] int32: tokens routed to each expert in this call)
    fused_moe_routed(x, weights, ids, w_gate_up, w_down, counts=None, elsewhere=False)
        -> the same, for routing computed elsewhere (weights/ids [T, top_k]: DeepSeek-V3's router, in torch);
        with `elsewhere`, id E marks a pair whose expert another rank holds (expert parallelism): it reads no
        weights and adds nothing, and counts has E + 1 entries (the last: such pairs)
    fused_moe_reference(...), fused_moe_routed_reference(...)  the torch ground truths (a loop over the
        experts, as the reference models run it), split the same way

Expert weights are dense tensors or `int4.Int4Weights` (w4a16: the compressed-tensors pack-quantized layout,
dequantized inside the expert kernels as each tile loads; int4.py has the layout and `dequantize`).

The launch facts the engine and the cost model share (row heights, the route-in-align limit, the grid's row
blocks) and the routing's torch reference live in moe_layout.py, which imports no Triton.

Shapes: x [T, H], router_weight [E, H], w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I].
Routing: softmax over the E router logits in fp32, the top_k probabilities, divided by their sum when
`renormalize`. Ties go to the lower expert index, the order of torch's stable descending sort (torch.topk
leaves the order of ties unspecified; on the CPU it does not take the lower index). Each token's output is
Σ_j w_j · down_e(silu(gate_e(x)) · up_e(x)) over its top_k experts e, accumulated in fp32.

Launches, none of them reading anything back to the host, every shape fixed by (T, E, top_k, H, I), so a
round that calls it can be captured once as a CUDA graph for each tree size:
  1. router logits: F.linear in x's dtype (as the reference models compute them);
  2. `_route_kernel`, one program per chunk of BLOCK_T tokens: softmax, top-k by repeated argmax,
     renormalisation, and the chunk's count of pairs per expert;
  3. the sort of the (token, j) pairs by expert, stably (pair p = t·top_k + j): `_scan_kernel`, one program,
     sums the chunks' counts per expert, compacts the touched experts into S = min(E, T·top_k) slots (slot s
     holds the s-th touched expert in expert order, -1 past the last, with its start in the pair list) and
     gives each chunk its first place per expert; then `_place_kernel`, one program per chunk, puts each pair
     at its chunk's place plus its rank within the chunk. Up to ROUTE_IN_ALIGN_MAX_T tokens (AR's step)
     `_route_align_kernel` does 2 and 3 in one program: a launch or two fewer, where serial work is small;
  4. `_gate_up_kernel`, grid (row blocks, I / BLOCK_N, K splits): one BLOCK_M block of a slot's tokens times
     its expert's gate and up rows, SiLU·mul, into h [T·top_k, I] in sorted order (`row_blocks` bounds the
     blocks any routing can need; each program finds its slot from the counts). An AR step on a long K splits
     it: each split leaves partial sums, and `_silu_mul_kernel` adds them in order, then SiLU·mul (with the launch
     option LAST_SPLIT_SUMS the tile's last split to finish does that itself, one launch fewer). Both expert
     kernels take their K steps through `_dot_tile`: dense tiles, or INT4 words unpacked a nibble at a time into
     the activations' dtype (bf16: two values an instruction) for the dot (accumulated in fp32 either way);
  5. `_down_kernel`, grid (row blocks, H / BLOCK_N, K splits): h times the down rows, scaled by the routing
     weight, into y [K splits, T·top_k, H] fp32 in pair order (one split unless the launch option SPLIT_K_DOWN
     asks for more: a walk over I in pieces, as the gate-up's, for calls whose live programs are few);
     (4 and 5 take their first two grid axes the other way round, column tiles first, where `columns_first` says:
     an expert-parallel share's AR steps and small trees);
  6. `_combine_kernel`, grid (T, H / BLOCK_H): out[t] = Σ_j Σ_split y[split, t·top_k + j] in a fixed order
     (deterministic, no atomics), cast to x's dtype.
fused_moe_routed skips 1 and 2: `_count_kernel` counts each chunk's pairs per expert from the given ids, then
3-6 run as above; up to ROUTE_IN_ALIGN_MAX_T tokens `_align_kernel` counts and sorts in one program, or the
routing kernel that chose the ids already did (`routed`: kernels/declared_route.py, the same `_align_pairs`).
Pairs held elsewhere sort as an expert E past the last: its slot's programs exit at once, and
the combine leaves them out.

Why this shape: decode and verify are bound by the weights' bytes, and a tree's tokens route alike (related
contexts), so a few experts may get most of the T tokens. A program owns one (row block, N-tile) of one
expert: while an expert's tokens fit one BLOCK_M block (T ≤ BLOCK_M) its weights are read once per call;
an expert with more tokens gets one program per block, side by side, re-reading its weight tiles from L2,
so a crowded expert is spread over the GPU instead of looping in a few programs (with alike tokens at large
T that loop kept the block far above its floor; docs/performance.md). Blocks past the routing's
own count exit at once.
The counts are an intermediate of the sort, so handing them out (for telemetry) costs nothing.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from .int4 import NIBBLE_OFFSET, VALUES_PER_WORD, Int4Weights, dequantize
    from .moe_layout import ROUTE_IN_ALIGN_MAX_T, route_reference, row_blocks, row_height
    from .pdl import _pdl_start, launch_options, pdl_applies
except ImportError:  # loaded as a lone file (bench's --baseline, tests/kernels/test_compile.py): its neighbours
    from int4 import NIBBLE_OFFSET, VALUES_PER_WORD, Int4Weights, dequantize
    from moe_layout import ROUTE_IN_ALIGN_MAX_T, route_reference, row_blocks, row_height
    from pdl import _pdl_start, launch_options, pdl_applies


_WORD = tl.constexpr(VALUES_PER_WORD)  # int4.py's layout, for the kernels: 4-bit values a packed int32
_BITS = tl.constexpr(32 // VALUES_PER_WORD)
_NIBBLE = tl.constexpr((1 << (32 // VALUES_PER_WORD)) - 1)
_MAGIC_BITS = tl.constexpr(0x4B000000)  # fp32 bits of 2^23: a nibble OR-ed in is its mantissa's low bits
_MAGIC_ZERO = tl.constexpr(float(2 ** 23 + NIBBLE_OFFSET))  # 2^23 + the symmetric zero point


assert VALUES_PER_WORD == 8, "the unpacking splits a word into 2·2·2 nibble columns"


def _bf16_pair(value: float) -> str:
    """A bf16 value's bits twice over, as a PTX 32-bit immediate (both halves of a bf16x2 register)."""
    bits = torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
    return f"0x{bits:04x}{bits:04x}"


# _dequant_bf16x2's assembly, two words a call (pack=2: $8 and $9 are neighbouring elements of a thread's tile, $10
# their two bf16 scales) -> for each nibble j the bf16 pair (word $8's value, word $9's value) in $j: the two values
# the dot takes from one register, so nothing is re-paired after it. prmt puts the words' low halves side by side
# (c), then their high halves (d); a nibble q OR-ed into bf16 128's bits is 128 + q exactly (128's last mantissa
# bit is worth 1); adding −(128 + NIBBLE_OFFSET) gives the value exactly, the scale multiplies it, rounded once.
def _pair_asm() -> str:
    lines = [".reg .b32 c, d, u, one, off, nz;",
             f"mov.b32 one, {_bf16_pair(1.0)};",
             f"mov.b32 off, {_bf16_pair(-(128 + NIBBLE_OFFSET))};",
             f"mov.b32 nz, {_bf16_pair(-0.0)};",
             "prmt.b32 c, $8, $9, 0x5410;",      # bytes 0, 1 of $8, then of $9: nibbles 0-3 of each word
             "prmt.b32 d, $8, $9, 0x7632;"]      # bytes 2, 3: nibbles 4-7
    for half, first in (("c", 0), ("d", 4)):
        for j in range(4):
            lines.append(f"shr.u32 u, {half}, {4 * j};" if j else f"mov.b32 u, {half};")
            lines.append(f"lop3.b32 ${first + j}, u, 0x000f000f, {_bf16_pair(128.0)}, 0xea;")  # (u & mask) | 128
    for j in range(8):
        lines += [f"fma.rn.bf16x2 ${j}, ${j}, one, off;", f"fma.rn.bf16x2 ${j}, ${j}, $10, nz;"]
    return "{\n" + "\n".join(lines) + "\n}"


_PAIR_ASM = tl.constexpr(_pair_asm())


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _route_block(Logits, Weights, Ids, rows, T, E, s_row, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Route tokens `rows` [BLOCK_T]; -> how many of them chose each expert [BLOCK_E] int32."""
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    rmask = rows < T
    cmask = cols < E
    x = tl.load(Logits + rows[:, None] * s_row + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=float("-inf")).to(tl.float32)                      # [BT, BE]
    x = tl.where(rmask[:, None], x, 0.0)  # rows past T: finite, so no NaN (never stored)
    m = tl.max(x, 1)
    p = tl.exp(x - m[:, None])
    p = tl.where(cmask[None, :], p, 0.0)
    p = p / tl.sum(p, 1)[:, None]
    cand = tl.where(cmask[None, :], p, -1.0)  # padding columns never win: probabilities are >= 0
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(cand, 1)
        idx = tl.argmax(cand, 1, tie_break_left=True).to(tl.int32)  # the lowest index among equals
        vals = tl.where(kcols[None, :] == j, best[:, None], vals)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        chosen = cols[None, :] == idx[:, None]                               # [BT, BE]
        counts += tl.sum((chosen & rmask[:, None]).to(tl.int32), 0)
        cand = tl.where(chosen, -1.0, cand)
    if RENORM:
        vals = vals / tl.sum(vals, 1)[:, None]
    out = rows[:, None] * TOP_K + kcols[None, :]
    smask = rmask[:, None] & (kcols[None, :] < TOP_K)
    tl.store(Weights + out, vals, mask=smask)
    tl.store(Ids + out, ids, mask=smask)
    return counts


@triton.jit
def _slots(counts, Counts, SlotExpert, SlotStart, E, S, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Per-expert counts [BLOCK_E] -> stored counts and slots; returns each expert's first place [BLOCK_E]."""
    experts = tl.arange(0, BLOCK_E)
    tl.store(Counts + experts, counts, mask=experts < E)
    starts = tl.cumsum(counts, 0) - counts                                  # exclusive: each expert's first pair
    touched = counts > 0
    slot_of = tl.cumsum(touched.to(tl.int32), 0) - 1
    n_touched = tl.sum(touched.to(tl.int32), 0)
    slots = tl.arange(0, BLOCK_S)
    tl.store(SlotExpert + slots, tl.full([BLOCK_S], -1, tl.int32), mask=(slots >= n_touched) & (slots < S))
    tl.store(SlotExpert + slot_of, experts, mask=touched)
    tl.store(SlotStart + slot_of, starts, mask=touched)
    return starts


@triton.jit
def _place_chunk(Ids, SortedPairs, p0, p1, base, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs p0 ≤ p < p1 to their sorted places: base[e] (where this chunk's first pair of expert e goes) plus
    the pair's rank among the chunk's pairs of e, so earlier pairs come first (a stable sort)."""
    experts = tl.arange(0, BLOCK_E)
    offs = p0 + tl.arange(0, BLOCK_P)
    ids = tl.load(Ids + offs, mask=offs < p1, other=-1)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)                 # [BP, BE]
    rank = tl.cumsum(onehot, 0) - onehot + base[None, :]
    tl.store(SortedPairs + tl.sum(onehot * rank, 1), offs, mask=offs < p1)
    return tl.sum(onehot, 0)


@triton.jit
def _route_kernel(Logits, Weights, Ids, ChunkCounts, T, E, s_row, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # chunk c = tokens [c·BLOCK_T, (c+1)·BLOCK_T): route them and keep how many chose each expert
    _pdl_start(PDL)
    c = tl.program_id(0)
    counts = _route_block(Logits, Weights, Ids, c * BLOCK_T + tl.arange(0, BLOCK_T), T, E, s_row, TOP_K, RENORM,
                          BLOCK_T, BLOCK_E, BLOCK_K)
    tl.store(ChunkCounts + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _count_kernel(Ids, ChunkCounts, P, CHUNK, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    # ids routed elsewhere (moe_align): chunk c = pairs [c·CHUNK, (c+1)·CHUNK), counted per expert
    _pdl_start(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    offs = c * CHUNK + tl.arange(0, BLOCK_P)
    ids = tl.load(Ids + offs, mask=(offs < P) & (offs < (c + 1) * CHUNK), other=-1)
    tl.store(ChunkCounts + c * BLOCK_E + experts, tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0))


@triton.jit
def _scan_kernel(ChunkCounts, ChunkBase, Counts, SlotExpert, SlotStart, C, E, S, BLOCK_C: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # one program over the [C, E] chunk counts: the experts' totals and slots, then where each chunk's first
    # pair of each expert goes (the expert's start plus the earlier chunks' pairs of it)
    _pdl_start(PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        rows = c0 + tl.arange(0, BLOCK_C)
        counts += tl.sum(tl.load(ChunkCounts + rows[:, None] * BLOCK_E + experts[None, :],
                                 mask=rows[:, None] < C, other=0), 0)
    running = _slots(counts, Counts, SlotExpert, SlotStart, E, S, BLOCK_E, BLOCK_S)
    for c0 in range(0, C, BLOCK_C):
        rows = c0 + tl.arange(0, BLOCK_C)
        at = rows[:, None] * BLOCK_E + experts[None, :]
        tile = tl.load(ChunkCounts + at, mask=rows[:, None] < C, other=0)    # [BC, BE]
        tl.store(ChunkBase + at, tl.cumsum(tile, 0) - tile + running[None, :], mask=rows[:, None] < C)
        running += tl.sum(tile, 0)


@triton.jit
def _place_kernel(Ids, ChunkBase, SortedPairs, P, CHUNK, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    _pdl_start(PDL)
    c = tl.program_id(0)
    base = tl.load(ChunkBase + c * BLOCK_E + tl.arange(0, BLOCK_E))
    _place_chunk(Ids, SortedPairs, c * CHUNK, tl.minimum((c + 1) * CHUNK, P), base, BLOCK_P, BLOCK_E)


@triton.jit
def _route_align_kernel(Logits, Weights, Ids, Counts, SlotExpert, SlotStart, SortedPairs, T, P, E, S, s_row,
                        TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # the whole of routing and the sort in one program, serially: one launch instead of three (AR's step)
    _pdl_start(PDL)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        counts += _route_block(Logits, Weights, Ids, t0 + tl.arange(0, BLOCK_T), T, E, s_row, TOP_K, RENORM,
                               BLOCK_T, BLOCK_E, BLOCK_K)
    running = _slots(counts, Counts, SlotExpert, SlotStart, E, S, BLOCK_E, BLOCK_S)
    tl.debug_barrier()  # the ids written above are read by other threads of this program below
    for p0 in range(0, P, BLOCK_P):
        running += _place_chunk(Ids, SortedPairs, p0, P, running, BLOCK_P, BLOCK_E)


@triton.jit
def _align_kernel(Ids, Counts, SlotExpert, SlotStart, SortedPairs, P, E, S,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # given ids (moe_align), few of them: the count, the slots and the placing in one program, serially: one
    # launch instead of three (AR's step under a given routing or expert parallelism)
    _pdl_start(PDL)
    _align_pairs(Ids, Counts, SlotExpert, SlotStart, SortedPairs, P, E, S, BLOCK_P, BLOCK_E, BLOCK_S)


@triton.jit
def _align_pairs(Ids, Counts, SlotExpert, SlotStart, SortedPairs, P, E, S,
                 BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """The P pairs' ids (in memory) counted, slotted and placed by one program: `_align_kernel`'s body, and the
    end of kernels/declared_route.py's when it sorts the pairs it routed (`routed=`)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(Ids + offs, mask=offs < P, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    running = _slots(counts, Counts, SlotExpert, SlotStart, E, S, BLOCK_E, BLOCK_S)
    for p0 in range(0, P, BLOCK_P):
        running += _place_chunk(Ids, SortedPairs, p0, P, running, BLOCK_P, BLOCK_E)


@triton.jit
def _grid_place(COLS_FIRST: tl.constexpr):
    """(row block, column tile) of this program: grid axes 0 and 1, or 1 and 0 when COLS_FIRST."""
    if COLS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _row_block(b, Counts, SlotExpert, S, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """This program's row block -> (slot, its expert, first row m0 within the slot); slot = -1 past the last
    block. Blocks are numbered slot by slot (each slot's ceil(count / BLOCK_M) in turn), so the blocks of one
    expert run side by side and share its weight tiles in L2. ONE_BLOCK (T ≤ BLOCK_M: no expert can fill
    two blocks): block b is slot b, with no search (two dependent loads fewer, which a small tree notices)."""
    if ONE_BLOCK:
        e = tl.load(SlotExpert + b)
        return tl.where(e >= 0, b, -1), e, 0
    slots = tl.arange(0, BLOCK_S)
    ex = tl.load(SlotExpert + slots, mask=slots < S, other=-1)
    n = tl.load(Counts + ex, mask=ex >= 0, other=0)
    ends = tl.cumsum((n + BLOCK_M - 1) // BLOCK_M, 0)                       # [BS] blocks up to each slot
    slot = tl.sum((ends <= b).to(tl.int32), 0)
    first = tl.max(tl.where(ends <= b, ends, 0), 0)                          # the slot's first block
    slot = tl.where(b < tl.max(ends, 0), slot, -1)
    e = tl.load(SlotExpert + tl.maximum(slot, 0))
    return slot, e, (b - first) * BLOCK_M


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; IEEE: exact fp32 products (fp32 inputs), else the tensor cores' default."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _nibble_columns(a, BLOCK_K: tl.constexpr):
    """a [BM, BK] -> its 8 column slices a_j [BM, BK/8], a_j[:, w] = a[:, 8w + j]: the activations that meet
    nibble j of each word. Each thread holds whole words' 8 columns, so the splits move nothing."""
    BM: tl.constexpr = a.shape[0]
    a = tl.reshape(a, (BM, BLOCK_K // 8, 2, 2, 2))       # (m, w, i2, i1, i0): column 8w + 4 i2 + 2 i1 + i0
    e, o = tl.split(a)                                   # i0
    ee, eo = tl.split(e)                                 # i1
    oe, oo = tl.split(o)
    a0, a4 = tl.split(ee)                                # i2
    a2, a6 = tl.split(eo)
    a1, a5 = tl.split(oe)
    a3, a7 = tl.split(oo)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _dequant_f32(packed, scale, Zero, e, n, g, tmask, s_ze, s_zn, HAS_ZERO: tl.constexpr, dtype: tl.constexpr):
    """INT4 words [BW, BN] (and their scales) -> the 8 nibble slices in `dtype`, slice j from nibble j of each
    word. A nibble becomes a float without a conversion: q | 2^23's bits is 2^23 + q in fp32, less 2^23 + the
    zero point gives q − zero exactly; times the group's scale (exact in fp32: a 4-bit integer times a 16-bit
    scale), rounded once to `dtype`: the value `dequantize` gives."""
    scale = scale.to(tl.float32)
    if HAS_ZERO:
        zw = tl.load(Zero + e * s_ze + (n // _WORD)[None, :] * s_zn + g[:, None], mask=tmask, other=0)
        zero = ((zw >> ((n % _WORD) * _BITS)[None, :]) & _NIBBLE) | _MAGIC_BITS                # [BW, BN]
        zero = zero.to(tl.float32, bitcast=True)
    else:
        zero = _MAGIC_ZERO
    return (_nibble_f32(packed, 0, zero, scale, dtype), _nibble_f32(packed, 1, zero, scale, dtype),
            _nibble_f32(packed, 2, zero, scale, dtype), _nibble_f32(packed, 3, zero, scale, dtype),
            _nibble_f32(packed, 4, zero, scale, dtype), _nibble_f32(packed, 5, zero, scale, dtype),
            _nibble_f32(packed, 6, zero, scale, dtype), _nibble_f32(packed, 7, zero, scale, dtype))


@triton.jit
def _nibble_f32(packed, j: tl.constexpr, zero, scale, dtype: tl.constexpr):
    """Nibble j of every word [BW, BN] as (q − zero) · scale in fp32, rounded once to `dtype`."""
    q = ((packed >> (j * _BITS)) & _NIBBLE) | _MAGIC_BITS
    return ((q.to(tl.float32, bitcast=True) - zero) * scale).to(dtype)


@triton.jit
def _dequant_bf16x2(packed, scale):
    """Symmetric INT4 words [BW, BN] and their bf16 scales -> the 8 nibble slices in bf16, two values an
    instruction, two words an assembly call: a thread's neighbouring elements (in the dot's operand layout, the
    words w and w + 1 of a column) give the bf16 pair (q_j of w, q_j of w + 1) with 128 added (a mask and an OR);
    one fma takes 136 off (exact), one more multiplies by the scale (rounded once: the value `dequantize` gives)."""
    return tl.inline_asm_elementwise(
        asm=_PAIR_ASM,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        args=[packed, scale],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _scale_groups(Scale, n, nmask, k0, K, s_sn, GROUP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales of a [BK/8 words, BN rows] INT4 tile's groups, a row's side by side: [BN, NG] (contiguous; a
    load per word would read each scale GROUP/8 times, one scattered element a lane). `_scale_tile` widens them.
    k0 is a multiple of BLOCK_K, and saying so (with no mask along K when EVEN_K) lets a row's NG scales load as one
    aligned vector, which the pipeliner then streams ahead of the step like the words: a 2-byte load it does not."""
    NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1          # groups a K step spans
    groups = tl.multiple_of(k0 // GROUP + tl.arange(0, NG), NG)
    return tl.load(Scale + n[:, None] * s_sn + groups[None, :],
                   mask=nmask[:, None] & ((groups * GROUP < K) | EVEN_K)[None, :], other=0.0)     # [BN, NG]


@triton.jit
def _scale_tile(s, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's group scales [BN, NG] -> one for each word [BW, BN], widened in registers where the dequant uses
    them (so the compiler lays them out as the unpacked words, not as the load that fetched them)."""
    NG: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
    s = tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, BLOCK_K // _WORD // NG))
    return tl.trans(tl.reshape(s, (BLOCK_N, BLOCK_K // _WORD)))


@triton.jit
def _a_tile(a_rows, rmask, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """A's [BM, BK] tile at columns k0 …: its live rows (rmask), no column mask when EVEN_K."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(a_rows + kk[None, :], mask=rmask[:, None] & ((kk < K) | EVEN_K)[None, :], other=0.0)


@triton.jit
def _dot_tile(acc, a_rows, rmask, W, Scale_e, Zero, e, n, nmask, k0, K, s_we, s_wn, s_sn, s_ze, s_zn,
              INT4: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, PAIRED: tl.constexpr,
              EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BM, BN] fp32 += A[:, k0 … k0 + BLOCK_K] @ expert e's rows n [BN] (as [BK, BN]); a_rows [BM, 1] points
    at the rows of A (rmask: the live ones). Dense: the stored weights. INT4 (int4.py's layout): each packed word
    loads once and A's [BM, BK] tile once (contiguous, so the pipeliner streams both ahead of the dots); nibble j of
    every word makes one [BK/8, BN] slice, dotted with A's columns 8w + j (the sum over K taken in another order, so
    no weight tile is reshaped). The scales (Scale_e: expert e's) stream ahead too where a lane holds two or more
    (`_scale_groups`). PAIRED (bf16
    activations, symmetric, compiled): two values an instruction (`_dequant_bf16x2`); else in fp32
    (`_dequant_f32`). Both give `dequantize`'s values bit for bit. EVEN_K (INT4 launches whose K is a multiple of
    BLOCK_K): no mask along K, so the words load 16 bytes at a time."""
    e = e.to(tl.int64)
    if INT4:
        words = k0 // _WORD + tl.arange(0, BLOCK_K // _WORD)                                 # [BW]
        wmask = (words < K // _WORD) | EVEN_K
        tmask = wmask[:, None] & nmask[None, :]
        packed = tl.load(W + e * s_we + n[None, :] * s_wn + words[:, None], mask=tmask, other=0)   # [BW, BN] int32
        g = words * _WORD // GROUP                              # a word's group (a group holds whole words)
        scale = _scale_groups(Scale_e, n, nmask, k0, K, s_sn, GROUP, EVEN_K, BLOCK_K)                 # [BN, NG]
        a = _a_tile(a_rows, rmask, k0, K, EVEN_K, BLOCK_K)                                  # [BM, BK]
        scale = _scale_tile(scale, GROUP, BLOCK_K, BLOCK_N)                                  # [BW, BN]
        a0, a1, a2, a3, a4, a5, a6, a7 = _nibble_columns(a, BLOCK_K)                       # [BM, BW] each
        if PAIRED:
            w0, w1, w2, w3, w4, w5, w6, w7 = _dequant_bf16x2(packed, scale)                    # [BW, BN] each
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = _dequant_f32(packed, scale, Zero, e, n, g, tmask, s_ze, s_zn, HAS_ZERO,
                                                          a.dtype)
        acc = _dot(a0, w0, acc, IEEE)
        acc = _dot(a1, w1, acc, IEEE)
        acc = _dot(a2, w2, acc, IEEE)
        acc = _dot(a3, w3, acc, IEEE)
        acc = _dot(a4, w4, acc, IEEE)
        acc = _dot(a5, w5, acc, IEEE)
        acc = _dot(a6, w6, acc, IEEE)
        acc = _dot(a7, w7, acc, IEEE)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        a = _a_tile(a_rows, rmask, k0, K, EVEN_K, BLOCK_K)                                  # [BM, BK]
        w = tl.load(W + e * s_we + n[None, :] * s_wn + kk[:, None], mask=(kk < K)[:, None] & nmask[None, :],
                    other=0.0)                                                                 # [BK, BN]
        acc = _dot(a, w, acc, IEEE)
    return acc


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) · up, in fp32: the gate-up's activation, unsplit or after its splits' sum."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gate_up_kernel(X, W, Scale, Zero, Hbuf, Part, Arrivals, Counts, SlotExpert, SlotStart, SortedPairs, H, I, S, E,
                    K_CHUNK, s_xt, s_we, s_wn, s_se, s_sn, s_ze, s_zn, s_ht, s_pk, s_pp, TOP_K: tl.constexpr,
                    IEEE: tl.constexpr, INT4: tl.constexpr, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr,
                    PAIRED: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, LAST_SPLIT_SUMS: tl.constexpr,
                    BLOCK_S: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, COLS_FIRST: tl.constexpr, PDL: tl.constexpr):
    # SPLIT_K > 1: program (·, ·, ks) sums K from ks·K_CHUNK for K_CHUNK (a multiple of BLOCK_K) and leaves the gate
    # and up partial sums in Part [SPLIT_K, T·top_k, 2I] fp32 for `_silu_mul_kernel`'s ordered sum, or, with
    # LAST_SPLIT_SUMS, for the tile's last split to finish, which sums them the same way (`_sum_splits`)
    _pdl_start(PDL)
    b, c = _grid_place(COLS_FIRST)
    slot, e, m0 = _row_block(b, Counts, SlotExpert, S, BLOCK_M, BLOCK_S, ONE_BLOCK)
    if slot < 0 or e >= E:  # past the last row block, or the pairs of experts held elsewhere
        return
    start = tl.load(SlotStart + slot)
    count = tl.load(Counts + e)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < count
    pair = tl.load(SortedPairs + start + rows, mask=rmask, other=0)
    tok = pair // TOP_K
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_rows = X + tok[:, None] * s_xt                                                       # [BM, 1]
    k_first, k_end = 0, H
    if SPLIT_K > 1:  # (unsplit, the loop keeps constant bounds: its code is the same as before splits existed)
        k_first = tl.program_id(2) * K_CHUNK
        k_end = tl.minimum(k_first + K_CHUNK, H)
    Scale_e = Scale + e.to(tl.int64) * s_se
    for k0 in range(k_first, k_end, BLOCK_K):
        acc_g = _dot_tile(acc_g, a_rows, rmask, W, Scale_e, Zero, e, cols, cmask, k0, H, s_we, s_wn, s_sn, s_ze, s_zn,
                          INT4, HAS_ZERO, GROUP, PAIRED, EVEN_K, IEEE, BLOCK_K, BLOCK_N)             # gate rows
        acc_u = _dot_tile(acc_u, a_rows, rmask, W, Scale_e, Zero, e, I + cols, cmask, k0, H, s_we, s_wn, s_sn, s_ze,
                          s_zn, INT4, HAS_ZERO, GROUP, PAIRED, EVEN_K, IEEE, BLOCK_K, BLOCK_N)       # up rows
    out_mask = rmask[:, None] & cmask[None, :]
    if SPLIT_K == 1:
        h = _silu_mul(acc_g, acc_u)
        tl.store(Hbuf + (start + rows)[:, None] * s_ht + cols[None, :], h.to(Hbuf.dtype.element_ty), mask=out_mask)
    else:
        part = Part + tl.program_id(2) * s_pk + (start + rows)[:, None] * s_pp + cols[None, :]
        tl.store(part, acc_g, mask=out_mask)
        tl.store(part + I, acc_u, mask=out_mask)
        if LAST_SPLIT_SUMS:
            # the tile's arrival count: the split that makes it SPLIT_K is the last, and every other split's
            # partials are stored by then (the barrier puts this program's stores before its count; the count
            # releases them to the GPU, and the last split's count acquires them). It sums them in order, as
            # _silu_mul_kernel would, and sets the count back to 0 for the next call (a graph's replay included)
            tl.debug_barrier()
            tile = Arrivals + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                rows_at = Part + (start + rows)[:, None] * s_pp + cols[None, :]                 # [BM, BN]
                h = _sum_splits(rows_at, out_mask, I, s_pk, SPLIT_K)
                tl.store(Hbuf + (start + rows)[:, None] * s_ht + cols[None, :], h.to(Hbuf.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits(at, mask, I, s_pk, SPLIT_K: tl.constexpr):
    """silu(Σ_ks gate partials) · Σ_ks up partials at `at` (the gate's; the up's I further), the splits added in
    order from zero: the same bits wherever it runs (`_silu_mul_kernel`, or a gate-up's last split). The loads
    bypass L1 (.cg): other programs wrote these partials during this launch."""
    g = tl.zeros(at.shape, dtype=tl.float32)
    u = tl.zeros(at.shape, dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        g += tl.load(at + ks * s_pk, mask=mask, other=0.0, cache_modifier=".cg")
        u += tl.load(at + ks * s_pk + I, mask=mask, other=0.0, cache_modifier=".cg")
    return _silu_mul(g, u)


@triton.jit
def _silu_mul_kernel(Part, Hbuf, I, s_pk, s_pp, s_ht, SPLIT_K: tl.constexpr, BLOCK_I: tl.constexpr,
                     PDL: tl.constexpr):
    # row p of h = silu(Σ_ks gate partials) · Σ_ks up partials, the splits summed in order (deterministic); rows
    # no expert here wrote hold garbage that nothing reads
    _pdl_start(PDL)
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    cmask = cols < I
    h = _sum_splits(Part + p * s_pp + cols, cmask, I, s_pk, SPLIT_K)
    tl.store(Hbuf + p * s_ht + cols, h.to(Hbuf.dtype.element_ty), mask=cmask)


@triton.jit
def _down_kernel(Hbuf, W, Scale, Zero, Y, Weights, Counts, SlotExpert, SlotStart, SortedPairs, H, I, S, E, K_CHUNK,
                 s_ht, s_we, s_wn, s_se, s_sn, s_ze, s_zn, s_yk, s_yt, IEEE: tl.constexpr, INT4: tl.constexpr,
                 HAS_ZERO: tl.constexpr, GROUP: tl.constexpr, PAIRED: tl.constexpr, EVEN_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_S: tl.constexpr, ONE_BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_FIRST: tl.constexpr,
                 PDL: tl.constexpr):
    # SPLIT_K > 1: program (·, ·, ks) sums K from ks·K_CHUNK for K_CHUNK (a multiple of BLOCK_K) into Y[ks], for
    # `_combine_kernel`'s ordered sum
    _pdl_start(PDL)
    b, c = _grid_place(COLS_FIRST)
    slot, e, m0 = _row_block(b, Counts, SlotExpert, S, BLOCK_M, BLOCK_S, ONE_BLOCK)
    if slot < 0 or e >= E:
        return
    start = tl.load(SlotStart + slot)
    count = tl.load(Counts + e)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)                               # output columns (of H)
    cmask = cols < H
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < count
    pair = tl.load(SortedPairs + start + rows, mask=rmask, other=0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_rows = Hbuf + (start + rows)[:, None] * s_ht                                         # [BM, 1]
    Scale_e = Scale + e.to(tl.int64) * s_se
    k_first, k_end = 0, I
    if SPLIT_K > 1:  # (unsplit, the loop keeps constant bounds: its code is the same as before splits existed)
        k_first = tl.program_id(2) * K_CHUNK
        k_end = tl.minimum(k_first + K_CHUNK, I)
        Y += tl.program_id(2) * s_yk
    for k0 in range(k_first, k_end, BLOCK_K):
        acc = _dot_tile(acc, a_rows, rmask, W, Scale_e, Zero, e, cols, cmask, k0, I, s_we, s_wn, s_sn, s_ze, s_zn,
                        INT4, HAS_ZERO, GROUP, PAIRED, EVEN_K, IEEE, BLOCK_K, BLOCK_N)
    acc = acc * tl.load(Weights + pair, mask=rmask, other=0.0)[:, None]
    tl.store(Y + pair[:, None] * s_yt + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


SPLIT_K_MAX_PAIRS = 16  # (token, expert) pairs up to which the gate-up may split K: an AR step, two tokens at top-8
SPLIT_K_STEPS = 8       # K steps a split walks
INT4_BLOCK_N_UP = 64    # an INT4 gate-up's columns at every T (launch_config; why: docs/kernels.md)


def _pow2(n: int, lo: int = 1, hi: int = 1 << 30) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def _sm_count(device) -> int:
    if _interpret() or torch.device(device).type != "cuda":
        return 1
    index = torch.device(device).index
    return _cuda_sms(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_sms(index: int) -> int:  # asked once per GPU: an eager forward calls this for every MoE layer
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(T: int, top_k: int, E: int, H: int, I: int, device, elsize: int = 2, int4: bool = False) -> dict:
    """Tile sizes from the static shape only (never from routing), so they are fixed at capture time.

    BLOCK_M is `row_height(T, int4)`: one block holds every token of an expert up to 32 tokens (an expert gets at
    most T); up to WIDE_ROWS_FROM_T tokens 32 or 64, more programs while the touched experts are few and
    crowded; from there 64, so a crowded expert's many tokens share its weight tiles in fewer programs.
    BLOCK_N shrinks until (slots × N-tiles) gives about two programs per SM, since a few programs cannot pull
    the weights at full bandwidth. For the same reason SPLIT_K_UP splits the gate-up's K walk into pieces of
    SPLIT_K_STEPS steps when a call has at most SPLIT_K_MAX_PAIRS pairs and K is long (a Kimi layer's 7,168: 56
    steps one after another in each of a few programs; with expert parallelism most slots are another rank's).
    The down's walk over I may split the same way (override SPLIT_K_DOWN; unset, one walk, until a sweep times it).
    LAST_SPLIT_SUMS (override; off until a GPU times it): the gate-up's last split of a tile sums the splits and
    applies SiLU·mul, instead of `_silu_mul_kernel`'s launch.
    An INT4 gate-up takes INT4_BLOCK_N_UP columns at every T: its unpacking, not a lack of programs, sets its pace,
    and at that width its scales stream ahead of each K step (docs/kernels.md).
    fp32 takes half the K depth and two stages, so its tiles fit shared memory.
    Under the interpreter: large tiles, few programs (it pays per operation)."""
    S = min(E, T * top_k)
    if _interpret():
        return dict(S=S, BLOCK_M=_pow2(T, 16, 64),
                    BLOCK_N_UP=_pow2(I, 16, 128), BLOCK_N_DOWN=_pow2(H, 16, 128), BLOCK_K_UP=_pow2(H, 16, 128),
                    BLOCK_K_DOWN=_pow2(I, 16, 128), num_warps=4, num_stages=1)
    sms = _sm_count(device)

    def block_n(N):
        bn = 64
        while bn > 16 and S * triton.cdiv(N, bn) < 2 * sms:
            bn //= 2
        return bn

    depth = 128 if elsize <= 2 else 64
    block_k_up = min(depth, _pow2(H, 16))
    steps = triton.cdiv(H, _block_k(block_k_up, int4))  # the gate-up's K steps as it will launch
    split = T * top_k <= SPLIT_K_MAX_PAIRS and steps > 2 * SPLIT_K_STEPS
    return dict(S=S, BLOCK_M=row_height(T, int4),
                BLOCK_N_UP=INT4_BLOCK_N_UP if int4 else block_n(I), BLOCK_N_DOWN=block_n(H), BLOCK_K_UP=block_k_up,
                BLOCK_K_DOWN=min(depth, _pow2(I, 16)),
                SPLIT_K_UP=triton.cdiv(steps, SPLIT_K_STEPS) if split else 1, num_warps=4,
                num_stages=3 if elsize <= 2 else 2)


def _route_blocks(T: int, E: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_T): BLOCK_T tokens make a chunk, one program of routing, counting and placing."""
    BLOCK_E = _pow2(E, 16)
    return BLOCK_E, max(1, min(_pow2(T), 4096 // BLOCK_E, 64 if _interpret() else 16))


def _route_buffers(logits, top_k):
    """Row-contiguous logits and the routing's outputs: weights [T, top_k] fp32, ids [T, top_k] int32."""
    T, E = logits.shape
    assert 1 <= top_k <= E, f"top_k={top_k} must be in 1..{E}"
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    return (x, torch.empty(T, top_k, dtype=torch.float32, device=x.device),
            torch.empty(T, top_k, dtype=torch.int32, device=x.device))


def _route(logits, top_k, renormalize, pdl=False):
    T, E = logits.shape
    x, weights, ids = _route_buffers(logits, top_k)
    BLOCK_E, BLOCK_T = _route_blocks(T, E)
    chunk_counts = torch.empty(triton.cdiv(T, BLOCK_T), BLOCK_E, dtype=torch.int32, device=x.device)
    _route_kernel[(chunk_counts.shape[0],)](x, weights, ids, chunk_counts, T, E, x.stride(0), TOP_K=top_k,
                                            RENORM=bool(renormalize), BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
                                            BLOCK_K=_pow2(top_k), PDL=pdl, num_warps=4, **launch_options(pdl))
    return weights, ids, chunk_counts


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32), best first."""
    return _route(logits, top_k, renormalize)[:2]


def align_outputs(P: int, E: int, device, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """moe_align's four outputs for P pairs over E experts, empty (`counts`, if given, is used in place):
    what declared_route's `routed=` fills."""
    S = min(E, P)
    counts = torch.empty(E, dtype=torch.int32, device=device) if counts is None else counts
    assert counts.shape == (E,) and counts.dtype == torch.int32 and counts.is_contiguous()
    return (counts, torch.empty(S, dtype=torch.int32, device=device),
            torch.empty(S, dtype=torch.int32, device=device), torch.empty(P, dtype=torch.int32, device=device))


def align_blocks(P: int, E: int) -> dict:
    """The one-program sort's tiles for P pairs over E experts (`_align_pairs`, wherever it runs)."""
    BLOCK_E = _route_blocks(1, E)[0]
    return dict(BLOCK_P=max(16, min(_pow2(P), 8192 // BLOCK_E)), BLOCK_E=BLOCK_E, BLOCK_S=BLOCK_E)


def _align_chunks(ids, E, counts, chunk_counts, pdl=False):
    """The sort from per-chunk counts (a chunk: `_route_blocks`' BLOCK_T tokens' pairs): a scan, then the
    chunks placed side by side."""
    T, top_k = ids.shape
    chunk_tokens = _route_blocks(T, E)[1]
    counts, slot_expert, slot_start, sorted_pairs = out = align_outputs(ids.numel(), E, ids.device, counts)
    C, BLOCK_E = chunk_counts.shape
    chunk_base = torch.empty_like(chunk_counts)
    _scan_kernel[(1,)](chunk_counts, chunk_base, counts, slot_expert, slot_start, C, E, slot_expert.numel(),
                       BLOCK_C=_pow2(C, 1, max(1, 8192 // BLOCK_E)), BLOCK_E=BLOCK_E, BLOCK_S=BLOCK_E, PDL=pdl,
                       num_warps=4, **launch_options(pdl))
    chunk = chunk_tokens * top_k
    _place_kernel[(C,)](ids, chunk_base, sorted_pairs, ids.numel(), chunk, BLOCK_P=_pow2(chunk, 16),
                        BLOCK_E=BLOCK_E, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


def moe_align(ids: torch.Tensor, E: int, counts: torch.Tensor | None = None, fuse: bool | None = None,
              pdl: bool = False):
    """ids [T, top_k] int32 -> (counts [E] int32, slot_expert [S] int32 (-1 past the touched experts),
    slot_start [S] int32 (valid where slot_expert >= 0), sorted_pairs [T·top_k] int32), S = min(E, T·top_k).
    With `fuse` (default: T <= ROUTE_IN_ALIGN_MAX_T, as moe_route_align's) one program does it, in one launch.
    `pdl`: launched as programmatic dependents (kernels/pdl.py; pdl_applies decides)."""
    T, top_k = ids.shape
    BLOCK_E, BLOCK_T = _route_blocks(T, E)
    if T <= ROUTE_IN_ALIGN_MAX_T if fuse is None else fuse:
        out = align_outputs(ids.numel(), E, ids.device, counts)
        P, S = ids.numel(), out[1].numel()
        _align_kernel[(1,)](ids, *out, P, E, S, **align_blocks(P, E), PDL=pdl, num_warps=4, **launch_options(pdl))
        return out
    chunk_counts = torch.empty(triton.cdiv(T, BLOCK_T), BLOCK_E, dtype=torch.int32, device=ids.device)
    chunk = BLOCK_T * top_k
    _count_kernel[(chunk_counts.shape[0],)](ids, chunk_counts, ids.numel(), chunk, BLOCK_P=_pow2(chunk, 16),
                                            BLOCK_E=BLOCK_E, PDL=pdl, num_warps=4, **launch_options(pdl))
    return _align_chunks(ids, E, counts, chunk_counts, pdl)


def moe_route_align(logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor | None = None,
                    fuse: bool | None = None, pdl: bool = False):
    """moe_route then moe_align: -> (weights, ids, counts, slot_expert, slot_start, sorted_pairs). The routing
    programs count their chunk's pairs as they go, so the sort needs no pass over the ids of its own. With
    `fuse` (default: T <= ROUTE_IN_ALIGN_MAX_T) one program does it all, serially, in one launch."""
    T, E = logits.shape
    if fuse is None:
        fuse = T <= ROUTE_IN_ALIGN_MAX_T
    if not fuse:
        weights, ids, chunk_counts = _route(logits, top_k, renormalize, pdl)
        return (weights, ids, *_align_chunks(ids, E, counts, chunk_counts, pdl))
    x, weights, ids = _route_buffers(logits, top_k)
    counts, slot_expert, slot_start, sorted_pairs = out = align_outputs(ids.numel(), E, ids.device, counts)
    P, S = ids.numel(), slot_expert.numel()
    BLOCK_T = _route_blocks(T, E)[1]
    _route_align_kernel[(1,)](x, weights, ids, counts, slot_expert, slot_start, sorted_pairs, T, P, E, S,
                              x.stride(0), TOP_K=top_k, RENORM=bool(renormalize), BLOCK_T=BLOCK_T,
                              BLOCK_K=_pow2(top_k), **align_blocks(P, E), PDL=pdl, num_warps=4,
                              **launch_options(pdl))
    return (weights, ids, *out)


@triton.jit
def _combine_kernel(Y, Ids, Out, H, E, s_yk, s_yt, s_ot, TOP_K: tl.constexpr, ELSEWHERE: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # out[t] = y[t·k] + … + y[t·k + k-1], in that order (deterministic), each pair's SPLIT_K partials (the down's
    # K splits) in order too, cast to out's dtype; ELSEWHERE: the pairs of experts held elsewhere (id E, y never
    # written) left out
    _pdl_start(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        here = mask
        if ELSEWHERE:
            here = mask & ((cols * 0 + tl.load(Ids + t * TOP_K + j)) < E)  # [BLOCK_H]: the pair's, broadcast
        for ks in tl.static_range(SPLIT_K):
            acc += tl.load(Y + ks * s_yk + (t * TOP_K + j) * s_yt + cols, mask=here, other=0.0)
    tl.store(Out + t * s_ot + cols, acc.to(Out.dtype.element_ty), mask=mask)


def _weight_shape(w) -> tuple[int, ...]:
    return w.shape if isinstance(w, Int4Weights) else tuple(w.shape)


def _expert_shapes(x, w_gate_up, w_down, what: str) -> tuple[int, int]:
    """-> (E, I) after checking x [T, H], gate_up [E, 2I, H], down [E, H, I] fit (either form of weight)."""
    T, H = x.shape
    E, two_i, H2 = _weight_shape(w_gate_up)
    I = two_i // 2
    assert H2 == H and _weight_shape(w_down) == (E, H, I) and two_i == 2 * I, (
        f"{what}: x {tuple(x.shape)}, gate_up {_weight_shape(w_gate_up)}, down {_weight_shape(w_down)} do not fit "
        "together")
    for w in (w_gate_up, w_down):
        assert isinstance(w, Int4Weights) or w.stride(2) == 1, "expert weights must be row-major"
    return E, I


def _weight_args(w, activations: torch.dtype, paired: bool = True) -> tuple[list, dict]:
    """A stacked weight -> (its kernel arguments: W, Scale, Zero and their strides, _dot_tile's constexprs).
    Dense weights pass themselves where the INT4 tensors go (never read: INT4=False). PAIRED (unless `paired` is
    False, the launch config's "paired": the fp32 unpacking, for side-by-side checks): bf16 activations and
    scales, symmetric, compiled (the interpreter runs no inline assembly)."""
    if isinstance(w, Int4Weights):
        zero = w.packed if w.zero is None else w.zero
        args = [w.packed, w.scale, zero, w.packed.stride(0), w.packed.stride(1), w.scale.stride(0),
                w.scale.stride(1), zero.stride(0), zero.stride(1)]
        paired = paired and w.zero is None and activations == w.scale.dtype == torch.bfloat16 and not _interpret()
        return args, dict(INT4=True, HAS_ZERO=w.zero is not None, GROUP=w.group_size, PAIRED=paired)
    return [w, w, w, w.stride(0), w.stride(1), 0, 0, 0, 0], dict(INT4=False, HAS_ZERO=False, GROUP=1, PAIRED=False)


def _block_k(depth: int, int4: bool) -> int:
    """A K step of `depth` values, deepened for INT4 on a GPU: its nibble slices are depth / 8 deep, and tl.dot
    takes 16 at least."""
    return max(depth, 16 * VALUES_PER_WORD) if int4 and not _interpret() else depth


def _k_splits(K: int, block_k: int, wanted: int) -> tuple[int, int]:
    """(splits, K values a split): `wanted` splits of K in whole BLOCK_K steps, fewer where K has fewer steps
    (every split gets at least one)."""
    steps = triton.cdiv(K, block_k)
    chunk = triton.cdiv(steps, max(1, min(wanted, steps)))
    return triton.cdiv(steps, chunk), chunk * block_k


def _experts(x, weights, routed, w_gate_up, w_down, top_k: int, I: int, cfg: dict, elsewhere=None,
             pdl: bool = False) -> torch.Tensor:
    """The expert stage after the sort (launches 4-6): x [T, H], weights [T, top_k] fp32 (pair order), routed =
    moe_align's (counts, slot_expert, slot_start, sorted_pairs), weights checked by _expert_shapes -> out [T, H]
    in x's dtype. `elsewhere`: the ids [T, top_k] int32, E marking pairs held elsewhere (left out)."""
    T, H = x.shape
    E = _weight_shape(w_gate_up)[0]
    counts, slot_expert, slot_start, sorted_pairs = routed
    S, P = cfg["S"], T * top_k
    ieee = x.dtype == torch.float32
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    # a launch sweep's options for one expert kernel, unset by default: MAXNREG_UP / MAXNREG_DOWN, a register cap per
    # thread, so more programs fit an SM (65,536 registers ÷ (cap · 32 · num_warps)), at the price of spills where
    # the cap is low; STAGES_UP / STAGES_DOWN, the K steps loaded ahead (num_stages) for that kernel alone: a
    # program of an AR step's few has only its own loads in flight to hide the memory's latency
    up_opts, down_opts = ({"num_warps": cfg["num_warps"], "num_stages": cfg.get(f"STAGES_{which}") or cfg["num_stages"],
                           **({"maxnreg": cfg[f"MAXNREG_{which}"]} if cfg.get(f"MAXNREG_{which}") else {})}
                          for which in ("UP", "DOWN"))
    one_block = T <= cfg["BLOCK_M"]
    blocks = S if one_block else row_blocks(P, S, cfg["BLOCK_M"])
    BLOCK_S = _pow2(S, 16)
    up_args, up_const = _weight_args(w_gate_up, x.dtype, cfg.get("paired", True))
    down_args, down_const = _weight_args(w_down, x.dtype, cfg.get("paired", True))
    up_k, down_k = _block_k(cfg["BLOCK_K_UP"], up_const["INT4"]), _block_k(cfg["BLOCK_K_DOWN"], down_const["INT4"])
    up_w, up_s, up_z, s_we, s_wn, *up_strides = up_args
    splits, k_chunk = _k_splits(H, up_k, cfg.get("SPLIT_K_UP", 1))
    part = torch.empty(splits, P, 2 * I, dtype=torch.float32, device=x.device) if splits > 1 else h  # (unread at 1)
    cols_first = columns_first(cfg, one_block, elsewhere is not None)

    def grid(cols: int, k_splits: int) -> tuple[int, int, int]:
        return (cols, blocks, k_splits) if cols_first else (blocks, cols, k_splits)

    up_grid = grid(triton.cdiv(I, cfg["BLOCK_N_UP"]), splits)
    arrivals = _arrivals(x.device, up_grid[0] * up_grid[1]) if splits > 1 and cfg.get("LAST_SPLIT_SUMS") else None
    _gate_up_kernel[up_grid](
        x, up_w, up_s, up_z, h, part, counts if arrivals is None else arrivals, counts, slot_expert, slot_start,
        sorted_pairs, H, I, S, E, k_chunk, x.stride(0), s_we, s_wn, *up_strides, h.stride(0), part.stride(0),
        part.stride(1) if splits > 1 else 0, TOP_K=top_k, IEEE=ieee, **up_const,
        EVEN_K=up_const["INT4"] and H % up_k == 0, SPLIT_K=splits, LAST_SPLIT_SUMS=arrivals is not None,
        BLOCK_S=BLOCK_S, ONE_BLOCK=one_block, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N_UP"], BLOCK_K=up_k,
        COLS_FIRST=cols_first, PDL=pdl, **up_opts, **launch_options(pdl))
    if splits > 1 and arrivals is None:
        BLOCK_I = min(1024, _pow2(I, 16))
        _silu_mul_kernel[(P, triton.cdiv(I, BLOCK_I))](part, h, I, part.stride(0), part.stride(1), h.stride(0),
                                                       SPLIT_K=splits, BLOCK_I=BLOCK_I, PDL=pdl, num_warps=4,
                                                       **launch_options(pdl))
    down_w, down_s, down_z, *down_strides = down_args
    down_splits, down_chunk = _k_splits(I, down_k, cfg.get("SPLIT_K_DOWN", 1))
    y = torch.empty(down_splits, P, H, dtype=torch.float32, device=x.device)  # each K split's partial sums
    _down_kernel[grid(triton.cdiv(H, cfg["BLOCK_N_DOWN"]), down_splits)](
        h, down_w, down_s, down_z, y, weights, counts, slot_expert, slot_start, sorted_pairs, H, I, S, E, down_chunk,
        h.stride(0), *down_strides, y.stride(0), y.stride(1), IEEE=ieee, **down_const,
        EVEN_K=down_const["INT4"] and I % down_k == 0, SPLIT_K=down_splits, BLOCK_S=BLOCK_S, ONE_BLOCK=one_block,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N_DOWN"], BLOCK_K=down_k, COLS_FIRST=cols_first, PDL=pdl,
        **down_opts, **launch_options(pdl))
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    BLOCK_H = min(1024, _pow2(H, 16))
    ids = y if elsewhere is None else elsewhere  # (never read without ELSEWHERE)
    _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, ids, out, H, E, y.stride(0), y.stride(1), out.stride(0),
                                                  TOP_K=top_k, ELSEWHERE=elsewhere is not None, SPLIT_K=down_splits,
                                                  BLOCK_H=BLOCK_H, PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The gate-up tiles' arrival counts for LAST_SPLIT_SUMS: int32 zeros on `device`, kept for the process (each
    launch leaves them at zero) and shared by every call, one launch at a time on the stream. None where they would
    first be made inside a CUDA graph's capture (the warm-up before it makes them): the splits then sum in a
    launch of their own, the same bits."""
    device = torch.device(device)
    have = _ARRIVALS.get(device)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        have = _ARRIVALS[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return have


def columns_first(cfg: dict, one_block: bool, expert_parallel: bool) -> bool:
    """The expert kernels' grid order (override COLS_FIRST): column tiles first for an expert-parallel share's
    calls whose experts fit one row block each. Row blocks first, most programs of such a call belong to slots
    with nothing here (experts held elsewhere, slots past the last) and sit between the few live ones, so the live
    ones start late; column tiles first, a live slot's programs launch one after another. Timed only there
    (docs/performance.md, "Session 22"); where an expert has several row blocks, row blocks first keep its
    blocks side by side, sharing its weight tiles in L2."""
    return bool(cfg.get("COLS_FIRST", one_block and expert_parallel))


def _config(x, top_k: int, E: int, I: int, config: dict | None, w_gate_up) -> dict:
    T, H = x.shape
    int4 = isinstance(w_gate_up, Int4Weights)
    return {**launch_config(T, top_k, E, H, I, x.device, x.element_size(), int4), **(config or {})}


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor | Int4Weights,
              w_down: torch.Tensor | Int4Weights, top_k: int, renormalize: bool, counts: torch.Tensor | None = None,
              config: dict | None = None):
    """x [T, H] -> (out [T, H] in x's dtype, counts [E] int32); `counts` (if given) is filled in place. The
    expert weights are dense tensors or Int4Weights (dequantized inside the kernels)."""
    E, I = _expert_shapes(x, w_gate_up, w_down, "fused_moe")
    assert router_weight.shape == (E, x.shape[1]), (
        f"fused_moe: router {tuple(router_weight.shape)} does not fit x {tuple(x.shape)} and {E} experts")
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = _config(x, top_k, E, I, config, w_gate_up)
    pdl = pdl_applies(cfg.get("PDL"), x)
    weights, _, *routed = moe_route_align(F.linear(x, router_weight), top_k, renormalize, counts,
                                          cfg.get("fuse_route"), pdl)
    return _experts(x, weights, routed, w_gate_up, w_down, top_k, I, cfg, pdl=pdl), routed[0]


def fused_moe_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor | Int4Weights,
                     w_down: torch.Tensor | Int4Weights, counts: torch.Tensor | None = None,
                     config: dict | None = None, elsewhere: bool = False,
                     routed: tuple[torch.Tensor, ...] | None = None):
    """The experts for routing computed elsewhere (DeepSeek-V3's grouped router runs in torch): x [T, H],
    weights [T, k] (fp32: each pair's factor, as given; no renormalisation here), ids [T, k] expert indices in
    [0, E) (any int dtype; best first, though the order only fixes the sum's) -> (out [T, H] in x's dtype,
    counts [E] int32). moe_align sorts the pairs, unless `routed` holds its four outputs for these ids already
    (kernels/declared_route.py sorts the pairs it routes: one launch fewer); the expert launches are fused_moe's.
    With `elsewhere` an id may also be E: a pair whose expert another rank holds, which adds nothing (counts then
    [E + 1])."""
    E, I = _expert_shapes(x, w_gate_up, w_down, "fused_moe_routed")
    T, top_k = ids.shape
    assert weights.shape == ids.shape and T == x.shape[0], (
        f"fused_moe_routed: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [T, k] with "
        f"T = {x.shape[0]} tokens")
    x = x if x.stride(1) == 1 else x.contiguous()
    sorted_experts = E + 1 if elsewhere else E  # pairs held elsewhere sort as one more expert, past the last
    cfg = _config(x, top_k, sorted_experts, I, config, w_gate_up)
    ids = ids.to(torch.int32).contiguous()  # pair p = t·k + j, as the kernels index it
    pdl = pdl_applies(cfg.get("PDL"), x)
    if routed is None:
        routed = moe_align(ids, sorted_experts, counts, cfg.get("fuse_route"), pdl=pdl)
    else:
        assert routed[0].shape == (sorted_experts,) and routed[3].shape == (ids.numel(),), (
            f"fused_moe_routed: routed holds the sort of {routed[3].numel()} pairs over {routed[0].numel()} "
            f"experts, not of {ids.numel()} over {sorted_experts}")
    out = _experts(x, weights.to(torch.float32).contiguous(), routed, w_gate_up, w_down, top_k, I, cfg,
                   ids if elsewhere else None, pdl)
    return out, routed[0]


# ----------------------------------------------------------------------------- torch references
# (the routing's, route_reference, is moe_layout's: the engine's torch path runs it too)

def align_reference(ids: torch.Tensor, E: int):
    """The same four tensors as moe_align, by a stable argsort (fixed shapes, no host sync)."""
    flat = ids.reshape(-1).long()
    P = flat.numel()
    S = min(E, P)
    counts = torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    sorted_pairs = flat.argsort(stable=True)
    starts = counts.cumsum(0) - counts
    touched = counts > 0
    slot_of = torch.where(touched, touched.long().cumsum(0) - 1, S)  # untouched experts go to a spare slot
    experts = torch.arange(E, device=ids.device)
    slot_expert = torch.full((S + 1,), -1, dtype=torch.long, device=ids.device).scatter_(0, slot_of, experts)
    slot_start = torch.zeros(S + 1, dtype=torch.long, device=ids.device).scatter_(0, slot_of, starts)
    slot_expert[S] = -1
    return counts.int(), slot_expert[:S].int(), slot_start[:S].int(), sorted_pairs.int()


def fused_moe_routed_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                               w_gate_up: torch.Tensor | Int4Weights, w_down: torch.Tensor | Int4Weights,
                               elsewhere: bool = False):
    """The ground truth of the experts for given routing (weights/ids [T, k]), any size: each expert on its own
    tokens in fp32, weighted, summed per token -> (out [T, H] in x's dtype, counts [E] int32). INT4 weights are
    dequantized first, to x's dtype (the values the kernels multiply). (A loop with data-dependent shapes: a
    reference, not a graph-safe path.) `elsewhere`: id E marks a pair held elsewhere (no term; counts [E + 1])."""
    T, H = x.shape
    w_gate_up, w_down = (dequantize(w, x.dtype) if isinstance(w, Int4Weights) else w for w in (w_gate_up, w_down))
    E, two_i, _ = w_gate_up.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(E):
        tok, j = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (xf[tok] @ w_gate_up[e].float().t()).split(two_i // 2, dim=-1)
        y = (F.silu(gate) * up) @ w_down[e].float().t()                       # [n, H]
        out.index_add_(0, tok, y * weights[tok, j, None].float())
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E + 1 if elsewhere else E).int()
    return out.to(x.dtype), counts


def fused_moe_reference(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor | Int4Weights,
                        w_down: torch.Tensor | Int4Weights, top_k: int, renormalize: bool):
    """fused_moe's ground truth: route_reference's routing, then fused_moe_routed_reference."""
    weights, ids = route_reference(F.linear(x, router_weight), top_k, renormalize)
    return fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down)
