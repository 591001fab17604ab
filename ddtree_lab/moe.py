"""The sparse mixture-of-experts MLP of Qwen3Moe and DeepSeek-V3 targets.

A router picks each token's top-k of E experts (Qwen3Moe: softmax, then optionally renormalised over the k;
DeepSeek-V3: grouped sigmoid routing, moe_layout.route_grouped_reference); each expert is a SwiGLU MLP; the
block's output is the routing-weighted sum of the k experts' outputs (plus DeepSeek's shared experts). Experts
are stored stacked: `gate_up` [E, 2I, H] (gate rows, then up rows) and `down` [E, H, I].

Two paths, both of fixed shape with no host synchronisation, so a round stays one captured graph:
the Triton kernels of `kernels/fused_moe.py` where `tree.use_triton` says so (CUDA), else `moe_torch`.
Either writes the per-expert token counts of its last call into the static buffer `counts` [E]: tracing
reads it after a forward to count the experts touched; an untraced replay never reads it. A forward whose
experts need gradients (training) runs `moe_torch_dense` instead, which fills `counts` too.

Expert parallelism (one rank's share, `held`): the block holds some of the E experts, routes over all E, and
computes only the pairs its experts take; a pair routed elsewhere is id `experts_here` in the kernels (adds
nothing), and `counts` has one entry more for them. The other ranks' share and the exchange are not here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import options
from .kernels.int4 import VALUES_PER_WORD, Int4Weights, check_group, dequantize
from .declared_routing import routing_kernel_runs
from .kernels.moe_layout import (GATHER_LIMIT_BYTES, SORT_IN_ROUTING_MAX_T, gather_bytes, route_grouped_reference,
                                 route_reference, routing_stats)
from .layers import GatedMLP, skinny_linear, takes_skinny
from .tree import use_triton


def _grouped_mm_fits(x: torch.Tensor, I: int) -> bool:
    # torch's grouped matmul takes bf16 on CUDA with 16-byte aligned rows; elsewhere the per-token gather runs
    H = x.shape[-1]
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and H % 8 == 0 and I % 8 == 0)


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's router (moe_layout.route_grouped_reference): sigmoid or softmax scores, a correction bias,
    groups, scaling. Qwen3Moe routes by softmax top-k instead (None), inside the fused kernel."""

    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


def moe_routing(cfg) -> GroupedRouting | None:
    """The router of a target config's MoE blocks."""
    if cfg.arch != "deepseek_v3":
        return None
    return GroupedRouting(cfg.scoring_func, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)


def moe_torch(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool, counts: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype, in torch, fixed shapes, softmax top-k routing (moe_torch_routed)."""
    weights, ids = route_reference(F.linear(x, router_weight), top_k, renormalize)  # [T, k] each
    return moe_torch_routed(x, weights, ids, w_gate_up, w_down, counts)


def moe_torch_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, counts: torch.Tensor | None = None, elsewhere: bool = False) -> torch.Tensor:
    """x [T, H], routing weights/ids [T, k] -> [T, H] in x's dtype, in torch, fixed shapes. On CUDA in bf16: the
    (token, expert) pairs sorted by expert and two grouped matmuls over device offsets (each touched expert's
    weights read once). Elsewhere: each token gathers its k experts' weights, [T, k, 2I, H] (fine for the small
    models that run on a CPU, not for large ones: past GATHER_LIMIT_BYTES it is refused). `elsewhere`: id E
    marks a pair another rank's expert takes (no term here; `counts` [E + 1] counts them last)."""
    T, H = x.shape
    top_k = ids.shape[1]
    E, two_i, _ = w_gate_up.shape
    if elsewhere:
        here = ids < E
        y = moe_torch_routed(x, weights * here, ids.clamp(max=E - 1), w_gate_up, w_down)  # elsewhere: weight 0
        if counts is not None:
            counts.zero_().scatter_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1), dtype=torch.int32))
        return y
    I = two_i // 2
    grouped = _grouped_mm_fits(x, I)
    if not grouped and (need := gather_bytes(T, top_k, H, I, w_gate_up.element_size())) > GATHER_LIMIT_BYTES:
        raise ValueError(f"moe_torch: the per-token gather of {T} tokens × {top_k} experts needs {need / 2**30:.1f} "
                         f"GiB, over the {GATHER_LIMIT_BYTES / 2**30:.0f} GiB limit; run the fused kernel "
                         "(Triton) or bf16 on CUDA (grouped matmul)")
    flat = ids.reshape(-1)                                                           # [T*k], pair p = t*k + j
    per_expert = torch.zeros(E, dtype=torch.int32, device=x.device) if counts is None else counts.zero_()
    per_expert.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    if grouped:
        order = flat.argsort(stable=True)                                            # pairs by expert
        offsets = per_expert.cumsum(0, dtype=torch.int32)                            # [E] group ends
        xs = x[order // top_k]                                                       # [T*k, H]
        gate, up = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offsets).split(I, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets)  # [T*k, H]
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(T, top_k, H)         # back to pair order
    else:
        gu = torch.einsum("th,tkoh->tko", x, w_gate_up[ids])                         # [T, k, 2I]
        gate, up = gu.split(I, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w_down[ids])            # [T, k, H]
    return (y.float() * weights[..., None]).sum(1).to(x.dtype)


