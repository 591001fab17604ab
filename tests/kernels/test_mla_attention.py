"""MLA tree-attention Triton kernel (absorbed form) vs the dense torch reference.

Without a GPU the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set before the kernels
are imported, which this module does itself. Interpreter runs use fp32 and fp16 (it has no bf16 arithmetic);
bf16 at the real sizes (C = 512, R = 64) runs in the GPU-only tests.
"""
import itertools
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels import mla_attention as mla  # noqa: E402
from ddtree_lab.kernels import tree_attention as ta  # noqa: E402
from ddtree_lab.tree import ancestor_matrix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_parents(T, gen, wide=False):
    """parents [T] int64, parents[0] = -1, parents[i] uniform in [0, i) (or in [0, min(i, 4)): bushy)."""
    i = torch.arange(T)
    hi = i.clamp(max=4) if wide else i
    p = (torch.rand(T, generator=gen) * hi).floor().long()
    p[0] = -1
    return p


def make_anc(T, kind, gen):
    if kind == "causal":
        return ta.causal_matrix(T).to(DEVICE)
    return ancestor_matrix(random_parents(T, gen, wide=(kind == "wide"))).to(DEVICE)


def make_inputs(H, T, past, C, R, dtype, gen, slack=5):
    """q [H, T, C+R], cache [past+T+slack, C+R]; the latent RMS-sized like the model's (unit scale)."""
    q = torch.randn(H, T, C + R, generator=gen).to(dtype)
    cache = torch.randn(past + T + slack, C + R, generator=gen).to(dtype)
    return q.to(DEVICE), cache.to(DEVICE)


def scale_of(C, R):
    return (C + R) ** -0.5


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert err < tol, f"max abs err {err} >= {tol}"


# ---------------------------------------------------------------- the reference itself

def test_reference_is_gqa_attention_with_one_kv_head():
    # the absorbed form is one KV head whose key is the whole row and whose value is the latent part
    gen = torch.Generator().manual_seed(0)
    H, T, past, C, R = 4, 9, 30, 32, 16
    q, cache = make_inputs(H, T, past, C, R, torch.float32, gen)
    anc = make_anc(T, "tree", gen)
    ref = ta.tree_attention_reference(q, cache[None], cache[None, :, :C], past, anc, scale=0.2)
    out = mla.mla_tree_attention_reference(q, cache, past, anc, C, 0.2)
    assert out.shape == (H, T, C)
    torch.testing.assert_close(out, ref)


# ---------------------------------------------------------------- interpreter / any-device matrix

HEADS = [1, 4, 16]
TS = [1, 5, 33, 70]
PASTS = [0, 7, 200]
SIZES = [(32, 16), (64, 32), (24, 8)]  # (C, R); 24 + 8 pads both to tiles of 32 and 16
CASES = []  # every (H, T, past); sizes, dtype and mask kind rotate so each T meets each of them
for (a, H), (b, T), (c, past) in itertools.product(enumerate(HEADS), enumerate(TS), enumerate(PASTS)):
    C, R = SIZES[(a + b + c) % 3]
    dtype = (torch.float32, torch.float16)[(a + 2 * c + b // 2) % 2]
    kind = ("tree", "causal", "wide")[(a + 2 * b + c) % 3]
    CASES.append((H, T, past, C, R, dtype, kind))


@pytest.mark.parametrize("H,T,past,C,R,dtype,kind", CASES)
def test_mla_matches_reference(H, T, past, C, R, dtype, kind):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((H, T, past, C, R, kind)).encode()))
    q, cache = make_inputs(H, T, past, C, R, dtype, gen)
    anc = make_anc(T, kind, gen)
    bits = ta.pack_mask(anc)
    ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, scale_of(C, R))
    out = mla.mla_tree_attention(q, cache, past, bits, C, scale_of(C, R))
    check(out, ref, dtype)
    # a device past_len (the graph-safe path) gives the same bits as the int
    past_t = torch.tensor(past, dtype=torch.int32, device=DEVICE)
    out_t = mla.mla_tree_attention(q, cache, past_t, bits, C, scale_of(C, R), max_past_len=past)
    assert torch.equal(out_t, out)


