"""Lossless decoding: AR, DFlash (single path) and DDTree, in one readable loop (DESIGN §1).

State between rounds: `n` committed tokens in the target's KV cache, the drafter's context features
for those n positions, and the bonus token b (the target's choice for position n, not yet cached).
A round drafts a block from b, builds a tree, verifies it in one target forward, walks the target's
choices down the tree, and commits the accepted path. DFlash is the same loop with topk=1 and
budget = block_size-1; AR is the target alone.
"""
from __future__ import annotations

import time

import torch

from .attention import TreeMask
from .checkpoint import Pair
from .prompts import encode_prompt
from .trace import STAGES, GenerationResult, RoundTrace, StageClock
from .tree import DraftTree, ancestor_matrix, build_tree, check_budget

METHODS = ("ar", "dflash", "ddtree")


class Chooser:
    """The target's choice at each row of logits: argmax at T = 0, else a seeded sample."""

    def __init__(self, temperature: float, seed: int, device: torch.device):
        self.temperature = temperature
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        # logits [T, V] -> [T]
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


def _validate(pair: Pair, method, budget, topk, max_new_tokens, temperature, prompt_len):
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
    check_budget(budget, topk)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a number ≥ 0")
    if prompt_len < 1:
        raise ValueError("prompt is empty: give at least one token")
    limit = pair.target.cfg.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {limit} tokens (max_position_embeddings)")
    if method != "ar" and pair.drafter is None:
        raise ValueError(f"method={method!r} needs a drafter; this pair has none")


@torch.inference_mode()
def generate(pair: Pair, prompt, method: str = "ddtree", budget: int = 64, topk: int | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0, trace: bool = True,
             stop: list[int] | None = None, draft_window: int | None = None,
             profile: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens from `prompt` (text, chat messages or token ids)."""
    prompt_ids = encode_prompt(pair, prompt)
    _validate(pair, method, budget, topk, max_new_tokens, temperature, len(prompt_ids))
    target, drafter, device = pair.target, pair.drafter, pair.device
    stop_ids = set(pair.eos_token_ids if stop is None else stop)
    L = drafter.cfg.block_size - 1 if drafter is not None else 0
    if method == "dflash":
        budget, topk = L, 1
    max_tree = {"ar": 1, "dflash": L + 1, "ddtree": budget + 1}[method]
    cache_len = len(prompt_ids) + max_new_tokens + max_tree + 1
    target.setup_cache(cache_len)
    layers = drafter.cfg.target_layer_ids if method != "ar" else []
    if drafter is not None:
        drafter.setup_cache(cache_len)
        drafter.window = draft_window
    choose = Chooser(temperature, seed, device)
    clock = StageClock(device, sync=profile)
    start = time.perf_counter()

    # Prefill: the prompt's KV, the drafter's context, and the first new token.
    n = len(prompt_ids)
    prompt_t = torch.tensor(prompt_ids, device=device)
    positions = torch.arange(n, device=device)
    logits, hidden = target(prompt_t, positions, 0, TreeMask.causal(n, device), layers,
                            logits_rows=torch.tensor([n - 1], device=device))
    bonus = choose(logits)[0]
    if method != "ar":
        drafter.append_context(hidden, positions)
    clock.mark("verify")
    out = [int(bonus)]
    acceptance, rounds = [], []
    mask_id = drafter.cfg.mask_token_id if drafter is not None else 0

    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        clock.round = len(acceptance)
        if method == "ar":
            logits, _ = target(bonus[None], positions.new_tensor([n]), n, TreeMask.causal(1, device))
            bonus = choose(logits)[0]
            clock.mark("verify")
            n += 1
            out.append(int(bonus))
            acceptance.append(1)
            if trace:
                rounds.append(RoundTrace(len(rounds), n - 1, out[-2], None, [0], [], out[-1]))
            clock.mark("other")
            continue

        # 1. Draft: [b, MASK × L] at positions n … n+L -> per-depth logits q_1 … q_L.
        block = torch.full((L + 1,), mask_id, device=device)
        block[0] = bonus
        h = drafter.draft(target.embed(block), n + torch.arange(L + 1, device=device))
        draft_logits = target.lm_head_logits(h[1:])  # [L, V]
        clock.mark("draft")

        # 2. Tree: the `budget` most likely rank prefixes; the root (index 0) is b at depth 0.
        tree = build_tree(draft_logits, budget, topk)
        tokens = torch.cat([bonus[None], tree.tokens])            # [T]
        parents = torch.cat([tree.parents.new_zeros(1), tree.parents])
        depths = torch.cat([tree.depths.new_zeros(1), tree.depths])
        anc = ancestor_matrix(parents, L)                          # [T, T]
        clock.mark("tree_build")

        # 3. Verify: one target forward over the tree at positions n + depth.
        logits, hidden = target(tokens, n + depths, n, TreeMask(anc), layers)
        clock.mark("verify")

        # 4. Walk: a node is accepted iff every node on its path carries its parent's target choice.
        choice = choose(logits)                                     # [T]
        matched = tokens == choice[parents]
        matched[0] = True
        accepted = ~(anc & ~matched[None, :]).any(dim=1)           # [T]
        deepest = torch.where(accepted, depths, -1).argmax()
        T = tokens.shape[0]
        path = torch.where(anc[deepest], torch.arange(T, device=device), T).sort().values[: L + 1]
        path = path.clamp(max=T - 1)                                # [L+1], first a entries valid
        bonus = choice[deepest]

        # 5. Commit: accepted KV to positions n … n+a-1, their features to the drafter.
        target.compact_cache(n, path)
        a = int(depths[deepest]) + 1                                # the round's one host sync
        drafter.append_context(hidden[path[:a]], n + torch.arange(a, device=device))
        clock.mark("commit")

        path_list = path[:a].tolist()
        new_tokens = tokens[path[1:a]].tolist() + [int(bonus)]
        out.extend(new_tokens)
        acceptance.append(a)
        if trace:
            rounds.append(RoundTrace(len(rounds), n, int(tokens[0]), tree.to("cpu"), path_list,
                                     new_tokens[:-1], new_tokens[-1]))
        n += a
        clock.mark("other")

    wall = time.perf_counter() - start
    totals, per_round = clock.resolve()
    for r in rounds:
        r.stage_seconds = per_round.get(r.index, {})
    totals["other"] += max(0.0, wall - sum(totals.values()))
    produced = len(out)
    out, stop_reason = _trim(out, max_new_tokens, stop_ids)
    return GenerationResult(
        method=method, prompt_tokens=prompt_ids, tokens=out, text=pair.decode(out),
        acceptance_lengths=acceptance, stage_seconds={s: totals.get(s, 0.0) for s in STAGES},
        wall_seconds=wall, trimmed=produced - len(out), stop_reason=stop_reason,
        settings={"method": method, "budget": budget if method != "ar" else None,
                  "topk": topk, "max_new_tokens": max_new_tokens, "temperature": temperature,
                  "seed": seed, "draft_window": draft_window, "attention": target.attention,
                  "device": str(device), "dtype": str(pair.dtype).replace("torch.", "")},
        rounds=rounds,
    )


def _trim(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], "stop_token"
    return tokens[:max_new_tokens], "max_new_tokens"


__all__ = ["generate", "METHODS", "DraftTree"]
