"""Multi-head latent attention (DeepSeek-V3, Kimi K2) in the absorbed form, over a cache of latents.

Every head's keys and values are expanded from one compressed latent a token, c (kv_lora_rank values, RMS-normed):
k_nope_h = W_UK_h c and v_h = W_UV_h c (the two halves of kv_b_proj), beside one RoPE key k_pe shared by all heads.
The cache holds [c ; k_pe] a token (MlaConfig.cache_width values, not 2 · heads · head_dim: what makes MLA's cache
small), and attention never expands it. A score q_nope_h · k_nope_h equals (W_UK_hᵀ q_nope_h) · c, so each query
moves into latent space once (q_lat_h) and attends to the cached rows as to one key/value head shared by every
query head, the latent part also the value; the output o_h = W_UV_h (Σ_j p_j c_j) then leaves latent space.
This is exact in real arithmetic; in floating point it rounds otherwise than the expanded form, so tests compare
logits at a tolerance and tokens exactly (greedy), not bits. AR steps and tree verify run this form: a few rows
over a long cache, bound by reading it, which the latents keep small.

The prompt's forward (nothing cached before it: every key is one of its own rows) runs the expanded form
instead: keys [W_UK c ; k_pe] and values W_UV c for its own T rows, then causal attention in the library's
fused kernel. A (query, key) pair then costs 2 (nope + R) + 2 v FLOPs (640 on Kimi) against the absorbed form's
2 (C + R) + 2 C (2,176), and prefill is compute-bound: T² pairs a head. Its cache rows are the same either way.

Cache layout, [L, 1, 1, S, cache_width]: the slots sit where a GQA cache [L, 2, Hkv, S, D] has them, so cache
writes, compaction and graphs treat both alike (docs/engine-interfaces.md).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import mla_attention, write_slots
from .config import MlaConfig
from .layers import GatedMLP, Linear, RMSNorm, apply_rope

# The reference implementation normalises the q and kv latents with this eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] pairs (x0, x1), (x2, x3)… -> evens then odds: interleaved RoPE becomes the half-split kind
    apply_rope computes, with the same values (a fixed permutation of dims shared by queries and keys)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MlaAttention(nn.Module):
    """The projections of MLA; checkpoint names as the reference model's `self_attn`."""

    def __init__(self, hidden: int, n_heads: int, mla: MlaConfig, scale: float):
        super().__init__()
        self.n_heads, self.mla, self.scale = n_heads, mla, scale
        qk = mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, n_heads * qk, bias=False)
            self.kv_a_proj_with_mqa = Linear(hidden, mla.cache_width, bias=False)
        else:
            # the two down projections read the same input: one matmul, q_a_proj's rows then kv_a_proj_with_mqa's
            # (q_proj, split by heads under tensor parallelism, stays apart from the replicated kv_a)
            self.qkv_a_proj = Linear(hidden, mla.q_lora_rank + mla.cache_width, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, n_heads * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(n_heads * mla.v_head_dim, hidden, bias=False)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, C], W_UV [H, v, C]): views of kv_b_proj's weight, no copy."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def queries_and_cache_rows(self, h: torch.Tensor, cos, sin, expanded: bool = False):
        """h [B, T, hidden] (normed) -> q [B, H, T, C + R] in latent space, RoPE applied (expanded: q [B, H, T,
        nope + R], not absorbed), and the cache rows [B, T, C + R] ([normed latent ; roped k_pe])."""
        B, T, _ = h.shape
        m = self.mla
        if m.q_lora_rank is None:
            q, kv = self.q_proj(h), self.kv_a_proj_with_mqa(h)
        else:
            q_a, kv = self.qkv_a_proj(h).split([m.q_lora_rank, m.cache_width], dim=-1)  # [B, T, q_lora], [B, T, C + R]
            q_a = self.q_a_layernorm(q_a)
        latent, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        if m.rope_interleave:
            k_pe = deinterleave(k_pe)
        # the cache rows before q_b_proj: their norm and RoPE run with q_a's norm, between the same two matmuls
        rows = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_pe[:, None], cos, sin)[:, 0]], dim=-1)
        if m.q_lora_rank is not None:
            q = self.q_b_proj(q_a)
        q = q.view(B, T, self.n_heads, m.qk_head_dim).transpose(1, 2)              # [B, H, T, nope + R]
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        if m.rope_interleave:
            q_pe = deinterleave(q_pe)
        if expanded:
            q_out = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)        # [B, H, T, nope + R]
        else:
            w_uk, _ = self.absorbed()
            q_lat = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)                   # [B, H, T, C]
            q_out = torch.cat([q_lat, apply_rope(q_pe, cos, sin)], dim=-1)         # [B, H, T, C + R]
        return q_out, rows

    def expanded_attention(self, q: torch.Tensor, rows: torch.Tensor, mask) -> torch.Tensor:
        """The prompt's attention in the expanded form: q [H, T, nope + R] (not absorbed) over the same T tokens'
        cache rows [T, C + R], visibility `mask` (a TreeMask) -> [H, T, v]."""
        m, H, T = self.mla, self.n_heads, q.shape[1]
        latent, k_pe = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(T, H, m.qk_nope_head_dim + m.v_head_dim).transpose(0, 1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)            # [H, T, nope], [H, T, v]
        k = torch.cat([k_nope, k_pe[None].expand(H, T, -1)], dim=-1)                 # [H, T, nope + R]
        v = F.pad(v, (0, max(k.shape[-1] - v.shape[-1], 0)))  # one head width: the fused kernel's condition
        causal = dict(is_causal=True) if mask.is_causal else dict(attn_mask=mask.anc)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale, **causal)
        return out[0, ..., :m.v_head_dim]

    def output(self, att: torch.Tensor, expanded: bool = False) -> torch.Tensor:
        """att [B, H, T, C] (attention over latents; expanded: [B, H, T, v], already values) -> [B, T, hidden]:
        through W_UV (absorbed only), then o_proj."""
        B, H, T, _ = att.shape
        if expanded:
            v = att.transpose(1, 2)                                                  # [B, T, H, v]
        else:
            _, w_uv = self.absorbed()
            v = torch.einsum("bhtc,hvc->bthv", att, w_uv)                            # [B, T, H, v]
        return self.o_proj(v.reshape(B, T, H * self.mla.v_head_dim))


