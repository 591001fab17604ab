"""Micro-benchmark of a declared routing (`declared_routing.DeclaredRouting.route`, uniform) on one MoE shape's
router: the one-launch Triton kernel (kernels/declared_route.py) against torch's path (moe_layout's references,
what the engine runs without it), each what one MoE layer of a forward pays, at several token counts; optionally
against another version of the kernel file (`--baseline`), side by side in one run on the same logits. With
`--router`, the shape's own grouped router instead (`grouped_route` against `route_grouped_reference`: a
checkpoint's routing="router").

    python -m ddtree_lab.bench.declared_route --shape kimi-k2.6-ep8-rank --tokens 1 9 17 65 257 \\
        [--baseline old_declared_route.py] [--router] --out declared_route_kimi.json
    python -m ddtree_lab.bench.declared_route --shape kimi-k2.6-ep8-rank --tokens 1 2 --sort   (AR's steps)
    python -m ddtree_lab.bench.declared_route --smoke --out /tmp/declared_route_smoke.json   (CPU, the interpreter)

Rows: T, triton_us, torch_us, torch_over_triton, per_forward_ms (the kernel's time × the shape's MoE layers), and
with a baseline baseline_us, over_baseline, equal_to_baseline; with `--warps W …`, warps_us: the kernel launched with
each count of warps on the same logits (its experts checked equal to the default launch's). `--sort` (up to ROUTE_IN_ALIGN_MAX_T tokens: AR's
steps) times instead what the engine runs there: the routing that also sorts the pairs in its launch (`routed=`,
sorted_us) against the routing, then fused_moe.moe_align's launch (then_align_us), over the places of the experts
the shape holds (a rank's, plus the bucket of those held elsewhere), the sorts checked equal. Every row first
checks the kernel's experts against torch's, exactly (a mismatch stops the bench: its time would describe another
routing). Timing as bench/fused_moe.py's: calls in a CUDA graph on a GPU; on the CPU one call's wall clock, a
check that it runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import options
from ..declared_routing import DeclaredRouting, token_keys
from ..kernels.moe_layout import ROUTE_IN_ALIGN_MAX_T
from . import load_kernel_file, smoke_device, write_bench_json
from .timing import time_call_us

TOKENS = (1, 9, 17, 33, 65, 129, 257)
SMOKE = dict(experts=24, top_k=3, scoring="sigmoid", renormalize=True, scaling=2.5, layers=2, n_group=4,
             topk_group=2, held=tuple(range(6, 12)))  # held: a rank's share, for --sort
SMOKE_TOKENS = (1, 5)


def router_shape(name: str) -> dict:
    """The router of an MoE random shape: every expert of the model is scored, on a rank shape too."""
    from ..pairs.random import shape_configs

    cfg = shape_configs(name)[0]
    if not cfg.is_moe:
        raise ValueError(f"{name} is not an MoE shape")
    return dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring_func,
                renormalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), n_group=cfg.n_group,
                topk_group=cfg.topk_group, held=tuple(cfg.experts_held))


def bench_grouped_route(tokens=TOKENS, experts=384, top_k=8, scoring="sigmoid", renormalize=True, scaling=1.0,
                        layers=1, n_group=1, topk_group=1, device="cuda", reps=20, progress=True,
                        held=(), warps=()) -> list[dict]:
    """Per T, a grouped router's choice of one layer both ways (a random correction bias), its experts checked
    equal first."""
    from ..kernels.declared_route import grouped_route
    from ..kernels.moe_layout import route_grouped_reference

    bias = (torch.randn(experts, generator=torch.Generator().manual_seed(0)) * 0.1).to(device)
    args = (top_k, n_group, topk_group, scoring, renormalize, scaling)
    rows = []
    for T in tokens:
        logits = (torch.randn(T, experts, generator=torch.Generator().manual_seed(T)) * 2).to(device)
        (w_tri, ids_tri), (w_ref, ids_ref) = grouped_route(logits, bias, *args), route_grouped_reference(
            logits, bias, *args)
        if not torch.equal(ids_tri, ids_ref):
            raise RuntimeError(f"T={T}: the kernel's experts differ from torch's; no timing of another routing")
        row = {"T": T, "max_abs_diff_weights": float((w_tri - w_ref).abs().max()),
               "triton_us": time_call_us(lambda: grouped_route(logits, bias, *args), device, reps),
               "torch_us": time_call_us(lambda: route_grouped_reference(logits, bias, *args), device, reps)}
        row["torch_over_triton"] = row["torch_us"] / row["triton_us"]
        row["per_forward_ms"] = row["triton_us"] * layers / 1000
        if warps:
            row["warps_us"] = _time_warps(lambda w: grouped_route(logits, bias, *args, num_warps=w), ids_tri, warps,
                                          device, reps, T)
        rows.append(row)
        if progress:
            print(row, flush=True)
    return rows


def _time_warps(launch, want_ids, warps, device, reps, T) -> dict:
    """{warps: µs} for launch(num_warps), each launch's experts checked equal to `want_ids` first."""
    out = {}
    for w in warps:
        if not torch.equal(launch(w)[1], want_ids):
            raise RuntimeError(f"T={T}: {w} warps route otherwise than the default launch; no timing")
        out[str(w)] = time_call_us(lambda: launch(w), device, reps)
    return out


