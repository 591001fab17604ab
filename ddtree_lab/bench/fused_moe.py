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

INT4 (`--int4 G`, w4a16): the experts are random INT4 in groups of G with bf16 scales, and the same experts
dequantized to bf16 run through the dense kernel side by side (bf16_us, int4_speedup = bf16_us / triton_us); the
floor counts the packed words and scales. `--shape` takes an MoE random shape's block (pairs/random.py:
qwen3-30b-a3b, kimi-k2.6, kimi-k2.6-tp8-rank…); inputs are drawn on the device (a Kimi block's experts are GBs).
An expert-parallel rank's shape (kimi-k2.6-ep8-rank) routes each token over all the model's experts and runs the
pairs its stack holds, the rest marked held elsewhere, as the engine runs a share (`all_experts`; rows time the
expert stage alone and count `pairs_here`).

Command line (GPU): python -m ddtree_lab.bench.fused_moe --out fused_moe.json [--similarity 0.9]
                    [--shape kimi-k2.6 --int4 32]
                    [--config BLOCK_N_UP=16 BLOCK_N_DOWN=16 fuse_route=0]   (launch_config overrides)
                    [--sweep BLOCK_N_UP=32,BLOCK_N_DOWN=32 num_warps=8]   (more overrides, each on the same inputs)
                    [--baseline old_fused_moe.py]   (another version of the kernel, side by side)
                    python -m ddtree_lab.bench.fused_moe --smoke --out /tmp/fused_moe_smoke.json   (CPU)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..kernels.moe_layout import GATHER_LIMIT_BYTES, blocks_at_height, gather_bytes, moe_weight_bytes, routing_stats
from . import load_kernel_file, smoke_device, write_bench_json
from .timing import time_call_us

TOKENS = (1, 8, 16, 65, 129, 1025)
SMOKE = dict(experts=8, top_k=2, hidden=64, width=32, layers=2)
SMOKE_TOKENS = (1, 3, 17)
# --config keys besides the BLOCK_… tiles
CONFIG_KEYS = ("num_warps", "num_stages", "fuse_route", "paired", "SPLIT_K_UP", "SPLIT_K_DOWN", "MAXNREG_UP",
               "MAXNREG_DOWN", "STAGES_UP", "STAGES_DOWN", "COLS_FIRST", "LAST_SPLIT_SUMS")
FLAG_KEYS = ("fuse_route", "paired", "COLS_FIRST", "LAST_SPLIT_SUMS")  # those that are on or off


def block_inputs(T, experts, hidden, width, dtype, device, similarity, seed=0, int4_group=0, router_experts=None):
    """x [T, H], router [router_experts or E, H], and the experts: dense [E, 2I, H], [E, H, I] in dtype, or
    (int4_group) Int4Weights of random nibbles with scales giving about N(0, 0.02), as random shapes draw them.
    Drawn on `device`."""
    from ..kernels.int4 import VALUES_PER_WORD, Int4Weights
    from ..pairs.random import INT4_VALUE_STD

    g = torch.Generator(device=device).manual_seed(seed)
    base = torch.randn(1, hidden, generator=g, device=device)
    x = similarity ** 0.5 * base + (1 - similarity) ** 0.5 * torch.randn(T, hidden, generator=g, device=device)
    router = torch.randn(router_experts or experts, hidden, generator=g, device=device) * 0.02

    def stack(N, K):
        if not int4_group:
            return torch.randn(experts, N, K, generator=g, device=device, dtype=dtype) * 0.02
        packed = torch.randint(-2**31, 2**31 - 1, (experts, N, K // VALUES_PER_WORD), generator=g, device=device,
                               dtype=torch.int32)
        scale = torch.full((experts, N, K // int4_group), 0.02 / INT4_VALUE_STD, dtype=dtype, device=device)
        return Int4Weights(packed, scale, None, int4_group)

    return x.to(dtype), router.to(dtype), stack(2 * width, hidden), stack(hidden, width)


def parse_overrides(items) -> dict:
    """["KEY=INT", …] -> fused_moe launch overrides (KEY a BLOCK_… tile size or one of CONFIG_KEYS; FLAG_KEYS as
    booleans); ValueError naming the item that is not one."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if not (key.startswith("BLOCK_") or key in CONFIG_KEYS) or not value.isdigit():
            raise ValueError(f"{item!r}: want KEY=INT, KEY a tile size BLOCK_… or one of {', '.join(CONFIG_KEYS)}")
        out[key] = bool(int(value)) if key in FLAG_KEYS else int(value)
    return out


def touched_bytes(counts, T, experts, hidden, width, elsize, expert_elsize=None) -> int:
    """What a block must move at least: the router and the touched experts' weights (expert_elsize bytes a value:
    INT4's packed words and scales; default elsize), x in and out."""
    touched = int((counts > 0).sum())
    experts_bytes = moe_weight_bytes(touched, 0, hidden, width, expert_elsize or elsize)
    return int(experts_bytes + experts * hidden * elsize) + 2 * T * hidden * elsize


def bench_fused_moe(tokens=TOKENS, experts=128, top_k=8, hidden=2048, width=768, layers=48, similarity=0.0,
                    dtype=torch.bfloat16, device="cuda", reps=20, copy_gbps=None, progress=True,
                    config: dict | None = None, baseline=None, int4_group: int = 0,
                    sweep: list[dict] | None = None, all_experts: int | None = None) -> list[dict]:
    """`baseline`: another fused_moe module (e.g. `load_baseline(PATH)` of an earlier commit's kernel file),
    timed in the same run on the same inputs: rows gain baseline_us, over_baseline, equal_to_baseline.
    `int4_group`: INT4 experts, beside the dense kernel on the same experts dequantized (bf16_us, int4_speedup);
    the dense kernel's output is then the one compared with. `sweep`: more launch overrides timed on the same inputs
    (rows gain `sweep`: each config's us, ÷ floor, and whether its output equals the row's own bit for bit).
    `all_experts` (an expert-parallel share): tokens route over that many experts, of which the stack holds the
    first `experts` (the placement's rank 0); the rest are held elsewhere. The block then runs as the engine runs
    a share, `fused_moe_routed(…, elsewhere=True)` after a routing in torch, so rows time the expert stage alone
    (no router, its bytes not in the floor) and gain `pairs_here`; the torch path is not timed."""
    from ..kernels import fused_moe as fm
    from ..kernels.moe_layout import route_reference
    from ..moe import _grouped_mm_fits, moe_torch

    share = all_experts is not None and all_experts > experts
    elsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for T in tokens:
        x, router, w_gate_up, w_down = block_inputs(T, experts, hidden, width, dtype, device, similarity, seed=T,
                                                    int4_group=int4_group, router_experts=all_experts)
        if share:  # the pairs of experts past the stack's are another rank's: id `experts` marks them
            weights, ids = route_reference(torch.nn.functional.linear(x, router), top_k, True)
            ids = torch.where(ids < experts, ids, experts)

        def block(module, gate_up, down, counts=None, cfg=config):
            """out, counts: the block of `module` (a fused_moe.py) on these inputs."""
            if share:
                return module.fused_moe_routed(x, weights, ids, gate_up, down, counts=counts, config=cfg,
                                               elsewhere=True)
            return module.fused_moe(x, router, gate_up, down, top_k, True, counts=counts, config=cfg)

        counts = torch.zeros(experts + share, dtype=torch.int32, device=device)
        out, _ = block(fm, w_gate_up, w_down, counts)
        dense = (dense_copy(w_gate_up, dtype), dense_copy(w_down, dtype)) if int4_group else None
        if dense is not None:  # INT4: the dense kernel on the same values
            want, want_counts = block(fm, *dense, cfg=None)
            expert_elsize = (w_gate_up.nbytes + w_down.nbytes) / (dense[0].numel() + dense[1].numel())
        elif share:  # the reference (a loop over the experts)
            want, want_counts = fm.fused_moe_routed_reference(x, weights, ids, w_gate_up, w_down, elsewhere=True)
            expert_elsize = elsize
        else:
            want, want_counts = fm.fused_moe_reference(x, router, w_gate_up, w_down, top_k, True)
            expert_elsize = elsize
        held = counts[:experts]  # a share's last count is its pairs held elsewhere
        router_rows = 0 if share else experts  # a share's block reads no router
        nbytes = touched_bytes(held, T, router_rows, hidden, width, elsize, expert_elsize)
        launch = {**fm.launch_config(T, top_k, experts + share, hidden, width, x.device, elsize, bool(int4_group)),
                  **(config or {})}
        row = dict(T=T, **routing_stats(held), row_blocks=int(blocks_at_height(held, launch["BLOCK_M"])),
                   touched_bytes=nbytes, launch={k: v for k, v in launch.items() if k.startswith("BLOCK")},
                   counts_equal_reference=bool(torch.equal(counts, want_counts)),
                   max_abs_diff=float((out.float() - want.float()).abs().max()),
                   floor_us=None if copy_gbps is None else nbytes / (copy_gbps * 1e3))
        if share:
            row["pairs_here"] = int(held.sum())
        row["triton_us"] = time_call_us(lambda: block(fm, w_gate_up, w_down, counts), device, reps)
        if dense is not None:
            row["bf16_us"] = time_call_us(lambda: block(fm, *dense), device, reps)
            row["int4_speedup"] = row["bf16_us"] / row["triton_us"]
            dense_bytes = touched_bytes(held, T, router_rows, hidden, width, elsize)
            row["bf16_floor_us"] = None if copy_gbps is None else dense_bytes / (copy_gbps * 1e3)
            del dense
        if sweep:
            row["sweep"] = []
            for extra in sweep:
                cfg = {**(config or {}), **extra}
                got, _ = block(fm, w_gate_up, w_down, cfg=cfg)
                us = time_call_us(lambda: block(fm, w_gate_up, w_down, cfg=cfg), device, reps)
                row["sweep"].append(dict(config=extra, us=us, equal=bool(torch.equal(got, out)),
                                         over_floor=None if not row["floor_us"] else us / row["floor_us"]))
        if baseline is not None:
            base_out, base_counts = block(baseline, w_gate_up, w_down, cfg=None)
            row["equal_to_baseline"] = bool(torch.equal(base_out, out) and torch.equal(base_counts, counts))
            row["baseline_us"] = time_call_us(lambda: block(baseline, w_gate_up, w_down, cfg=None), device, reps)
            row["over_baseline"] = row["triton_us"] / row["baseline_us"]
        gather = gather_bytes(T, top_k, hidden, width, elsize)
        if share:
            row["torch_us"], row["torch_error"] = None, "skipped: an expert-parallel share (the expert stage alone)"
        elif int4_group:
            row["torch_us"], row["torch_error"] = None, 'skipped: INT4 experts (the dense kernel runs beside)'
        elif not _grouped_mm_fits(x, width) and gather > GATHER_LIMIT_BYTES:  # moe_torch would refuse it
            row["torch_us"], row["torch_error"] = None, f"skipped: the per-token gather needs {gather / 2**30:.0f} GiB"
        else:
            try:
                row["torch_us"] = time_call_us(lambda: moe_torch(x, router, w_gate_up, w_down, top_k, True), device, reps)
                row["torch_path"] = "grouped_mm" if _grouped_mm_fits(x, width) else "gather"
            except Exception as e:  # recorded, not fatal: the other rows still run
                row["torch_us"], row["torch_error"] = None, f"{type(e).__name__}: {e}"[:300]
        for name in ("triton", "torch", "bf16"):
            floor = row.get("bf16_floor_us") if name == "bf16" else row["floor_us"]
            if floor and row.get(f"{name}_us"):
                row[f"{name}_over_floor"] = row[f"{name}_us"] / floor
        row["per_forward_ms"] = row["triton_us"] * layers / 1e3
        row["floor_per_forward_ms"] = None if row["floor_us"] is None else row["floor_us"] * layers / 1e3
        rows.append(row)
        if progress:
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def dense_copy(w, dtype, chunk: int = 8) -> torch.Tensor:
    """INT4 experts dequantized into one dense [E, N, K] stack, a few experts at a time (dequantizing a Kimi
    block whole would take several times its dense size in intermediates)."""
    from ..kernels.int4 import dequantize

    E, N, K = w.shape
    out = torch.empty(E, N, K, dtype=dtype, device=w.device)
    for e0 in range(0, E, chunk):
        ids = torch.arange(e0, min(E, e0 + chunk), device=w.device)
        out[e0:e0 + len(ids)] = dequantize(w, dtype, experts=ids)
    return out


def block_shape(name: str) -> dict:
    """An MoE random shape's block sizes (its expert stack as one GPU holds it), for bench_fused_moe."""
    from ..pairs.random import shape_configs

    cfg = shape_configs(name)[0]
    if not cfg.is_moe:
        raise ValueError(f"{name} is not an MoE shape")
    shape = dict(experts=cfg.experts_here, top_k=min(cfg.num_experts_per_tok, cfg.experts_here),
                 hidden=cfg.hidden_size, width=cfg.moe_intermediate_size,
                 layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)))
    if cfg.experts_here < cfg.num_experts:  # an expert-parallel share: tokens route over every expert
        shape["all_experts"] = cfg.num_experts
    return shape


def load_baseline(path: str):
    """A fused_moe.py from elsewhere (`git show REV:kernels/fused_moe.py > old.py`) as a module of its own."""
    return load_kernel_file(path, "fused_moe_baseline")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--similarity", type=float, default=0.0, help="0: independent routing; near 1: alike")
    ap.add_argument("--config", nargs="*", default=[], metavar="KEY=INT",
                    help="fused_moe launch_config overrides, e.g. BLOCK_N_UP=16 BLOCK_N_DOWN=32, num_warps=8, "
                         "fuse_route=0 (route in its own launch), paired=0 (INT4 unpacked in fp32)")
    ap.add_argument("--sweep", nargs="+", default=[], metavar="KEY=INT[,KEY=INT…]",
                    help="more launch overrides, each timed on the same inputs as the row, e.g. "
                         "BLOCK_N_UP=32,BLOCK_N_DOWN=32 num_warps=8 num_stages=2")
    ap.add_argument("--baseline", default=None, metavar="FILE",
                    help="another fused_moe.py (e.g. an earlier commit's), timed side by side on the same inputs")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="an MoE random shape's block (pairs/random.py)")
    ap.add_argument("--int4", type=int, default=0, metavar="G", help="INT4 experts in groups of G, beside bf16")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the interpreter on a CPU): the path runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        config = parse_overrides(a.config)
    except ValueError as e:
        ap.error(f"--config {e}")
    try:
        sweep = [parse_overrides(group.split(",")) for group in a.sweep]
    except ValueError as e:
        ap.error(f"--sweep {e}")
    if a.smoke:
        # tiny shapes: the interpreter on the CPU, the compiled kernels on a GPU (a correctness run, not a timing)
        device = smoke_device(ap)
        shape, tokens, dtype, bw = SMOKE, a.tokens or SMOKE_TOKENS, torch.float32, None
    else:
        from .timing import device_copy_gbps

        try:
            shape = block_shape(a.shape)
        except ValueError as e:
            ap.error(f"--shape: {e}")
        tokens, device, dtype = a.tokens or TOKENS, "cuda", torch.bfloat16
        bw = device_copy_gbps()
    if a.baseline and not Path(a.baseline).is_file():
        ap.error(f"--baseline {a.baseline}: no such file")
    rows = bench_fused_moe(tokens, **shape, similarity=a.similarity, dtype=dtype, device=device, copy_gbps=bw,
                           config=config or None, baseline=load_baseline(a.baseline) if a.baseline else None,
                           sweep=sweep,
                           int4_group=a.int4)
    if a.out:
        write_bench_json(a.out, rows, __name__, argv, shape=shape, shape_name=a.shape, int4_group=a.int4,
                         similarity=a.similarity, config=config, sweep=sweep, baseline=a.baseline,
                         dtype=str(dtype).replace("torch.", ""), copy_gbps=bw, smoke=a.smoke)
    return rows


if __name__ == "__main__":
    main()
