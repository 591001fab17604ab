"""Micro-benchmark of the fused MoE block (`fused_moe.fused_moe`) against torch's grouped path
(`ddtree_lab.moe.moe_torch`: the pairs sorted by expert, two grouped matmuls) and against the floor, the
bytes the touched experts must move (their weights, the router, the activations) over the device's copy
bandwidth. Default shape: Qwen3-30B-A3B's MoE block (128 experts, top-8, hidden 2048, expert width 768; 48
such layers per forward) at T = 1, 8, 16, 65, 129, 1025 tokens (AR, small trees, a tree of 1024 + root).

    bench_fused_moe(tokens, experts=128, top_k=8, hidden=2048, width=768, layers=48, similarity=0.0, config=None)
        -> list of dicts {T, experts_touched, expert_tokens_max (the busiest expert's tokens), row_blocks (the
                          kernel's live row blocks, Σ ceil(tokens_e / BLOCK_M); expert_row_blocks: per height),
                          touched_bytes,
                          floor_us, triton_us, torch_us, …_over_floor, per_forward_ms (one block's time × layers),
                          max_abs_diff (vs the reference), launch (the kernel's tile sizes, `config` applied)}

Hidden states are x = √s·base + √(1−s)·noise per token: s = 0 routes tokens independently (about
E·(1 − (1 − k/E)^T) experts touched), s near 1 makes them route alike, as a tree of related tokens may.
Time per call: `bench.timing.time_cuda_graph` (calls captured in a CUDA graph, L2 flushed before each); on the CPU
(`--smoke`: tiny shapes, the interpreter) the wall clock of one call, a check that the path runs, not a timing.

Command line (GPU): python -m ddtree_lab.bench.fused_moe --out fused_moe.json [--similarity 0.9]
                    [--config BLOCK_N_UP=16 BLOCK_N_DOWN=16 fuse_route=0]   (launch_config overrides)
                    [--baseline old_fused_moe.py]   (another version of the kernel, side by side)
                    python -m ddtree_lab.bench.fused_moe --smoke --out /tmp/fused_moe_smoke.json   (CPU)
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..kernels.moe_layout import GATHER_LIMIT_BYTES, blocks_at_height, gather_bytes, moe_weight_bytes, routing_stats
from . import load_kernel_file, write_bench_json
from .timing import time_cuda_graph

QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, width=768, layers=48)
TOKENS = (1, 8, 16, 65, 129, 1025)
SMOKE = dict(experts=8, top_k=2, hidden=64, width=32, layers=2)
SMOKE_TOKENS = (1, 3, 17)
CONFIG_KEYS = ("num_warps", "num_stages", "fuse_route")  # --config keys besides the BLOCK_… tile sizes


def block_inputs(T, experts, hidden, width, dtype, device, similarity, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, hidden, generator=g)
    x = similarity ** 0.5 * base + (1 - similarity) ** 0.5 * torch.randn(T, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g) * 0.02
    w_gate_up = torch.randn(experts, 2 * width, hidden, generator=g) * 0.02
    w_down = torch.randn(experts, hidden, width, generator=g) * 0.02
    return [t.to(device, dtype) for t in (x, router, w_gate_up, w_down)]


def touched_bytes(counts, T, experts, hidden, width, elsize) -> int:
    """What a block must move at least: the router and the touched experts' weights, x in and out."""
    touched = int((counts > 0).sum())
    return int(moe_weight_bytes(touched, experts, hidden, width, elsize)) + 2 * T * hidden * elsize


