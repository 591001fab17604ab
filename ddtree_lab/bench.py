"""`ddtree-lab bench`: speed measured side by side in one run, written as JSON.

  kernels  verify-attention latency and achieved bandwidth vs tree size and context (triton/sdpa/flex)
  e2e      per-round stage times, rounds/s and tokens/s for AR, DFlash and DDTree at several budgets,
           for a checkpoint, a named pair, or a random-weight real-size shape built on the GPU
           (`random:qwen3-8b`, `random:qwen3-4b`, `random:llama3.1-8b`, the MoE `random:qwen3-30b-a3b`) so real costs can be measured
           without the weights. Also the AR step's roofline (weight bytes ÷ copy bandwidth, same run).
  prompts  tokens/s and speedup of AR, DFlash and DDTree on a pair's shipped prompts
  profile  where a round's time goes: kernels launched and GPU time per stage, and the top kernels
           (eager rounds under torch.profiler: a graph replay hides its kernels from the profiler)
"""
from __future__ import annotations

import bisect
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .atomic import atomic_write_text
from .checkpoint import DTYPES, Pair
from .config import DrafterConfig, RopeConfig, TargetConfig
from .drafter import Drafter
from .model import Target

# Public configs of the shapes (sizes only; the weights are random).
RANDOM_SHAPES = {
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=False, rope=RopeConfig(theta=1e6)),
    "qwen3-4b": dict(arch="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=True, rope=RopeConfig(theta=1e6)),
    "llama3.1-8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        rope=RopeConfig(theta=5e5, type="llama3", factor=8.0, low_freq_factor=1.0,
                                        high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen3-30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          max_position_embeddings=40960, tie_word_embeddings=False, rope=RopeConfig(theta=1e6),
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}
DRAFT_LAYERS = 5  # the public block-16 drafters of these targets have five layers
# The drafters' MLP width where it is not the target's dense width. A drafter is dense: an MoE target's
# expert width is never its size.
DRAFT_INTERMEDIATE = {"qwen3-30b-a3b": 6144}


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    env["source_sha256"] = source_digest()
    return env


def source_digest() -> str:
    """sha256 over the package's and the kernels' Python sources (relative path and bytes, in path
    order): names the code that ran even where a copied tree's git metadata is stale or absent."""
    import hashlib

    pkg = Path(__file__).resolve().parent
    files = sorted(pkg.rglob("*.py")) + sorted((pkg.parent / "kernels").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        if "__pycache__" in f.parts or f.is_symlink() or (f.parent.name == "kernels" and f.parent.parent == pkg):
            continue
        h.update(f.relative_to(pkg.parent).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def random_configs(shape: str) -> tuple[TargetConfig, DrafterConfig]:
    """The target and drafter configs of a random shape (nothing allocated)."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    tcfg = TargetConfig(**RANDOM_SHAPES[shape])
    dcfg = DrafterConfig(hidden_size=tcfg.hidden_size,
                         intermediate_size=DRAFT_INTERMEDIATE.get(shape, tcfg.intermediate_size),
                         num_hidden_layers=DRAFT_LAYERS, num_attention_heads=tcfg.num_attention_heads,
                         num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                         vocab_size=tcfg.vocab_size, block_size=16, num_target_layers=tcfg.num_hidden_layers,
                         mask_token_id=tcfg.vocab_size - 1, rope=tcfg.rope,
                         max_position_embeddings=tcfg.max_position_embeddings)
    return tcfg, dcfg


def random_pair(shape: str, device="cuda", dtype=torch.bfloat16, attention="triton", seed=0,
                compile: bool = False) -> Pair:
    """A real-size target + DFlash drafter with random weights, built directly on the device."""
    tcfg, dcfg = random_configs(shape)
    torch.manual_seed(seed)
    models = []
    for cls, cfg in ((Target, tcfg), (Drafter, dcfg)):
        with torch.device("meta"):
            m = cls(cfg)
        m = m.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        m.rotary = type(m.rotary)(cfg.head_dim, cfg.rope, m.rotary.max_positions).to(device)
        models.append(m.eval().requires_grad_(False))
    target, drafter = models
    target.set_attention(attention)
    drafter.set_attention(attention)
    if compile:
        target.compile_layers()
        drafter.compile_layers()
    ident = {"path": f"random:{shape}", "kind": tcfg.arch}
    return Pair(target=target, drafter=drafter, tokenizer=None, name=f"random:{shape}", target_id=ident,
                drafter_id={"path": f"random:{shape}-dflash", "kind": "dflash"}, device=torch.device(device),
                dtype=dtype, eos_token_ids=[])


def weight_bytes_per_step(target: Target, experts_touched: list[float] | None = None) -> int:
    """Bytes of weights one decoding step reads: every matrix, but one row of an untied embedding, and of
    an MoE block the router and the touched experts: `experts_touched[l]` of MoE layer l's E (default: the
    top-k, what one token reads), e.g. a verify forward's counts from a traced round."""
    from .moe import SparseMoE

    share = {}
    moe = [(name, m) for name, m in target.named_modules() if isinstance(m, SparseMoE)]
    for i, (mname, m) in enumerate(moe):
        touched = m.top_k if experts_touched is None else experts_touched[i]
        share[f"{mname}.gate_up"] = share[f"{mname}.down"] = touched / m.num_experts
    total = 0
    for name, p in target.named_parameters():
        if name == "embed_tokens.weight" and target.lm_head is not None:
            continue  # untied: the step reads one row, not the table
        total += p.numel() * p.element_size() * share.get(name, 1.0)
    return int(total)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + written), the roofline's denominator."""
    from .kernels.bench import device_copy_gbps

    return device_copy_gbps(nbytes) * 1e9


