"""Batched generation with the target, for training pools and evaluation.

`greedy_extend` builds a KV cache from the target's own layers (the engine's cached forward serves one
sequence at a time; training wants thousands at once) and computes exactly what `Target.forward_train`
computes, position by position, for GQA and MLA (DeepSeek-V3) targets alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def left_padded(ids: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (x [B, P] left-padded with pad_id, prompt lengths [B]), as greedy_extend takes them."""
    plen = torch.tensor([len(seq) for seq in ids], device=device)
    x = torch.full((len(ids), int(plen.max())), pad_id, dtype=torch.long, device=device)
    for r, seq in enumerate(ids):
        x[r, x.shape[1] - len(seq):] = torch.tensor(seq, device=device)
    return x, plen


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
    # per layer what the block's attention_inputs returns for one token: K and V per KV head, or MLA's one row
    row = (2, cfg.num_key_value_heads, cfg.head_dim) if cfg.mla is None else (1, 1, cfg.mla.cache_width)
    cache = torch.zeros(cfg.num_hidden_layers, B, row[0], row[1], S, row[2], device=dev, dtype=dt)
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
        delta = torch.zeros_like(x)
        for li, blk in enumerate(target.layers):
            # q [B, Hq, T, D]; kv [B, 2, Hkv, T, D] (GQA) or [B, 1, 1, T, C + R] (MLA)
            x, q, kv = blk.attention_inputs(x, delta, cos, sin)
            cache[li, :, :, :, pos0:pos0 + T] = kv
            k, v, scale = _keys_values(blk, cache[li, :, :, :, :pos0 + T])
            if T > 1 and pad is None:  # prefill (pos0 == 0): causal over itself
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            elif T > 1:  # padded prefill: causal, pad keys hidden; every query sees itself (no empty rows)
                m = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & key_ok[:, None, :T]
                m = m | torch.eye(T, dtype=torch.bool, device=dev)[None]
                att = F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], scale=scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
            else:  # one new token sees the whole cache; grouped matmuls, no K/V copies per query head
                att = _decode_attention(q, k, v, None if key_ok is None else key_ok[:, :pos0 + 1], scale)
            x, delta = blk.attention_output(x, att)
        x = x + delta
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
            if bool(done.all()):  # one host sync per step, small next to a step of every layer
                return out[:, :pos0 + 1]
    return out


def _keys_values(blk, cached: torch.Tensor):
    """A layer's cache so far [B, n, Hkv, S, W] -> (k, v, softmax scale or None for 1/sqrt(D)): GQA's K and V, or
    MLA's rows as one key head whose latent part is also the value (mla.MlaBlock.causal_attention's form)."""
    if not hasattr(blk, "self_attn"):
        return cached[:, 0], cached[:, 1], None
    k = cached[:, 0]                                               # [B, 1, S, C + R]
    return k, k[..., :blk.self_attn.mla.kv_lora_rank], blk.self_attn.scale


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ok=None,
                      scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (query head h uses KV head h // (Hq/Hkv)) ->
    [B, Hq, 1, Dv]; scale defaults to 1/sqrt(D).

    key_ok [B, S] (optional): False hides a key (left padding)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.to(k.dtype).reshape(B, Hkv, Hq // Hkv, D)              # [B, Hkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()      # [B, Hkv, G, S]
    scores = scores / D ** 0.5 if scale is None else scores * scale
    if key_ok is not None:
        scores = scores.masked_fill(~key_ok[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v)          # [B, Hkv, G, Dv]
    return out.reshape(B, Hq, 1, v.shape[-1])


@torch.no_grad()
def greedy_all(target, prompts: list[list[int]], n_new: int, device, batch: int = 64):
    """Each prompt + its greedy continuation of n_new tokens ([1, P + n_new] each), generated in
    left-padded batches (a padded row gets the tokens it gets alone)."""
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        x, lens = left_padded(chunk, 0, device)
        P = x.shape[1]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = greedy_extend(target, x, n_new, prompt_lens=lens if len(set(lens.tolist())) > 1 else None)
        for r, p in enumerate(chunk):
            yield torch.cat([out[r, P - len(p):P], out[r, P:]])[None]
