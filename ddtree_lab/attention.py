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

from . import options
from .names import ATTENTION_BACKENDS


@dataclass
class TreeMask:
    """Who sees whom among the T new tokens. Derived forms are built once per forward, not per layer."""

    anc: torch.Tensor  # [T, T] bool
    is_causal: bool = False  # anc is lower-triangular ones (a prompt): kernels that know causality skip the mask
    _bits: torch.Tensor | None = field(default=None, repr=False)
    _chain: tuple | None = field(default=None, repr=False)
    _dense: dict = field(default_factory=dict, repr=False)

    @classmethod
    def causal(cls, T: int, device) -> "TreeMask":
        return cls(torch.ones(T, T, dtype=torch.bool, device=device).tril(), is_causal=True)

    @classmethod
    def full(cls, T: int, device) -> "TreeMask":
        """Every new token sees every other (the drafter's non-causal block)."""
        return cls(torch.ones(T, T, dtype=torch.bool, device=device))

    def fresh(self) -> "TreeMask":
        """The same relation (and packed bits, if made) for another forward, without the dense masks
        cached for this one: those depend on past_len, which moves between rounds."""
        return TreeMask(self.anc, self.is_causal, self._bits, self._chain)

    @property
    def bits(self) -> torch.Tensor:
        # int32 [T, ceil(T/32)]: bit j%32 of word j//32 of row i = anc[i, j]
        if self._bits is None:
            from .kernels.tree_attention import pack_mask

            self._bits = pack_mask(self.anc)
        return self._bits

    @property
    def chain(self) -> tuple[torch.Tensor, torch.Tensor]:
        # (int32 [T, T], int32 [T]): row i's ancestors-or-self root first, and how many (the invariant backend)
        if self._chain is None:
            from .kernels.batch_invariant import ancestor_chain

            self._chain = ancestor_chain(self.anc)
        return self._chain

    def dense(self, past_len, kv_len: int, window: int | None) -> torch.Tensor:
        """bool [T, kv_len]: visible cache slots. past_len may be a device tensor (fixed shapes).
        An int past_len is part of the key: a mask reused at another past_len without fresh() must not
        hand out the slots of the last one (a device tensor is read when the mask is made: fresh())."""
        key = (kv_len, window, past_len if isinstance(past_len, int) else id(past_len))
        if key not in self._dense:
            T = self.anc.shape[0]
            rel = torch.arange(kv_len, device=self.anc.device) - past_len  # slot - past_len
            past = rel < 0
            if window is not None:
                past = past & (rel >= -window)
            tree = (rel >= 0) & (rel < T)
            self._dense[key] = past[None, :] | (tree[None, :] & self.anc[:, rel.clamp(0, T - 1)])
        return self._dense[key]