def bench_e2e(pair: Pair, budgets=(16, 64, 256, 1024), prompt_len: int = 512, rounds: int = 24,
              methods=("ar", "dflash", "ddtree"), cuda_graphs: bool | None = None, progress=True) -> dict:
    """Per method/budget: stage seconds per round, round time, rounds/s, tokens/s (same prompt)."""
    from .decode import generate

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, pair.target.cfg.vocab_size - 2, (prompt_len,), generator=g).tolist()
    runs = [("ar", None)] if "ar" in methods else []
    runs += [("dflash", None)] if "dflash" in methods else []
    runs += [("ddtree", b) for b in budgets] if "ddtree" in methods else []
    rows = []
    for method, budget in runs:
        kw = dict(method=method, budget=budget or 16, max_new_tokens=rounds, trace=False, stop=[],
                  cuda_graphs=cuda_graphs)
        generate(pair, prompt, **kw)  # warm-up: compiles kernels and captures graphs
        res = generate(pair, prompt, **kw)
        n = len(res.acceptance_lengths)
        per_round = {k: v / n for k, v in res.stage_seconds.items() if k != "other"}
        forward_s = sum(per_round.values())
        row = {"method": method, "budget": budget, "rounds": n, "mean_tau": res.mean_acceptance,
               "stage_seconds_per_round": per_round,
               "round_seconds": forward_s,
               "wall_seconds": res.wall_seconds, "prefill_seconds": res.prefill_seconds,
               "rounds_per_second": n / max(res.wall_seconds - res.prefill_seconds, 1e-9),
               "tokens_per_second": len(res.tokens) / max(res.wall_seconds, 1e-9),
               "settings": res.settings}
        if pair.target.cfg.is_moe:  # a few traced rounds: the experts each MoE layer's verify touched
            traced = generate(pair, prompt, **{**kw, "trace": True, "max_new_tokens": min(rounds, 8)})
            per_layer = [sum(col) / len(col) for col in zip(*(r.experts_touched for r in traced.rounds))]
            row["experts_touched_per_layer"] = per_layer
            row["experts_touched_mean"] = sum(per_layer) / len(per_layer)
        rows.append(row)
        if progress:
            print(f"  {method:6s} budget={budget!s:5s} round {forward_s * 1e3:8.3f} ms  "
                  + " ".join(f"{k}={v * 1e3:.3f}" for k, v in per_round.items()), file=sys.stderr, flush=True)
    return {"rows": rows}


def bench_model(model: str, dtype, attention, device, compile=False) -> Pair:
    """A random real-size shape, a named pair, or a directory holding target/ and drafter/."""
    if model.startswith("random:"):
        pair = random_pair(model.split(":", 1)[1], device=device, dtype=DTYPES[dtype], attention=attention,
                           compile=compile)
    else:
        from .checkpoint import load_pair

        named = "/" not in model and not Path(model).exists()
        pair = load_pair(model if named else None, target=None if named else Path(model) / "target",
                         drafter=None if named else Path(model) / "drafter", device=device, dtype=dtype,
                         attention=attention, compile=compile)
    return pair


