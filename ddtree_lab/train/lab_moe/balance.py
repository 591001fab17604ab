"""Learned, balanced routing for the lab-moe target: DeepSeek-V3's auxiliary-loss-free bias update, and the load
figures the card checks.

After every training step each MoE layer's correction bias moves against its load (the step's tokens per expert):
bias_e += rate · sign(mean load − load_e). The bias only chooses experts (weights come from the uncorrected scores,
moe_layout.route_grouped_reference), so it steers load without a loss term; it is a parameter outside the optimizer
(requires_grad False). The per-expert counts are SparseMoE's `counts`, which the training forward fills.

Load shares: an expert's tokens over the mean expert's (1 = its fair share, k·T/E of T tokens); an expert below
DEAD_SHARE of its fair share is dead in all but name, and one routed MOST_TOKENS of all tokens takes most of them.
"""
from __future__ import annotations

import numpy as np
import torch

DEAD_SHARE = 0.1     # an expert getting less than a tenth of its fair share counts as dead
MOST_TOKENS = 0.5    # an expert routed more than half of all tokens takes most tokens


def moe_blocks(model) -> list:
    from ...moe import SparseMoE
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def load_figures(counts: np.ndarray, top_k: int) -> dict:
    """Per-layer tokens per expert [L, E] -> per layer: the least and most loaded expert against the fair share
    (min_vs_fair, max_vs_fair), the most loaded one's share of all tokens (max_token_share), and the verdicts."""
    counts = np.asarray(counts, dtype=np.float64)
    fair = counts.mean(-1, keepdims=True).clip(min=1e-12)              # [L, 1]
    tokens = counts.sum(-1) / top_k                                    # [L]
    lo, hi = (counts / fair).min(-1), (counts / fair).max(-1)
    share = counts.max(-1) / tokens.clip(min=1e-12)
    return {"min_vs_fair": lo.round(3).tolist(), "max_vs_fair": hi.round(3).tolist(),
            "max_token_share": share.round(3).tolist(), "tokens": int(tokens.max()) if len(tokens) else 0,
            "dead_experts": int((counts / fair < DEAD_SHARE).sum()), "none_dead": bool((lo >= DEAD_SHARE).all()),
            "none_takes_most": bool((share <= MOST_TOKENS).all())}


class RouterBalance:
    """The target loop's monitor (lab.pipeline.stage_target): freezes each router's correction bias out of the
    optimizer, updates it after every step at `rate` (0: no update, the routing left to the router's gradient),
    and records each eval interval's load (tokens per expert, per MoE layer)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.blocks: list = []
        self.interval: torch.Tensor | None = None   # [L, E] tokens since the last eval
        self.history: list[dict] = []               # per eval: the interval's counts

    def attach(self, model) -> None:
        self.blocks = moe_blocks(model)
        for m in self.blocks:
            m.router.e_score_correction_bias.requires_grad_(False)

    @torch.no_grad()
    def after_step(self, model, step: int) -> None:
        counts = torch.stack([m.counts for m in self.blocks]).float()   # [L, E]: the step's forward
        self.interval = counts if self.interval is None else self.interval + counts
        if self.rate > 0:
            mean = counts.mean(-1, keepdim=True)
            for m, d in zip(self.blocks, torch.sign(mean - counts)):
                m.router.e_score_correction_bias.add_(self.rate * d)

    def at_eval(self, model) -> dict:
        if self.interval is None:
            return {}
        counts = self.interval.cpu().numpy()
        self.history.append({"counts": counts.astype(np.int64).tolist()})
        self.interval = None
        f = load_figures(counts, self.blocks[0].top_k)
        return {"load_min_vs_fair": f["min_vs_fair"], "load_max_vs_fair": f["max_vs_fair"],
                "bias_spread": [round(float(m.router.e_score_correction_bias.max() -
                                            m.router.e_score_correction_bias.min()), 4) for m in self.blocks]}

    def state_dict(self) -> dict:
        return {"history": self.history, "interval": self.interval}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.interval = state["history"], state["interval"]

    def summary(self, model) -> dict:
        return {"routing": {"bias_update_rate": self.rate, "load_history": self.history,
                            "final_bias": [m.router.e_score_correction_bias.tolist() for m in self.blocks]}}


@torch.no_grad()
def heldout_load(target, ids: np.ndarray, seq_len: int, device, max_windows: int = 64, batch: int = 16) -> np.ndarray:
    """Tokens per expert [L, E] of the (frozen) target over non-overlapping held-out windows of seq_len tokens, in
    the target's own dtype (no autocast: the router's choice as the engine makes it)."""
    blocks = moe_blocks(target)
    n = min(len(ids) // seq_len, max_windows)
    arr = torch.from_numpy(ids[: n * seq_len].astype(np.int64)).view(n, seq_len)
    total = torch.zeros(len(blocks), blocks[0].num_experts, dtype=torch.float64)
    for i in range(0, n, batch):
        target.forward_train(arr[i:i + batch].to(device))
        total += torch.stack([m.counts for m in blocks]).double().cpu()
    return total.numpy()
