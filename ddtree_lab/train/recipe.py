"""Batched pieces shared by lab training and evaluation.

- `greedy_extend`: batched greedy generation with a KV cache built from the target's own layers
  (the engine's cached forward serves one sequence at a time; training wants thousands at once).
  It computes exactly what `Target.forward_train` computes, position by position.
- `block_logits`: the DFlash training forward — for anchors p in a sequence, the block
  [x_p, MASK x (bs-1)] at positions p … p+bs-1 attends (non-causally) to its own block and to the
  projected target features of positions < p; returns the drafter's logits for block slots 1 … bs-1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def greedy_extend(target, tokens: torch.Tensor, n_new: int, prompt_lens: torch.Tensor | None = None,
                  stop_id: int | None = None, temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """tokens [B, P] -> [B, P + n_new], the target's greedy continuation of every row (or, with
    temperature > 0, one sampled from softmax(logits / temperature) with `generator`).

    prompt_lens [B] (optional): rows are left-padded, row b's prompt is its last prompt_lens[b] tokens;
    pad keys are masked and positions count from the row's first real token, so a padded row gets the
    same tokens as alone (chat prompts differ in length, and one batch must hold them all).
    stop_id (optional): stop early once every row has produced it (the output is then shorter)."""
    cfg = target.cfg
    B, P = tokens.shape
    S = P + n_new
    dev, dt = tokens.device, target.embed_tokens.weight.dtype
    if torch.is_autocast_enabled(dev.type):
        dt = torch.get_autocast_dtype(dev.type)
    kc = torch.zeros(cfg.num_hidden_layers, B, cfg.num_key_value_heads, S, cfg.head_dim, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    out = torch.empty(B, S, dtype=tokens.dtype, device=dev)
    out[:, :P] = tokens
    pad = None if prompt_lens is None else (P - prompt_lens.to(dev))  # [B] left pads per row
    key_ok = None if pad is None else torch.arange(S, device=dev)[None] >= pad[:, None]  # [B, S]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    step_in, pos0 = tokens, 0
    for _ in range(n_new):
        T = step_in.shape[1]
        x = target.embed(step_in)
        pos = torch.arange(pos0, pos0 + T, device=dev)
        if pad is not None:
            pos = (pos[None] - pad[:, None]).clamp(min=0)  # [B, T]
        cos, sin = target.rotary(pos, x.dtype)
        for li, blk in enumerate(target.layers):
            q, k, v = blk.qkv.project(blk.input_layernorm(x))  # [B, H*, T, D]
            q, k = blk.qkv.norm_rope_q(q, cos, sin), blk.qkv.norm_rope_k(k, cos, sin)
            kc[li, :, :, pos0:pos0 + T] = k
            vc[li, :, :, pos0:pos0 + T] = v
            if T > 1 and pad is None:  # prefill (pos0 == 0): causal over itself
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            elif T > 1:  # padded prefill: causal, pad keys hidden; every query sees itself (no empty rows)
                m = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & key_ok[:, None, :T]
                m = m | torch.eye(T, dtype=torch.bool, device=dev)[None]
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None],
                                                     enable_gqa=q.shape[1] != k.shape[1])
            else:  # one new token sees the whole cache; grouped matmuls, no K/V copies per query head
                att = _decode_attention(q, kc[li, :, :, :pos0 + 1], vc[li, :, :, :pos0 + 1],
                                        None if key_ok is None else key_ok[:, :pos0 + 1])
            x = x + blk.o_proj(att.transpose(1, 2).reshape(B, T, -1))
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        logits = target.lm_head_logits(target.norm(x[:, -1]))  # [B, V]
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]
        else:
            nxt = logits.argmax(-1)  # [B]
        out[:, pos0 + T] = nxt
        step_in, pos0 = nxt[:, None], pos0 + T
        if stop_id is not None:
            done |= nxt == stop_id
            if bool(done.all()):  # one host sync per step; cheap next to a 30-layer step
                return out[:, :pos0 + 1]
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok=None) -> torch.Tensor:
    """q [B, Hq, 1, D], k/v [B, Hkv, S, D] (query head h uses KV head h // (Hq/Hkv)) -> [B, Hq, 1, D].

    key_ok [B, S] (optional): False hides a key (left padding)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.to(k.dtype).reshape(B, Hkv, Hq // Hkv, D)              # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() / D ** 0.5  # [B, Hkv, G, S]
    if key_ok is not None:
        scores = scores.masked_fill(~key_ok[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)          # [B, Hkv, G, D]
    return out.reshape(B, Hq, 1, D)


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


__all__ = ["greedy_extend", "block_inputs", "block_mask", "block_logits", "follow_up_anchors", "position_weights",
           "block_loss"]