def run_e2e(model: str, budgets, prompt_len, rounds, dtype, attention, device, compile=False) -> dict:
    pair = bench_model(model, dtype, attention, device, compile)
    out = {"model": model, "dtype": dtype, "attention": attention, "prompt_len": prompt_len, "compile": compile}
    if pair.device.type == "cuda":
        bw = copy_bandwidth()
        wb = weight_bytes_per_step(pair.target)
        out["roofline"] = {"copy_bytes_per_second": bw, "weight_bytes_per_step": wb,
                           "ar_step_roofline_seconds": wb / bw}
    out.update(bench_e2e(pair, budgets=budgets, prompt_len=prompt_len, rounds=rounds))
    if "roofline" in out:
        ar = next((r for r in out["rows"] if r["method"] == "ar"), None)
        if ar:
            out["roofline"]["ar_step_over_roofline"] = ar["round_seconds"] / out["roofline"]["ar_step_roofline_seconds"]
            for r in out["rows"]:
                r["round_over_ar_step"] = r["round_seconds"] / ar["round_seconds"]
        for r in out["rows"]:  # MoE: the verify's floor is the weights of the experts it touched
            if "experts_touched_per_layer" in r:
                r["verify_floor_seconds"] = weight_bytes_per_step(pair.target, r["experts_touched_per_layer"]) / bw
                r["verify_over_floor"] = r["stage_seconds_per_round"]["verify"] / r["verify_floor_seconds"]
    return out


