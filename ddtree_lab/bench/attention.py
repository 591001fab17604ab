"""Micro-benchmarks of verify attention: the Triton tree kernels against torch baselines.

    bench_tree_attention(tree_sizes, contexts, backends=("triton", "sdpa", "flex"), ...)
        -> list of dicts, one per (T, context, backend)
    bench_mla_attention(tree_sizes, contexts, heads, latent, rope, backends=("triton", "sdpa"), ...)
        -> the same for MLA's absorbed form (kernels/mla_attention.py), one per (heads, T, context, backend)

backends: "triton" = tree_attention (bit mask, GQA packing, split-K); "sdpa" = torch
scaled_dot_product_attention with a dense bool mask [T, past_len+T] and enable_gqa; "flex" =
torch flex_attention compiled with torch.compile, with a block mask from the same ancestor
relation. Latency is the median of triton.testing.do_bench (L2 flushed between calls); bandwidth
counts the bytes any backend must move: K/V of past_len+T slots once, q and out once.

Command line (GPU): python -m ddtree_lab.bench.attention --out bench.json [--trees 16 64 --contexts 1024 8192]
                    python -m ddtree_lab.bench.attention --mla [--heads 64 8 --latent 512 --rope 64]
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from ..checkpoint import torch_dtype
from ..kernels.mla_attention import mla_tree_attention
from ..kernels.tree_attention import pack_mask, tree_attention
from ..names import STUDY_DTYPES
from ..tree import ancestor_matrix
from . import MLA_CONTEXTS, MLA_HEADS, MLA_TREES, write_bench_json
from .timing import device_copy_gbps, time_cuda_graph


def random_tree_parents(T: int, gen: torch.Generator, max_children_depth: int = 16) -> torch.Tensor:
    """A DDTree-like tree: parents [T] (parents[0] = -1), node i's parent among the previous
    max(1, i // 4) nodes, so trees are bushy near the root and a dozen or so levels deep."""
    i = torch.arange(T)
    hi = (i // 4).clamp(min=1).minimum(i)
    p = (torch.rand(T, generator=gen) * hi).floor().long()
    p[0] = -1
    return p


def _make_case(T, ctx, Hq, Hkv, D, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    S = ctx + T  # cache holds exactly the context plus the tree, so no backend slices it
    q = torch.randn(Hq, T, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(Hkv, S, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(Hkv, S, D, generator=gen).to(device=device, dtype=dtype)
    anc = ancestor_matrix(random_tree_parents(T, gen).to(device))  # [T, T]
    return q, k, v, anc


def _dense_mask(anc, ctx):
    T = anc.shape[0]
    return torch.cat([torch.ones(T, ctx, dtype=torch.bool, device=anc.device), anc], dim=1)


def _make_fn(backend, q, k, v, anc, ctx, triton_kwargs=None, flex_compiled=None):
    """A no-argument callable running one verify attention, plus a note."""
    if backend == "triton":
        bits = pack_mask(anc)
        past = torch.tensor(ctx, device=q.device, dtype=torch.int32)  # graph-path: device past_len
        cfg = dict(triton_kwargs or {})
        return (lambda: tree_attention(q, k, v, past, bits, config=cfg)), ""
    if backend == "sdpa":
        mask = _dense_mask(anc, ctx)  # [T, ctx+T]
        q4, k4, v4 = q[None], k[None], v[None]
        f = torch.nn.functional.scaled_dot_product_attention
        return (lambda: f(q4, k4, v4, attn_mask=mask, enable_gqa=True)[0]), "dense bool mask, enable_gqa"
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        dense = _dense_mask(anc, ctx)

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[q_idx, kv_idx]

        T, S = anc.shape[0], k.shape[1]
        bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=S, device=q.device)
        q4, k4, v4 = q[None], k[None], v[None]
        return (lambda: flex_compiled(q4, k4, v4, block_mask=bm, enable_gqa=True)[0]), "torch.compile(flex_attention)"
    raise ValueError(f"unknown backend {backend!r}")




def _flex_compiled():
    """torch.compile'd flex_attention, or (None, why)."""
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("cache_size_limit", "recompile_limit"):  # one compile per shape
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        return torch.compile(flex_attention, dynamic=False), ""
    except Exception as e:  # pragma: no cover - depends on the torch build
        return None, f"flex unavailable: {type(e).__name__}: {e}"


def bench_tree_attention(tree_sizes=(16, 64, 256, 1024), contexts=(1024, 8192, 32768),
                         backends=("triton", "sdpa", "flex"), Hq=32, Hkv=8, D=128,
                         dtype=torch.bfloat16, *, device="cuda", seed=0, warmup_ms=25,
                         rep_ms=100, triton_configs=None, check=True, progress=False,
                         on_row=None, deadline_s=None, timing="graph"):
    """Latency (median ms), bandwidth (GB/s) and useful TFLOP/s per (T, context, backend).

    timing: "graph" (default) = GPU time from CUDA-graph replay with the L2 flushed before each
    call (time_cuda_graph; the engine replays verify as a graph), falling back to do_bench if a
    backend cannot be captured; "do_bench" = triton.testing.do_bench median, host launch
    overhead included when it exceeds the GPU time.

    triton_configs: optional list of keyword dicts for tree_attention (block_m, block_n,
    num_warps, num_stages, num_splits); each is timed as backend "triton" with its "config".
    check: record each backend's max |difference| from the first backend that ran.
    on_row: called with each row as it is measured; deadline_s: wall seconds after which the
    remaining rows are recorded as skipped.
    """
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    flex_fn, flex_why = (None, "")
    if "flex" in backends:
        flex_fn, flex_why = _flex_compiled()
    rows = []
    t_start = time.perf_counter()
    for T in tree_sizes:
        for ctx in contexts:
            q, k, v, anc = _make_case(T, ctx, Hq, Hkv, D, dtype, device, seed)
            bytes_moved = 2 * Hkv * (ctx + T) * D * elt + 2 * Hq * T * D * elt
            flops = 4 * Hq * D * (T * ctx + int(anc.sum()))  # QK^T and PV over visible pairs
            runs = []
            for backend in backends:
                for cfg in (triton_configs or [None]) if backend == "triton" else [None]:
                    runs.append((backend, cfg))
            first = None
            for backend, cfg in runs:
                row = dict(backend=backend, T=T, context=ctx, Hq=Hq, Hkv=Hkv, D=D,
                           dtype=str(dtype).replace("torch.", ""), bytes=bytes_moved, flops=flops)
                if cfg:
                    row["config"] = dict(cfg)

                def make(backend=backend, cfg=cfg, q=q, k=k, v=v, anc=anc):  # bound now: the loop deletes them
                    if backend == "flex" and flex_fn is None:
                        raise RuntimeError(flex_why)
                    return _make_fn(backend, q, k, v, anc, ctx, cfg, flex_fn)

                late = deadline_s is not None and time.perf_counter() - t_start > deadline_s
                first = _measure(row, make, first, timing, warmup_ms, rep_ms, check, late)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                if progress:
                    print(_fmt_row(row), flush=True)
            del q, k, v, anc
            torch.cuda.empty_cache()
    return rows


def _mla_fn(backend, q, cache, anc, ctx, C, scale, triton_kwargs=None):
    """A no-argument callable running one MLA verify attention (absorbed form), plus a note."""
    if backend == "triton":
        bits = pack_mask(anc)
        past = torch.tensor(ctx, device=q.device, dtype=torch.int32)  # graph-path: device past_len
        cfg = dict(triton_kwargs or {})
        return (lambda: mla_tree_attention(q, cache, past, bits, C, scale, config=cfg)), ""
    if backend == "sdpa":
        mask = _dense_mask(anc, ctx)  # [T, ctx+T]
        rows = cache[None, None]  # [1, 1, ctx+T, C+R]: one KV head, the latent also the value
        f = torch.nn.functional.scaled_dot_product_attention
        return (lambda: f(q[None], rows, rows[..., :C], attn_mask=mask, scale=scale, enable_gqa=True)[0]), \
            "dense bool mask, one KV head"
    raise ValueError(f"MLA attention runs triton or sdpa, not {backend!r}")


def bench_mla_attention(tree_sizes=MLA_TREES, contexts=MLA_CONTEXTS, heads=MLA_HEADS, latent=512, rope=64,
                        backends=("triton", "sdpa"), dtype=torch.bfloat16, *, device="cuda", seed=0, warmup_ms=25,
                        rep_ms=100, triton_configs=None, check=True, progress=False, on_row=None, deadline_s=None,
                        timing="graph"):
    """MLA verify attention (kernels/mla_attention.py) per (heads, T, context, backend): latency, and bandwidth
    over the bytes any backend must move, the latent cache's (context + T) rows of latent + rope values once
    plus q and out; TFLOP/s over the visible pairs' latent and rope dots and the latent-weighted sum.
    Defaults: Kimi K2's widths (latent 512, rope 64), all 64 heads of one GPU and a TP8 rank's 8. The other
    arguments are bench_tree_attention's (triton_configs: mla_tree_attention's config dicts)."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    width = latent + rope
    rows, t_start = [], time.perf_counter()
    for H in heads:
        for T in tree_sizes:
            for ctx in contexts:
                gen = torch.Generator().manual_seed(seed)
                q = torch.randn(H, T, width, generator=gen).to(device=device, dtype=dtype)
                cache = torch.randn(ctx + T, width, generator=gen).to(device=device, dtype=dtype)
                anc = ancestor_matrix(random_tree_parents(T, gen).to(device))  # [T, T]
                scale = width ** -0.5
                bytes_moved = (ctx + T) * width * elt + H * T * (width + latent) * elt
                flops = 2 * H * (width + latent) * (T * ctx + int(anc.sum()))
                runs = [(b, cfg) for b in backends for cfg in ((triton_configs or [None]) if b == "triton" else [None])]
                first = None
                for backend, cfg in runs:
                    row = dict(backend=backend, T=T, context=ctx, H=H, latent=latent, rope=rope,
                               dtype=str(dtype).replace("torch.", ""), bytes=bytes_moved, flops=flops)
                    if cfg:
                        row["config"] = dict(cfg)
                    late = deadline_s is not None and time.perf_counter() - t_start > deadline_s
                    make = functools.partial(_mla_fn, backend, q, cache, anc, ctx, latent, scale, cfg)
                    first = _measure(row, make, first, timing, warmup_ms, rep_ms, check, late)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    if progress:
                        print(f"H={H:3d} " + _fmt_row(row), flush=True)
                del q, cache, anc
                torch.cuda.empty_cache()
    return rows


def _measure(row, make, first, timing, warmup_ms, rep_ms, check, late=False):
    """Time the call make() returns ((fn, note)) into row: first_call_s (compile included), ms (median), GB/s
    over row["bytes"], TFLOP/s over row["flops"], and its max |difference| from `first` (the first backend's
    output, returned when None). An error, or `late` (the deadline passed), is recorded in the row."""
    import triton.testing

    try:
        if late:
            raise TimeoutError("skipped: benchmark deadline reached")
        fn, note = make()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        ms = None
        if timing == "graph":
            try:
                ms, row["timing"] = time_cuda_graph(fn), "cuda_graph"
            except Exception as e:  # not capturable: time it eagerly
                row["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        if ms is None:
            ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
            row["timing"] = "do_bench"
        row.update(ms=ms, gbps=row["bytes"] / ms * 1e-6, tflops=row["flops"] / ms * 1e-9, note=note)
        if check:
            if first is None:
                first = out.float()
            row["max_abs_diff"] = (out.float() - first).abs().max().item()
    except Exception as e:  # record and go on: one failing backend must not stop a sweep
        row.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
    return first


def _fmt_row(r):
    cfg = r.get("config")
    name = r["backend"] + (("[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]") if cfg else "")
    if r.get("ms") is None:
        return f"T={r['T']:5d} ctx={r['context']:6d} {name:40s} ERROR {r.get('error')}"
    return (f"T={r['T']:5d} ctx={r['context']:6d} {name:40s} {r['ms'] * 1e3:9.1f} us "
            f"{r['gbps']:7.0f} GB/s {r['tflops']:6.1f} TF/s  diff={r.get('max_abs_diff', float('nan')):.3g}")


def summary_table(rows):
    """Text table: per (T, context) the latency of each backend and triton's speedups."""
    by = {}
    for r in rows:
        if r.get("ms") is not None and "config" not in r:
            by.setdefault((r["T"], r["context"]), {})[r["backend"]] = r["ms"]
    lines = [f"{'T':>5} {'ctx':>6} {'triton us':>10} {'sdpa us':>10} {'flex us':>10} {'x sdpa':>7} {'x flex':>7}"]
    for (T, ctx), d in sorted(by.items()):
        tr, sd, fx = d.get("triton"), d.get("sdpa"), d.get("flex")
        f = lambda x: f"{x * 1e3:10.1f}" if x else f"{'-':>10}"
        sp = lambda a, b: f"{b / a:7.2f}" if a and b else f"{'-':>7}"
        lines.append(f"{T:5d} {ctx:6d} {f(tr)} {f(sd)} {f(fx)} {sp(tr, sd)} {sp(tr, fx)}")
    return "\n".join(lines)


def mla_summary_table(rows):
    """Text table: per (heads, T, context) triton's and sdpa's latency, triton's bandwidth and its speedup."""
    by = {}
    for r in rows:
        if r.get("ms") is not None and "config" not in r:
            by.setdefault((r["H"], r["T"], r["context"]), {})[r["backend"]] = r
    lines = [f"{'H':>3} {'T':>5} {'ctx':>6} {'triton us':>10} {'GB/s':>7} {'sdpa us':>10} {'x sdpa':>7}"]
    for (H, T, ctx), d in sorted(by.items()):
        tr, sd = d.get("triton"), d.get("sdpa")
        us = lambda r: f"{r['ms'] * 1e3:10.1f}" if r else f"{'-':>10}"
        gbps = f"{tr['gbps']:7.0f}" if tr else f"{'-':>7}"
        speedup = f"{sd['ms'] / tr['ms']:7.2f}" if tr and sd else f"{'-':>7}"
        lines.append(f"{H:3d} {T:5d} {ctx:6d} {us(tr)} {gbps} {us(sd)} {speedup}")
    return "\n".join(lines)


def _prewarm_job(job):
    """Run one (backend, T, ctx, cfg) once in a worker process, filling the on-disk caches."""
    backend, T, ctx, cfg, Hq, Hkv, D, dtype, device = job
    try:
        q, k, v, anc = _make_case(T, ctx, Hq, Hkv, D, torch_dtype(dtype), device, 0)
        flex_fn = _flex_compiled()[0] if backend == "flex" else None
        fn, _ = _make_fn(backend, q, k, v, anc, ctx, cfg, flex_fn)
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"{backend} T={T} ctx={ctx}: {type(e).__name__}: {str(e)[:200]}"


def prewarm(tree_sizes, contexts, backends, triton_configs=None, Hq=32, Hkv=8, D=128,
            dtype="bfloat16", workers=8, device="cuda"):
    """Compile every kernel variant a sweep will need in parallel processes (Triton and Inductor
    cache on disk), so the timed process spends little time compiling."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = []
    for T in tree_sizes:
        for ctx in contexts:
            for b in backends:
                for cfg in (triton_configs or [None]) if b == "triton" else [None]:
                    if b != "sdpa":
                        jobs.append((b, T, ctx, cfg, Hq, Hkv, D, dtype, device))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return [e for e in ex.map(_prewarm_job, jobs) if e]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", type=int, nargs="+", default=None,
                    help=f"tree sizes T (default 16 64 256 1024; with --mla {' '.join(map(str, MLA_TREES))})")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help=f"past tokens (default 1024 8192 32768; with --mla {' '.join(map(str, MLA_CONTEXTS))})")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="default triton sdpa flex; with --mla triton sdpa")
    ap.add_argument("--mla", action="store_true",
                    help="MLA's absorbed form over a latent cache (kernels/mla_attention.py) instead of GQA")
    ap.add_argument("--heads", type=int, nargs="+", default=list(MLA_HEADS), help="with --mla: query heads")
    ap.add_argument("--latent", type=int, default=512, help="with --mla: latent values a cache row (kv_lora_rank)")
    ap.add_argument("--rope", type=int, default=64, help="with --mla: RoPE key values a cache row")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=STUDY_DTYPES)
    ap.add_argument("--configs", default=None, help="JSON list of tree_attention keyword dicts (with --mla: "
                                                      "mla_tree_attention's)")
    ap.add_argument("--prewarm", type=int, default=0, help="compile in this many processes first")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--timing", default="graph", choices=["graph", "do_bench"])
    ap.add_argument("--out", default=None, help="write the rows as JSON here (and .jsonl as they come)")
    ap.add_argument("--deadline", type=float, default=None, help="stop timing after this many s")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("the attention micro-benchmarks time CUDA kernels; this machine has no CUDA device")
    if a.mla and a.prewarm:
        ap.error("--prewarm compiles the GQA sweep only; leave it out with --mla")
    if a.mla and a.backends and set(a.backends) - {"triton", "sdpa"}:
        others = " ".join(sorted(set(a.backends) - {"triton", "sdpa"}))
        ap.error(f"--mla times triton and sdpa; {others} has no MLA form")
    a.trees = a.trees or list(MLA_TREES if a.mla else (16, 64, 256, 1024))
    a.contexts = a.contexts or list(MLA_CONTEXTS if a.mla else (1024, 8192, 32768))
    a.backends = a.backends or (["triton", "sdpa"] if a.mla else ["triton", "sdpa", "flex"])
    configs = json.loads(a.configs) if a.configs else None
    if a.prewarm:
        t0 = time.time()
        errs = prewarm(a.trees, a.contexts, a.backends, configs, a.hq, a.hkv, a.head_dim,
                       a.dtype, a.prewarm)
        print(f"prewarm {time.time() - t0:.1f}s", *errs, sep="\n", flush=True)
    log = open(a.out + "l", "w") if a.out else None
    on_row = (lambda r: (log.write(json.dumps(r) + "\n"), log.flush())) if log else None
    copy_gbps = device_copy_gbps()
    print(f"device copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    timed = dict(rep_ms=a.rep_ms, warmup_ms=max(5, a.rep_ms // 4), triton_configs=configs, progress=True,
                 on_row=on_row, deadline_s=a.deadline, timing=a.timing)
    if a.mla:
        rows = bench_mla_attention(a.trees, a.contexts, a.heads, a.latent, a.rope, tuple(a.backends),
                                   torch_dtype(a.dtype), **timed)
    else:
        rows = bench_tree_attention(a.trees, a.contexts, tuple(a.backends), a.hq, a.hkv, a.head_dim,
                                    torch_dtype(a.dtype), **timed)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv, copy_gbps=copy_gbps)
    print(mla_summary_table(rows) if a.mla else summary_table(rows))
    return rows


if __name__ == "__main__":
    main()
