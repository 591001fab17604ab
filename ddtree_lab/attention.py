"""Verify attention: tree queries over a static KV cache, behind one function and three backends.

Contract (docs/engine-interfaces.md): the T new tokens' K/V sit at cache slots past_len … past_len+T-1;
query i sees every slot < past_len and tree slot past_len+j iff anc[i, j] (j is an ancestor of i or i).
A causal prefill is the same thing with a lower-triangular `anc`, so one mechanism serves AR,
prefill and tree verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "triton", "flex")


@dataclass
class TreeMask:
    """Who sees whom among the T new tokens. Derived forms are computed once per forward, not per layer."""

    anc: torch.Tensor  # [T, T] bool
    _bits: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def causal(cls, T: int, device) -> "TreeMask":
        return cls(torch.ones(T, T, dtype=torch.bool, device=device).tril())

    @property
    def bits(self) -> torch.Tensor:
        # int32 [T, ceil(T/32)]: bit j%32 of word j//32 of row i = anc[i, j]
        if self._bits is None:
            from .kernels.tree_attention import pack_mask

            self._bits = pack_mask(self.anc)
        return self._bits


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention={name!r} is not one of {', '.join(BACKENDS)}")
    return name


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len: int,
                   mask: TreeMask, backend: str = "sdpa") -> torch.Tensor:
    """q [Hq, T, D], k_cache/v_cache [Hkv, S, D] -> [Hq, T, D]."""
    if backend == "triton":
        from .kernels.tree_attention import tree_attention as triton_tree_attention

        return triton_tree_attention(q, k_cache, v_cache, past_len, mask.bits)
    if backend == "flex":
        return _flex_attention(q, k_cache, v_cache, past_len, mask.anc)
    return _sdpa_attention(q, k_cache, v_cache, past_len, mask.anc)


def _sdpa_attention(q, k_cache, v_cache, past_len, anc):
    T = q.shape[1]
    k, v = k_cache[:, : past_len + T], v_cache[:, : past_len + T]
    dense = torch.cat([anc.new_ones(T, past_len), anc], dim=1)  # [T, past_len + T]
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=dense,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]


_compiled_flex = None


def _flex_attention(q, k_cache, v_cache, past_len, anc):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True) if q.is_cuda else flex_attention
    T = q.shape[1]
    kv_len = past_len + T

    def mask_mod(b, h, qi, kv):
        return (kv < past_len) | anc[qi, (kv - past_len).clamp(min=0)]

    block_mask = create_block_mask(mask_mod, None, None, T, kv_len, device=q.device)
    out = _compiled_flex(q[None], k_cache[None, :, :kv_len], v_cache[None, :, :kv_len],
                         block_mask=block_mask, enable_gqa=q.shape[0] != k_cache.shape[0])
    return out[0]
