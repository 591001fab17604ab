"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, gated MLP, QKV projection."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import options
from .attention import tree_attention, write_slots
from .config import RopeConfig, rope_inv_freq


# Batch-invariant numerics (attention="invariant", model.Target.set_attention): the target's linears and norms
# run kernels/batch_invariant.py, whose result for a row does not depend on the other rows. As custom ops, a
# compiled layer calls them whole (the compiler fuses around them, never into them: fusing would change
# their arithmetic from shape to shape).
def _invariant_op(name: str, schema: str, fake):
    """kernels/batch_invariant.<name> as the custom op ddtree_lab::invariant_<name>, `fake` giving its output's
    shape and dtype to the compiler."""
    def run(*args):
        from .kernels import batch_invariant

        return getattr(batch_invariant, name)(*args)

    op = torch.library.custom_op(f"ddtree_lab::invariant_{name}", run, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op


invariant_linear = _invariant_op("linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                                 lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))
invariant_rms_norm = _invariant_op("rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor",
                                   lambda x, weight, eps: x.new_empty(
                                       x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)))


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    from .kernels.skinny_gemm import skinny_gemm

    rows = x.reshape(-1, x.shape[-1])
    return skinny_gemm(rows, weight, torch.float32 if out_fp32 else None).view(*x.shape[:-1], weight.shape[0])


# options.dense_products="skinny": a few rows times a dense weight through kernels/skinny_gemm.py, a custom op so a
# compiled layer calls it whole, as it calls the library's matmul
skinny_linear = torch.library.custom_op("ddtree_lab::skinny_linear", _skinny_linear, mutates_args=(),
                                        schema="(Tensor x, Tensor weight, bool out_fp32) -> Tensor")
skinny_linear.register_fake(lambda x, weight, out_fp32: x.new_empty(
    *x.shape[:-1], weight.shape[0], dtype=torch.float32 if out_fp32 else x.dtype))


def takes_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product runs kernels/skinny_gemm.py: the option chose it, on CUDA, up to its rows, one dtype."""
    if options.current().dense_products != "skinny" or not x.is_cuda or x.dtype != weight.dtype:
        return False
    from .kernels.skinny_gemm import MAX_ROWS

    return x.numel() // x.shape[-1] <= MAX_ROWS


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint keys) that can switch to the batch-invariant kernel, or for a few
    rows to kernels/skinny_gemm.py (options.dense_products)."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear(x, self.weight, self.bias)
        if self.bias is None and takes_skinny(x, self.weight):
            return skinny_linear(x, self.weight, False)
        return F.linear(x, self.weight, self.bias)


def set_batch_invariant(module: nn.Module, on: bool) -> None:
    """Every Linear and RMSNorm in `module` to the batch-invariant kernels (on) or back to torch's."""
    for m in module.modules():
        if isinstance(m, (Linear, RMSNorm)):
            m.batch_invariant = on


class RMSNorm(nn.Module):
    batch_invariant = False  # set_batch_invariant: kernels/batch_invariant.rms_norm, the same arithmetic per row

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 (as the reference implementations do), scale in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


ROPE_SLACK = 256  # positions past the context a round may touch: a tree or block is ≤ block_size deep


class Rotary(nn.Module):
    """RoPE for arbitrary (tree) positions; the half-split convention of HF models.

    With `max_positions`, the cos/sin rows of every position below it are computed once per device
    and dtype (the same arithmetic as per call), side by side in one table, so a forward gathers its
    rows in one launch instead of computing them in seven. Models give the context length plus ROPE_SLACK, room for the trees
    and draft blocks that run past the last position of a full context."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int = 0):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self.factor = rope.cos_sin_factor  # yarn scales cos and sin; 1 (no multiply) for other types
        self.max_positions = max_positions
        self._tables: dict = {}

    def compute(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions [..., T] -> cos, sin [..., T, D]
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.factor != 1.0:
            return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        if not self.max_positions:
            return self.compute(positions, dtype)
        key = (self.inv_freq.device, dtype)
        if key not in self._tables:  # the first call (an eager warm-up before any graph capture)
            cos, sin = self.compute(torch.arange(self.max_positions, device=self.inv_freq.device), dtype)
            self._tables[key] = torch.cat([cos, sin], dim=-1)  # [P, 2D]: one gather serves both
        table = self._tables[key]
        D = table.shape[-1] // 2
        # a gather rather than index_select, whose CUDA kernel walks up to 16 positions one after another
        rows = table[positions.reshape(-1)].view(*positions.shape, 2 * D)
        return rows[..., :D], rows[..., D:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, D]; cos/sin [B, T, D] (or [T, D]) broadcast over heads
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = Linear(hidden, 2 * intermediate, bias=False)
        self.down = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)


class QKV(nn.Module):
    """Fused q/k/v projection with optional per-head q/k RMSNorm (Qwen3) and RoPE."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool,
                 eps: float, bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wqkv = Linear(hidden, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def project(self, x: torch.Tensor):
        # x [B, T, H] -> q [B, Hq, T, D], k/v [B, Hkv, T, D], before norms and RoPE
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim).transpose(1, 2)
        return qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)

    def project_kv(self, x: torch.Tensor):
        # x [B, T, H] -> k/v [B, Hkv, T, D]: only the K/V rows of the fused weight (context features
        # need no queries, and the Q rows are most of the matrix)
        B, T, _ = x.shape
        q_rows = self.n_heads * self.head_dim
        bias = None if self.wqkv.bias is None else self.wqkv.bias[q_rows:]
        kv = F.linear(x, self.wqkv.weight[q_rows:], bias).view(B, T, 2 * self.n_kv_heads, self.head_dim)
        return kv.transpose(1, 2).split([self.n_kv_heads, self.n_kv_heads], dim=1)

    def norm_rope_q(self, q, cos, sin):
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def norm_rope_k(self, k, cos, sin):
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin)


