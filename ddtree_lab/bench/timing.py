"""How the benchmarks time the GPU: a call inside a captured graph, and the copy bandwidth (the roofline).

Torch only (no Triton kernels), so the end-to-end benchmarks and the workbench that reads their figures
import it on a CPU-only machine without the triton extra.
"""
from __future__ import annotations

import time

import torch


def time_cuda_graph(fn, n=20, reps=5, flush_bytes=256 << 20):
    """GPU time of one fn() call in ms, as a decoding round would see it: n calls captured in a
    CUDA graph (no host launch cost), each after a write of flush_bytes that evicts the L2; the
    same graph without fn is timed too and subtracted. Median over reps replays."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    meds = []
    for g in graphs:
        g.replay()  # warm
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        meds.append(sorted(ts)[len(ts) // 2])
    del graphs, flush
    return max(meds[0] - meds[1], 0.0) / n


def device_copy_gbps(nbytes=1 << 30):
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s): the roofline."""
    import triton.testing

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    del a, b
    return 2 * nbytes / ms * 1e-6


def time_call_us(fn, device, reps: int = 20) -> float:
    """A micro-benchmark's µs per fn() call: time_cuda_graph's on a GPU; on the CPU one call's wall clock (the
    interpreter's smoke runs: a check that the path runs, not a timing)."""
    if str(device).startswith("cuda"):
        return time_cuda_graph(fn, n=reps) * 1000
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6
