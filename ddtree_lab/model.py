"""The target model: a Qwen3 / Llama decoder with a static KV cache and tree-aware attention.

One `forward` serves prefill, AR steps and tree verification: it takes query tokens with explicit
positions and a `TreeMask` saying which of the new tokens each query may see (all committed
positions are always visible), writes the new K/V into the cache after the committed ones, and
returns logits plus the hidden states of requested layers (the drafter's context features).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import TreeMask, cache_slots, check_backend, static_cache
from .config import TargetConfig
from .layers import (ROPE_SLACK, DecoderLayer, Linear, RMSNorm, Rotary, compiled_layer_ops, invariant_linear,
                     set_batch_invariant)
from .declared_routing import DeclaredRouting, check_routing, routing_name, token_keys
from .mla import MlaBlock
from .moe import SparseMoE, expert_routing, moe_routing
from .names import MLA_BACKENDS
from .tree import use_triton


def sparse_block(cfg: TargetConfig, index: int) -> SparseMoE | None:
    """Layer index's MoE block (None where the layer is dense)."""
    if not cfg.is_moe_layer(index):
        return None
    return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.norm_topk_prob, routing=moe_routing(cfg),
                     shared_intermediate=cfg.moe_intermediate_size * cfg.n_shared_experts,
                     int4_group=cfg.expert_int4_group, int4_asymmetric=cfg.expert_int4_asymmetric,
                     held=cfg.experts_held)


class Block(DecoderLayer):
    def __init__(self, cfg: TargetConfig, index: int = 0):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.qk_norm, cfg.rms_norm_eps,
                         cfg.attention_bias, mlp=sparse_block(cfg, index))


def block_class(cfg: TargetConfig) -> type:
    """The decoder layer of this architecture: GQA (Block) or MLA (MlaBlock)."""
    return Block if cfg.mla is None else MlaBlock


def make_block(cfg: TargetConfig, index: int) -> nn.Module:
    if cfg.mla is None:
        return Block(cfg, index)
    return MlaBlock(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.mla, cfg.rms_norm_eps,
                    cfg.attention_scale, mlp=sparse_block(cfg, index))