def bench_prompts(pair: Pair, prompts: list, budgets=(16, 32, 64, 128, 256), max_new_tokens: int = 96,
                  cuda_graphs: bool | None = None, progress=True, repeats: int = 3) -> dict:
    """Tokens/s of AR, DFlash and DDTree on real prompts (same prompts, same run), and the speedup.

    Each repeat runs every method over all prompts in turn, so drift (clocks, a busy host) touches
    all methods alike; a method's tokens/s is its median over the repeats (each repeat's is kept).
    Tokens/s counts the whole `generate` call, prefill included; `decode_tokens_per_second` leaves the
    prefill out, and `stage_seconds` splits the median repeat's time by stage (events between stages)."""
    import statistics

    from .decode import generate

    runs = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in budgets]
    kws = [dict(method=m, budget=b or 16, max_new_tokens=max_new_tokens, trace=False, cuda_graphs=cuda_graphs,
                stop=[]) for m, b in runs]
    for prompt in prompts:  # every prompt length once, untimed: a compiled model specialises on shapes
        generate(pair, prompt, method="ar", max_new_tokens=2, trace=False, cuda_graphs=cuda_graphs, stop=[])
    for kw in kws:
        generate(pair, prompts[0], **kw)  # warm-up: kernels compiled, graphs captured
    rows = [{"method": m, "budget": b, "seconds_per_repeat": [], "prefill_seconds_per_repeat": [],
             "stage_seconds_per_repeat": []} for m, b in runs]
    for rep in range(max(1, repeats)):
        for row, kw in zip(rows, kws):
            tokens, seconds, prefill, stages, taus, outputs = 0, 0.0, 0.0, {}, [], []
            for prompt in prompts:
                res = generate(pair, prompt, **kw)
                tokens += len(res.tokens)
                seconds += res.wall_seconds
                prefill += res.prefill_seconds
                for stage, sec in res.stage_seconds.items():
                    stages[stage] = stages.get(stage, 0.0) + sec
                taus += res.acceptance_lengths
                outputs.append(res.tokens)
            row["seconds_per_repeat"].append(seconds)
            row["prefill_seconds_per_repeat"].append(prefill)
            row["stage_seconds_per_repeat"].append(stages)
            if rep == 0:  # tokens and τ are the same every repeat (T = 0)
                row.update(tokens=tokens, mean_tau=sum(taus) / len(taus), outputs=outputs)
    for row in rows:
        per_repeat = [row["tokens"] / s for s in row["seconds_per_repeat"]]
        row["tokens_per_second_per_repeat"] = per_repeat
        row["tokens_per_second"] = statistics.median(per_repeat)
        row["seconds"] = statistics.median(row["seconds_per_repeat"])
        median = min(range(len(per_repeat)), key=lambda i: abs(per_repeat[i] - row["tokens_per_second"]))
        row["prefill_seconds"] = row["prefill_seconds_per_repeat"][median]
        row["stage_seconds"] = row["stage_seconds_per_repeat"][median]
        row["decode_tokens_per_second"] = row["tokens"] / max(row["seconds_per_repeat"][median] - row["prefill_seconds"], 1e-9)
        if progress:
            print(f"  {row['method']:6s} budget={row['budget']!s:5s} {row['tokens_per_second']:9.1f} tok/s "
                  f"(repeats {min(per_repeat):.0f}–{max(per_repeat):.0f})  tau {row['mean_tau']:.2f}  "
                  f"prefill {row['prefill_seconds'] / row['seconds_per_repeat'][median]:.0%} of the time, "
                  f"decode alone {row['decode_tokens_per_second']:.0f} tok/s", file=sys.stderr, flush=True)
    ar = rows[0]
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
        r["decode_speedup_over_ar"] = r["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
        r["lossless"] = r["outputs"] == ar["outputs"]
        # in bf16 a near-tied argmax can flip between batched verify and AR's one-token step: count them
        r["prompts_equal_to_ar"] = sum(o == a for o, a in zip(r["outputs"], ar["outputs"]))
    for r in rows:
        del r["outputs"]
    best = max(rows[2:], key=lambda r: r["tokens_per_second"]) if len(rows) > 2 else None
    return {"rows": rows, "best_budget": best and best["budget"], "repeats": max(1, repeats)}


def profile_rounds(pair: Pair, method: str = "ddtree", budget: int = 64, prompt_len: int = 512,
                   rounds: int = 8, top: int = 25) -> dict:
    """Kernels launched and their microseconds, per stage per round, from eager rounds under
    torch.profiler.

    On a GPU every device event counts (torch's kernels, Triton's, copies), attributed by its start
    on the GPU to the stage running then: the rounds run with a synchronisation after each stage
    (`generate(profile=True)`), so a stage's kernels start after its host span begins and before the
    next stage's does. (Triton kernels are launched outside any torch op, so attributing kernels to
    the op that launched them would miss them.) On the CPU the outermost ops of each stage count."""
    from torch.profiler import ProfilerActivity, profile

    from .decode import generate
    from .trace import STAGES

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, pair.target.cfg.vocab_size - 2, (prompt_len,), generator=g).tolist()
    on_gpu = pair.device.type == "cuda"
    kw = dict(method=method, budget=budget, max_new_tokens=rounds, trace=False, stop=[], cuda_graphs=False,
              profile=on_gpu)
    generate(pair, prompt, **kw)  # warm-up (compiles, autotunes)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        res = generate(pair, prompt, **kw)
    work = _device_work(prof, STAGES) if on_gpu else _cpu_work(prof, STAGES)
    per_stage = {s: {"kernels": 0, "us": 0.0} for s in STAGES}
    by_name: dict[tuple, list] = {}  # (stage, kernel) -> [us, count]
    for stage, name, us in work:
        per_stage[stage]["kernels"] += 1
        per_stage[stage]["us"] += us
        agg = by_name.setdefault((stage, name), [0.0, 0])
        agg[0] += us
        agg[1] += 1
    n = len(res.acceptance_lengths)
    stages = {s: {"kernels_per_round": v["kernels"] / n, "us_per_round": v["us"] / n}
              for s, v in per_stage.items() if v["kernels"]}
    total = sum(v["us_per_round"] for v in stages.values()) or 1.0
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"method": method, "budget": budget if method == "ddtree" else None, "rounds": n,
            "device": "GPU kernels" if on_gpu else "CPU ops (outermost)", "stages": stages, "us_per_round": total,
            "kernels_per_round": sum(v["kernels_per_round"] for v in stages.values()),
            "top_kernels": [{"name": name[:120], "stage": stage, "us_per_round": v[0] / n, "per_round": v[1] / n,
                             "share": v[0] / n / total} for (stage, name), v in tops]}


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto activity types that are device work


