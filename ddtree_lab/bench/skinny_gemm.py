"""Micro-benchmark of an AR step's dense products: each bf16 matrix one layer of a shape reads (and the output
head), times a few rows, through the library's matmul (what the engine runs) and kernels/skinny_gemm.py, side by
side on the same inputs, against the copy bandwidth measured in the same run.

    python -m ddtree_lab.bench.skinny_gemm --shape kimi-k2.6-ep8-rank --tokens 1 2 9 --out skinny_kimi_ep8.json
    python -m ddtree_lab.bench.skinny_gemm --smoke   (CPU, the interpreter: the path runs)

The matrices are the modules of one MoE layer of the shape as the engine builds it (`random:SHAPE@2`'s second
layer) and its output head, so the list follows the model code. Rows: matrix, N, K, MB, T, torch_us, skinny_us,
skinny_over_torch, floor_us (the matrix's bytes ÷ the copy bandwidth), torch_over_floor, skinny_over_floor,
max_abs_diff (skinny against torch, in units of the output's largest magnitude).
"""
from __future__ import annotations

import argparse
import json

import torch

from . import smoke_device, write_bench_json
from .timing import device_copy_gbps, time_call_us

TOKENS = (1, 2, 9)


def layer_matrices(shape: str, device) -> list[tuple[str, torch.Tensor]]:
    """(name, weight [N, K]) of every 2-D floating weight of one MoE layer of `shape` (a dense layer's where the
    shape has no MoE) and of the output head, in the dtype the engine keeps them."""
    from .. import load_pair

    pair = load_pair(f"random:{shape}@2", device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
                     attention="sdpa" if device.type == "cpu" else "triton")
    model = pair.target
    layer = model.layers[-1]
    found = [(f"layers.{len(model.layers) - 1}.{name}", p) for name, p in layer.named_parameters()
             if p.dim() == 2 and p.is_floating_point() and "experts" not in name]
    found += [(name, p) for name, p in model.named_parameters() if name.startswith("lm_head") and p.dim() == 2]
    return [(n, p.detach()) for n, p in found]


def smoke_matrices(device) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("smoke.proj", torch.randn(40, 96, generator=g).to(device)),
            ("smoke.router", torch.randn(24, 64, generator=g).to(device))]


def bench(shape: str | None, tokens=TOKENS, device="cuda", reps=20, configs=()) -> tuple[list[dict], float | None]:
    """Rows as the module's doc says; shape None: two small matrices (the smoke run); each of `configs` (launch
    overrides, skinny_gemm's `config`) timed too, as configs_us in the same order, and its output's distance from
    torch's as configs_max_abs_diff."""
    from ..kernels.skinny_gemm import skinny_gemm

    device = torch.device(device)
    gbps = device_copy_gbps() if device.type == "cuda" else None
    rows = []
    for name, w in (layer_matrices(shape, device) if shape else smoke_matrices(device)):
        N, K = w.shape
        mb = w.numel() * w.element_size() / 1e6
        out_dtype = torch.float32 if w.dtype == torch.float32 or "router" in name else None
        for T in tokens:
            x = torch.randn(T, K, device=device).to(w.dtype)
            ref = (torch.mm(x, w.t(), out_dtype=torch.float32) if out_dtype == torch.float32 and w.dtype != torch.float32
                   and device.type == "cuda" else (x.float() @ w.float().t()).to(out_dtype or w.dtype))
            ours = skinny_gemm(x, w, out_dtype=out_dtype)
            scale = ref.float().abs().max().clamp_min(1e-30)
            row = {"matrix": name, "N": N, "K": K, "MB": mb, "T": T,
                   "max_abs_diff": float((ours.float() - ref.float()).abs().max() / scale)}
            if out_dtype == torch.float32 and w.dtype != torch.float32 and device.type == "cuda":
                torch_fn = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)  # noqa: E731 (the router's call)
            else:
                torch_fn = lambda: torch.mm(x, w.t())  # noqa: E731
            row["torch_us"] = time_call_us(torch_fn, device, reps)
            row["skinny_us"] = time_call_us(lambda: skinny_gemm(x, w, out_dtype=out_dtype), device, reps)
            row["skinny_over_torch"] = row["skinny_us"] / row["torch_us"]
            if configs:
                row["configs_max_abs_diff"] = [
                    float((skinny_gemm(x, w, out_dtype=out_dtype, config=c).float() - ref.float()).abs().max() / scale)
                    for c in configs]
                row["configs_us"] = [time_call_us(lambda c=c: skinny_gemm(x, w, out_dtype=out_dtype, config=c),
                                                  device, reps) for c in configs]
            if gbps:
                row["floor_us"] = mb * 1e3 / gbps
                row["torch_over_floor"] = row["torch_us"] / row["floor_us"]
                row["skinny_over_floor"] = row["skinny_us"] / row["floor_us"]
            rows.append(row)
            print(f"{name:40s} {N:6d}x{K:<6d} T={T:<3d} torch {row['torch_us']:8.1f} us  skinny "
                  f"{row['skinny_us']:8.1f} us  ratio {row['skinny_over_torch']:.3f}"
                  + (f"  floor {row['floor_us']:.1f}" if gbps else "") + f"  diff {row['max_abs_diff']:.1e}"
                  + "".join(f"  c{i} {us:.1f}" for i, us in enumerate(row.get("configs_us", ()))), flush=True)
    return rows, gbps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="kimi-k2.6-ep8-rank", help="a random shape (pairs/random.py)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--configs", type=json.loads, default=[],
                    help='launch overrides timed beside the default, a JSON list: \'[{"block_n": 32, "block_k": 256}]\'')
    ap.add_argument("--smoke", action="store_true", help="two small matrices (the interpreter on a CPU): the path runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from ..kernels.skinny_gemm import MAX_ROWS, check_config

    if not a.smoke and not torch.cuda.is_available():
        ap.error("times a GPU: no CUDA device here (--smoke runs the path on the CPU)")
    if any(not 1 <= t <= MAX_ROWS for t in a.tokens):
        ap.error(f"--tokens {' '.join(map(str, a.tokens))}: the kernel takes 1 to {MAX_ROWS} rows")
    try:
        if not isinstance(a.configs, list) or not all(isinstance(c, dict) for c in a.configs):
            raise ValueError("a JSON list of objects")
        for c in a.configs:
            check_config(c)
    except ValueError as e:
        ap.error(f"--configs: {e}")
    device = smoke_device(ap) if a.smoke else "cuda"
    if a.smoke:
        a.shape, a.tokens = None, [1, 3]
    rows, gbps = bench(a.shape, a.tokens, device, configs=a.configs)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv, shape=a.shape, copy_gbps=gbps, configs=a.configs)


if __name__ == "__main__":
    main()
