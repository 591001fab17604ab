"""The Triton kernels compile for Hopper (sm_90), with no GPU needed: the interpreter runs a kernel's
Python, but type rules that only the compiler enforces (a loop variable changing type, say) would
otherwise first fail on the GPU. Triton's wheel ships the compiler and ptxas.

The compiles run in a fresh process: once the interpreter has run a kernel in a process, it leaves
triton.language patched, and compiling there fails.

By default one signature per kernel compiles (the first case of each), so the suite stays within its
time on two cores whatever the load; `DDTREE_LAB_FULL_COMPILE=1` compiles every case below (the widest
blocks take minutes each), which `.ci/run` does as its own bounded step. A case is (module, kernel, signature,
constexprs) and, where its launch sets them, the compile options (num_warps, num_stages)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[2] / "kernels"

FUSED_TREE_SIGNATURE = {
    "TopLp": "*fp32", "TopTok": "*i64", "CandSlot": "*i64", "CandRank": "*i64", "BeamScore": "*fp32",
    "BeamSlot": "*i32", "BeamRank": "*i32", "NodeOf": "*i32", "Tokens": "*i64", "Depths": "*i64",
    "Parents": "*i64", "Scores": "*fp32", "Logprobs": "*fp32", "Ranks": "*i64", "L": "i32", "W": "i32",
    "K": "i32", "M": "i32", "n": "i32"}

AUTO_STATE_SIGNATURE = {
    "Scores": "*fp32", "Budgets": "*i64", "Costs": "*fp32", "Edges": "*fp32", "TableSum": "*fp32",
    "TableCount": "*fp32", "Totals": "*fp32", "BinRing": "*i64", "Proposals": "*i64", "Schedule": "*i64",
    "j": "i32", "n_conf": "i32", "explore": "fp32", "weight": "fp32", "decay": "fp32", "max_tau": "fp32"}
ADVANCE_SIGNATURE = {
    "Tokens": "*i64", "Path": "*i64", "A": "*i64", "Choice": "*i64", "N": "*i64", "Bonus": "*i64", "Out": "*i64",
    "OutLen": "*i64", "Taus": "*i64", "RoundIdx": "*i64", "CtxPos": "*i64", "CtxCount": "*i64", "L": "i32"}
AUTO_SIGNATURE = {"Path": "*i64", "A": "*i64", "RoundIdx": "*i64", **AUTO_STATE_SIGNATURE}
LINEAR_SIGNATURE = {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                    "k_chunk": "i32", "s_xm": "i32", "s_wn": "i32", "s_ym": "i32", "s_ys": "i32"}
CHAIN_ATTN_SIGNATURE = {
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Part": "*fp32", "PartM": "*fp32", "PartL": "*fp32",
    "Chain": "*i32", "ChainLen": "*i32", "PastPtr": "*i64", "past_val": "i32",
    **{s: "i32" for s in ("s_qh", "s_qt", "s_kh", "s_ks", "s_vh", "s_vs", "s_oh", "s_ot", "s_chain", "n_chunks")},
    "qk_scale": "fp32"}
# the expert kernels: dense weights pass themselves where the INT4 scales and zero points go (never read)
GATE_UP_SIGNATURE = {
    "X": "*bf16", "W": "*bf16", "Scale": "*bf16", "Zero": "*bf16", "Hbuf": "*bf16", "Part": "*fp32", "Arrivals": "*i32",
    "Counts": "*i32",
    "SlotExpert": "*i32", "SlotStart": "*i32", "SortedPairs": "*i32", "H": "i32", "I": "i32", "S": "i32",
    "E": "i32", "K_CHUNK": "i32",
    **{s: "i32" for s in ("s_xt", "s_we", "s_wn", "s_se", "s_sn", "s_ze", "s_zn", "s_ht", "s_pk", "s_pp")}}
DOWN_SIGNATURE = {
    "Hbuf": "*bf16", "W": "*bf16", "Scale": "*bf16", "Zero": "*bf16", "Y": "*fp32", "Weights": "*fp32",
    "Counts": "*i32", "SlotExpert": "*i32", "SlotStart": "*i32", "SortedPairs": "*i32", "H": "i32", "I": "i32",
    "S": "i32", "E": "i32", "K_CHUNK": "i32",
    **{s: "i32" for s in ("s_ht", "s_we", "s_wn", "s_se", "s_sn", "s_ze", "s_zn", "s_yk", "s_yt")}}
DENSE = {"INT4": False, "HAS_ZERO": False, "GROUP": 1, "PAIRED": False, "EVEN_K": False}

# the routing kernel: a mode's unread pointers are passed the logits'
ROUTE_SIGNATURE = {"Weights": "*fp32", "Out": "*i32", "Bias": "*fp32", "T": "i32", "E": "i32", "s_lt": "i32",
                   "layer_term": "i32", "M0": "i32", "M2": "i32", "M3": "i32", "scaling": "fp32", "group_size": "i32",
                   "Counts": "*i32", "SlotExpert": "*i32", "SlotStart": "*i32", "SortedPairs": "*i32", "E_SORT": "i32",
                   "S_SORT": "i32"}
ROUTE_MODES = {"PRIME": 2_147_483_647, "HASH": False, "CHOOSE": False, "SIGMOID": False, "RENORM": True,
               "LOCAL": False, "STORE": True, "TOP_K": 8, "N_GROUP": 1, "TOPK_GROUP": 1, "PRECISE": True,
               "BLOCK_T": 1, "BLOCK_K": 8, "BLOCK_G": 1, "SORT": False, "BLOCK_P": 16, "BLOCK_SE": 16}

MLA_FWD_SIGNATURE = {
    "Q": "*bf16", "Cache": "*bf16", "Out": "*bf16", "OPart": "*fp32", "LPart": "*fp32", "Mask": "*i32",
    "PastPtr": "*i32", **{s: "i32" for s in ("past_val", "T", "mask_words", "split_target", "min_chunk", "s_qh",
                                             "s_qt", "s_cs", "s_oh", "s_ot")}, "qk_scale": "fp32"}

CASES = [
    ("tree_build", "_beam_step_kernel",
     {"Prev": "*fp32", "Lp": "*fp32", "CandSlot": "*i64", "CandRank": "*i64", "OutScore": "*fp32",
      "OutFlat": "*i64", "M": "i32", "W": "i32", "K": "i32"}, {"BLOCK_C": 64, "BLOCK_K": 64}),
    ("tree_build", "_select_kernel",
     {"Beam": "*fp32", "BeamFlat": "*i64", "TopLp": "*fp32", "TopTok": "*i64", "Tokens": "*i64",
      "Depths": "*i64", "Parents": "*i64", "Scores": "*fp32", "Logprobs": "*fp32", "Ranks": "*i64",
      "L": "i32", "W": "i32", "K": "i32", "n": "i32"}, {"BLOCK_E": 64, "BLOCK_W": 64}),
    ("tree_build", "_fused_tree_kernel",
     FUSED_TREE_SIGNATURE, {"BLOCK_M": 512, "BLOCK_W": 64, "BLOCK_G": 1024}),
    ("tree_build", "_fused_tree_kernel",  # the widest beam it takes: 15 depths x 256
     FUSED_TREE_SIGNATURE, {"BLOCK_M": 2048, "BLOCK_W": 256, "BLOCK_G": 4096}),
    ("tree_walk", "_masks_kernel",
     {"Parents": "*i64", "Anc": "*i8", "Bits": "*i32", "T": "i32", "n_words": "i32", "L": "i32"},
     {"BLOCK_J": 128}),
    ("tree_walk", "_accept_kernel",
     {"Tokens": "*i64", "Parents": "*i64", "Depths": "*i64", "Choice": "*i64", "Path": "*i64", "A": "*i64",
      "T": "i32", "L": "i32"}, {"BLOCK_T": 128, "BLOCK_P": 16}),
    ("vocab_topk", "_vocab_topk_kernel",  # the lab pair's vocabulary, and the widest row it takes
     {"Logits": "*bf16", "TopLp": "*fp32", "TopTok": "*i64", "V": "i32", "K": "i32", "s_row": "i32"},
     {"BLOCK_V": 4096}),
    ("vocab_topk", "_vocab_topk_kernel",
     {"Logits": "*bf16", "TopLp": "*fp32", "TopTok": "*i64", "V": "i32", "K": "i32", "s_row": "i32"},
     {"BLOCK_V": 16384}),
    ("row_argmax", "_row_argmax_kernel",  # the lab pair's verify logits, and the widest row it takes
     {"Logits": "*bf16", "Out": "*i64", "V": "i32", "s_row": "i32"}, {"BLOCK": 1024, "N_BLOCKS": 4}),
    ("row_argmax", "_row_argmax_kernel",
     {"Logits": "*fp32", "Out": "*i64", "V": "i32", "s_row": "i32"}, {"BLOCK": 1024, "N_BLOCKS": 16}),
    ("fused_moe", "_route_kernel",  # Qwen3-30B-A3B's router: 128 experts, top-8
     {"Logits": "*bf16", "Weights": "*fp32", "Ids": "*i32", "ChunkCounts": "*i32", "T": "i32", "E": "i32",
      "s_row": "i32"},
     {"TOP_K": 8, "RENORM": True, "BLOCK_T": 16, "BLOCK_E": 128, "BLOCK_K": 8}),
    ("declared_route", "_declared_route_kernel",  # a Kimi EP8 rank: 384 experts, top-8, sigmoid, its places, int32
     {**ROUTE_SIGNATURE, "Logits": "*fp32", "Keys": "*i64", "Ids": "*fp32", "Local": "*i64", "Bias": "*fp32",
      "layer_term": "i64"},
     {**ROUTE_MODES, "HASH": True, "SIGMOID": True, "LOCAL": True, "BLOCK_E": 512}),
    ("declared_route", "_declared_route_kernel",  # the same in four warps (bench/declared_route.py --warps)
     {**ROUTE_SIGNATURE, "Logits": "*fp32", "Keys": "*i64", "Ids": "*fp32", "Local": "*i64", "Bias": "*fp32",
      "layer_term": "i64"},
     {**ROUTE_MODES, "HASH": True, "SIGMOID": True, "LOCAL": True, "BLOCK_E": 512}, {"num_warps": 4}),
    ("declared_route", "_declared_route_kernel",  # the EP8 rank's AR step: its token's pairs sorted as well, over
     {**ROUTE_SIGNATURE, "Logits": "*fp32", "Keys": "*i64", "Ids": "*fp32", "Local": "*i64", "Bias": "*fp32",
      "layer_term": "i64"},                       # its 48 places and the bucket of experts held elsewhere, 4 warps
     {**ROUTE_MODES, "HASH": True, "SIGMOID": True, "LOCAL": True, "BLOCK_E": 512, "BLOCK_T": 1, "SORT": True,
      "BLOCK_P": 16, "BLOCK_SE": 64}, {"num_warps": 4}),
    ("declared_route", "_declared_route_kernel",  # Qwen3-30B-A3B from a trace: given experts, softmax, bf16 logits
     {**ROUTE_SIGNATURE, "Logits": "*bf16", "Keys": "*bf16", "Ids": "*i64", "Local": "*bf16", "Bias": "*bf16"},
     {**ROUTE_MODES, "BLOCK_E": 128}),
    ("declared_route", "_declared_route_kernel",  # DeepSeek-V3's own router: 256 experts in 8 groups, 4 open
     {**ROUTE_SIGNATURE, "Logits": "*fp32", "Keys": "*fp32", "Ids": "*fp32", "Local": "*fp32"},
     {**ROUTE_MODES, "CHOOSE": True, "SIGMOID": True, "N_GROUP": 8, "TOPK_GROUP": 4, "BLOCK_E": 256, "BLOCK_G": 8}),
    ("fused_moe", "_route_align_kernel",  # routing and the sort in one program (AR's step)
     {"Logits": "*bf16", "Weights": "*fp32", "Ids": "*i32", "Counts": "*i32", "SlotExpert": "*i32",
      "SlotStart": "*i32", "SortedPairs": "*i32", "T": "i32", "P": "i32", "E": "i32", "S": "i32", "s_row": "i32"},
     {"TOP_K": 8, "RENORM": True, "BLOCK_T": 1, "BLOCK_K": 8, "BLOCK_P": 16, "BLOCK_E": 128, "BLOCK_S": 128}),
    ("fused_moe", "_scan_kernel",
     {"ChunkCounts": "*i32", "ChunkBase": "*i32", "Counts": "*i32", "SlotExpert": "*i32", "SlotStart": "*i32",
      "C": "i32", "E": "i32", "S": "i32"}, {"BLOCK_C": 64, "BLOCK_E": 128, "BLOCK_S": 128}),
    ("fused_moe", "_place_kernel",
     {"Ids": "*i32", "ChunkBase": "*i32", "SortedPairs": "*i32", "P": "i32", "CHUNK": "i32"},
     {"BLOCK_P": 128, "BLOCK_E": 128}),
    ("fused_moe", "_align_kernel",  # given ids, few: counted and sorted in one program (AR's step)
     {"Ids": "*i32", "Counts": "*i32", "SlotExpert": "*i32", "SlotStart": "*i32", "SortedPairs": "*i32",
      "P": "i32", "E": "i32", "S": "i32"}, {"BLOCK_P": 16, "BLOCK_E": 512, "BLOCK_S": 512}),
    ("fused_moe", "_count_kernel",
     {"Ids": "*i32", "ChunkCounts": "*i32", "P": "i32", "CHUNK": "i32"}, {"BLOCK_P": 128, "BLOCK_E": 128}),
    ("fused_moe", "_combine_kernel",
     {"Y": "*fp32", "Ids": "*i32", "Out": "*bf16", "H": "i32", "E": "i32", "s_yk": "i32", "s_yt": "i32",
      "s_ot": "i32"},
     {"TOP_K": 8, "ELSEWHERE": False, "SPLIT_K": 1, "BLOCK_H": 1024}),
    ("fused_moe", "_combine_kernel",  # an expert-parallel share: pairs held elsewhere left out, the down split
     {"Y": "*fp32", "Ids": "*i32", "Out": "*bf16", "H": "i32", "E": "i32", "s_yk": "i32", "s_yt": "i32",
      "s_ot": "i32"},
     {"TOP_K": 8, "ELSEWHERE": True, "SPLIT_K": 2, "BLOCK_H": 1024}),
    ("fused_moe", "_gate_up_kernel", GATE_UP_SIGNATURE,
     {"TOP_K": 8, "IEEE": False, **DENSE, "SPLIT_K": 1, "LAST_SPLIT_SUMS": False,
     "BLOCK_S": 128, "ONE_BLOCK": True, "BLOCK_M": 16,
      "BLOCK_N": 64, "BLOCK_K": 128, "COLS_FIRST": False}),
    ("fused_moe", "_gate_up_kernel",  # fp32 weights: IEEE dot products
     {**GATE_UP_SIGNATURE, "X": "*fp32", "W": "*fp32", "Scale": "*fp32", "Zero": "*fp32", "Hbuf": "*fp32"},
     {"TOP_K": 8, "IEEE": True, **DENSE, "SPLIT_K": 1, "LAST_SPLIT_SUMS": False,
     "BLOCK_S": 128, "ONE_BLOCK": False, "BLOCK_M": 64,
      "BLOCK_N": 32, "BLOCK_K": 64, "COLS_FIRST": False}),
    ("fused_moe", "_gate_up_kernel",  # INT4 experts, groups of 32: four a tile; bf16 pairs (inline assembly)
     {**GATE_UP_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {"TOP_K": 8, "IEEE": False, "INT4": True, "HAS_ZERO": False, "GROUP": 32, "PAIRED": True, "EVEN_K": True,
      "SPLIT_K": 1, "LAST_SPLIT_SUMS": False,
      "BLOCK_S": 64, "ONE_BLOCK": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
      "COLS_FIRST": False}),
    ("fused_moe", "_gate_up_kernel",  # a Kimi AR step: INT4, its K walk split in seven
     {**GATE_UP_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {"TOP_K": 8, "IEEE": False, "INT4": True, "HAS_ZERO": False, "GROUP": 32, "PAIRED": True, "EVEN_K": True,
      "SPLIT_K": 7, "LAST_SPLIT_SUMS": False,
      "BLOCK_S": 16, "ONE_BLOCK": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
      "COLS_FIRST": True}),
    ("fused_moe", "_gate_up_kernel",  # the same, its last split to finish summing the splits (LAST_SPLIT_SUMS)
     {**GATE_UP_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {"TOP_K": 8, "IEEE": False, "INT4": True, "HAS_ZERO": False, "GROUP": 32, "PAIRED": True, "EVEN_K": True,
      "SPLIT_K": 7, "LAST_SPLIT_SUMS": True, "BLOCK_S": 16, "ONE_BLOCK": True, "BLOCK_M": 16, "BLOCK_N": 64,
      "BLOCK_K": 128, "COLS_FIRST": True, "PDL": True}),  # and launched as a programmatic dependent
    ("fused_moe", "_silu_mul_kernel",
     {"Part": "*fp32", "Hbuf": "*bf16", "I": "i32", "s_pk": "i32", "s_pp": "i32", "s_ht": "i32"},
     {"SPLIT_K": 7, "BLOCK_I": 1024}),
    ("fused_moe", "_down_kernel",  # INT4 with zero points, a group as wide as the tile
     {**DOWN_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {"IEEE": False, "INT4": True, "HAS_ZERO": True, "GROUP": 128, "PAIRED": False, "EVEN_K": False,
      "SPLIT_K": 1, "BLOCK_S": 128, "ONE_BLOCK": False, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128,
      "COLS_FIRST": False}),
    ("fused_moe", "_down_kernel", DOWN_SIGNATURE,
     {"IEEE": False, **DENSE, "SPLIT_K": 1, "BLOCK_S": 128, "ONE_BLOCK": False, "BLOCK_M": 64, "BLOCK_N": 64,
      "BLOCK_K": 128, "COLS_FIRST": False}),
    ("fused_moe", "_down_kernel",  # a Kimi EP8 rank's AR step, its walk over I split in two (SPLIT_K_DOWN)
     {**DOWN_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {"IEEE": False, "INT4": True, "HAS_ZERO": False, "GROUP": 32, "PAIRED": True, "EVEN_K": True, "SPLIT_K": 2,
      "BLOCK_S": 16, "ONE_BLOCK": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "COLS_FIRST": True}),
    ("commit", "_advance_kernel", ADVANCE_SIGNATURE, {"BLOCK": 16}),
    ("auto_budget", "_auto_kernel", AUTO_SIGNATURE,
     {"J": 8, "NB": 8, "BLOCK_P": 16, "BLOCK_C": 1024, "BLOCK_J": 8, "BLOCK_R": 16}),
    ("batch_invariant", "_linear_kernel", LINEAR_SIGNATURE,  # the GPU's tiles; one pass straight to bf16
     {"HAS_BIAS": False, "IEEE": False, "ORDERED": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
    ("batch_invariant", "_linear_kernel", {**LINEAR_SIGNATURE, "X": "*fp32", "W": "*fp32", "Bias": "*fp32",
                                           "Y": "*fp32"},  # fp32: IEEE dot products (and a split's partials)
     {"HAS_BIAS": True, "IEEE": True, "ORDERED": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
    ("batch_invariant", "_sum_splits_kernel",
     {"Part": "*fp32", "Bias": "*bf16", "Y": "*bf16", "MN": "i32", "N": "i32", "splits": "i32"},
     {"HAS_BIAS": True, "BLOCK": 1024}),
    ("batch_invariant", "_rms_norm_kernel",
     {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "N": "i32", "s_x": "i32", "s_y": "i32", "eps": "fp32"},
     {"BLOCK": 1024}),
    ("batch_invariant", "_chain_attn_kernel", CHAIN_ATTN_SIGNATURE,  # a device past_len (graphs), SmolLM2's heads
     {"G": 3, "BLOCK_G": 16, "BLOCK_N": 64, "HEAD_D": 64, "CHUNK": 512, "SPLIT": True, "PAST_ON_DEVICE": True,
      "IEEE": False, "ORDERED": False}),
    ("batch_invariant", "_chain_attn_kernel", CHAIN_ATTN_SIGNATURE,  # a host past_len, wide heads, one chunk
     {"G": 4, "BLOCK_G": 16, "BLOCK_N": 64, "HEAD_D": 128, "CHUNK": 512, "SPLIT": False, "PAST_ON_DEVICE": False,
      "IEEE": False, "ORDERED": False}),
    ("batch_invariant", "_chain_merge_kernel",
     {"Part": "*fp32", "PartM": "*fp32", "PartL": "*fp32", "Out": "*bf16", "ChainLen": "*i32", "PastPtr": "*i64",
      "past_val": "i32", "s_oh": "i32", "s_ot": "i32", "n_chunks": "i32"},
     {"G": 3, "BLOCK_G": 16, "HEAD_D": 64, "CHUNK": 512, "PAST_ON_DEVICE": True}),
    ("mla_attention", "_mla_fwd", MLA_FWD_SIGNATURE,  # Kimi K2's widths, the 64-row tiles of a long past
     {"H": 64, "C": 512, "R": 64, "C_PAD": 512, "R_PAD": 64, "BLOCK_M": 64, "BLOCK_N": 64, "SINGLE": False,
      "PAST_FROM_PTR": True, "IEEE": False}, {"num_warps": 8, "num_stages": 2}),
    ("mla_attention", "_mla_fwd", MLA_FWD_SIGNATURE,  # the launch default for a 512-wide latent (8 TP heads)
     {"H": 8, "C": 512, "R": 64, "C_PAD": 512, "R_PAD": 64, "BLOCK_M": 32, "BLOCK_N": 64, "SINGLE": False,
      "PAST_FROM_PTR": True, "IEEE": False}),
    ("mla_attention", "_mla_fwd", {**MLA_FWD_SIGNATURE, "Q": "*fp32", "Cache": "*fp32", "Out": "*fp32"},
     {"H": 4, "C": 24, "R": 8, "C_PAD": 32, "R_PAD": 16, "BLOCK_M": 64, "BLOCK_N": 64, "SINGLE": True,
      "PAST_FROM_PTR": False, "IEEE": True}),  # padded widths, fp32
    ("tree_attention", "_tree_attn_fwd",  # the 8B's AR step: 4 query heads a KV head, head width 128, split
     {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "OPart": "*fp32", "LPart": "*fp32", "Mask": "*i32",
      "PastPtr": "*i64", **{s: "i32" for s in ("past_val", "T", "mask_words", "num_splits", "split_target",
                                               "min_chunk", "s_qh", "s_qt", "s_kh", "s_ks", "s_vh", "s_vs", "s_oh",
                                               "s_ot")}, "qk_scale": "fp32"},
     {"G": 4, "HEAD_D": 128, "BLOCK_M": 16, "BLOCK_N": 64, "SINGLE": False, "PAST_FROM_PTR": True, "IEEE": False},
     {"num_warps": 4, "num_stages": 4}),
    ("tree_attention", "_tree_attn_merge",
     {"OPart": "*fp32", "LPart": "*fp32", "Out": "*bf16", "T": "i32", "Hq": "i32", "s_oh": "i32", "s_ot": "i32",
      "num_splits": "i32"}, {"HEAD_D": 128, "SPLIT_PAD": 32}),
    ("mla_attention", "_mla_merge",
     {"OPart": "*fp32", "LPart": "*fp32", "Out": "*bf16", "M": "i32", "s_oh": "i32", "s_ot": "i32",
      "num_splits": "i32"}, {"H": 64, "C": 512, "BLOCK_R": 16, "BLOCK_C": 32, "SPLIT_PAD": 32}),
    ("skinny_gemm", "_skinny_gemm_kernel",  # an AR step's o_proj of a Kimi layer: 7168 x 8192, bf16
     {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "T": "i32", "N": "i32", "K": "i32", "s_xt": "i32", "s_wn": "i32",
      "s_yt": "i32"}, {"BLOCK_T": 16, "BLOCK_N": 32, "BLOCK_K": 512, "STAGES": 4}, {"num_warps": 4}),
]

# the kernels that take PDL (kernels/pdl.py: a programmatic dependent launch's wait first): off unless a case says
PDL_KERNELS = {"_route_kernel", "_count_kernel", "_scan_kernel", "_place_kernel", "_route_align_kernel",
               "_align_kernel", "_gate_up_kernel", "_silu_mul_kernel", "_down_kernel", "_combine_kernel",
               "_declared_route_kernel", "_mla_fwd", "_mla_merge", "_tree_attn_fwd", "_tree_attn_merge"}
for _case in CASES:
    if _case[1] in PDL_KERNELS:
        _case[3].setdefault("PDL", False)

FULL_ENV = "DDTREE_LAB_FULL_COMPILE"


def _selected_cases() -> list[int]:
    """Indices into CASES: all of them when opted in, else the first case of each kernel."""
    if os.environ.get(FULL_ENV) == "1":
        return list(range(len(CASES)))
    seen, picked = set(), []
    for i, (module, kernel, *_rest) in enumerate(CASES):
        if (module, kernel) not in seen:
            seen.add((module, kernel))
            picked.append(i)
    return picked


SELECTED = _selected_cases()

COMPILE_ALL = r"""
import importlib.util, json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    print(json.dumps({"skip": "this triton has no ASTSource/GPUTarget compile API"})); sys.exit(0)
kernels_dir, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, kernels_dir)  # a kernel file may import its neighbours' helpers as lone files
results = {}
for i, (module, kernel, signature, constexprs, *launch) in enumerate(cases):
    try:
        spec = importlib.util.spec_from_file_location("_compile_" + module, f"{kernels_dir}/{module}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        src = ASTSource(fn=getattr(mod, kernel), signature={**signature, **{k: "constexpr" for k in constexprs}},
                        constexprs=constexprs)
        options = launch[0] if launch else {}  # a case's launch options (num_warps, num_stages), if it has any
        results[i] = len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"])
    except Exception as e:  # reported per case
        results[i] = f"{type(e).__name__}: {e}"[:2000]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cases = [CASES[i] for i in SELECTED]
    out = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(KERNELS), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600 if len(cases) < len(CASES) else 1800)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(results["skip"])
    return {SELECTED[int(k)]: v for k, v in results.items()}  # json keys are strings


