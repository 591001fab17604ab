"""Tree-attention Triton kernel vs the dense torch reference.

Without a GPU the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set before
the kernels are imported (decorated), which this module does itself. Interpreter runs use fp32
and fp16 (it has no bf16 arithmetic); bf16 and large shapes run in the GPU-only tests.
"""
import itertools
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels import tree_attention as ta  # noqa: E402
from ddtree_lab.tree import ancestor_matrix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_parents(T, gen, wide=False):
    """parents [T] int64, parents[0] = -1, parents[i] uniform in [0, i) (or in [0, min(i, 4)))."""
    i = torch.arange(T)
    hi = i.clamp(max=4) if wide else i
    p = (torch.rand(T, generator=gen) * hi).floor().long()
    p[0] = -1
    return p


def naive_ancestors(parents):
    T = parents.shape[0]
    anc = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parents[j])
    return anc


def make_inputs(Hq, Hkv, D, T, past, dtype, gen, slack=5):
    S_max = past + T + slack
    q = torch.randn(Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(Hkv, S_max, D, generator=gen).to(dtype)
    v = torch.randn(Hkv, S_max, D, generator=gen).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    tol = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert err < tol, f"max abs err {err} >= {tol}"


# ---------------------------------------------------------------- helpers

def test_ancestor_matrix_matches_walk():
    gen = torch.Generator().manual_seed(0)
    for T in (1, 2, 5, 33, 130, 300):
        for wide in (False, True):
            par = random_parents(T, gen, wide)
            assert torch.equal(ancestor_matrix(par), naive_ancestors(par))
    chain = torch.arange(-1, 299)  # depth T-1: the worst case for pointer doubling
    assert torch.equal(ancestor_matrix(chain), ta.causal_matrix(300))


def test_pack_mask_roundtrip_and_bit_layout():
    gen = torch.Generator().manual_seed(1)
    for T in (1, 31, 32, 33, 64, 130):
        anc = torch.rand(T, T, generator=gen) < 0.5
        bits = ta.pack_mask(anc)
        assert bits.dtype == torch.int32 and bits.shape == (T, (T + 31) // 32)
        assert torch.equal(ta.unpack_mask(bits, T), anc)
    anc = torch.zeros(1, 40, dtype=torch.bool)
    anc[0, 31] = anc[0, 32] = True  # bit 31 of word 0 (sign bit), bit 0 of word 1
    assert ta.pack_mask(anc).tolist() == [[-(2**31), 1]]


def test_pack_mask_in_row_chunks_equals_whole(monkeypatch):
    """A long prefill's mask packs a few rows at a time (bounded staging): the same words as packed whole."""
    gen = torch.Generator().manual_seed(2)
    anc = torch.rand(100, 100, generator=gen) < 0.5
    whole = ta.pack_mask(anc)
    for rows in (1, 7, 32, 99):
        assert torch.equal(ta.pack_mask(anc, rows_at_once=rows), whole), rows
    monkeypatch.setattr(ta, "PACK_STAGING", 4 * 128)  # the default chunking: 4 rows of 4 words
    assert torch.equal(ta.pack_mask(anc), whole)


# ---------------------------------------------------------------- interpreter / any-device matrix

HEADS = [(4, 4), (8, 2), (12, 4)]
TS = [1, 5, 33, 130]
PASTS = [0, 7, 300]
CASES = []  # every (heads, T, past); D, dtype and mask kind rotate so each T meets each of them
for (a, (hq, hkv)), (b, T), (c, past) in itertools.product(
        enumerate(HEADS), enumerate(TS), enumerate(PASTS)):
    D = (64, 128)[(a + b + c) % 2]
    dtype = (torch.float32, torch.float16)[(a + 2 * c + b // 2) % 2]
    kind = ("tree", "causal", "wide")[(a + c) % 3]
    CASES.append((hq, hkv, D, T, past, dtype, kind))


@pytest.mark.parametrize("Hq,Hkv,D,T,past,dtype,kind", CASES)
def test_tree_attention_matches_reference(Hq, Hkv, D, T, past, dtype, kind):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((Hq, Hkv, D, T, past, kind)).encode()))
    q, k, v = make_inputs(Hq, Hkv, D, T, past, dtype, gen)
    if kind == "causal":
        anc = ta.causal_matrix(T)
    else:
        anc = ancestor_matrix(random_parents(T, gen, wide=(kind == "wide")))
    anc = anc.to(DEVICE)
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    # int past_len, then a device tensor (graph-safe path)
    check(ta.tree_attention(q, k, v, past, ta.pack_mask(anc)), ref, dtype)
    past_t = torch.tensor(past, dtype=torch.int32, device=DEVICE)
    check(ta.tree_attention(q, k, v, past_t, ta.pack_mask(anc)), ref, dtype)


@pytest.mark.parametrize("splits,block_n", [(1, 128), (2, 64), (5, 32), (16, 64)])
def test_split_and_tile_variants(splits, block_n):
    # more splits than context blocks leaves empty splits; block_n 64/128 exercise multi-word masks
    gen = torch.Generator().manual_seed(splits * 1000 + block_n)
    Hq, Hkv, D, T, past = 8, 2, 64, 70, 200
    q, k, v = make_inputs(Hq, Hkv, D, T, past, torch.float32, gen)
    anc = ancestor_matrix(random_parents(T, gen)).to(DEVICE)
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    out = ta.tree_attention(q, k, v, past, ta.pack_mask(anc),
                            config=dict(num_splits=splits, block_n=block_n))
    check(out, ref, torch.float32)


def test_gpu_launch_config_splits_one_query_finer(monkeypatch):
    # The compiled path's choice, read without a GPU: an AR step (one query) splits the committed context
    # into 64-slot chunks, a tree keeps 512-slot chunks (docs/performance.md measured both).
    monkeypatch.setattr(ta, "_interpret", lambda: False)
    monkeypatch.setattr(ta, "_sm_count", lambda device: 132)
    one = ta.launch_config(1, 4, 128, 768, 8, torch.device("cpu"))
    tree = ta.launch_config(64, 4, 128, 768, 8, torch.device("cpu"))
    assert (one["min_chunk"], one["num_splits"]) == (64, 12)
    assert (tree["min_chunk"], tree["num_splits"]) == (512, 2)
    assert ta.launch_config(1, 4, 128, 768, 8, torch.device("cpu"), {"min_chunk": 256})["num_splits"] == 3


def test_gpu_launch_config_splits_in_whole_waves(monkeypatch):
    # Read without a GPU: at head dim 128 a tile's stages fill an SM's shared memory, so a launch may hold two
    # waves of one program an SM and never start a third (the shapes the H100 timed, docs/performance.md).
    monkeypatch.setattr(ta, "_interpret", lambda: False)
    sms = 132  # an H100's or H200's
    monkeypatch.setattr(ta, "_sm_count", lambda device: sms)
    for T, past in ((64, 32768), (128, 8192), (128, 32768), (256, 8192), (256, 32768), (512, 8192)):
        cfg = ta.launch_config(T, 4, 128, past, 8, torch.device("cpu"))
        programs = -(-T * 4 // cfg["block_m"]) * 8 * cfg["num_splits"]
        assert sms < programs <= 2 * sms, (T, past, cfg)
    assert ta.whole_wave_splits(200, sms, 2.0) == 1  # one split's programs already fill the SMs
    assert ta.whole_wave_splits(100, sms, 0.5) == 1  # never zero splits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [None, dict(split_target=8)])
def test_result_does_not_depend_on_cache_size(dtype, config):
    # The same past and queries in caches of different sizes launch different split counts, yet must
    # give the same bits: a run's text may not change with max_new_tokens or with budget="auto" sizing
    # the cache for its largest candidate.
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, T, past = 8, 2, 64, 37, 300
    q, k, v = make_inputs(Hq, Hkv, D, T, past, dtype, gen, slack=0)
    bits = ta.pack_mask(ancestor_matrix(random_parents(T, gen)).to(DEVICE))
    past_t = torch.tensor(past, dtype=torch.int32, device=DEVICE)
    outs, launched = [], set()
    for extra in (0, 700, 3000):
        pad = torch.randn(Hkv, extra, D, generator=gen).to(dtype).to(DEVICE)  # slots the kernel must not read
        kk, vv = torch.cat([k, pad], 1), torch.cat([v, pad], 1)
        launched.add(ta.launch_config(T, Hq // Hkv, D, kk.shape[1] - T, Hkv, q.device, config, dtype)["num_splits"])
        outs.append(ta.tree_attention(q, kk, vv, past_t, bits, config=config))
    if config:
        assert len(launched) > 1  # the case this test is about: different launches, same result
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    check(outs[0], ta.tree_attention_reference(q, k, v, past, ta.unpack_mask(bits, T)), dtype)


def test_too_few_splits_is_refused():
    with pytest.raises(ValueError, match="num_splits=2 leaves chunks undone"):
        ta.launch_config(8, 4, 64, 2000, 2, torch.device("cpu"), dict(num_splits=2, split_target=8))


@pytest.mark.parametrize("block_m", [16, 128])
def test_block_m_variants(block_m):
    gen = torch.Generator().manual_seed(block_m)
    Hq, Hkv, D, T, past = 12, 4, 64, 21, 100
    q, k, v = make_inputs(Hq, Hkv, D, T, past, torch.float16, gen)
    anc = ancestor_matrix(random_parents(T, gen)).to(DEVICE)
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    out = ta.tree_attention(q, k, v, past, ta.pack_mask(anc),
                            config=dict(block_m=block_m, num_splits=3))
    check(out, ref, torch.float16)


@pytest.mark.parametrize("past_dtype,shape", [(torch.int32, ()), (torch.int64, (1,))])
def test_device_past_len_and_bound(past_dtype, shape):
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, D, T, past = 8, 2, 128, 21, 250
    q, k, v = make_inputs(Hq, Hkv, D, T, past, torch.float32, gen, slack=200)
    anc = ancestor_matrix(random_parents(T, gen)).to(DEVICE)
    bits = ta.pack_mask(anc)
    past_t = torch.full(shape, past, dtype=past_dtype, device=DEVICE)
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    check(ta.tree_attention(q, k, v, past_t, bits), ref, torch.float32)
    check(ta.tree_attention(q, k, v, past_t, bits, max_past_len=past), ref, torch.float32)


def test_strided_cache_scale_and_empty_rows():
    # k/v as views of an all-layer cache [L, 2, Hkv, S_max, D]; custom scale; with past_len = 0 a
    # query whose mask row is empty sees nothing and must give 0, not NaN
    gen = torch.Generator().manual_seed(3)
    L, Hkv, S_max, D, Hq, T = 2, 2, 64, 64, 4, 9
    cache = torch.randn(L, 2, Hkv, S_max, D, generator=gen).to(DEVICE)
    q = torch.randn(Hq, T, D, generator=gen).to(DEVICE)
    anc = ancestor_matrix(random_parents(T, gen)).to(DEVICE)
    for past in (0, 40):
        ref = ta.tree_attention_reference(q, cache[1, 0], cache[1, 1], past, anc, scale=0.3)
        out = ta.tree_attention(q, cache[1, 0], cache[1, 1], past, ta.pack_mask(anc), scale=0.3)
        check(out, ref, torch.float32)
    anc_empty = anc.clone()
    anc_empty[4] = False
    out = ta.tree_attention(q, cache[0, 0], cache[0, 1], 0, ta.pack_mask(anc_empty))
    assert torch.isfinite(out).all() and (out[:, 4] == 0).all()
    ref = ta.tree_attention_reference(q, cache[0, 0], cache[0, 1], 0, anc_empty)
    check(out, ref, torch.float32)


# ---------------------------------------------------------------- GPU only

@gpu_only
@pytest.mark.parametrize("T", [16, 64, 256, 1024, 1025])
@pytest.mark.parametrize("past", [0, 777, 8000])
def test_gpu_large_bf16(T, past):
    gen = torch.Generator().manual_seed(T * 7 + past)
    Hq, Hkv, D = 32, 8, 128
    q, k, v = make_inputs(Hq, Hkv, D, T, past, torch.bfloat16, gen)
    anc = ancestor_matrix(random_parents(T, gen, wide=(T % 2 == 0)).to(DEVICE))
    bits = ta.pack_mask(anc)
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    check(ta.tree_attention(q, k, v, past, bits), ref, torch.bfloat16)
    past_t = torch.tensor(past, device=DEVICE)
    check(ta.tree_attention(q, k, v, past_t, bits), ref, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_dtypes(dtype, D):
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, T, past = 12, 4, 130, 3000
    q, k, v = make_inputs(Hq, Hkv, D, T, past, dtype, gen)
    anc = ancestor_matrix(random_parents(T, gen).to(DEVICE))
    ref = ta.tree_attention_reference(q, k, v, past, anc)
    check(ta.tree_attention(q, k, v, past, ta.pack_mask(anc)), ref, dtype)


@gpu_only
def test_gpu_cuda_graph_replay_new_past_len():
    # capture once with a device past_len, replay with another: no host value is baked in
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D, T, S_max = 32, 8, 128, 64, 6000
    q, k, v = make_inputs(Hq, Hkv, D, T, S_max - T - 5, torch.bfloat16, gen)
    anc = ancestor_matrix(random_parents(T, gen).to(DEVICE))
    bits = ta.pack_mask(anc)
    past_t = torch.tensor(100, device=DEVICE)
    ta.tree_attention(q, k, v, past_t, bits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.tree_attention(q, k, v, past_t, bits)
    for past in (100, 4321, 17, 0):
        past_t.fill_(past)
        graph.replay()
        torch.cuda.synchronize()
        check(out, ta.tree_attention_reference(q, k, v, past, anc), torch.bfloat16)


@pytest.mark.parametrize("T", [1, 9])
def test_programmatic_dependent_launches_change_no_bit(T):
    """The verify kernel and its merge as programmatic dependents ({"pdl": True}), as the MLA test checks its pair:
    bit for bit the plain launches' output on a GPU, eagerly and from a graph; the option dropped on the CPU."""
    from ddtree_lab.testing import assert_replays_equal

    gen = torch.Generator().manual_seed(T)
    q, k, v = make_inputs(8, 2, 64, T, 300, torch.bfloat16 if DEVICE == "cuda" else torch.float32, gen)
    bits = ta.pack_mask(ancestor_matrix(random_parents(T, gen)).to(DEVICE))
    split = {"num_splits": 4, "min_chunk": 64}  # the merge runs

    def call(pdl):
        q2 = q * 1.0  # a kernel before the attention, writing what it reads
        return ta.tree_attention(q2, k, v, 300, bits, config=dict(split, pdl=True) if pdl else split)

    want = call(False)
    assert torch.equal(call(True), want)
    if DEVICE == "cuda":
        assert_replays_equal(lambda: call(True), want)
