"""Tensor parallelism for the target: `load_pair(..., tp=N)` in each of N processes (torchrun).

Each process holds 1/N of every layer: its share of the query and KV heads (the fused QKV rows,
column-parallel, with their KV cache; MLA: its heads' expansions of the replicated latent, whose cache every
process keeps whole) and of the MLP width or every expert's width (gate/up rows,
column-parallel; down columns, row-parallel). A layer's attention output and MLP output are then partial
sums, so each is summed across processes by one all-reduce (`DecoderLayer.reduce`): two a decoder layer,
one per block. Embedding, router, norms, LM head and the drafter are replicated, so every process computes
the same logits and, from the same seed, the same tokens; the round stays fixed-shape, and on CUDA the
all-reduces (NCCL) are captured in its graphs like any other kernel.

From a checkpoint, each process reads only its share of every split tensor (`stored_split`, `read_share`:
safetensors' slices) into a model built at its shard's sizes (`local_config`), so a process never holds the
whole target. `make_parallel` shards a whole target already in memory (random shapes).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from .config import TargetConfig, local_config  # noqa: F401  (local_config: the shard sizes, config.py's)


def init(tp: int) -> tuple[int, torch.device | None]:
    """Join (or check) the process group for tp processes -> (rank, this rank's CUDA device or None).
    torchrun sets RANK/WORLD_SIZE/MASTER_ADDR; a caller may also have initialised the group itself."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) != tp:
            raise ValueError(f"tp={tp} needs {tp} processes: run under `torchrun --nproc-per-node {tp}` "
                             f"(WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')})")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_world_size() != tp:
        raise ValueError(f"tp={tp} but the process group has {dist.get_world_size()} processes")
    rank = dist.get_rank()
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return rank, device


@dataclasses.dataclass(frozen=True)
class Split:
    """How a stored tensor is split across processes: along `dim`, in `blocks` equal blocks, each split
    (a fused gate_up holds gate rows then up rows: each process takes its rows of both)."""

    dim: int
    blocks: int = 1


# Stored [out, in] projections (and q/k/v biases [out]) split by output rows: column-parallel.
# MLA: the per-head expansions (q_b_proj, or q_proj without a q LoRA, and kv_b_proj) split by heads; the shared
# latent projections (q_a_proj and kv_a_proj_with_mqa, one fused parameter) and their norms are replicated.
# INT4 experts (quant.py) split as their dense weights: packed words, scales and zero points alike (gate/up by
# rows, zero points 8 rows a word; down by columns, K/8 words and K/G groups).
_INT4 = ("weight_packed", "weight_scale", "weight_zero_point")
_SPLIT_BY_ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
                  "gate_proj.weight", "up_proj.weight", "q_b_proj.weight", "kv_b_proj.weight",
                  *(f"{p}_proj.{t}" for p in ("gate", "up") for t in _INT4))
# Stored [out, in] projections split by input columns: row-parallel, their outputs partial sums.
_SPLIT_BY_COLUMNS = ("o_proj.weight", "down_proj.weight", *(f"down_proj.{t}" for t in _INT4))


def stored_split(name: str) -> Split | None:
    """How a target tensor stored under its HF name is split (None: replicated, as the embedding, norms,
    router and LM head are). Agrees with shard_into, which splits our fused parameters the same way."""
    if name.endswith(_SPLIT_BY_ROWS):
        return Split(0)
    if name.endswith(_SPLIT_BY_COLUMNS):
        return Split(1)
    if name.endswith("experts.gate_up_proj"):  # stacked [E, 2I, H]: gate rows, then up rows
        return Split(1, blocks=2)
    if name.endswith("experts.down_proj"):  # stacked [E, H, I]
        return Split(2)
    return None


def full_shape(share: tuple[int, ...], split: Split | None, tp: int) -> tuple[int, ...]:
    """The stored tensor's shape, from the shape of one process's share of it."""
    if split is None:
        return tuple(share)
    return tuple(n * tp if d == split.dim else n for d, n in enumerate(share))


def read_share(stored, split: Split, rank: int, tp: int) -> torch.Tensor:
    """rank's share of a stored tensor. `stored` is a safetensors slice (`safe_open(...).get_slice(name)`):
    indexing it reads only the rows or columns asked for."""
    block = stored.get_shape()[split.dim] // split.blocks
    n = block // tp
    lead = (slice(None),) * split.dim
    pieces = [stored[(*lead, slice(b * block + rank * n, b * block + (rank + 1) * n))]
              for b in range(split.blocks)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, split.dim)


def _rows(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    n = t.shape[dim] // parts
    return t.narrow(dim, index * n, n)


def shard_into(full, local, rank: int, tp: int) -> None:
    """Copy rank's share of a full Target's weights into `local` (built from local_config)."""
    c = full.cfg
    D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    own = dict(local.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            if ".qkv.wqkv." in name:  # [(Hq + 2 Hkv)·D, H] or its bias: q, k and v heads, each split
                q, k, v = p.split([Hq * D, Hkv * D, Hkv * D], dim=0)
                part = torch.cat([_rows(t, 0, rank, tp) for t in (q, k, v)], 0)
            elif name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight", "kv_b_proj.weight")):
                part = _rows(p, 0, rank, tp)  # MLA: [heads · d, in], this rank's heads
            elif name.endswith("o_proj.weight"):  # [H, Hq·D]: the columns of this rank's heads
                part = _rows(p, 1, rank, tp)
            elif name.endswith(("gate_up.weight", "mlp.gate_up")):  # dense, shared or routed experts
                # dense [2I, H] or experts [E, 2I, H]: gate rows then up rows, each split
                dim = p.dim() - 2
                gate, up = p.chunk(2, dim=dim)
                part = torch.cat([_rows(gate, dim, rank, tp), _rows(up, dim, rank, tp)], dim)
            elif name.endswith(("down.weight", "mlp.down")):  # [.., H, I]: columns
                part = _rows(p, p.dim() - 1, rank, tp)
            else:  # embedding, norms, router, LM head: replicated
                part = p
            own[name].copy_(part)
        own = dict(local.named_buffers())
        for name, b in full.named_buffers():  # INT4 experts: packed words, scales, zero points split as the weights
            stack, _, kind = name.rpartition(".")
            if kind not in ("packed", "scale", "zero") or not stack.endswith(("mlp.gate_up", "mlp.down")):
                continue
            if stack.endswith("gate_up"):  # [E, 2N, …]: gate rows then up rows (zero points: 2N/8 words), each split
                gate, up = b.chunk(2, dim=1)
                part = torch.cat([_rows(gate, 1, rank, tp), _rows(up, 1, rank, tp)], 1)
            else:  # down [E, H, K/8 | K/G]: this rank's columns
                part = _rows(b, 2, rank, tp)
            own[name].copy_(part)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """A block's partial output summed over the tensor-parallel processes, in place."""
    dist.all_reduce(t)
    return t


def connect(local, tp: int, rank: int):
    """Mark a Target holding rank's share as one of tp processes: its blocks sum their outputs across them."""
    for blk in local.layers:
        blk.reduce = all_reduce_sum
    local.tp, local.tp_rank = tp, rank
    return local


def make_parallel(full, tp: int, rank: int):
    """A Target holding rank's share of `full` (a whole target in memory), connected to the other processes."""
    with torch.device("meta"):
        local = type(full)(local_config(full.cfg, tp))
    like = next(full.parameters())
    local = local.to_empty(device=like.device).to(like.dtype)
    shard_into(full, local, rank, tp)
    local.rotary = full.rotary
    return connect(local, tp, rank)