class MlaBlock(nn.Module):
    """A DeepSeek-V3 decoder layer: MLA, then a dense MLP or a sparse MoE block. Its two halves have the
    signatures of layers.DecoderLayer's, so the target's forward and its compiled layer ops serve both."""

    def __init__(self, hidden: int, intermediate: int, n_heads: int, mla: MlaConfig, eps: float, scale: float,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MlaAttention(hidden, n_heads, mla, scale)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, intermediate) if mlp is None else mlp
        self.reduce = None  # tensor parallel: sums a block's partial output across processes (parallel.py)

    def attention_inputs(self, x, delta, cos, sin, expanded: bool = False):
        """x, delta [B, T, H] -> (x + delta, q [B, Heads, T, C + R], rows [B, 1, 1, T, C + R]): the rows shaped
        as one layer's cache [1, 1, S, C + R] takes them. `expanded`: the prompt's form (module docstring)."""
        x = x + delta
        q, rows = self.self_attn.queries_and_cache_rows(self.input_layernorm(x), cos, sin, expanded)
        return x, q, rows[:, None, None]

    def attention_inputs_into(self, x, delta, cos, sin, cache, slots, expanded: bool = False):
        """attention_inputs, then the new rows written into this layer's cache [1, 1, S, C + R] at `slots`, as
        DecoderLayer.attention_inputs_into -> (x + delta, q)."""
        x, q, rows = self.attention_inputs(x, delta, cos, sin, expanded)
        write_slots(cache, slots, rows[0])
        return x, q

    def attention_output(self, x, att, expanded: bool = False):
        """x [B, T, H], att [B, Heads, T, C] (expanded: [B, Heads, T, v]) -> (x after attention, the MLP's
        output), as DecoderLayer's."""
        attn = self.self_attn.output(att, expanded)
        if self.reduce is not None:
            attn = self.reduce(attn)
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x, mlp if self.reduce is None else self.reduce(mlp)

    def attend(self, q, cache, past_len, mask, backend: str, max_past=None, expanded: bool = False) -> torch.Tensor:
        """q [Heads, T, C + R] over this layer's cache [1, 1, S, C + R] -> [Heads, T, C]. Expanded (the prompt,
        past_len 0, whatever the backend): q [Heads, T, nope + R] over its own T rows -> [Heads, T, v]."""
        if expanded:
            return self.self_attn.expanded_attention(q, cache[0, 0, :q.shape[1]], mask)
        return mla_attention(q, cache[0, 0], past_len, mask, backend, self.self_attn.mla.kv_lora_rank,
                             self.self_attn.scale, max_past=max_past)

    def causal_attention(self, q, rows):
        """Training: q [B, Heads, T, C + R] over the same rows [B, 1, 1, T, C + R], causal -> [B, Heads, T, C]."""
        k = rows[:, 0]                                                                # [B, 1, T, C + R]
        return F.scaled_dot_product_attention(q, k, k[..., :self.self_attn.mla.kv_lora_rank], is_causal=True,
                                              scale=self.self_attn.scale, enable_gqa=True)
