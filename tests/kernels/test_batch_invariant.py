"""Batch-invariant ops vs their float64 references, and the property they exist for: a row's bits do not
depend on the other rows (a token alone, in a tree, in a prefill).

Without a GPU the kernels run under the Triton interpreter (fp32, fp16); bf16 runs in the GPU-only tests.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels import batch_invariant as bi  # noqa: E402
from ddtree_lab.tree import ancestor_matrix  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def random_parents(T, seed):
    g = torch.Generator().manual_seed(seed)
    p = (torch.rand(T, generator=g) * torch.arange(T)).floor().long()
    p[0] = 0  # the root is its own parent (ancestor_matrix's convention)
    return p


SPLIT = {"K_CHUNK": 128, "SPLIT_BELOW_N_TILES": None, "BLOCK_K": 64}  # fixed chunks of K, summed in order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [None, SPLIT], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("M,N,K,bias", [(1, 48, 40, False), (7, 200, 96, True), (65, 130, 64, False),
                                        (130, 64, 300, True)])
def test_linear_matches_reference(M, N, K, bias, dtype, tiles):
    x, w = rand(M, K, dtype=dtype, seed=1), rand(N, K, dtype=dtype, seed=2) / K ** 0.5
    b = rand(N, dtype=dtype, seed=3) if bias else None
    got, want = bi.linear(x, w, b, tiles=tiles), bi.linear_reference(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [None, SPLIT], ids=["one-pass", "split-k"])
def test_linear_row_bits_do_not_depend_on_the_batch(dtype, tiles):
    x, w = rand(70, 296, dtype=dtype, seed=4), rand(150, 296, dtype=dtype, seed=5)
    b = rand(150, dtype=dtype, seed=6)
    full = bi.linear(x, w, b, tiles=tiles)
    for rows in ([0], [69], [3, 5, 64], list(range(17, 50))):
        assert torch.equal(bi.linear(x[rows], w, b, tiles=tiles), full[rows]), rows
    assert torch.equal(bi.linear(x[None, 2:9], w, b, tiles=tiles)[0], full[2:9])  # leading dims fold into rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,N", [(1, 64), (9, 100), (33, 576)])
def test_rms_norm_matches_reference_and_is_row_invariant(rows, N, dtype):
    x, w = rand(rows, N, dtype=dtype, seed=6), 1 + 0.1 * rand(N, dtype=dtype, seed=7)
    got = bi.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.float(), bi.rms_norm_reference(x, w, 1e-6).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(bi.rms_norm(x[-1:], w, 1e-6), got[-1:])
    # per-head norms: a [B, H, T, D] view that is not contiguous
    x4 = rand(1, 6, 3, 16, dtype=dtype, seed=8).transpose(1, 2)
    w4 = 1 + 0.1 * rand(16, dtype=dtype, seed=9)
    torch.testing.assert_close(bi.rms_norm(x4, w4, 1e-6).float(), bi.rms_norm_reference(x4, w4, 1e-6).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_the_split_rule_takes_long_narrow_matrices_only():
    t = {"K_CHUNK": 256, "SPLIT_BELOW_N_TILES": 32, "BLOCK_N": 64}
    assert bi.k_chunk(576, 1536, t) == 256      # a small model's down projection: 9 column tiles
    assert bi.k_chunk(576, 576, t) == 576       # square: one pass
    assert bi.k_chunk(4096, 12288, t) == 12288  # 64 column tiles fill the GPU without a split
    assert bi.k_chunk(576, 200, {**t, "SPLIT_BELOW_N_TILES": None}) == 200  # K within one chunk


def test_rms_norm_output_dtype_is_torchs():
    x, w = rand(3, 32, dtype=torch.float16, seed=10), rand(32, dtype=torch.float32, seed=11)
    assert bi.rms_norm(x, w, 1e-6).dtype == torch.float32


@pytest.mark.parametrize("T", [1, 5, 40])
def test_ancestor_chain_lists_each_rows_ancestors_root_first(T):
    parents = random_parents(T, seed=T)
    anc = ancestor_matrix(parents, T)
    chain, length = bi.ancestor_chain(anc.to(DEVICE))
    for i in range(T):
        want, j = [], i
        while True:
            want.append(j)
            if j == 0:
                break
            j = int(parents[j])
        assert chain[i, :length[i]].tolist() == want[::-1]


def _cache(Hkv, S, D, dtype, seed):
    return rand(Hkv, S, D, dtype=dtype, seed=seed), rand(Hkv, S, D, dtype=dtype, seed=seed + 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,past,Hq,Hkv,D", [(1, 0, 4, 2, 16), (1, 130, 4, 4, 32), (12, 7, 6, 2, 64),
                                             (40, 70, 4, 1, 16)])
@pytest.mark.parametrize("past_on_device", [False, True])
@pytest.mark.parametrize("chunk", [None, 64], ids=["one-chunk", "chunks-of-64"])
def test_chain_attention_matches_reference(T, past, Hq, Hkv, D, dtype, past_on_device, chunk):
    anc = ancestor_matrix(random_parents(T, seed=T + past), T).to(DEVICE)
    q = rand(Hq, T, D, dtype=dtype, seed=12)
    k, v = _cache(Hkv, past + T + 5, D, dtype, seed=13)
    p = torch.tensor([past], device=DEVICE) if past_on_device else past
    got = bi.chain_attention(q, k, v, p, *bi.ancestor_chain(anc), chunk=chunk)
    torch.testing.assert_close(got.float(), bi.chain_attention_reference(q, k, v, past, anc).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("past", [0, 60, 64, 200])
@pytest.mark.parametrize("chunk", [None, 64], ids=["one-chunk", "chunks-of-64"])
def test_chain_attention_gives_a_tree_node_the_bits_of_an_ar_step(past, dtype, chunk):
    """Node i of a tree at past_len `past` == one query at position past + depth(i) over a cache holding
    the committed slots, then i's ancestors in depth order (what AR would have written): bit for bit. With
    chunks of 64, some of these launches split and merge and some fit one chunk: the bits agree anyway."""
    T, Hq, Hkv, D = 24, 4, 2, 32
    parents = random_parents(T, seed=past)
    anc = ancestor_matrix(parents, T).to(DEVICE)
    chain, length = bi.ancestor_chain(anc)
    q = rand(Hq, T, D, dtype=dtype, seed=14)
    k, v = _cache(Hkv, past + T, D, dtype, seed=15)
    tree = bi.chain_attention(q, k, v, past, chain, length, chunk=chunk)
    one = torch.ones(1, 1, dtype=torch.bool, device=DEVICE)
    for i in (0, 1, T // 2, T - 1):
        path = chain[i, :length[i]].long()
        ak, av = k[:, :past + len(path)].clone(), v[:, :past + len(path)].clone()
        ak[:, past:], av[:, past:] = k[:, past + path], v[:, past + path]
        pos = past + len(path) - 1  # the AR step: the query at its own position, seeing slots 0 … pos
        ar = bi.chain_attention(q[:, i:i + 1], ak, av, pos, *bi.ancestor_chain(one), chunk=chunk)
        assert torch.equal(ar[:, 0], tree[:, i]), i


def test_a_device_past_len_launches_for_its_bound_with_the_same_bits():
    """Graphs pass past_len on the device and a bound (max_past): a bound of several chunks splits the launch,
    and a query that fits one chunk keeps its bits."""
    T, Hq, Hkv, D, past = 5, 4, 2, 16, 30
    anc = ancestor_matrix(random_parents(T, seed=3), T).to(DEVICE)
    q = rand(Hq, T, D, dtype=torch.float32, seed=16)
    k, v = _cache(Hkv, 400, D, torch.float32, seed=17)
    p = torch.tensor([past], device=DEVICE)
    chain = bi.ancestor_chain(anc)
    assert torch.equal(bi.chain_attention(q, k, v, p, *chain, max_past=300, chunk=64),
                       bi.chain_attention(q, k, v, past, *chain, chunk=64))


@gpu_only
def test_linear_bf16_bits_do_not_depend_on_m_across_graph_sizes():
    """The tile choice is fixed: 1 row, a tree of 1025 and a prefill of 3000 give row 0 the same bits."""
    w = rand(4096, 1024, dtype=torch.bfloat16, seed=16)
    x = rand(3000, 1024, dtype=torch.bfloat16, seed=17)
    full = bi.linear(x, w)
    for m in (1, 17, 1025):
        assert torch.equal(bi.linear(x[:m], w), full[:m])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's path (on a GPU a dot is an MMA)")
def test_the_interpreter_path_never_asks_the_host_blas(monkeypatch):
    """Under the interpreter a tl.dot is numpy's matmul, i.e. the host's BLAS, whose kernels may round a row
    by its neighbours: the batch-invariant ops must not depend on it, so here they must not call it at all."""
    import numpy

    def no_blas(*args, **kwargs):
        raise AssertionError("a batch-invariant op reached the host BLAS")
    monkeypatch.setattr(numpy, "matmul", no_blas)
    x, w = rand(5, 96, dtype=torch.float32, seed=1), rand(40, 96, dtype=torch.float32, seed=2)
    torch.testing.assert_close(bi.linear(x, w), bi.linear_reference(x, w), atol=1e-4, rtol=1e-4)
    anc = ancestor_matrix(random_parents(6, seed=3), 6)
    chain, chain_len = bi.ancestor_chain(anc)
    q, k, v = rand(4, 6, 16, dtype=torch.float32, seed=4), rand(2, 40, 16, dtype=torch.float32, seed=5), \
        rand(2, 40, 16, dtype=torch.float32, seed=6)
    torch.testing.assert_close(bi.chain_attention(q, k, v, 20, chain, chain_len),
                               bi.chain_attention_reference(q, k, v, 20, anc), atol=1e-4, rtol=1e-4)