def _device_work(prof, stage_names) -> list[tuple[str, str, float]]:
    """(stage, kernel name, µs) for every GPU event that starts inside a stage's window: from the
    stage span's start to the next span's start (prefill and the host reads have no stage)."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    spans = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                   if e.device_type() == DeviceType.CPU and e.name() in stage_names + ("prefill",))
    starts = [a for a, _, _ in spans]
    out = []
    for e in events:
        # kernels and copies only: not the GPU mirror of annotations, nor synchronisation waits
        if e.device_type() != DeviceType.CUDA or e.duration_ns() <= 0 or not _is_device_work(e, stage_names):
            continue
        i = bisect.bisect_right(starts, e.start_ns()) - 1
        if i < 0 or spans[i][2] == "prefill":
            continue
        out.append((spans[i][2], e.name(), e.duration_ns() / 1e3))
    return out


def _is_device_work(e, stage_names) -> bool:
    if hasattr(e, "activity_type"):  # newer torch says what the event is
        return e.activity_type() in GPU_WORK
    # older: leave out annotations mirrored on the GPU and synchronisation waits by their names
    name = e.name()
    return name not in stage_names + ("prefill",) and "sync" not in name.lower() and not (
        hasattr(e, "is_user_annotation") and e.is_user_annotation())


def _cpu_work(prof, stage_names) -> list[tuple[str, str, float]]:
    """On the CPU the outermost ops of a stage stand in for kernels."""
    out = []
    for e in prof.events():
        parent = e.cpu_parent
        if parent is not None and parent.name in stage_names:
            out.append((parent.name, e.name, e.cpu_time_total))
    return out


def _add_runtime_args(p) -> None:
    """How the models run: the same options for every end-to-end bench."""
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention", default="triton")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="fuse per-layer elementwise work (torch.compile)")
    p.add_argument("--compile-mode", choices=["default", "max-autotune-no-cudagraphs"], default="default",
                   help="with --compile: torch.compile's mode; max-autotune-no-cudagraphs times the compiler's own "
                        "matmul kernels against cuBLAS (compiling takes minutes)")
    p.add_argument("--tree-kernels", choices=["auto", "torch", "triton"], default="auto",
                   help="who builds, masks and walks trees: auto (Triton on CUDA), torch, or triton")
    p.add_argument("--tree-build", choices=["auto", "sort", "count", "fused"], default="auto",
                   help="which tree build runs where it takes the beam (sort elsewhere): the torch sort, the "
                        "counting kernels or the one-launch kernel; auto: tree.build_tree's measured choice")
    p.add_argument("--tree-topk", choices=["auto", "torch", "triton"], default="auto",
                   help="the per-depth top-K over the vocabulary: torch (log_softmax, topk) or triton (one launch, "
                        "vocabularies up to kernels/vocab_topk.MAX_VOCAB); auto: tree.TREE_TOPK's default (torch)")
    p.add_argument("--host-read-lag", type=int, default=None,
                   help="host reads in flight before it waits (default: 1 on CUDA, the next round stays queued; "
                        "0 elsewhere); 0 reads after each round")
    p.add_argument("--attn-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Triton attention launch choices for the whole run (kernels/tree_attention.py: "
                        "launch_config), e.g. min_chunk=128 waves=4 num_splits=8")


def add_bench_args(p) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    k = sub.add_parser("kernels", help="verify attention: triton vs sdpa (dense mask) vs flex")
    k.add_argument("--trees", type=int, nargs="+", default=[16, 64, 256, 1024])
    k.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    k.add_argument("--backends", nargs="+", default=["triton", "sdpa", "flex"])
    k.add_argument("--out", default="outputs/bench/kernels.json")
    e = sub.add_parser("e2e", help="end-to-end rounds: AR, DFlash, DDTree at several budgets")
    e.add_argument("--model", default="random:qwen3-8b",
                   help="random:qwen3-8b | random:qwen3-4b | random:llama3.1-8b | random:qwen3-30b-a3b | a pair name | a dir "
                        "holding target/ and drafter/")
    e.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    e.add_argument("--prompt-len", type=int, default=512)
    e.add_argument("--rounds", type=int, default=24)
    _add_runtime_args(e)
    e.add_argument("--out", default="outputs/bench/e2e.json")
    r = sub.add_parser("prompts", help="tokens/s and speedup on a pair's shipped prompts")
    r.add_argument("--pair", default="lab")
    r.add_argument("--prompts", default="lab:code", help="prompt set, e.g. lab:code or a .jsonl path")
    r.add_argument("--n-prompts", type=int, default=8)
    r.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    r.add_argument("--max-new-tokens", type=int, default=96)
    r.add_argument("--repeats", type=int, default=3, help="interleaved passes over all methods; tok/s is the median")
    _add_runtime_args(r)
    r.add_argument("--out", default="outputs/bench/prompts.json")
    f = sub.add_parser("profile", help="kernels and GPU time per stage of eager rounds (torch.profiler)")
    f.add_argument("--model", default="random:qwen3-8b", help="as for e2e")
    f.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"])
    f.add_argument("--budgets", type=int, nargs="+", default=[64])
    f.add_argument("--prompt-len", type=int, default=512)
    f.add_argument("--rounds", type=int, default=8)
    _add_runtime_args(f)
    f.add_argument("--out", default="outputs/bench/profile.json")


ATTN_CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "num_splits", "waves", "min_chunk")


def parse_attn_config(items: list[str]) -> dict:
    """['min_chunk=128', 'waves=4'] -> {'min_chunk': 128, 'waves': 4.0}; unknown keys are refused."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in ATTN_CONFIG_KEYS or not value:
            raise ValueError(f"--attn-config {item!r}: expected KEY=VALUE with KEY one of {', '.join(ATTN_CONFIG_KEYS)}")
        out[key] = float(value) if key == "waves" else int(value)
    return out


