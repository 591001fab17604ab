"""Kernel census: what one eager round launches on a GPU, counted on the CPU without one.

The round's stages (decode.RoundProgram, the code a bench e2e times) run once as a warm-up and once counted on
the meta device: tensors have shapes but no data, so a 61-layer Kimi rank costs nothing to hold. The CUDA code
paths are taken (options.tree_kernels="triton", which every Triton-or-torch choice follows; the GPU's SM count
for launch splits; Triton's interpreter off), Triton launches are recorded instead of run. On a GPU every aten op
that computes is one kernel (views and empty allocations are none) and every Triton launch one, so the census is
the kernels a round launches under eager layers. It also sums each op's activation bytes: its tensor inputs and
outputs, except a matmul's weight operand (the weights' own term) and a gather's table (it moves the rows it
outputs), so eager elementwise traffic is priced as bytes. Kernels that their own bench prices whole (the fused
MoE block, MLA attention: PRICED) are counted apart. Compiled layers fuse the elementwise ops; their kernels come
from `bench profile` on a GPU instead (the advisor's calibration).
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import pkgutil
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import options
from ..names import DEFAULT_ROUTING, recorded_routing, routing_kind

CENSUS_SMS = 132  # the H200's SMs: launch splits (attention's, the fused MoE's) follow the calibration GPU's
# The kernel modules whose launches their own bench prices (advisor: moe_block_seconds, mla_call_seconds)
PRICED = {"fused_moe": "moe", "mla_attention": "attention"}
# aten ops that launch nothing: views, metadata and allocations without a fill
FREE_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "as_strided", "detach", "alias",
    "unsqueeze", "squeeze", "permute", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "split", "split_with_sizes", "unbind", "narrow", "_reshape_alias", "reshape", "view_as_real",
    "view_as_complex", "lift_fresh", "diagonal", "unfold", "chunk", "sym_size", "sym_stride", "is_same_size"})
MATMUL_OPS = frozenset({"mm", "bmm", "addmm", "_grouped_mm", "matmul", "linear"})  # operand 0: the activations
# aten ops torch.compile leaves as kernels of their own (library calls, ops it has no lowering for); it fuses the
# runs of other ops between them (and between Triton launches), each run into a few kernels
EXTERN_OPS = MATMUL_OPS | {"topk", "sort", "argsort", "nonzero"}
GATHER_OPS = frozenset({"index", "gather", "index_select", "embedding"})


@dataclass
class StageCensus:
    """One stage's launches: plain kernels (aten ops and Triton launches not in PRICED; `matmuls` of them are
    matmuls), the PRICED ones by part, activation bytes, and the count of each op or kernel. For compiled layers:
    `extern`, the plain kernels compile leaves alone (EXTERN_OPS, Triton launches), and `fused_runs`, the runs of
    other ops between any two launches it leaves alone (what it fuses)."""
    kernels: int = 0
    matmuls: int = 0
    priced: dict = field(default_factory=dict)
    activation_bytes: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)
    extern: int = 0
    fused_runs: int = 0
    in_run: bool = field(default=False, repr=False)  # the last op counted was a fusible one

    def count(self, fusible: bool) -> None:
        """One more kernel that compile fuses with its neighbours (fusible) or leaves alone."""
        if fusible and not self.in_run:
            self.fused_runs += 1
        self.in_run = fusible

    @property
    def launched(self) -> int:
        """Every kernel the stage launches, the PRICED ones included."""
        return self.kernels + sum(self.priced.values())

    def as_json(self) -> dict:
        return {"kernels": self.kernels, "matmuls": self.matmuls, "priced_kernels": dict(self.priced),
                "activation_bytes": self.activation_bytes, "extern": self.extern, "fused_runs": self.fused_runs,
                "by_op": dict(self.by_op.most_common())}


def _nbytes(leaves) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _CountOps(TorchDispatchMode):
    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stage = self.sink[-1] if self.sink else None
        name = func.overloadpacket.__name__
        if stage is None or name in FREE_OPS:
            return out
        ins, outs = tree_leaves((args, kwargs)), tree_leaves(out)
        schema = func._schema.arguments
        in_place = bool(schema) and schema[0].alias_info is not None and schema[0].alias_info.is_write
        if name in MATMUL_OPS:
            moved = _nbytes(ins[:1]) + _nbytes(outs)
        elif name in GATHER_OPS:
            moved = 2 * _nbytes(outs)
        elif in_place:  # writes its other inputs' worth into the first (a cache row, a counter)
            moved = 2 * _nbytes(ins[1:])
        else:
            moved = _nbytes(ins) + _nbytes(outs)
        stage.kernels += 1
        stage.matmuls += name in MATMUL_OPS
        stage.extern += name in EXTERN_OPS
        stage.count(fusible=name not in EXTERN_OPS)
        stage.activation_bytes += moved
        stage.by_op["aten." + name] += 1
        return out


@contextlib.contextmanager
def _cuda_paths(sink: list):
    """Triton launches recorded (not run) into the stage on top of `sink`; each kernel module's SM count and
    interpreter test answer as on the calibration GPU."""
    from triton.runtime import autotuner, jit

    def launch(self, *args, **kwargs):
        fn = getattr(self, "fn", self)  # an autotuner wraps the jitted function
        module = getattr(fn, "__module__", "").rsplit(".", 1)[-1]
        stage = sink[-1] if sink else None
        if stage is not None:
            part = PRICED.get(module)
            if part:
                stage.priced[part] = stage.priced.get(part, 0) + 1
            else:
                stage.kernels += 1
                stage.extern += 1
            stage.count(fusible=False)
            stage.by_op[f"triton.{module}.{getattr(fn, '__name__', '?')}"] += 1

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(jit.JITFunction, "run", launch))
        stack.enter_context(mock.patch.object(autotuner.Autotuner, "run", launch))
        interpreted = getattr(importlib.import_module("triton.runtime.interpreter"), "InterpretedFunction", None)
        if interpreted is not None:
            stack.enter_context(mock.patch.object(interpreted, "run", launch))
        package = importlib.import_module(__package__.rsplit(".", 1)[0] + ".kernels")
        for info in pkgutil.iter_modules(package.__path__):  # every kernel module, imported now to be patched
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for attr, value in (("_sm_count", lambda device: CENSUS_SMS), ("_interpret", lambda: False)):
                if hasattr(module, attr):
                    stack.enter_context(mock.patch.object(module, attr, value))
        stack.enter_context(options.using(tree_kernels="triton"))
        yield


_PAIRS: dict = {}  # (model, attention, routing) -> [pair, the methods it has warmed up]


def census_pair(model: str, attention: str = "triton", routing=None):
    """A pair on the meta device (shapes only), kept for the next census of the same settings: a random shape
    (`random:<shape>[@<layers>]`), a named pair or a directory holding target/ and drafter/ (their config.json
    only: no weights are read)."""
    from ..declared_routing import routing_name

    key = (model, attention, None if routing is None else routing_name(routing))
    if key not in _PAIRS:
        _PAIRS.clear()  # one at a time: a pair holds its caches' (meta) buffers
        if model.startswith("random:"):
            from ..pairs.random import random_pair

            pair = random_pair(model.split(":", 1)[1], device="meta", dtype="bfloat16", attention=attention,
                               routing=routing)
        else:
            pair = _pair_from_configs(model, attention, routing or "router")
        _PAIRS[key] = [pair, set()]
    return _PAIRS[key]


def _pair_from_configs(model: str, attention: str, routing):
    """A checkpoint pair's models built from its config.json files on the meta device (INT4 experts as its
    quantization_config declares them)."""
    import dataclasses
    from pathlib import Path

    from ..checkpoint import Pair
    from ..config import drafter_config_from_hf, read_json, target_config_from_hf
    from ..drafter import Drafter
    from ..model import Target
    from ..moe import SparseMoE
    from ..pairs import PAIRS, resolve
    from ..quant import read_quantization

    if (Path(model) / "target").is_dir():
        tdir, ddir = Path(model) / "target", Path(model) / "drafter"
    elif model in PAIRS:
        tdir, ddir = resolve(model)
    else:
        raise ValueError(f"census: model {model!r} is no random shape (random:<shape>[@<layers>]), pair name or "
                         "directory holding target/ and drafter/")
    for d in (tdir, ddir):
        if not (d / "config.json").is_file():
            raise ValueError(f"census: no {d / 'config.json'}")
    raw = read_json(tdir / "config.json")
    tcfg = target_config_from_hf(raw, tdir / "config.json")
    spec = read_quantization(raw, tdir / "config.json")
    moe_layer = next((i for i in range(tcfg.num_hidden_layers) if tcfg.is_moe_layer(i)), None)
    scheme = spec and moe_layer is not None and spec.scheme_for(f"model.layers.{moe_layer}.mlp.experts.0.gate_proj")
    if scheme:  # INT4 routed experts, as the checkpoint loader reads them (checkpoint._int4_experts)
        tcfg = dataclasses.replace(tcfg, expert_int4_group=scheme.group_size,
                                   expert_int4_asymmetric=not scheme.symmetric)
    dcfg = drafter_config_from_hf(read_json(ddir / "config.json"), ddir / "config.json")
    with torch.device("meta"):
        target, drafter = Target(tcfg).to(torch.bfloat16), Drafter(dcfg).to(torch.bfloat16)
    for block in (b for b in target.modules() if isinstance(b, SparseMoE)):
        block.fill_local_index()
    for m in (target, drafter):
        m.eval().requires_grad_(False)
        m.set_attention(attention)
    target.set_routing(routing)
    return Pair(target=target, drafter=drafter, tokenizer=None, name=model, target_id={}, drafter_id={},
                device=torch.device("meta"), dtype=torch.bfloat16, eos_token_ids=[])


def round_census(model: str, method: str, budget: int | None, prompt_len: int, attention: str = "triton",
                 routing: str | None = None, declared_routing: str | None = None) -> dict[str, StageCensus]:
    """{stage: StageCensus} of one eager round of `method` (DDTree at `budget`) after `prompt_len` tokens."""
    pair, warmed = census_pair(model, attention, routing)
    return count_round(pair, method, budget, prompt_len, declared_routing, warmed)


def count_round(pair, method: str, budget: int | None, prompt_len: int, declared_routing: str | None = None,
                warmed: set | None = None) -> dict[str, StageCensus]:
    """round_census of a pair on the meta device (census_pair's: nothing is read, no Triton kernel runs);
    `warmed`: the (method, declared routing) the pair has already warmed up, updated."""
    from ..decode import RoundProgram, plan_call

    warmed = set() if warmed is None else warmed
    sink: list = []
    with _cuda_paths(sink), options.using(declared_routing=declared_routing), _CountOps(sink):
        plan = plan_call(pair, prompt_len, method, budget, None, 64, 0.0, 0, False, None, None, False, False, 1,
                         False)
        pair.target.setup_cache(plan.cache_len, max_past=plan.context_room)
        pair.drafter.setup_cache(plan.cache_len, max_past=plan.context_room)
        program = RoundProgram(pair, plan.method, plan.budget, plan.topk, 0.0, plan.out_capacity, plan.max_rounds)
        if (method, declared_routing) not in warmed:  # as a graph capture's warm-up: one-time tables (RoPE's,
            for _, run, _ in program.stages:           # the drafter's block mask) are built here, once a pair
                run()
            warmed.add((method, declared_routing))
        out = {}
        for stage, run, _ in program.stages:
            sink.append(out.setdefault(stage, StageCensus()))
            try:
                run()
            finally:
                sink.pop()
    return out


CENSUS_STAGES = ("verify", "draft")  # the stages with layers, whose counts the advisor prices
LAYER_DEPTHS = (2, 4)  # two depths of a random shape: what the deeper one launches more is that many layers'
LAYER_BUDGET = 16      # the tree a verify's layers are counted at


def layer_census(shape: str, stage: str, prompt_len: int = 512, routing: str | None = None) -> tuple[float, float]:
    """(extern kernels, fused runs) that each further layer of random shape `shape` adds to the target forward
    of an AR step (stage "ar") or of a verify (stage "verify", a budget-LAYER_BUDGET tree), its MoE layers routed
    by `routing` (None: the shape's default): its census at LAYER_DEPTHS, differenced (for a shape whose first
    layers are dense, the later kind's)."""
    if stage not in ("ar", "verify"):
        raise ValueError(f"layer_census: stage {stage!r} is not 'ar' or 'verify'")
    method, budget = ("ar", None) if stage == "ar" else ("ddtree", LAYER_BUDGET)
    (e0, r0), (e1, r1) = ((s.extern, s.fused_runs) for s in
                          (round_census(f"random:{shape}@{depth}", method, budget, prompt_len,
                                        routing=routing)["verify"] for depth in LAYER_DEPTHS))
    layers = LAYER_DEPTHS[1] - LAYER_DEPTHS[0]
    return (e1 - e0) / layers, (r1 - r0) / layers


OTHER_ROUTINGS = ("router", "trace")  # kinds (names.routing_kind) counted for an MoE shape beside its default


def counted_routing(kind: str, shape: str):
    """A routing of `kind` for random shape `shape`'s census: "router", or a trace of its own experts and top-k
    (which experts does not change what launches)."""
    if kind != "trace":
        return kind
    from ..declared_routing import RoutingTrace
    from ..pairs.random import shape_configs

    cfg = shape_configs(shape)[0]
    ids = torch.arange(64 * cfg.num_experts_per_tok).remainder(cfg.num_experts).view(64, 1, -1)  # [tokens, layers, k]
    return RoutingTrace(ids, "census")


def file_layer_census(bench: dict) -> dict[str, list[float]]:
    """A compiled bench e2e JSON's layers, counted on this code: {"ar" | "verify": [extern kernels, fused runs]}
    a layer of its random shape launches, under the routing it ran (ValueError: no random shape)."""
    model = bench.get("model") or ""
    if not model.startswith("random:"):
        raise ValueError(f"census: {model!r} is no random shape; only a random shape's layers are counted")
    from ..pairs.random import shape_configs, shape_entry

    shape = model.split(":", 1)[1].split("@")[0]
    if shape_entry(shape) is None:
        raise ValueError(f"census: no random shape {shape!r}")
    kind = routing_kind(recorded_routing(bench)) if shape_configs(shape)[0].is_moe else DEFAULT_ROUTING
    routing = None if kind == DEFAULT_ROUTING else counted_routing(kind, shape)  # a trace's ids launch alike
    return {stage: list(layer_census(shape, stage, routing=routing)) for stage in ("ar", "verify")}


def e2e_census(bench: dict) -> list[dict | None]:
    """Each row of a bench e2e JSON (eager layers) counted under the file's own model, context, attention and
    routing: {stage: {"kernels", "matmuls", "activation_bytes"}} for the stages with layers, None for a
    budget="auto" row (its rounds vary). A file without a `declared_routing` field predates its kernel, so torch
    computed it."""
    if bench.get("compile"):
        raise ValueError("census: compiled layers (compile=True) fuse their kernels; a census counts eager rounds")
    routing = recorded_routing(bench)
    declared = bench.get("declared_routing") or "torch"
    out = []
    for row in bench.get("rows", []):
        budget = row.get("budget") if row["method"] == "ddtree" else None
        if row["method"] == "ddtree" and not isinstance(budget, int):
            out.append(None)
            continue
        stages = round_census(bench.get("model") or "", row["method"], budget, int(bench.get("prompt_len") or 512),
                              bench.get("attention") or "triton", routing, None if declared == "auto" else declared)
        out.append({k: {"kernels": s.kernels, "matmuls": s.matmuls, "activation_bytes": s.activation_bytes}
                    for k, s in stages.items() if k in CENSUS_STAGES})
    return out


def census_layers(model: str, attention: str = "triton", routing=None) -> int:
    """The target's layers, which census_rows divides by."""
    return census_pair(model, attention, routing)[0].target.cfg.num_hidden_layers


def census_rows(model: str, methods, budgets, prompt_len: int, attention: str = "triton",
                routing: str | None = None, declared_routing: str | None = None) -> list[dict]:
    """bench census's rows: per method (and budget), each stage's census, and the verify's kernels per layer."""
    rows = []
    layers = census_layers(model, attention, routing)
    for method in methods:
        for budget in (budgets if method == "ddtree" else [None]):
            stages = round_census(model, method, budget, prompt_len, attention, routing, declared_routing)
            rows.append({"method": method, "budget": budget,
                         "kernels_per_round": sum(s.launched for s in stages.values()),
                         # the embedding, final norm and LM head included
                         "verify_kernels_per_layer": stages["verify"].launched / layers,
                         "stages": {k: s.as_json() for k, s in stages.items()}})
    return rows