def bench_sorted_route(tokens=(1,), experts=384, top_k=8, scoring="sigmoid", renormalize=True, scaling=1.0,
                       layers=1, held=(), device="cuda", reps=20, progress=True, **_router) -> list[dict]:
    """Per T, uniform routing of one layer that sorts its pairs in the same launch, against the routing and then
    moe_align's own launch: the places of `held` (() = every expert), the sorts checked equal first."""
    from ..kernels.declared_route import declared_route
    from ..kernels.fused_moe import align_outputs, moe_align

    local, sorted_experts = None, experts
    if held:
        local = torch.full((experts,), len(held), dtype=torch.int64)
        local[list(held)] = torch.arange(len(held))
        local, sorted_experts = local.to(device), len(held) + 1
    rows = []
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        keys = token_keys(torch.randint(0, 163_840, (T,), generator=g), torch.arange(4096, 4096 + T)).to(device)
        logits = (torch.randn(T, experts, generator=g) * 2).to(device)
        routed = align_outputs(T * top_k, sorted_experts, device)
        args = (logits, top_k, scoring, renormalize, scaling)
        kw = dict(keys=keys, layer=layers - 1, local_index=local, ids_dtype=torch.int32)

        def sorted_in_route():
            return declared_route(*args, **kw, routed=routed)

        def then_align():
            _, ids = declared_route(*args, **kw)
            return moe_align(ids, sorted_experts, fuse=True)

        sorted_in_route()
        apart = then_align()
        valid = apart[1] >= 0  # a slot's start is defined where the slot holds an expert
        if not (all(torch.equal(a, b) for a, b in zip(routed[:2] + routed[3:], apart[:2] + apart[3:]))
                and torch.equal(routed[2][valid], apart[2][valid])):
            raise RuntimeError(f"T={T}: the sort in the routing's launch differs from moe_align's; no timing")
        row = {"T": T, "sorted_experts": sorted_experts, "sorted_us": time_call_us(sorted_in_route, device, reps),
               "then_align_us": time_call_us(then_align, device, reps)}
        row["sorted_over_then_align"] = row["sorted_us"] / row["then_align_us"]
        rows.append(row)
        if progress:
            print(row, flush=True)
    return rows