class Target(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rope_dim, cfg.rope, cfg.max_position_embeddings + ROPE_SLACK)
        self.kv: torch.Tensor | None = None  # the static cache: [L, 2, Hkv, S_max, D]; MLA [L, 1, 1, S_max, C + R]
        self.max_past: int | None = None    # the most committed slots a forward sees (None: S_max − T)
        self.attention = "sdpa"
        self.routing = "router"  # MoE: how tokens pick experts (set_routing)
        layer_cls = block_class(cfg)
        self._attention_inputs, self._attention_output = layer_cls.attention_inputs_into, layer_cls.attention_output
        self._norm = RMSNorm.forward

    def compile_layers(self, **options) -> "Target":
        """Fuse each layer's elementwise work with torch.compile (one compiled function serves every
        layer: modules are graph inputs, not constants). The first calls compile; graph capture's
        warm-up takes care of that."""
        self._attention_inputs, self._attention_output, self._norm = compiled_layer_ops(block_class(self.cfg),
                                                                                         **options)
        return self

    # ------------------------------------------------------------------ helpers
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # A plain gather, not nn.Embedding: on CUDA the embedding's index_select walks a few indices one after
        # another, the gather spreads them over threads (docs/performance.md). Same values; forward_train keeps
        # nn.Embedding for its backward.
        return self.embed_tokens.weight[tokens]

    def lm_head_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.attention == "invariant":
            return invariant_linear(h, weight, None)
        return F.linear(h, weight)

    def setup_cache(self, max_len: int, device=None, dtype=None, max_past: int | None = None) -> None:
        """A static cache of at least max_len slots (a larger one already held stays: attention.static_cache);
        max_past (if given) bounds the committed context, the rest being room for a tree (the attention
        kernel's launch follows the bound, not the cache's size)."""
        self.max_past = max_past
        c = self.cfg
        p = self.embed_tokens.weight
        shape = (c.num_hidden_layers, 2, c.num_key_value_heads, max_len, c.head_dim) if c.mla is None else (
            c.num_hidden_layers, 1, 1, max_len, c.mla.cache_width)  # MLA: one latent row a token (mla.py)
        self.kv = static_cache(self.kv, shape, device or p.device, dtype or p.dtype)

    def set_attention(self, backend: str) -> None:
        """"invariant" also moves every linear and norm to kernels/batch_invariant.py: then a token's logits
        have the same bits in any tree, in a prefill and in an AR step (dense targets: the fused MoE kernels
        tile by the number of tokens)."""
        check_backend(backend)
        if self.cfg.mla is not None and backend not in MLA_BACKENDS:
            raise ValueError(f"attention={backend!r} covers GQA targets; an MLA target runs "
                             f"{' or '.join(repr(b) for b in MLA_BACKENDS)}")
        if backend == "invariant" and self.cfg.is_moe:
            raise ValueError("attention='invariant' covers dense targets; this one has MoE layers, whose fused "
                             "kernels tile by the number of tokens")
        if backend == "invariant" and getattr(self, "tp", 1) > 2:  # a sum of two is the same in either order
            raise ValueError(f"attention='invariant' takes tp ≤ 2: across {self.tp} processes the all-reduce sums "
                             "in an order that follows the message's size")
        self.attention = backend
        set_batch_invariant(self, backend == "invariant")

    def set_routing(self, model) -> None:
        """Declare how the MoE blocks route (declared_routing.py): "router" (the weights' own), "uniform" or a
        RoutingTrace. A dense target takes only "router"."""
        blocks = self._moe()
        if not blocks:
            if model != "router":
                raise ValueError(f"routing={routing_name(model)!r} needs an MoE target; this one is dense")
            return
        check_routing(model, blocks[0].num_experts, blocks[0].top_k)
        for j, m in enumerate(blocks):
            m.declared = None if model == "router" else DeclaredRouting(model, j, len(blocks)).to(m.counts.device)
        self.routing = model

    def _moe(self) -> list[SparseMoE]:
        if "_moe_blocks" not in self.__dict__:  # found once: walking every module each traced round costs more
            self.__dict__["_moe_blocks"] = [m for m in self.modules() if isinstance(m, SparseMoE)]
        return self.__dict__["_moe_blocks"]

    def expert_routing(self) -> dict[str, object] | None:
        """Per MoE layer, of the last forward: `moe.expert_routing`'s experts touched, busiest expert's tokens
        and row blocks (None for a dense target). Reads the device once: call it only when tracing."""
        if not self.cfg.is_moe:
            return None
        return expert_routing(self._moe())

    @property
    def cache_len(self) -> int:
        return 0 if self.kv is None else self.kv.shape[3]

    # ------------------------------------------------------------------ decoding forward
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, past_len: int, mask: TreeMask,
                hidden_layers: list[int] = (), logits_rows: torch.Tensor | None = None):
        """tokens, positions [T]; the new K/V go to cache slots past_len … past_len+T-1.

        past_len is an int, or a one-element device tensor for fixed-shape (CUDA graph) rounds.

        Returns logits [T or len(logits_rows), V] and hidden [T, len(hidden_layers)*H].
        """
        T = tokens.shape[0]
        if not isinstance(past_len, torch.Tensor) and past_len + T > self.cache_len:
            raise ValueError(f"context of {past_len + T} tokens exceeds the KV cache of {self.cache_len}")
        if self.routing == "uniform":  # the declared routing hashes each token's (id, position)
            keys = token_keys(tokens, positions)
            for m in self._moe():
                m.declared.keys = keys
        x = self.embed(tokens)[None]  # [1, T, H]
        cos, sin = self.rotary(positions, x.dtype)  # [T, D]
        slots = cache_slots(past_len, T, tokens.device)
        wanted = {layer: i for i, layer in enumerate(hidden_layers)}
        captured = [None] * len(hidden_layers)
        delta = torch.zeros_like(x)  # the last MLP output, added at the next layer's start (fused with its norm)
        # MLA's prompt (nothing cached before it) runs the expanded form, compute-bound and cheaper (mla.py)
        form = {"expanded": True} if self.cfg.mla is not None and not isinstance(past_len, torch.Tensor) \
            and past_len == 0 else {}
        for li, blk in enumerate(self.layers):
            # q [1, Hq, T, D]; the new K and V written into the cache [2, Hkv, S, D] (MLA's rows [1, 1, S, C + R])
            x, q = self._attention_inputs(blk, x, delta, cos, sin, self.kv[li], slots, **form)
            if li - 1 in wanted:  # x is now layer li-1's output
                captured[wanted[li - 1]] = x[0]
            att = blk.attend(q[0], self.kv[li], past_len, mask, self.attention, self.max_past, **form)  # [Hq, T, D or C]
            x, delta = self._attention_output(blk, x, att[None], **form)
        x = x + delta
        if len(self.layers) - 1 in wanted:
            captured[wanted[len(self.layers) - 1]] = x[0]
        hidden = torch.cat(captured, dim=-1) if captured else x.new_zeros(T, 0)
        out = x[0] if logits_rows is None else x[0, logits_rows]
        return self.lm_head_logits(self._norm(self.norm, out)), hidden

    # ------------------------------------------------------------------ training forward
    def forward_train(self, tokens: torch.Tensor, hidden_layers: list[int] = ()):
        """Plain causal forward without a cache. tokens [B, T] -> logits [B, T, V], hidden [B, T, k*H]."""
        B, T = tokens.shape
        x = self.embed_tokens(tokens)
        positions = torch.arange(T, device=tokens.device)
        cos, sin = self.rotary(positions, x.dtype)
        wanted = {layer: i for i, layer in enumerate(hidden_layers)}
        captured = [None] * len(hidden_layers)
        for li, blk in enumerate(self.layers):
            x, q, kv = blk.attention_inputs(x, torch.zeros_like(x), cos, sin)
            x, delta = blk.attention_output(x, blk.causal_attention(q, kv))
            x = x + delta
            if li in wanted:
                captured[wanted[li]] = x
        hidden = torch.cat(captured, dim=-1) if captured else x.new_zeros(B, T, 0)
        return self.lm_head_logits(self.norm(x)), hidden

    def compact_cache(self, past_len, src: torch.Tensor, count=None) -> None:
        """Move cache slots past_len + src[i] to past_len + i (src ascending, src[i] >= i), all layers,
        for i < count (default all; int or device tensor). One Triton launch where the tree kernels
        run in Triton (kernels/kv_compact.py); else a gather that copies before the scatter writes, so
        overlapping moves are safe (it moves every entry: those past count land in scratch slots)."""
        if use_triton(src.device) and self.kv.shape[-1] in (16, 32, 64, 128, 256):  # the kernel's row widths
            from .kernels.kv_compact import compact_kv

            compact_kv(self.kv, past_len, src, src.shape[0] if count is None else count)
            return
        dst = past_len + torch.arange(src.shape[0], device=src.device)
        self.kv.index_copy_(3, dst, self.kv.index_select(3, past_len + src))