def moe_torch_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Training: x [T, H], routing weights/ids [T, k] -> [T, H]. Every expert runs on every token and its output
    counts with the token's routing weight for it (0 off the token's top-k): the sparse block's function,
    differentiable in router and experts, in two large matmuls (E/k times the sparse FLOPs, which for the small
    models trained here costs less than E small matmuls and their backward). Fills `counts` as the other paths."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    flat = ids.reshape(-1)
    per_expert = torch.zeros(E, dtype=torch.int32, device=x.device) if counts is None else counts.zero_()
    per_expert.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    combine = weights.new_zeros(T, E).scatter(1, ids, weights)                       # [T, E] fp32
    gate, up = torch.einsum("th,eoh->teo", x, w_gate_up).split(two_i // 2, dim=-1)   # [T, E, I] each
    h = F.silu(gate) * up * combine[..., None]                                       # [T, E, I]
    return torch.einsum("tei,ehi->th", h, w_down).to(x.dtype)


class Float32Router(nn.Module):
    """A router whose logits are fp32 whatever dtype the model moves to: DeepSeek's reference routes in fp32, and a
    bf16 product would pick other experts near ties. `weight` [E, H] keeps the dtype its values need: fp32, or
    bf16 once `narrow()` finds every value a bf16 (a checkpoint stored in bf16, as DeepSeek-V3's and Kimi K2's
    are). Either way each product is exact in fp32 and the sums run in fp32; the bf16 copy reads half the bytes
    and takes the tensor cores. `e_score_correction_bias` [E] fp32 (a parameter so checkpoints fill it as any
    tensor)."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, H] -> logits [T, E] fp32
        w = self.weight
        if w.dtype == x.dtype == torch.bfloat16 and x.device.type in ("cuda", "meta"):  # meta: the census's GPU
            if takes_skinny(x, w):
                return skinny_linear(x, w, True)
            return torch.mm(x, w.t(), out_dtype=torch.float32)  # bf16 products, fp32 sums
        return F.linear(x.float(), w.float())

    def narrow(self) -> bool:
        """Keep `weight` in bf16 when that loses nothing (every value a bf16); True if it is bf16 now."""
        w = self.weight.data
        if w.dtype == torch.float32 and not w.is_meta and torch.equal(w.to(torch.bfloat16).float(), w):
            self.keep_bf16()
        return self.weight.dtype == torch.bfloat16

    def keep_bf16(self) -> None:
        """`weight` in bf16 from now on, rounded where a value was not one (a random shape's router)."""
        self.weight = nn.Parameter(self.weight.data.to(torch.bfloat16), requires_grad=self.weight.requires_grad)

    def _apply(self, fn, recurse=True):
        # take fn's device, never its dtype: each parameter keeps its own (fn of an empty tensor shows where it
        # sends tensors)
        for name, p in self._parameters.items():
            device = fn(p.new_empty(0)).device
            data = (torch.empty(p.shape, dtype=p.dtype, device=device) if p.is_meta
                    else p.data.to(device=device))
            self._parameters[name] = nn.Parameter(data, requires_grad=p.requires_grad)
        return self


def narrow_routers(model: nn.Module) -> None:
    """Each fp32 router whose weights are all bf16 values keeps them in bf16 (Float32Router.narrow)."""
    for m in model.modules():
        if isinstance(m, Float32Router):
            m.narrow()


class Int4Experts(nn.Module):
    """E experts' [N, K] weights kept packed, 4 bits a value (kernels/int4.py has the layout): buffers `packed`
    [E, N, K/8] int32, `scale` [E, N, K/G] (in the model's dtype), `zero` [E, ceil(N/8), K/G] int32 when
    asymmetric. The fused kernels dequantize them tile by tile; `weights()` is what they take."""

    def __init__(self, E: int, N: int, K: int, group_size: int, asymmetric: bool = False):
        super().__init__()
        check_group(group_size, K, "INT4 experts")
        self.group_size = group_size
        self.register_buffer("packed", torch.zeros(E, N, K // VALUES_PER_WORD, dtype=torch.int32))
        self.register_buffer("scale", torch.ones(E, N, K // group_size))
        zero = torch.zeros(E, -(-N // VALUES_PER_WORD), K // group_size, dtype=torch.int32) if asymmetric else None
        self.register_buffer("zero", zero)

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, words = self.packed.shape
        return E, N, words * VALUES_PER_WORD

    def weights(self) -> Int4Weights:
        return Int4Weights(self.packed, self.scale, self.zero, self.group_size)

    def element_size(self) -> float:
        """Bytes a weight value takes, scales and zero points included (what reading an expert costs)."""
        E, N, K = self.shape
        return self.weights().nbytes / (E * N * K)


def expert_tensor(w):
    """What the kernels take for a stack of experts: the dense parameter, or Int4Experts' Int4Weights."""
    return w.weights() if isinstance(w, Int4Experts) else w


class SparseMoE(nn.Module):
    """Router + E SwiGLU experts, top-k routing: Qwen3Moe's sparse block, or with `routing` DeepSeek-V3's
    (grouped sigmoid routing, fp32 router, plus `shared_intermediate` wide shared experts on every token).
    With `int4_group` the experts are Int4Experts (weight-only INT4, groups of that many values)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 routing: GroupedRouting | None = None, shared_intermediate: int = 0, int4_group: int = 0,
                 int4_asymmetric: bool = False, held: tuple[int, ...] = ()):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate, self.routing = intermediate, routing
        self.held = tuple(held)  # expert parallelism: the global indices of the experts stacked here (() = all)
        distinct = len(set(self.held)) == len(self.held)
        if self.held and not (distinct and 0 <= min(self.held) and max(self.held) < num_experts):
            raise ValueError(f"held experts {self.held[:4]}… must be distinct indices in 0..{num_experts - 1}")
        n = self.experts_here
        self.router = nn.Linear(hidden, num_experts, bias=False) if routing is None else Float32Router(hidden, num_experts)
        if int4_group:
            self.gate_up = Int4Experts(n, 2 * intermediate, hidden, int4_group, int4_asymmetric)
            self.down = Int4Experts(n, hidden, intermediate, int4_group, int4_asymmetric)
        else:
            self.gate_up = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))
            self.down = nn.Parameter(torch.empty(n, hidden, intermediate))
        self.shared = GatedMLP(hidden, shared_intermediate) if shared_intermediate else None
        self.declared = None  # a DeclaredRouting: which experts is declared, not the router's (declared_routing.py)
        # tokens per expert in the last forward (not saved; written in place, so graphs keep its address); held
        # here: one entry more, the pairs routed elsewhere
        self.register_buffer("counts", torch.zeros(n + bool(self.held), dtype=torch.int32), persistent=False)
        if self.held:  # global expert -> its place in the stack, or n (held elsewhere)
            self.register_buffer("local_index", torch.empty(num_experts, dtype=torch.int64), persistent=False)
            self.fill_local_index()

    def fill_local_index(self) -> None:
        """local_index anew (a model built on the meta device and moved by to_empty holds garbage there)."""
        if self.held:
            n = self.experts_here
            self.local_index.fill_(n)
            self.local_index[list(self.held)] = torch.arange(n, device=self.local_index.device)

    @property
    def experts_here(self) -> int:
        return len(self.held) or self.num_experts

    def counts_here(self) -> torch.Tensor:
        """[experts_here] tokens per expert held here in the last forward (the pairs routed elsewhere left out)."""
        return self.counts[:self.experts_here]

    def routing_kernel_runs(self, device) -> bool:
        """Whether route() runs as one launch of kernels/declared_route.py (a declared routing or a grouped
        router, where declared_routing.routing_kernel_runs), which can also sort the pairs (`routed`)."""
        return ((self.declared is not None or self.routing is not None)
                and routing_kernel_runs(self.num_experts, device))

    def route(self, x: torch.Tensor, local: bool = False, ids_dtype: torch.dtype = torch.int64,
              routed: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, ids [T, k] ids_dtype) in fixed shapes: a grouped router's (torch), or
        the declared experts weighted by the router's own scores at them, normalised as the model does (one launch
        where Triton runs). `local`: the ids as places in the stack held here (experts_here: held elsewhere), else
        the experts' own. `routed` (where routing_kernel_runs, up to SORT_IN_ROUTING_MAX_T tokens): fused_moe's
        align_outputs, filled with the pairs' sort in the routing's launch."""
        r = self.routing
        place = self.local_index if local and self.held else None
        # [T, E]: a grouped router's in fp32 (Float32Router), a softmax router's in the weights' dtype
        logits = F.linear(x, self.router.weight) if r is None else self.router(x)
        if self.declared is not None:
            scoring, scaling = ("softmax", 1.0) if r is None else (r.scoring, r.scaling)
            return self.declared.route(logits, self.top_k, scoring, self.renormalize, scaling, place, ids_dtype,
                                       routed, pdl=options.current().launch_pdl)
        if routed is not None and not self.routing_kernel_runs(x.device):
            raise ValueError("routed= sorts the pairs in the routing kernel's launch, which does not run here")
        if r is None:
            weights, ids = route_reference(logits, self.top_k, self.renormalize)
            return weights, (ids if place is None else place[ids]).to(ids_dtype)
        bias = self.router.e_score_correction_bias
        if self.routing_kernel_runs(x.device):
            from .kernels.declared_route import grouped_route

            # one launch, the places, their dtype and the sort included
            return grouped_route(logits, bias, self.top_k, r.n_group, r.topk_group, r.scoring, self.renormalize,
                                 r.scaling, local_index=place, ids_dtype=ids_dtype, routed=routed,
                                 pdl=options.current().launch_pdl)
        weights, ids = route_grouped_reference(logits, bias, self.top_k, r.n_group, r.topk_group, r.scoring,
                                               self.renormalize, r.scaling)
        return weights, (ids if place is None else place[ids]).to(ids_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        if self.shared is not None and x.is_cuda and options.current().overlap_shared:
            return _routed_beside_shared(self, x)
        out = self.routed(x)
        return out if self.shared is None else out + self.shared(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> the routed experts' output [B, T, H] (the shared expert's not added)."""
        return _dispatch(self, x.reshape(-1, x.shape[-1])).view(x.shape)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@torch.compiler.disable  # streams fork and join here, eagerly: a compiled layer calls it whole
def _routed_beside_shared(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] -> the routed experts' output plus the shared expert's, the shared expert on a stream of its own
    (options.overlap_shared): forked after x is written, joined before the sum. In a captured graph the fork
    becomes a branch beside the routing and the experts."""
    main = torch.cuda.current_stream(x.device)
    side = _SIDE_STREAMS.setdefault(x.device, torch.cuda.Stream(x.device))
    side.wait_stream(main)
    with torch.cuda.stream(side):
        shared = moe.shared(x)
    routed = moe.routed(x)
    main.wait_stream(side)
    shared.record_stream(main)  # made on the side stream, read on this one: not reused before that read
    return routed + shared


@torch.compiler.disable  # a compiled layer calls the kernels as they are: they take no tracing
def _dispatch(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and getattr(moe.gate_up, "requires_grad", False):
        # training: the kernels have no backward, and a large batch is past the per-token gather's limit
        if moe.held:
            raise ValueError("an expert-parallel share holds some experts only: it does not train")
        weights, ids = moe.route(x)
        return moe_torch_dense(x, weights, ids, moe.gate_up, moe.down, counts=moe.counts)
    gate_up, down = expert_tensor(moe.gate_up), expert_tensor(moe.down)
    triton = use_triton(x.device)
    if not triton:  # the torch path multiplies dense weights: INT4 experts dequantized (CPU-sized models)
        gate_up, down = (dequantize(w, x.dtype) if isinstance(w, Int4Weights) else w for w in (gate_up, down))
    # launch overrides for the run (bench --moe-config), and whether the kernels launch as programmatic dependents
    config = dict(options.current().moe_launch, **({"PDL": True} if options.current().launch_pdl else {})) or None
    if moe.routing is not None or moe.declared is not None or moe.held:
        elsewhere = bool(moe.held)
        routed = None
        if (triton and x.shape[0] <= SORT_IN_ROUTING_MAX_T and moe.routing_kernel_runs(x.device)
                and (config or {}).get("fuse_route", True)):
            # an AR step's pairs: the routing kernel sorts them in its own launch (one launch fewer); the sort covers
            # the stack's experts and, with expert parallelism, the bucket of those held elsewhere
            from .kernels.fused_moe import align_outputs

            routed = align_outputs(x.shape[0] * moe.top_k, moe.counts.numel(), x.device, moe.counts)
        # [T, k] places in the stack (experts_here: held elsewhere), int32 as the kernels take them
        weights, ids = moe.route(x, local=True, ids_dtype=torch.int32 if triton else torch.int64, routed=routed)
        if triton:
            from .kernels.fused_moe import fused_moe_routed

            return fused_moe_routed(x, weights, ids, gate_up, down, counts=moe.counts, elsewhere=elsewhere,
                                    config=config, routed=routed)[0]
        return moe_torch_routed(x, weights, ids, gate_up, down, counts=moe.counts, elsewhere=elsewhere)
    if triton:
        from .kernels.fused_moe import fused_moe

        return fused_moe(x, moe.router.weight, gate_up, down, moe.top_k, moe.renormalize, counts=moe.counts,
                         config=config)[0]
    return moe_torch(x, moe.router.weight, gate_up, down, moe.top_k, moe.renormalize, counts=moe.counts)


def expert_routing(blocks: list[SparseMoE]) -> dict[str, object]:
    """Per MoE block's last forward, in order: `moe_layout.routing_stats` of its counts (experts touched, the
    busiest expert's tokens, row blocks per height), and whether the experts are INT4 (`expert_int4`: the
    kernel's row height follows it, `moe_layout.row_height`). One host read."""
    counts = (torch.stack([m.counts_here() for m in blocks]) if blocks
              else torch.zeros(0, 1, dtype=torch.int32))  # [L, experts here]
    return {**routing_stats(counts), "expert_int4": any(isinstance(m.gate_up, Int4Experts) for m in blocks)}