def bench_declared_route(tokens=TOKENS, experts=384, top_k=8, scoring="sigmoid", renormalize=True, scaling=1.0,
                         layers=1, n_group=1, topk_group=1, device="cuda", reps=20, baseline=None,
                         progress=True, held=(), warps=()) -> list[dict]:
    """Per T, the declared routing of one layer (the shape's last MoE layer's index) both ways; `baseline`:
    another declared_route module (`load_kernel_file(PATH, …)`), timed on the same inputs. (A declared routing
    has no groups: n_group and topk_group are the router's, for bench_grouped_route.)"""
    layer = DeclaredRouting("uniform", layers - 1, layers)
    rows = []
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        layer.keys = token_keys(torch.randint(0, 163_840, (T,), generator=g),
                                torch.arange(4096, 4096 + T)).to(device)
        # the router's logits in fp32, as a sigmoid router computes them (softmax routers: in the weights' dtype)
        logits = (torch.randn(T, experts, generator=g) * 2).to(device)

        def run(choice):
            with options.using(declared_routing=choice):
                return layer.route(logits, top_k, scoring, renormalize, scaling)

        (w_tri, ids_tri), (w_ref, ids_ref) = run("triton"), run("torch")
        if not torch.equal(ids_tri, ids_ref):
            raise RuntimeError(f"T={T}: the kernel's experts differ from torch's; no timing of another routing")
        row = {"T": T, "max_abs_diff_weights": float((w_tri - w_ref).abs().max()),
               "triton_us": time_call_us(lambda: run("triton"), device, reps),
               "torch_us": time_call_us(lambda: run("torch"), device, reps)}
        row["torch_over_triton"] = row["torch_us"] / row["triton_us"]
        row["per_forward_ms"] = row["triton_us"] * layers / 1000
        if baseline is not None:
            def old():
                return baseline.declared_route(logits, top_k, scoring, renormalize, scaling, keys=layer.keys,
                                               layer=layer.layer)
            w_old, ids_old = old()
            row["equal_to_baseline"] = bool(torch.equal(ids_old, ids_tri) and torch.equal(w_old, w_tri))
            row["baseline_us"] = time_call_us(old, device, reps)
            row["over_baseline"] = row["triton_us"] / row["baseline_us"]
        if warps:
            from ..kernels.declared_route import declared_route

            row["warps_us"] = _time_warps(
                lambda w: declared_route(logits, top_k, scoring, renormalize, scaling, keys=layer.keys,
                                         layer=layer.layer, num_warps=w), ids_tri, warps, device, reps, T)
        rows.append(row)
        if progress:
            print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="kimi-k2.6-ep8-rank", help="an MoE random shape (pairs/random.py)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="another declared_route.py (e.g. an earlier commit's), timed side by side")
    ap.add_argument("--router", action="store_true",
                    help="the shape's own grouped router (grouped_route) instead of declared uniform routing")
    ap.add_argument("--sort", action="store_true",
                    help="AR's steps: the routing that sorts its pairs in the same launch against it and then "
                         "moe_align's launch")
    ap.add_argument("--warps", type=int, nargs="+", default=(), metavar="W",
                    help="also time the routing kernel launched with each of these warp counts (1 2 4 8 16)")
    ap.add_argument("--smoke", action="store_true", help="a tiny router (the interpreter on a CPU): the path runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.baseline and not Path(a.baseline).is_file():
        ap.error(f"--baseline {a.baseline}: no such file")
    if a.smoke:
        shape, tokens = SMOKE, a.tokens or SMOKE_TOKENS
        device = smoke_device(ap)
    else:
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU (--smoke runs a tiny router on the CPU)")
        try:
            shape = router_shape(a.shape)
        except ValueError as e:
            ap.error(f"--shape: {e}")
        tokens, device = a.tokens or TOKENS, "cuda"
    if a.sort and not a.tokens:
        tokens = tuple(range(1, ROUTE_IN_ALIGN_MAX_T + 1))
    if any(t < 1 for t in tokens):
        ap.error(f"--tokens {tokens}: each at least 1")
    if a.router and a.baseline:
        ap.error("--baseline times the declared routing's kernel; --router times the grouped router's")
    if any(w not in (1, 2, 4, 8, 16) for w in a.warps):
        ap.error(f"--warps {list(a.warps)}: each a power of two from 1 to 16")
    if a.sort and (a.router or a.baseline or a.warps):
        ap.error("--sort times declared uniform routing's two ways of sorting; leave out --router, --baseline and "
                 "--warps")
    if a.sort and max(tokens) > ROUTE_IN_ALIGN_MAX_T:
        ap.error(f"--sort --tokens {tokens}: the routing sorts in its own launch up to {ROUTE_IN_ALIGN_MAX_T} tokens")
    baseline = load_kernel_file(a.baseline, "declared_route_baseline") if a.baseline else None
    if a.sort:
        rows = bench_sorted_route(tokens, **shape, device=device)
    elif a.router:
        rows = bench_grouped_route(tokens, **shape, device=device, warps=tuple(a.warps))
    else:
        rows = bench_declared_route(tokens, **shape, device=device, baseline=baseline, warps=tuple(a.warps))
    if a.out:
        write_bench_json(a.out, rows, __name__, argv, shape=shape, shape_name=None if a.smoke else a.shape,
                         baseline=a.baseline, smoke=a.smoke, routing="router" if a.router else "uniform",
                         sort=a.sort)
    return rows


if __name__ == "__main__":
    main()
