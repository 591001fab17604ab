"""The sparse mixture-of-experts MLP of Qwen3Moe targets.

A router picks each token's top-k of E experts (softmax, then optionally renormalised over the k); each
expert is a SwiGLU MLP; the block's output is the routing-weighted sum of the k experts' outputs. Experts
are stored stacked: `gate_up` [E, 2I, H] (gate rows, then up rows) and `down` [E, H, I].

Two paths, both of fixed shape with no host synchronisation, so a round stays one captured graph:
the Triton kernels of `kernels/fused_moe.py` where `tree.use_triton` says so (CUDA), else `moe_torch`.
Either writes the per-expert token counts of its last call into the static buffer `counts` [E]: tracing
reads it after a forward to count the experts touched; an untraced replay never reads it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kernels.moe_layout import GATHER_LIMIT_BYTES, gather_bytes, route_reference, routing_stats
from .tree import use_triton


def _grouped_mm_fits(x: torch.Tensor, I: int) -> bool:
    # torch's grouped matmul takes bf16 on CUDA with 16-byte aligned rows; elsewhere the per-token gather runs
    H = x.shape[-1]
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and H % 8 == 0 and I % 8 == 0)


def moe_torch(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool, counts: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype, in torch, fixed shapes. On CUDA in bf16: the (token, expert) pairs
    sorted by expert and two grouped matmuls over device offsets (each touched expert's weights read once).
    Elsewhere: each token gathers its k experts' weights, [T, k, 2I, H] (fine for the small models that
    run on a CPU, not for large ones: past GATHER_LIMIT_BYTES it is refused)."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    grouped = _grouped_mm_fits(x, I)
    if not grouped and (need := gather_bytes(T, top_k, H, I, w_gate_up.element_size())) > GATHER_LIMIT_BYTES:
        raise ValueError(f"moe_torch: the per-token gather of {T} tokens × {top_k} experts needs {need / 2**30:.1f} "
                         f"GiB, over the {GATHER_LIMIT_BYTES / 2**30:.0f} GiB limit; run the fused kernel "
                         "(Triton) or bf16 on CUDA (grouped matmul)")
    weights, ids = route_reference(F.linear(x, router_weight), top_k, renormalize)  # [T, k] each
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


class SparseMoE(nn.Module):
    """Router + E SwiGLU experts, top-k routing (Qwen3Moe's sparse block)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = intermediate
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        # tokens per expert in the last forward (not saved; written in place, so graphs keep its address)
        self.register_buffer("counts", torch.zeros(num_experts, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        return _dispatch(self, x.reshape(-1, x.shape[-1])).view(x.shape)


@torch.compiler.disable  # a compiled layer calls the kernels as they are: they take no tracing
def _dispatch(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    if use_triton(x.device):
        from .kernels.fused_moe import fused_moe

        return fused_moe(x, moe.router.weight, moe.gate_up, moe.down, moe.top_k, moe.renormalize,
                         counts=moe.counts)[0]
    return moe_torch(x, moe.router.weight, moe.gate_up, moe.down, moe.top_k, moe.renormalize, counts=moe.counts)


def expert_routing(blocks: list[SparseMoE]) -> dict[str, object]:
    """Per MoE block's last forward, in order: `moe_layout.routing_stats` of its counts (experts touched, the
    busiest expert's tokens, row blocks per height). One host read."""
    counts = torch.stack([m.counts for m in blocks]) if blocks else torch.zeros(0, 1, dtype=torch.int32)  # [L, E]
    return routing_stats(counts)