class DecoderLayer(nn.Module):
    """The parts of a pre-norm decoder layer that target and drafter share: everything around the
    attention call. The two halves are pure functions of their inputs, so one compiled copy of each
    (`torch.compile`) can fuse the elementwise work of every layer."""

    def __init__(self, hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 qk_norm: bool, eps: float, bias: bool = False, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.qkv = QKV(hidden, n_heads, n_kv_heads, head_dim, qk_norm, eps, bias)
        self.o_proj = Linear(n_heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate) if mlp is None else mlp  # mlp: e.g. a sparse MoE block
        self.reduce = None  # tensor parallel: sums a block's partial output across processes (parallel.py)

    def attention_inputs(self, x, delta, cos, sin):
        """x [B, T, H] residual stream, delta [B, T, H] (the previous layer's MLP output, not yet
        added; zeros before the first layer) -> (x + delta, q [B, Hq, T, D], kv [B, 2, Hkv, T, D]),
        normed, RoPE applied. Adding delta here lets one compiled kernel do the residual add and the
        norm; K and V come stacked so the cache takes them in one write. (A tensor, never None: one
        compiled variant fewer per shape.)"""
        x = x + delta
        q, k, v = self.qkv.project(self.input_layernorm(x))
        return x, self.qkv.norm_rope_q(q, cos, sin), torch.stack([self.qkv.norm_rope_k(k, cos, sin), v], dim=1)

    def attention_inputs_into(self, x, delta, cos, sin, cache, slots):
        """attention_inputs, then the new K and V written into this layer's cache [2, Hkv, S, D] at `slots` ([T],
        attention.cache_slots) -> (x + delta, q). Compiled as one function, the write lands in the kernel that
        computes K (its norm and RoPE) instead of a stack and a copy launched after it (docs/performance.md,
        "Session 23")."""
        x, q, kv = self.attention_inputs(x, delta, cos, sin)
        write_slots(cache, slots, kv[0])
        return x, q

    def attention_output(self, x, att):
        """x [B, T, H], att [B, Hq, T, D] -> (x after attention, the MLP's output): the layer's output
        is their sum, left to the next layer's attention_inputs (or the caller) to add."""
        B, T = x.shape[:2]
        attn = self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        if self.reduce is not None:  # tensor parallel (parallel.py): this process's heads give a partial sum
            attn = self.reduce(attn)
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x, mlp if self.reduce is None else self.reduce(mlp)

    def attend(self, q, cache, past_len, mask, backend: str, max_past=None) -> torch.Tensor:
        """q [Hq, T, D] over this layer's cache [2, Hkv, S, D] (K, V) -> [Hq, T, D]."""
        return tree_attention(q, cache[0], cache[1], past_len, mask, backend, max_past=max_past)

    def causal_attention(self, q, kv):
        """Training: q [B, Hq, T, D], kv [B, 2, Hkv, T, D], causal -> [B, Hq, T, D]."""
        k, v = kv.unbind(1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def compile_fn(fn, **kwargs):
    """torch.compile(fn) with options.compile_options (e.g. mode="max-autotune-no-cudagraphs", to let the
    compiler time its own matmuls against cuBLAS), then `kwargs` on top."""
    return torch.compile(fn, **{**dict(options.current().compile_options), **kwargs})


def compiled_layer_ops(layer_cls=DecoderLayer, **options):
    """(attention_inputs_into, attention_output, norm) compiled once, to call as fn(module, …) on any layer of
    `layer_cls` or RMSNorm: a norm left eager is ~7 small kernels, compiled it is one."""
    return (compile_fn(layer_cls.attention_inputs_into, **options),
            compile_fn(layer_cls.attention_output, **options),
            compile_fn(RMSNorm.forward, **options))