def check_backend(name: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return name


def static_cache(cache: torch.Tensor | None, shape: tuple, device, dtype) -> torch.Tensor:
    """A KV cache of `shape` [..., S, D] (S slots along dim -2): `cache` itself where it matches and holds at
    least S slots, else a new zeroed one. A cache only grows: moving it would void every captured round and
    prefill kept on its address (graphs.kept), so runs that alternate budgets or prompt lengths would
    capture again each time. Slots past the bound a caller passes (max_past) are never read."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    fits = (cache is not None and cache.device == device and cache.dtype == dtype and cache.dim() == len(shape)
            and cache.shape[:-2] == torch.Size(shape[:-2]) and cache.shape[-1] == shape[-1]
            and cache.shape[-2] >= shape[-2]
            # one made under inference mode takes no in-place write outside it (the other way round is fine)
            and (not cache.is_inference() or torch.is_inference_mode_enabled()))
    return cache if fits else torch.zeros(shape, device=device, dtype=dtype)


def cache_slots(past_len, T: int, device) -> torch.Tensor:
    """The slots past_len … past_len+T-1 of T new tokens as an index tensor [T] (past_len an int or a device
    tensor), made once per forward (not per layer)."""
    return past_len + torch.arange(T, device=device)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache [..., S, D] <- new [..., T, D] at `slots` (from cache_slots): K and V of a layer in one
    write when both are stacked in the leading dims. An index write, so a compiled caller fuses it with what
    computes `new` (layers.attention_inputs_into)."""
    cache.index_copy_(cache.dim() - 2, slots, new)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past_len,
                   mask: TreeMask, backend: str = "sdpa", window: int | None = None,
                   max_past: int | None = None) -> torch.Tensor:
    """q [Hq, T, D], k_cache/v_cache [Hkv, S, D] -> [Hq, T, D].

    past_len is an int (eager) or a one-element device tensor (fixed shapes, CUDA graphs).
    `window` limits the committed slots seen to the last `window` (the drafter's draft_window).
    `max_past` bounds a device past_len (default S − T): the kernel's split count follows it, so a bound
    from the committed context alone costs a wide tree's room in the cache nothing.
    """
    if backend == "triton" and window is None:
        from .kernels.tree_attention import tree_attention as triton_tree_attention

        launch = dict(options.current().attention_launch, **({"pdl": True} if options.current().launch_pdl else {}))
        return triton_tree_attention(q, k_cache, v_cache, past_len, mask.bits, config=launch or None,
                                     max_past_len=max_past)
    if backend == "invariant" and window is None:
        from .kernels.batch_invariant import chain_attention

        return chain_attention(q, k_cache, v_cache, past_len, *mask.chain, max_past=max_past)
    if backend == "flex" and window is None and not isinstance(past_len, torch.Tensor):
        return _flex_attention(q, k_cache, v_cache, past_len, mask.anc)
    return _sdpa_attention(q, k_cache, v_cache, past_len, mask, window, max_past)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, past_len, mask: TreeMask, backend: str, latent_dim: int,
                  scale: float, max_past: int | None = None) -> torch.Tensor:
    """MLA in the absorbed form (ddtree_lab/mla.py): q [H, T, C + R] over cache rows [S, C + R] ([latent ; RoPE
    key], the latent also the value) -> [H, T, latent_dim], the same visibility as tree_attention. Backends:
    "triton" (kernels/mla_attention.py) or the dense "sdpa" reference; the model refuses the others."""
    if backend == "triton":
        from .kernels.mla_attention import mla_tree_attention

        launch = {"pdl": True} if options.current().launch_pdl else None
        return mla_tree_attention(q, cache, past_len, mask.bits, latent_dim, scale, max_past_len=max_past,
                                  config=launch)
    T = q.shape[1]
    if isinstance(past_len, torch.Tensor):
        kv_len = cache.shape[0] if max_past is None else min(cache.shape[0], max_past + T)
    else:
        kv_len = past_len + T
    rows = cache[None, None, :kv_len]                                                  # [1, 1, kv_len, C + R]
    out = F.scaled_dot_product_attention(q[None], rows, rows[..., :latent_dim], attn_mask=mask.dense(past_len, kv_len, None),
                                         scale=scale, enable_gqa=True)
    return out[0]


def _sdpa_attention(q, k_cache, v_cache, past_len, mask: TreeMask, window, max_past: int | None = None):
    T = q.shape[1]
    # eager: only the used slots; fixed shapes: the slots up to the bound (the whole cache without one), masked
    if isinstance(past_len, torch.Tensor):
        kv_len = k_cache.shape[1] if max_past is None else min(k_cache.shape[1], max_past + T)
    else:
        kv_len = past_len + T
    dense = mask.dense(past_len, kv_len, window)  # [T, kv_len]
    out = F.scaled_dot_product_attention(q[None], k_cache[None, :, :kv_len], v_cache[None, :, :kv_len],
                                         attn_mask=dense, enable_gqa=q.shape[0] != k_cache.shape[0])
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
