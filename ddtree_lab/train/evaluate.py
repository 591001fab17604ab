"""Acceptance τ of a drafter for DFlash and DDTree, while training and for the model cards.

Two ways to get τ:
- `fast_tau` (used while training, batched on the GPU): at T = 0 the committed sequence is always
  the target's greedy sequence, so every round's drafter input is known up front. One batched
  drafter pass drafts a block at every position of the greedy continuation; a round at position n
  accepts the longest path of the tree (built by the engine's `build_tree`) that spells the greedy
  tokens n+1, n+2, …; the next round starts at n + τ. This is the engine's loop minus the KV cache.
- `engine_tau` (used for the model card): `ddtree_lab.generate` itself, which also checks that
  DFlash and DDTree emit exactly the AR tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .blocks import block_logits
from .generate import greedy_all


def _walk(tree, truth: list[int]) -> int:
    """Accepted nodes (root included) when the target's choices are `truth` (depths 1..L)."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault(p, {})[t] = i + 1
    node, a = 0, 1
    for t in truth:
        node = children.get(node, {}).get(t)
        if node is None:
            break
        a += 1
    return a


@dataclass
class TauResult:
    per_method: dict = field(default_factory=dict)   # method -> list of τ (all rounds, all prompts)
    per_prompt: dict = field(default_factory=dict)   # method -> list of per-prompt mean τ
    # Per prompt, DFlash's chain τ at every position of the output, as training measures it. The
    # engine's rounds start only where the last one ended, right after a token the drafter missed,
    # so their mean (per_method["dflash"]) is lower: the gap says how much the start positions cost.
    per_anchor: list = field(default_factory=list)

    def anchor_mean(self) -> float:
        xs = [t for p in self.per_anchor for t in p]
        return float(np.mean(xs)) if xs else float("nan")

    def mean(self, method: str) -> float:
        xs = self.per_method.get(method, [])
        return float(np.mean(xs)) if xs else float("nan")

    def summary(self) -> dict:
        return {m: round(self.mean(m), 3) for m in self.per_method}


@torch.no_grad()
def fast_tau(target, drafter, prompts: list[list[int]], n_new: int = 96, budgets=(16, 64, 256),
             eos_id: int | None = None, device=None) -> TauResult:
    """τ of DFlash and DDTree(budget) per round at T = 0, simulated on the greedy sequence."""
    from ..tree import build_tree

    device = device or target.embed_tokens.weight.device
    bs = drafter.cfg.block_size
    L = bs - 1
    mask_id = drafter.cfg.mask_token_id
    layers = list(drafter.cfg.target_layer_ids)
    methods = ["dflash"] + [f"ddtree{b}" for b in budgets]
    res = TauResult({m: [] for m in methods}, {m: [] for m in methods})
    for ids, seq in zip(prompts, greedy_all(target, prompts, n_new + bs, device)):
        P = len(ids)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, hid = target.forward_train(seq, hidden_layers=layers)
            anchors = torch.arange(P, P + n_new, device=device)[None]  # a round can start anywhere here
            logits, _ = block_logits(target, drafter, seq, hid, anchors, mask_id)  # [1, A, L, V]
        logits = logits[0].float()  # [A, L, V] stays on the device: trees are built there (a CPU
        # copy of every position's block over the whole vocabulary is large, and top-k on the host slow)
        toks = seq[0].tolist()
        n_out = n_new
        if eos_id is not None and eos_id in toks[P:P + n_new]:
            n_out = toks[P:P + n_new].index(eos_id) + 1  # the engine stops after emitting EOS
        # DFlash's chain at every anchor where a round could start (P … P+n_out-2), judged like a round
        A = n_out - 1
        pos = torch.arange(P, P + A, device=device)[:, None] + torch.arange(1, L + 1, device=device)  # [A, L]
        hits = logits[:A].argmax(-1) == seq[0][pos]
        res.per_anchor.append((1 + torch.cumprod(hits.int(), -1).sum(-1)).tolist())
        for m in methods:
            taus, n = [], P  # n = position of the bonus token; the prefill emitted toks[P]
            while n - P + 1 < n_out:
                truth = toks[n + 1: n + 1 + L]
                q = logits[n - P]
                if m == "dflash":
                    hits = (q.argmax(-1) == torch.tensor(truth, device=q.device)).int()
                    a = 1 + int(torch.cumprod(hits, 0).sum())
                else:
                    a = _walk(build_tree(q, int(m[6:])), truth)
                taus.append(a)
                n += a
            res.per_method[m].extend(taus)
            res.per_prompt[m].append(float(np.mean(taus)) if taus else float("nan"))
    return res


def engine_tau(pair, prompt_rows: list[dict], n_new: int = 96, budgets=(16, 64, 256), log=print,
               temperature: float = 0.0, seed: int = 0) -> dict:
    """Run ddtree_lab.generate for AR, DFlash and DDTree(budgets) on every prompt; check losslessness.

    At T > 0 outputs are samples, so the token-equality check applies only at T = 0."""
    import ddtree_lab as dl

    methods = [("ar", {}), ("dflash", {})] + [(f"ddtree{b}", {"budget": b}) for b in budgets]
    taus = {m: [] for m, _ in methods}
    secs = {m: 0.0 for m, _ in methods}
    toks = {m: 0 for m, _ in methods}
    mismatches, samples = [], []
    for i, row in enumerate(prompt_rows):
        outs = {}
        for m, kw in methods:
            t0 = time.perf_counter()
            r = dl.generate(pair, row["prompt"], method="ddtree" if m.startswith("ddtree") else m,
                            max_new_tokens=n_new, temperature=temperature, seed=seed + i, trace=False, **kw)
            secs[m] += time.perf_counter() - t0
            toks[m] += len(r.tokens)
            outs[m] = r
            taus[m].extend(r.acceptance_lengths)
        for m, _ in methods[1:]:
            if temperature == 0 and outs[m].tokens != outs["ar"].tokens:
                mismatches.append({"id": row["id"], "method": m})
        if i < 3:
            samples.append({"id": row["id"], "source": row.get("source", ""), "prompt": row["prompt"],
                            "output": outs["ar"].text})
        if log and (i + 1) % 8 == 0:
            log(f"  engine eval {i + 1}/{len(prompt_rows)}: " +
                ", ".join(f"{m} {np.mean(taus[m]):.2f}" for m, _ in methods[1:]))
    return {"tau": {m: float(np.mean(v)) for m, v in taus.items()},
            "rounds": {m: len(v) for m, v in taus.items()},
            "tokens_per_s": {m: toks[m] / max(secs[m], 1e-9) for m in secs},
            "mismatches": mismatches, "samples": samples, "n_prompts": len(prompt_rows)}


def pooled(sets: dict) -> dict:
    """engine_tau results per prompt set -> {"sets", "overall_tau", "lossless"}: τ pooled over every round of
    every set (accepted tokens / rounds), and whether no set had a mismatch."""
    rounds = {m: sum(s["rounds"][m] for s in sets.values()) for m in next(iter(sets.values()))["rounds"]}
    overall = {m: sum(s["tau"][m] * s["rounds"][m] for s in sets.values()) / max(rounds[m], 1) for m in rounds}
    return {"sets": sets, "overall_tau": overall, "lossless": all(not s["mismatches"] for s in sets.values())}
