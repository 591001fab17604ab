"""kernels/skinny_gemm.py (a few rows times a wide weight) vs torch's product, across row counts, widths that do
and do not fill a tile, and dtypes; a row's result does not depend on the rows beside it. Without a GPU the kernel
runs under the interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ddtree_lab.kernels.skinny_gemm import MAX_ROWS, check_config, skinny_gemm, skinny_gemm_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("T", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("N,K", [(16, 64), (40, 96), (130, 200)] + ([(2112, 7168), (7168, 8192)] if DEVICE == "cuda"
                                                                   else []))
@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_gemm_matches_torch(T, N, K, dtype):
    g = torch.Generator().manual_seed(T * 131 + N * 7 + K)
    x = torch.randn(T, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEVICE, dtype)
    got, want = skinny_gemm(x, w), skinny_gemm_reference(x, w)
    assert got.shape == (T, N) and got.dtype == dtype
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_gemm_fp32_output_and_row_independence(dtype):
    """fp32 output (a router's logits from bf16 weights); each row's bits are the same alone as among 16."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MAX_ROWS, 160, generator=g).to(DEVICE, dtype)
    w = torch.randn(48, 160, generator=g).to(DEVICE, dtype)
    many = skinny_gemm(x, w, out_dtype=torch.float32)
    assert many.dtype == torch.float32
    assert (many - skinny_gemm_reference(x, w, torch.float32)).abs().max() <= 1e-3 * many.abs().max()
    for t in (0, 7, MAX_ROWS - 1):
        assert torch.equal(skinny_gemm(x[t:t + 1], w, out_dtype=torch.float32), many[t:t + 1])


def test_skinny_gemm_refuses_too_many_rows_or_mismatched_widths():
    w = torch.zeros(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="up to 16 rows"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="width"):
        skinny_gemm(torch.zeros(2, 31, device=DEVICE), w)


def test_launch_choices_are_checked_by_name():
    check_config({"block_n": 32, "block_k": 128, "stages": 3, "num_warps": 8})
    for bad, why in (({"block_m": 16}, "'block_m' is not a launch choice"), ({"block_n": 24}, "block_n=24"),
                     ({"block_k": 8}, "block_k=8"), ({"stages": 0}, "stages=0"), ({"num_warps": 3}, "num_warps=3")):
        with pytest.raises(ValueError, match=why):
            check_config(bad)


def test_the_bench_refuses_bad_input_in_one_line(capsys):
    from ddtree_lab.bench import skinny_gemm as bench

    for argv, why in ((["--smoke", "--tokens", "17"], "1 to 16 rows"), (["--smoke", "--configs", '[{"block_n": 3}]'],
                      "--configs: block_n=3"), (["--smoke", "--configs", '{"block_n": 32}'], "a JSON list")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert why in capsys.readouterr().err
