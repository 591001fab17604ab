"""kernels/vocab_topk.py (per-depth log-softmax + top-K in one launch) vs torch's log_softmax + topk, across
vocabularies, K and dtypes; and the tree it leads to. Without a GPU the kernel runs under the interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab import tree  # noqa: E402
from ddtree_lab.kernels.vocab_topk import MAX_VOCAB, vocab_topk, vocab_topk_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# The interpreter's sort takes minutes beyond a few thousand keys: the widest rows run on a GPU only.
ON_GPU = pytest.mark.skipif(DEVICE != "cuda", reason="minutes under the interpreter; the narrower rows run here")
SHAPES = [(1, 5, 1), (15, 64, 16), (6, 1000, 64), (2, 300, 300),
          pytest.param(15, 4096, 256, marks=ON_GPU), pytest.param(2, 4096, 4096, marks=ON_GPU),
          pytest.param(4, MAX_VOCAB, 32, marks=ON_GPU)]


@pytest.mark.parametrize("L,V,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vocab_topk_matches_torch(L, V, K, dtype):
    g = torch.Generator().manual_seed(V + K)
    for scale in (0.3, 6.0):  # flat and peaked rows
        logits = (torch.randn(L, V, generator=g) * scale).to(DEVICE, dtype)
        lp, tok = vocab_topk(logits, K)
        want_lp, want_tok = vocab_topk_reference(logits, K)
        assert lp.dtype == torch.float32 and tok.dtype == torch.long and lp.shape == tok.shape == (L, K)
        torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
        # each token carries its own log-probability (the same tokens as torch up to the order of exact ties,
        # which torch leaves unspecified and the kernel breaks by the smaller index)
        full = torch.log_softmax(logits.float(), dim=-1)
        torch.testing.assert_close(full.gather(1, tok), want_lp, rtol=1e-5, atol=1e-5)
        assert all(row.unique().numel() == K for row in tok)
        # where a log-probability is not tied with a neighbour, the token is torch's
        same = torch.zeros_like(want_lp, dtype=torch.bool)
        same[:, 1:] |= want_lp[:, 1:] == want_lp[:, :-1]
        same[:, :-1] |= want_lp[:, :-1] == want_lp[:, 1:]
        if K < V:  # tied with the best left out
            same[:, -1] |= want_lp[:, -1] == full.topk(K + 1, dim=-1).values[:, K]
        assert torch.equal(tok[~same], want_tok[~same])


def test_vocab_topk_takes_strided_rows_and_ties():
    logits = torch.zeros(4, 100, device=DEVICE)
    logits[:, 10] = 2.0
    lp, tok = vocab_topk(logits[::2], 5)  # rows 0 and 2: a stride, and 99 tied values
    assert tok.tolist() == [[10, 0, 1, 2, 3]] * 2
    torch.testing.assert_close(lp, vocab_topk_reference(logits[::2], 5)[0])
    with pytest.raises(AssertionError, match="MAX_VOCAB|up to"):
        vocab_topk(torch.zeros(1, MAX_VOCAB + 1, device=DEVICE), 4)


@pytest.mark.parametrize("budget", [16, 64])
def test_tree_with_the_triton_topk_equals_torch(monkeypatch, budget, use_options):
    g = torch.Generator().manual_seed(budget)
    logits = (torch.randn(15, 512, generator=g) * 3).to(DEVICE)
    want = tree.build_tree(logits, budget, method="sort")
    use_options(tree_topk="triton")
    use_options(tree_kernels="triton")  # on the CPU too (interpreter)
    got = tree.build_tree(logits, budget, method="sort")
    for f in ("tokens", "depths", "parents", "ranks"):
        assert torch.equal(getattr(got, f).cpu(), getattr(want, f).cpu()), f
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-5, atol=1e-5)


def test_benchmark_checks_what_it_times():
    """kernels/bench_vocab_topk.py: side by side with torch, each result checked (timed only on a GPU)."""
    try:
        from ddtree_lab.bench.vocab_topk import bench_vocab_topk
    except ImportError:
        pytest.skip("the kernels/ folder is not importable from here")
    rows = bench_vocab_topk(vocabs=(300,), ks=(16, 400), depth=3, device=DEVICE, reps=3,
                            dtype=torch.float32)
    assert [r["k"] for r in rows] == [16] and rows[0]["same_logprobs"] is True  # K > V is skipped
    assert (rows[0]["triton_us"] is not None) == (DEVICE == "cuda")