IDS = [f"{CASES[i][1]}-{'-'.join(map(str, CASES[i][3].values()))}" for i in SELECTED]


def test_default_set_covers_every_kernel():
    kernels = {(c[0], c[1]) for c in CASES}
    assert {(CASES[i][0], CASES[i][1]) for i in SELECTED} == kernels


@pytest.mark.parametrize("case", SELECTED, ids=IDS)
def test_kernel_compiles_for_sm90(compiled, case):
    result = compiled[case]
    assert isinstance(result, int) and result > 1000, result  # the cubin's size, or the compiler's error


# A K loop's loads, as compiled for a real launch (pointers 16-byte aligned, sizes and strides divisible by 16, as
# Triton specialises them at launch): the pipeliner streams into shared memory, ahead of their step, the loads it can
# copy asynchronously (4 bytes a lane at least); any other load in the loop is a plain one, which its step waits out.
# In the INT4 expert loops the scales are the candidates: aligned as `_scale_groups` declares them, they stream
# where a lane holds two or more (launch_config's 64 columns, 4 groups a step). A plain load whose value only leaves
# the step (the loop's yield) would not make the step wait; one used in it does.
LOOP_LOADS = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernels_dir, kernel, signature, constexprs, unaligned = sys.argv[1], sys.argv[2], *map(json.loads, sys.argv[3:6])
sys.path.insert(0, kernels_dir)
spec = importlib.util.spec_from_file_location("_loop_loads", f"{kernels_dir}/fused_moe.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
fn = getattr(mod, kernel)
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in signature if n not in unaligned}
src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs,
                attrs=attrs)
