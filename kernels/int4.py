"""INT4 weight-only expert weights, stacked for the fused-MoE kernel, in the layout of the compressed-tensors
`pack-quantized` format (docs/engine-interfaces.md, "INT4 experts", has the whole layout).

    Int4Weights(packed, scale, zero, group_size)   a stacked [E, N, K] weight, 4 bits a value
    unpack_int4(words) -> int8 values               the stored nibbles, offset removed
    dequantize(w, dtype=None, experts=None)         the dense weight: the kernels' torch reference

A row of K values is held as K / 8 int32 words: value i of a word sits at bits 4i … 4i+3 and is stored as
value + 8 (so 0 … 15 holds -8 … 7). Each run of `group_size` values along K shares one scale. Symmetric:
w = (stored − 8) · scale. Asymmetric: a zero point a group, itself a 4-bit value + 8 packed along N (8 rows a
word, the same nibble order), w = (stored − stored_zero) · scale. The products are exact in fp32 (a 4-bit
difference times a 16-bit scale), so `dequantize` in the scale's dtype equals the format's own
decompression bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

VALUES_PER_WORD = 8  # 4-bit values in one int32
NIBBLE_OFFSET = 8  # stored nibble = value + NIBBLE_OFFSET


def check_group(group_size: int, K: int, what: str = "Int4Weights") -> None:
    """ValueError unless `group_size` is a power of two of at least 8 (the kernels' tiles split K at group
    edges and unpack whole words) dividing K."""
    if group_size < VALUES_PER_WORD or group_size & (group_size - 1):
        raise ValueError(f"{what}: group_size={group_size} is not a power of two of at least {VALUES_PER_WORD}")
    if K % group_size:
        raise ValueError(f"{what}: K={K} is not a multiple of the group size {group_size}")


@dataclass(frozen=True)
class Int4Weights:
    """E experts' [N, K] weights, 4 bits a value. packed [E, N, K // 8] int32; scale [E, N, K // G] (fp32, fp16
    or bf16); zero [E, ceil(N / 8), K // G] int32 for the asymmetric scheme, else None; G = group_size.
    Each tensor's last dim is contiguous."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    def __post_init__(self):
        p, s, z, G = self.packed, self.scale, self.zero, self.group_size
        if p.dtype != torch.int32 or p.dim() != 3:
            raise ValueError(f"Int4Weights: packed must be int32 [E, N, K // 8], got {p.dtype} {tuple(p.shape)}")
        E, N, words = p.shape
        K = words * VALUES_PER_WORD
        check_group(G, K)
        if not s.is_floating_point() or tuple(s.shape) != (E, N, K // G):
            raise ValueError(f"Int4Weights: scale must be float [E, N, K // G] = {(E, N, K // G)}, got {s.dtype} "
                             f"{tuple(s.shape)}")
        if z is not None and (z.dtype != torch.int32 or tuple(z.shape) != (E, -(-N // VALUES_PER_WORD), K // G)):
            raise ValueError(f"Int4Weights: zero must be int32 [E, ceil(N / 8), K // G] = "
                             f"{(E, -(-N // VALUES_PER_WORD), K // G)}, got {z.dtype} {tuple(z.shape)}")
        for name, t in (("packed", p), ("scale", s), ("zero", z)):
            if t is not None and t.stride(-1) != 1 and t.shape[-1] > 1:
                raise ValueError(f"Int4Weights: {name} must be contiguous along its last dim")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the dense weight."""
        E, N, words = self.packed.shape
        return E, N, words * VALUES_PER_WORD

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero) if t is not None)

    def to(self, device) -> Int4Weights:
        """The same weights on `device` (the dtypes stay: the scales' dtype is the checkpoint's)."""
        z = None if self.zero is None else self.zero.to(device)
        return Int4Weights(self.packed.to(device), self.scale.to(device), z, self.group_size)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int8 [..., 8W]: value i of each word (bits 4i … 4i+3), offset removed (-8 … 7)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)                # [8]
    nibbles = (words[..., None] >> shifts) & 0xF                                            # [..., W, 8]
    return (nibbles.flatten(-2) - NIBBLE_OFFSET).to(torch.int8)


def dequantize(w: Int4Weights, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight [E, N, K] in `dtype` (default: the scales'), computed in fp32 and rounded once. With
    `experts` (an index tensor of any shape) only those experts, [*experts.shape, N, K] (the torch path's
    per-token gather, without dequantizing the rest)."""
    N, G = w.shape[1], w.group_size
    pick = (lambda t: t) if experts is None else (lambda t: t[experts])
    q = unpack_int4(pick(w.packed)).float()                                                 # [..., N, K]
    scale = pick(w.scale).float()                                                           # [..., N, K/G]
    if w.zero is None:
        zero = torch.zeros((), device=q.device)
    else:
        zero = unpack_int4(pick(w.zero).transpose(-1, -2)).transpose(-1, -2)[..., :N, :].float()  # [..., N, K/G]
        zero = zero.repeat_interleave(G, dim=-1)
    dense = (q - zero) * scale.repeat_interleave(G, dim=-1)
    return dense.to(w.scale.dtype if dtype is None else dtype)