def _time(fn, device, reps):
    if device == "cuda":
        return time_cuda_graph(fn, n=reps) * 1000  # µs
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def bench_fused_moe(tokens=TOKENS, experts=128, top_k=8, hidden=2048, width=768, layers=48, similarity=0.0,
                    dtype=torch.bfloat16, device="cuda", reps=20, copy_gbps=None, progress=True,
                    config: dict | None = None, baseline=None) -> list[dict]:
    """`baseline`: another fused_moe module (e.g. `load_baseline(PATH)` of an earlier commit's kernel file),
    timed in the same run on the same inputs: rows gain baseline_us, over_baseline, equal_to_baseline."""
    from ..kernels.fused_moe import fused_moe, fused_moe_reference, launch_config
    from ..moe import _grouped_mm_fits, moe_torch

    elsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for T in tokens:
        x, router, w_gate_up, w_down = block_inputs(T, experts, hidden, width, dtype, device, similarity, seed=T)
        counts = torch.zeros(experts, dtype=torch.int32, device=device)
        out, _ = fused_moe(x, router, w_gate_up, w_down, top_k, True, counts=counts, config=config)
        want, want_counts = fused_moe_reference(x, router, w_gate_up, w_down, top_k, True)
        nbytes = touched_bytes(counts, T, experts, hidden, width, elsize)
        launch = {**launch_config(T, top_k, experts, hidden, width, x.device, elsize), **(config or {})}
        row = dict(T=T, **routing_stats(counts), row_blocks=int(blocks_at_height(counts, launch["BLOCK_M"])),
                   touched_bytes=nbytes, launch={k: v for k, v in launch.items() if k.startswith("BLOCK")},
                   counts_equal_reference=bool(torch.equal(counts, want_counts)),
                   max_abs_diff=float((out.float() - want.float()).abs().max()),
                   floor_us=None if copy_gbps is None else nbytes / (copy_gbps * 1e3))
        row["triton_us"] = _time(lambda: fused_moe(x, router, w_gate_up, w_down, top_k, True, counts=counts,
                                                   config=config), device, reps)
        if baseline is not None:
            base_out, base_counts = baseline.fused_moe(x, router, w_gate_up, w_down, top_k, True)
            row["equal_to_baseline"] = bool(torch.equal(base_out, out) and torch.equal(base_counts, counts))
            row["baseline_us"] = _time(lambda: baseline.fused_moe(x, router, w_gate_up, w_down, top_k, True),
                                       device, reps)
            row["over_baseline"] = row["triton_us"] / row["baseline_us"]
        gather = gather_bytes(T, top_k, hidden, width, elsize)
        if not _grouped_mm_fits(x, width) and gather > GATHER_LIMIT_BYTES:  # moe_torch would refuse it
            row["torch_us"], row["torch_error"] = None, f"skipped: the per-token gather needs {gather / 2**30:.0f} GiB"
        else:
            try:
                row["torch_us"] = _time(lambda: moe_torch(x, router, w_gate_up, w_down, top_k, True), device, reps)
                row["torch_path"] = "grouped_mm" if _grouped_mm_fits(x, width) else "gather"
            except Exception as e:  # recorded, not fatal: the other rows still run
                row["torch_us"], row["torch_error"] = None, f"{type(e).__name__}: {e}"[:300]
        for name in ("triton", "torch"):
            if row["floor_us"] and row.get(f"{name}_us"):
                row[f"{name}_over_floor"] = row[f"{name}_us"] / row["floor_us"]
        row["per_forward_ms"] = row["triton_us"] * layers / 1e3
        row["floor_per_forward_ms"] = None if row["floor_us"] is None else row["floor_us"] * layers / 1e3
        rows.append(row)
        if progress:
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def load_baseline(path: str):
    """A fused_moe.py from elsewhere (`git show REV:kernels/fused_moe.py > old.py`) as a module of its own."""
    return load_kernel_file(path, "fused_moe_baseline")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--similarity", type=float, default=0.0, help="0: independent routing; near 1: alike")
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=INT",
                    help="fused_moe launch_config overrides, e.g. BLOCK_N_UP=16 BLOCK_N_DOWN=32, num_warps=8, "
                         "fuse_route=0 (route in its own launch)")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="another fused_moe.py (e.g. an earlier commit's), timed side by side on the same inputs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the interpreter on a CPU): the path runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    config = {}
    for item in a.config:
        key, _, value = item.partition("=")
        if not (key.startswith("BLOCK_") or key in CONFIG_KEYS) or not value.isdigit():
            ap.error(f"--config {item!r}: want KEY=INT, KEY a tile size BLOCK_… or one of {', '.join(CONFIG_KEYS)}")
        config[key] = bool(int(value)) if key == "fuse_route" else int(value)
    if a.smoke:
        # tiny shapes: the interpreter on the CPU, the compiled kernels on a GPU (a correctness run, not a timing)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        shape, tokens, dtype, bw = SMOKE, a.tokens or SMOKE_TOKENS, torch.float32, None
    else:
        from .timing import device_copy_gbps

        shape, tokens, device, dtype = QWEN3_30B_A3B, a.tokens or TOKENS, "cuda", torch.bfloat16
        bw = device_copy_gbps()
    if a.baseline and not Path(a.baseline).is_file():
        ap.error(f"--baseline {a.baseline}: no such file")
    rows = bench_fused_moe(tokens, **shape, similarity=a.similarity, dtype=dtype, device=device, copy_gbps=bw,
                           config=config or None, baseline=load_baseline(a.baseline) if a.baseline else None)
    if a.out:
        write_bench_json(a.out, rows, shape=shape, similarity=a.similarity, config=config, baseline=a.baseline,
                         dtype=str(dtype).replace("torch.", ""), copy_gbps=bw, smoke=a.smoke)
    return rows


if __name__ == "__main__":
    main()
