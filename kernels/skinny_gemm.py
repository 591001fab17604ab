"""A few rows times a wide weight, streaming the weight once: y = x @ w.T for up to MAX_ROWS rows.

    skinny_gemm(x, w, out_dtype=None, config=None) -> [T, N]   x [T, K], w [N, K] (a Linear's weight)
    skinny_gemm_reference(x, w, out_dtype)                     torch's product, the ground truth

One program owns BLOCK_N output columns over the whole of K: it walks K in BLOCK_K steps, each a [BLOCK_N,
BLOCK_K] tile of w (rows of w are contiguous, so a tile is BLOCK_N runs of BLOCK_K values) and the matching x
tile, and sums in fp32 with tl.dot (the rows padded to 16 for the tensor cores, which cost nothing here: the
time is w's bytes). No split of K, so each output is one fp32 sum in K order and the result does not depend
on how many rows come with it (a row's bits are the same at T 1 and T 16). Out-of-range rows, columns and K
read as zero.

Why: an AR step's dense products (MLA's projections, the shared expert, the router) are one row against
matrices of 5-120 MB, whose time should be the weight's bytes over the bandwidth. Measured (docs/kernels.md), this
kernel and the library's are each ahead on some matrices and the step as a whole is slower with this one, so the
engine keeps the library's unless options.dense_products chooses this one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # one MMA row tile; wider products are the library's (compute starts to matter)


@triton.jit
def _skinny_gemm_kernel(X, W, Y, T, N, K, s_xt, s_wn, s_yt,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_T)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk = k0 + ks
        x = tl.load(X + rows[:, None] * s_xt + kk[None, :], mask=(rows[:, None] < T) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + cols[:, None] * s_wn + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # [BLOCK_T, BLOCK_N] fp32; fp32 inputs exact, not tf32
    tl.store(Y + rows[:, None] * s_yt + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < N))


def launch_config(T: int, N: int, K: int, device: torch.device) -> dict:
    """Tiles for [T, K] x [K, N]: columns narrow enough that every SM gets programs (at least two waves where N
    allows), K steps of up to 256 values (512 B of a bf16 row), four stages in flight (64 KB of shared memory at
    16 columns: three programs an SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    block_n = 64
    while block_n > 16 and triton.cdiv(N, block_n) < 2 * sms:
        block_n //= 2
    return dict(block_n=block_n, block_k=min(256, max(32, triton.next_power_of_2(K))), stages=4, num_warps=4)


CONFIG_KEYS = ("block_n", "block_k", "stages", "num_warps")


def check_config(config: dict) -> None:
    """Launch overrides: keys of CONFIG_KEYS, tiles powers of two of at least 16, stages and warps in range;
    anything else is refused by name."""
    for key, value in config.items():
        if key not in CONFIG_KEYS:
            raise ValueError(f"{key!r} is not a launch choice of skinny_gemm (one of {', '.join(CONFIG_KEYS)})")
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if key in ("block_n", "block_k", "num_warps"):
            ok = ok and value & (value - 1) == 0 and (value >= 16 or key == "num_warps") and value <= 1024
        if not ok:
            raise ValueError(f"{key}={value!r}: " + ("a power of two from 16" if key.startswith("block")
                                                      else "a power of two" if key == "num_warps" else "at least 1"))


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= MAX_ROWS), w [N, K], both of one float dtype -> [T, N] in out_dtype (x's by default).
    `config`: launch overrides (check_config)."""
    T, K = x.shape
    N, Kw = w.shape
    if T > MAX_ROWS or K != Kw:
        raise ValueError(f"skinny_gemm takes up to {MAX_ROWS} rows of w's width: x {tuple(x.shape)}, w {tuple(w.shape)}")
    check_config(config or {})
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    cfg = {**launch_config(T, N, K, x.device), **(config or {})}
    y = torch.empty(T, N, dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(N, cfg["block_n"]),)
    _skinny_gemm_kernel[grid](x, w, y, T, N, K, x.stride(0), w.stride(0), y.stride(0),
                              BLOCK_T=16, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], STAGES=cfg["stages"],
                              num_warps=cfg["num_warps"])
    return y


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(out_dtype or x.dtype)