print(json.dumps(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, num_stages=3)).asm["ttgir"]))
"""


def plain_loads_used_in_their_step(ttgir: str) -> list[str]:
    """The `tt.load` results inside the outermost scf.for's body that the body uses other than in its yield."""
    lines = ttgir.splitlines()
    start = next(i for i, ln in enumerate(lines) if "scf.for" in ln)
    depth, body = 0, []
    for ln in lines[start:]:
        depth += ln.count("{") - ln.count("}")
        body.append(ln)
        if depth <= 0 and len(body) > 1:
            break
    used = []
    for ln in body:
        if " = tt.load " in ln:
            name = ln.split("=")[0].strip()
            uses = [u for u in body if u is not ln and (name + " " in u or name + "," in u or name + ")" in u
                                                        or name + ":" in u)]
            if any("scf.yield" not in u for u in uses):
                used.append(name)
    return used


INT4_LOOP = {"IEEE": False, "INT4": True, "HAS_ZERO": False, "GROUP": 32, "PAIRED": True, "EVEN_K": True,
             "ONE_BLOCK": True, "BLOCK_M": 16, "BLOCK_K": 128, "PDL": False}


@pytest.mark.parametrize("kernel, signature, constexprs", [
    ("_gate_up_kernel", {**GATE_UP_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {**INT4_LOOP, "TOP_K": 8, "SPLIT_K": 7, "LAST_SPLIT_SUMS": False, "BLOCK_S": 16, "BLOCK_N": 64,
      "COLS_FIRST": True}),
    ("_gate_up_kernel", {**GATE_UP_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {**INT4_LOOP, "TOP_K": 8, "SPLIT_K": 1, "LAST_SPLIT_SUMS": False, "BLOCK_S": 128, "BLOCK_N": 64,
      "COLS_FIRST": False}),
    ("_down_kernel", {**DOWN_SIGNATURE, "W": "*i32", "Zero": "*i32"},
     {**INT4_LOOP, "SPLIT_K": 1, "BLOCK_S": 128, "BLOCK_N": 64, "COLS_FIRST": False}),
], ids=["ar_gate_up_split_k", "tree_gate_up", "down"])
def test_an_int4_k_step_waits_on_no_plain_load_of_its_own(kernel, signature, constexprs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", LOOP_LOADS, str(KERNELS), kernel, json.dumps(signature),
                          json.dumps(constexprs), json.dumps(["S", "E"])], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ttgir = json.loads(out.stdout.strip().splitlines()[-1])
    assert "async_copy_global_to_local" in ttgir  # the packed words and A's tile stream ahead
    assert plain_loads_used_in_their_step(ttgir) == []


# A kernel's PTX, compiled for sm_90 as a case of CASES describes it
PTX_OF = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernels_dir, module, kernel = sys.argv[1:4]
signature, constexprs = map(json.loads, sys.argv[4:6])
sys.path.insert(0, kernels_dir)
spec = importlib.util.spec_from_file_location("_ptx_of", f"{kernels_dir}/{module}.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
src = ASTSource(fn=getattr(mod, kernel), signature={**signature, **{k: "constexpr" for k in constexprs}},
                constexprs=constexprs)
print(json.dumps(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]))
"""


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("module, kernel", [("fused_moe", "_combine_kernel"), ("mla_attention", "_mla_merge"),
                                            ("tree_attention", "_tree_attn_merge")])
def test_a_programmatic_dependent_waits_before_it_touches_memory_or_exits(module, kernel, pdl):
    """With PDL (kernels/pdl.py) every program's first memory access, and its exit, come after
    `griddepcontrol.wait`, and it lets the next launch start; without it neither instruction is there."""
    _, _, signature, constexprs, *_ = next(c for c in CASES if c[0] == module and c[1] == kernel)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", PTX_OF, str(KERNELS), module, kernel, json.dumps(signature),
                          json.dumps({**constexprs, "PDL": pdl})], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    body = [ln.strip() for ln in json.loads(out.stdout.strip().splitlines()[-1]).splitlines()]
    touches = [i for i, ln in enumerate(body) if any(op in ln for op in ("ld.global", "st.global", "atom.", "ret;"))]
    waits = [i for i, ln in enumerate(body) if "griddepcontrol.wait" in ln]
    starts = [i for i, ln in enumerate(body) if "griddepcontrol.launch_dependents" in ln]
    if pdl:
        assert waits and starts and waits[0] < touches[0] and waits[0] < starts[0]
    else:
        assert not waits and not starts