@pytest.mark.parametrize("C,R", [(64, 32), (24, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_splits_on_and_off_agree(C, R, dtype):
    # one split (no merge), several (more than the context has blocks leaves empty ones), and wider blocks
    gen = torch.Generator().manual_seed(C * 7 + R)
    H, T, past = 4, 33, 200
    q, cache = make_inputs(H, T, past, C, R, dtype, gen)
    anc = make_anc(T, "tree", gen)
    bits = ta.pack_mask(anc)
    ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, scale_of(C, R))
    one = mla.mla_tree_attention(q, cache, past, bits, C, scale_of(C, R), config=dict(num_splits=1))
    check(one, ref, dtype)
    for cfg in (dict(num_splits=3), dict(num_splits=9, block_n=32), dict(num_splits=2, block_n=128, block_m=16),
                dict(num_splits=5, merge_rows=16, merge_cols=16)):
        out = mla.mla_tree_attention(q, cache, past, bits, C, scale_of(C, R), config=cfg)
        check(out, ref, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-3  # the same sums in another order
        assert (out.float() - one.float()).abs().max().item() < tol, cfg


@pytest.mark.parametrize("past_dtype,shape", [(torch.int32, ()), (torch.int64, (1,))])
def test_device_past_len_and_a_larger_bound(past_dtype, shape):
    gen = torch.Generator().manual_seed(7)
    H, T, past, C, R = 4, 21, 150, 32, 16
    q, cache = make_inputs(H, T, past, C, R, torch.float32, gen, slack=400)
    anc = make_anc(T, "wide", gen)
    bits = ta.pack_mask(anc)
    past_t = torch.full(shape, past, dtype=past_dtype, device=DEVICE)
    ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, 0.25)
    # the split count follows the GPU's SMs and a chunk's least length unless pinned: pinned, every device splits
    split = dict(split_target=8, min_chunk=64)
    for bound in (None, past, past + 300):  # None: the whole cache's room (S_max - T)
        cfg = mla.launch_config(T, H, C, R, bound if bound is not None else cache.shape[0] - T, q.device, split,
                                dtype=q.dtype)
        out = mla.mla_tree_attention(q, cache, past_t, bits, C, 0.25, max_past_len=bound, config=split)
        check(out, ref, torch.float32)
    assert cfg["num_splits"] > 1  # the larger bound launches splits the past leaves empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_result_does_not_depend_on_cache_size(dtype):
    # the same past in caches of different sizes launches different split counts, yet gives the same bits
    gen = torch.Generator().manual_seed(11)
    H, T, past, C, R = 4, 17, 300, 32, 16
    q, cache = make_inputs(H, T, past, C, R, dtype, gen, slack=0)
    bits = ta.pack_mask(make_anc(T, "tree", gen))
    past_t = torch.tensor(past, dtype=torch.int32, device=DEVICE)
    outs, launched = [], set()
    for extra in (0, 700, 3000):
        pad = torch.randn(extra, C + R, generator=gen).to(dtype).to(DEVICE)  # slots the kernel must not read
        big = torch.cat([cache, pad], 0)
        cfg = mla.launch_config(T, H, C, R, big.shape[0] - T, q.device, dict(split_target=8), dtype)
        launched.add(cfg["num_splits"])
        outs.append(mla.mla_tree_attention(q, big, past_t, bits, C, 0.3, config=dict(split_target=8)))
    assert len(launched) > 1
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    check(outs[0], mla.mla_tree_attention_reference(q, cache, past, ta.unpack_mask(bits, T), C, 0.3), dtype)


def test_strided_cache_and_queries():
    # the cache as one layer of [L, S, C+R] and as a column of [S, 2, C+R] (row stride 2(C+R)); q as the
    # transpose of a [T, H, C+R] projection
    gen = torch.Generator().manual_seed(3)
    L, S_max, H, T, C, R = 3, 90, 4, 9, 32, 16
    layers = torch.randn(L, S_max, C + R, generator=gen).to(DEVICE)
    pairs = torch.randn(S_max, 2, C + R, generator=gen).to(DEVICE)
    q = torch.randn(T, H, C + R, generator=gen).to(DEVICE).transpose(0, 1)  # [H, T, C+R], strides (C+R, H(C+R), 1)
    anc = make_anc(T, "tree", gen)
    for cache in (layers[1], pairs[:, 1]):
        for past in (0, 60):
            ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, 0.2)
            out = mla.mla_tree_attention(q, cache, past, ta.pack_mask(anc), C, 0.2)
            check(out, ref, torch.float32)
            assert out.is_contiguous()


def test_a_row_that_sees_nothing_gives_zero():
    gen = torch.Generator().manual_seed(4)
    H, T, C, R = 4, 9, 24, 8
    q, cache = make_inputs(H, T, 0, C, R, torch.float32, gen)
    anc = make_anc(T, "tree", gen)
    anc[4] = False
    out = mla.mla_tree_attention(q, cache, 0, ta.pack_mask(anc), C, 0.2)
    assert torch.isfinite(out).all() and (out[:, 4] == 0).all()
    check(out, mla.mla_tree_attention_reference(q, cache, 0, anc, C, 0.2), torch.float32)


def test_bad_arguments_are_named():
    gen = torch.Generator().manual_seed(5)
    H, T, C, R = 2, 5, 32, 16
    q, cache = make_inputs(H, T, 10, C, R, torch.float32, gen)
    bits = ta.pack_mask(make_anc(T, "causal", gen))
    cases = [
        (dict(cache=cache[:, :40]), "q's last dim 48 differs from the cache row's 40"),
        (dict(latent_dim=48), "latent_dim=48 must leave RoPE dims"),
        (dict(cache=cache.half()), "must share a float32/float16/bfloat16 dtype"),
        (dict(mask_bits=bits[:4]), r"mask_bits must be int32 \[T, >= ceil\(T/32\)\]"),
        (dict(mask_bits=bits.long()), "mask_bits must be int32"),
        (dict(past_len=20), "past_len=20 with T=5 needs 25 cache slots; the cache has 20"),
        (dict(scale=0.0), "scale=0.0 must be positive"),
        (dict(config=dict(block_n=48)), "block_n=48 must be a power of two"),
    ]
    base = dict(q=q, cache=cache, past_len=10, mask_bits=bits, latent_dim=C, scale=0.2)
    for change, message in cases:
        args = {**base, **change}
        config = args.pop("config", None)
        with pytest.raises(ValueError, match=message):
            mla.mla_tree_attention(*args.values(), config=config)
    with pytest.raises(ValueError, match="num_splits=2 leaves chunks undone"):
        mla.launch_config(8, 4, 64, 32, 2000, torch.device("cpu"), dict(num_splits=2, split_target=8))


def test_gpu_launch_config_fits_hopper(monkeypatch):
    # the compiled path's choices, read without a GPU: the real sizes' accumulator and shared memory fit
    monkeypatch.setattr(mla, "_interpret", lambda: False)
    sms = 132  # an H100's or H200's
    monkeypatch.setattr(mla, "_sm_count", lambda device: sms)
    cpu = torch.device("cpu")
    for H, T in ((64, 1), (64, 17), (64, 1025), (8, 1), (8, 129), (16, 70)):
        for dtype in (torch.bfloat16, torch.float32):
            cfg = mla.launch_config(T, H, 512, 64, 4096, cpu, dtype=dtype)
            elt = 4 if dtype == torch.float32 else 2
            assert mla.shared_bytes(cfg["block_m"], cfg["block_n"], cfg["num_stages"], 512, 64, elt) <= mla.SMEM_BUDGET
            assert cfg["block_m"] * 512 <= mla.ACC_REGS * 32 * cfg["num_warps"]
    real = mla.launch_config(1025, 64, 512, 64, 4096, cpu)
    assert (real["block_m"], real["block_n"], real["num_warps"], real["num_splits"]) == (32, 64, 4, 1)  # swept
    assert mla.launch_config(9, 8, 512, 64, 4096, cpu)["block_m"] == 16  # few (query, head) rows: short tiles
    one = mla.launch_config(1, 64, 512, 64, 4096, cpu)
    assert (one["min_chunk"], one["num_splits"]) == (128, 32)  # an AR step splits its context finely
    assert (one["merge_rows"], one["merge_cols"]) == (16, 32)  # swept: the merge's chain spread over 64 programs
    tree = mla.launch_config(17, 64, 512, 64, 4096, cpu)
    assert (tree["min_chunk"], tree["num_splits"]) == (512, 7)  # 34 row tiles: 7 splits fill two waves, 8 a third
    for T, H, past in ((17, 64, 16384), (9, 64, 32768), (17, 64, 32768), (65, 64, 32768), (5, 64, 32768)):
        cfg = mla.launch_config(T, H, 512, 64, past, cpu)  # never more programs than two waves of one an SM
        programs = -(-T * H // cfg["block_m"]) * cfg["num_splits"]
        assert sms < programs <= 2 * sms, (T, H, past, cfg)
    small = mla.launch_config(33, 4, 64, 32, 4096, cpu)
    assert (small["block_m"], small["block_n"], small["num_warps"]) == (128, 64, 4)
    # 64-row tiles where the sweeps timed them faster: 320 (query, head) rows or more, trees of up to 65 queries,
    # over a long past
    tiles = lambda T, H, past: tuple(mla.launch_config(T, H, 512, 64, past, cpu)[k]
                                     for k in ("block_m", "block_n", "num_warps", "num_stages"))
    for T, H in ((5, 64), (17, 64), (65, 64), (65, 8)):
        assert tiles(T, H, 32768) == (64, 64, 8, 2)
        assert tiles(T, H, 8192)[:3] == ((16 if T * H < 256 else 32), 64, 4)  # a short past keeps 32 rows
    for T, H in ((1, 64), (33, 8), (129, 64), (129, 8)):  # too few rows to share a block, or a long tree
        assert tiles(T, H, 32768)[0] in (16, 32)


# ---------------------------------------------------------------- GPU only

@gpu_only
@pytest.mark.parametrize("H", [64, 8])
@pytest.mark.parametrize("T", [1, 17, 129, 1025])
def test_gpu_real_sizes_bf16(H, T):
    gen = torch.Generator().manual_seed(H * 1000 + T)
    past, C, R = 4096, 512, 64
    q, cache = make_inputs(H, T, past, C, R, torch.bfloat16, gen)
    anc = make_anc(T, "wide" if T % 2 else "tree", gen)
    bits = ta.pack_mask(anc)
    scale = 192 ** -0.5  # the real model's (qk_nope + qk_rope)^-1/2
    ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, scale)
    check(mla.mla_tree_attention(q, cache, past, bits, C, scale), ref, torch.bfloat16)
    past_t = torch.tensor(past, device=DEVICE)
    check(mla.mla_tree_attention(q, cache, past_t, bits, C, scale), ref, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("H, T", [(64, 17), (8, 65)])
def test_gpu_long_past_takes_64_row_tiles(H, T):
    # launch_config's 64-row tiles over a 32k past: the warpgroup-MMA tiles, against the reference
    gen = torch.Generator().manual_seed(H + T)
    past, C, R = mla.WIDE_PAST, 512, 64
    q, cache = make_inputs(H, T, past, C, R, torch.bfloat16, gen)
    assert mla.launch_config(T, H, C, R, past, q.device)["block_m"] == 64
    anc = make_anc(T, "tree", gen)
    bits = ta.pack_mask(anc)
    scale = 192 ** -0.5  # the real model's (qk_nope + qk_rope)^-1/2
    ref = mla.mla_tree_attention_reference(q, cache, past, anc, C, scale)
    check(mla.mla_tree_attention(q, cache, past, bits, C, scale), ref, torch.bfloat16)
    check(mla.mla_tree_attention(q, cache, torch.tensor(past, device=DEVICE), bits, C, scale), ref, torch.bfloat16)


@gpu_only
def test_gpu_cuda_graph_replay_new_past_len():
    # capture once with a device past_len, replay with others: no host value is baked in
    gen = torch.Generator().manual_seed(5)
    H, T, C, R, S_max = 16, 33, 512, 64, 3000
    q, cache = make_inputs(H, T, S_max - T - 5, C, R, torch.bfloat16, gen)
    anc = make_anc(T, "tree", gen)
    bits = ta.pack_mask(anc)
    past_t = torch.tensor(100, device=DEVICE)
    mla.mla_tree_attention(q, cache, past_t, bits, C, 0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla.mla_tree_attention(q, cache, past_t, bits, C, 0.1)
    for past in (100, 2900, 17, 0):
        past_t.fill_(past)
        graph.replay()
        torch.cuda.synchronize()
        check(out, mla.mla_tree_attention_reference(q, cache, past, anc, C, 0.1), torch.bfloat16)


@pytest.mark.parametrize("T", [1, 9])
def test_programmatic_dependent_launches_change_no_bit(T):
    """{"pdl": True} (kernels/pdl.py): on a GPU the attention and its merge launch as programmatic dependents,
    eagerly and replayed from a CUDA graph after a kernel that writes the queries: the same bits as plain launches.
    Under the interpreter (the CPU twin) the option is dropped and the result is the same too."""
    from ddtree_lab.testing import assert_replays_equal

    gen = torch.Generator().manual_seed(T)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, cache = make_inputs(8, T, 300, 64, 16, dtype, gen)
    bits = ta.pack_mask(make_anc(T, "tree", gen))
    split = {"num_splits": 4, "min_chunk": 64}  # the merge runs

    def call(pdl):
        q2 = q * 1.0  # a kernel before the attention, writing what it reads
        return mla.mla_tree_attention(q2, cache, 300, bits, 64, scale_of(64, 16),
                                      config=dict(split, pdl=True) if pdl else split)

    want = call(False)
    assert torch.equal(call(True), want)
    if DEVICE == "cuda":
        assert_replays_equal(lambda: call(True), want)
