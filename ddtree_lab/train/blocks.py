"""The DFlash block: its training forward and its loss.

`block_logits`: for anchors p in a sequence, the block [x_p, MASK x (bs-1)] at positions p … p+bs-1
attends (non-causally) to its own block and to the projected target features of positions < p; it
returns the drafter's logits for block slots 1 … bs-1. `block_loss` weighs them against the labels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 lengths: torch.Tensor | None = None):
    """tokens [B, S], anchors [B, A] -> block tokens [B, A, bs], positions [B, A, bs], labels [B, A, bs-1].

    Labels past the end of the sequence (or of row b's first lengths[b] tokens) are -100 (ignored)."""
    B, S = tokens.shape
    ar = torch.arange(block_size, device=tokens.device)
    pos = anchors[..., None] + ar  # [B, A, bs]
    blk = torch.full_like(pos, mask_token_id)
    blk[..., 0] = torch.gather(tokens, 1, anchors)
    lab_pos = pos[..., 1:]
    labels = torch.gather(tokens, 1, lab_pos.clamp(max=S - 1).flatten(1)).view_as(lab_pos)
    end = S if lengths is None else lengths.to(tokens.device)[:, None, None]
    labels = labels.masked_fill(lab_pos >= end, -100)
    return blk, pos, labels


def block_mask(anchors: torch.Tensor, S: int, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> bool [B, A*bs, S + A*bs]: a block sees context < its anchor and itself."""
    B, A = anchors.shape
    dev = anchors.device
    ctx_ok = torch.arange(S, device=dev)[None, None, :] < anchors[..., None]  # [B, A, S]
    ctx_ok = ctx_ok[:, :, None, :].expand(B, A, block_size, S).reshape(B, A * block_size, S)
    blk_id = torch.arange(A, device=dev).repeat_interleave(block_size)  # [A*bs]
    own = (blk_id[:, None] == blk_id[None, :])[None].expand(B, -1, -1)
    return torch.cat([ctx_ok, own], dim=-1)


def block_logits(target, drafter, tokens: torch.Tensor, target_hidden: torch.Tensor,
                 anchors: torch.Tensor, mask_token_id: int, lengths: torch.Tensor | None = None):
    """One DFlash forward for A anchors per row.

    tokens [B, S]; target_hidden [B, S, k*H] (target features at the drafter's target_layer_ids);
    anchors [B, A] with anchor >= 1 (a block needs some context). Returns logits [B, A, bs-1, V]
    and labels [B, A, bs-1] (the sequence's own next tokens, -100 past its end or lengths [B])."""
    bs = drafter.cfg.block_size
    B, S = tokens.shape
    A = anchors.shape[1]
    blk, pos, labels = block_inputs(tokens, anchors, bs, mask_token_id, lengths)
    ctx = drafter.project_context(target_hidden)  # [B, S, H]
    ctx_pos = torch.arange(S, device=tokens.device).expand(B, S)
    x = target.embed(blk.view(B, A * bs))  # [B, A*bs, H]
    h = drafter(x, pos.view(B, A * bs), ctx, ctx_pos, block_mask(anchors, S, bs))  # [B, A*bs, H]
    h = h.view(B, A, bs, -1)[:, :, 1:]
    return target.lm_head_logits(h), labels


@torch.no_grad()
def follow_up_anchors(logits: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, end) -> torch.Tensor:
    """Where the engine's next round would start after a round at each anchor: anchor + its DFlash
    acceptance (1 + the leading slots the drafter got right). logits [B, A, L, V], labels/anchors
    [B, A]; end: sequence lengths [B] or one int. Rounds start right after a token the drafter missed,
    which uniform anchors rarely hit; an anchor past end - 2 (no next token) stays where it was."""
    hits = (logits.argmax(-1) == labels) & (labels >= 0)              # [B, A, L]
    follow = anchors + 1 + torch.cumprod(hits.long(), -1).sum(-1)     # [B, A]
    last = (end[:, None] if torch.is_tensor(end) else torch.tensor(end)).to(anchors.device) - 2
    return torch.where(follow <= last, follow, anchors)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Loss weight of block slot k = 1 … bs-1: exp(-(k-1)/gamma); early slots decide acceptance."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma) if gamma > 0 else torch.ones_like(k)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               soft_targets: torch.Tensor | None = None, soft_weight: float = 0.0):
    """Position-weighted cross-entropy [B, A, L, V] vs labels [B, A, L]; optional KL to soft targets.

    Returns (loss, per-slot top-1 accuracy [L], mean chain acceptance 1 + leading hits)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    valid = labels >= 0
    nll = -torch.gather(logp, -1, labels.clamp(min=0)[..., None])[..., 0]  # [B, A, L]
    if soft_targets is not None and soft_weight > 0:
        # KL(target || draft) per slot; the target's distribution is the richer signal for ranks > 1.
        tp = F.log_softmax(soft_targets.float(), dim=-1)
        kl = (tp.exp() * (tp - logp)).sum(-1)
        nll = (1 - soft_weight) * nll + soft_weight * kl
    w = weights * valid
    loss = (nll * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logp.argmax(-1) == labels) & valid
        acc = hit.flatten(0, 1).float().sum(0) / valid.flatten(0, 1).float().sum(0).clamp(min=1)
        tau = 1.0 + torch.cumprod(hit.float(), -1).sum(-1).mean()
    return loss, acc, tau