def run_bench_cli(args) -> int:
    from . import tree

    if getattr(args, "tree_kernels", "auto") != "auto":
        tree.TREE_KERNELS = args.tree_kernels
    if getattr(args, "tree_build", "auto") != "auto":
        tree.TREE_BUILD = args.tree_build
    if getattr(args, "tree_topk", "auto") != "auto":
        tree.TREE_TOPK = args.tree_topk
    from . import decode

    if getattr(args, "host_read_lag", None) is not None:
        decode.HOST_READ_LAG = max(0, args.host_read_lag)
    compile_mode = getattr(args, "compile_mode", "default")
    if compile_mode != "default":
        from .layers import COMPILE_OPTIONS

        COMPILE_OPTIONS["mode"] = compile_mode
    attn_config = parse_attn_config(getattr(args, "attn_config", []))
    if attn_config:
        from .kernels.tree_attention import LAUNCH_OVERRIDES

        LAUNCH_OVERRIDES.update(attn_config)
    if args.bench == "kernels":
        if not torch.cuda.is_available():
            raise ValueError("bench kernels needs a CUDA GPU")
        from .kernels.bench import bench_tree_attention, device_copy_gbps, summary_table

        rows = bench_tree_attention(args.trees, args.contexts, tuple(args.backends), progress=True)
        result = {"kind": "kernels", "environment": environment(), "copy_gbps": device_copy_gbps(), "rows": rows}
        print(summary_table(rows), file=sys.stderr)
    elif args.bench == "prompts":
        from .checkpoint import load_pair
        from .study import load_prompts

        pair = load_pair(args.pair, device=args.device, dtype=args.dtype, attention=args.attention,
                         compile=args.compile)
        prompts = [p["prompt"] for p in load_prompts(args.prompts, args.n_prompts)]
        result = {"kind": "prompts", "environment": environment(), "pair": pair.describe(), "compile": args.compile,
                  "tree_kernels": args.tree_kernels,
                  "prompt_set": args.prompts, "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                  **bench_prompts(pair, prompts, args.budgets, args.max_new_tokens, repeats=args.repeats)}
    elif args.bench == "profile":
        pair = bench_model(args.model, args.dtype, args.attention, args.device, args.compile)
        runs = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [None])]
        rows = []
        for method, budget in runs:
            row = profile_rounds(pair, method, budget or 16, args.prompt_len, args.rounds)
            rows.append(row)
            print(f"  {method:6s} budget={budget!s:5s} {row['kernels_per_round']:6.0f} kernels "
                  f"{row['us_per_round']:9.1f} us/round  " + " ".join(
                      f"{s}={v['kernels_per_round']:.0f}k/{v['us_per_round']:.0f}us"
                      for s, v in row["stages"].items()), file=sys.stderr, flush=True)
        result = {"kind": "profile", "environment": environment(), "model": args.model, "dtype": args.dtype,
                  "attention": args.attention, "compile": args.compile, "tree_kernels": args.tree_kernels, "rows": rows}
    else:
        start = time.perf_counter()
        result = {"kind": "e2e", "environment": environment(),
                  **run_e2e(args.model, args.budgets, args.prompt_len, args.rounds, args.dtype, args.attention,
                            args.device, args.compile)}
        result["tree_kernels"] = args.tree_kernels
        result["bench_seconds"] = time.perf_counter() - start
    result["tree_build"] = getattr(args, "tree_build", "auto")
    result["tree_topk"] = getattr(args, "tree_topk", "auto")
    result["attn_config"] = attn_config
    result["compile_mode"] = compile_mode
    result["host_read_lag"] = decode.host_read_lag(getattr(args, "device", "cuda"))
    atomic_write_text(Path(args.out), json.dumps(result, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
