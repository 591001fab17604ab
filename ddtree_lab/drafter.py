"""The DFlash block drafter: one non-causal pass predicts a whole block of tokens.

Context: per committed position, the target's hidden states after `target_layer_ids`, concatenated,
projected by `fc` and normalised by `hidden_norm`. In every layer keys/values come from
[context ; block] and queries from the block alone, with no causal mask. The context part of K/V
depends only on the context features (not on earlier drafter layers), so it is computed once when
a position is committed and kept in the drafter's own cache.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import TreeMask, cache_slots, check_backend, static_cache, tree_attention, write_slots
from .config import DrafterConfig
from .layers import ROPE_SLACK, DecoderLayer, RMSNorm, Rotary, compile_fn, compiled_layer_ops


class DrafterLayer(DecoderLayer):
    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, True, cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos, sin):
        # ctx [B, Tc, H] (projected features, not re-normalised per layer) -> kv [B, 2, Hkv, Tc, D]
        k, v = self.qkv.project_kv(ctx)
        return torch.stack([self.qkv.norm_rope_k(k, cos, sin), v], dim=1)

    def block(self, x, cos, sin, k_ctx, v_ctx, mask=None):
        """x [B, Tq, H] block states; k_ctx/v_ctx [B, Hkv, Tc, D]; mask [B|1, Tq, Tc+Tq] or None."""
        x, q, kv = self.attention_inputs(x, torch.zeros_like(x), cos, sin)
        k, v = torch.cat([k_ctx, kv[:, 0]], dim=2), torch.cat([v_ctx, kv[:, 1]], dim=2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                             enable_gqa=q.shape[1] != k.shape[1])
        x, delta = self.attention_output(x, att)
        return x + delta


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n_feat = len(cfg.target_layer_ids) * cfg.hidden_size
        self.fc = nn.Linear(n_feat, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_position_embeddings + ROPE_SLACK)
        self.kv: torch.Tensor | None = None  # [Ld, 2, Hkv, S_max, D]: context K/V only
        self.ctx_len: torch.Tensor | None = None  # [1] long, committed context positions
        self._attention_inputs = DecoderLayer.attention_inputs_into
        self._attention_output = DecoderLayer.attention_output
        self._context_kv = DrafterLayer.context_kv
        self._norm = RMSNorm.forward
        self.window: int | None = None  # draft_window: how many recent context positions a block sees
        self.max_past: int | None = None  # the most committed context slots (None: the cache's size)
        self.attention = "sdpa"  # as the target's (load_pair sets both); a window always uses sdpa
        self._block_masks: dict = {}  # the block's all-to-all mask per (size, device), packed once

    def set_attention(self, backend: str) -> None:
        # "invariant" is the target's numerics (a draft only proposes: its bits never decide a token)
        self.attention = "triton" if check_backend(backend) == "invariant" else backend

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[..., k*H] concatenated target layer outputs -> [..., H] context features."""
        return self._norm(self.hidden_norm, self.fc(target_hidden))

    # ------------------------------------------------------------------ training / reference forward
    def forward(self, x, q_pos, ctx, ctx_pos, mask=None):
        """x [B, Tq, H] block input embeddings, ctx [B, Tc, H] projected context -> hidden [B, Tq, H]."""
        cos_q, sin_q = self.rotary(q_pos, x.dtype)
        cos_c, sin_c = self.rotary(ctx_pos, x.dtype)
        for layer in self.layers:
            k_ctx, v_ctx = layer.context_kv(ctx, cos_c, sin_c).unbind(1)
            x = layer.block(x, cos_q, sin_q, k_ctx, v_ctx, mask)
        return self.norm(x)

    # ------------------------------------------------------------------ cached decoding
    # ctx_len lives on the device as a one-element tensor, so a round needs no host sync and
    # replays under a CUDA graph; slots at and beyond ctx_len are scratch.
    def setup_cache(self, max_len: int, device=None, dtype=None, max_past: int | None = None) -> None:
        self.max_past = max_past
        c, p = self.cfg, self.fc.weight
        device = device or p.device
        shape = (c.num_hidden_layers, 2, c.num_key_value_heads, max_len + c.block_size, c.head_dim)
        kv = static_cache(self.kv, shape, device, dtype or p.dtype)  # a larger one already held stays
        if kv is not self.kv:
            self.kv = kv
            self.ctx_len = torch.zeros(1, dtype=torch.long, device=device)
        self.ctx_len.zero_()  # in place: captured graphs hold this tensor

    def append_context(self, target_hidden: torch.Tensor, positions: torch.Tensor, count=None) -> None:
        """Commit context: target_hidden [M, k*H] at `positions` [M]; the first `count` rows (int or
        device tensor; default all) become committed, the rest stay scratch."""
        ctx = self.project_context(target_hidden)[None]  # [1, M, H]
        cos, sin = self.rotary(positions, ctx.dtype)
        slots = cache_slots(self.ctx_len, positions.shape[0], ctx.device)
        for li, layer in enumerate(self.layers):
            write_slots(self.kv[li], slots, self._context_kv(layer, ctx, cos, sin)[0])  # [2, Hkv, M, D]
        self.ctx_len += positions.shape[0] if count is None else count

    def draft(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [Tq, H] block input embeddings at `positions` [Tq] -> hidden [Tq, H] (final-normed)."""
        cos, sin = self.rotary(positions, x.dtype)
        key = (x.shape[0], x.device)
        if key not in self._block_masks:  # first call: an eager warm-up, before any graph capture
            self._block_masks[key] = TreeMask.full(x.shape[0], x.device)
            if self.attention == "triton":
                self._block_masks[key].bits  # packed once, reused by every later forward
        mask = self._block_masks[key].fresh()
        h = x[None]  # [1, Tq, H]
        slots = cache_slots(self.ctx_len, x.shape[0], x.device)
        delta = torch.zeros_like(h)  # as in Target.forward: each MLP output is added at the next layer's start
        for li, layer in enumerate(self.layers):
            # the block's K/V go to scratch slots ctx_len… of the context cache, so one attention
            # call sees the committed context and the block alike
            h, q = self._attention_inputs(layer, h, delta, cos, sin, self.kv[li], slots)
            att = tree_attention(q[0], self.kv[li, 0], self.kv[li, 1], self.ctx_len, mask, self.attention, self.window,
                                 max_past=self.max_past)
            h, delta = self._attention_output(layer, h, att[None])
        return self._norm(self.norm, h + delta)[0]

    def compile_layers(self, **options) -> "Drafter":
        """Fuse each layer's elementwise work with torch.compile (see Target.compile_layers)."""
        self._attention_inputs, self._attention_output, self._norm = compiled_layer_ops(**options)
        self._context_kv = compile_fn(DrafterLayer.context_kv, **options)
        return self
