"""What a generation records: per-round traces and the result, both JSON-ready (traces.jsonl)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .names import STAGES
from .tree import DraftTree


@dataclass
class RoundTrace:
    """One speculative round. `accepted` holds node indices along the accepted path, 0 = root."""

    index: int
    position: int                  # n: committed tokens before the round; the root sits at position n
    root_token: int                # the bonus token b the round started from
    tree: DraftTree | None         # None for AR steps
    accepted: list[int]
    accepted_tokens: list[int]     # tokens of the accepted nodes after the root
    next_token: int                # the target's choice at the last accepted node (next bonus)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # MoE targets: per MoE layer, the distinct experts the round's target forward (the verify, or the AR
    # step) routed a token to; None for dense targets
    experts_touched: list[int] | None = None
    expert_tokens_max: list[int] | None = None  # per MoE layer, the most tokens one expert got (its load)
    # per row-block height ("16", "32", "64"), per MoE layer: the fused kernel's row blocks, Σ ceil(tokens_e / h)
    expert_row_blocks: dict[str, list[int]] | None = None
    expert_int4: bool = False      # the experts are INT4 (the kernel runs them at moe_layout.row_height(T, int4))
    budget: int | None = None      # the round's tree budget (DDTree; with budget="auto" the one chosen)

    @property
    def acceptance_length(self) -> int:
        return len(self.accepted)

    def to_json(self) -> dict:
        return {
            "index": self.index, "position": self.position, "root_token": self.root_token,
            "acceptance_length": self.acceptance_length, "accepted": self.accepted,
            "accepted_tokens": self.accepted_tokens, "next_token": self.next_token,
            "stage_seconds": self.stage_seconds, "experts_touched": self.experts_touched,
            "expert_tokens_max": self.expert_tokens_max, "expert_row_blocks": self.expert_row_blocks,
            "expert_int4": self.expert_int4, "budget": self.budget,
            "tree": None if self.tree is None else self.tree.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> "RoundTrace":
        return cls(index=d["index"], position=d["position"], root_token=d["root_token"],
                   tree=None if d.get("tree") is None else DraftTree.from_json(d["tree"]),
                   accepted=d["accepted"], accepted_tokens=d["accepted_tokens"],
                   next_token=d["next_token"], stage_seconds=d.get("stage_seconds", {}),
                   experts_touched=d.get("experts_touched"), expert_tokens_max=d.get("expert_tokens_max"),
                   expert_row_blocks=d.get("expert_row_blocks"), expert_int4=bool(d.get("expert_int4")),
                   budget=d.get("budget"))


@dataclass
class GenerationResult:
    """`tokens` are the new tokens. The prefill forward yields the first one; every round then yields
    its acceptance length τ, so len(tokens) == 1 + sum(acceptance_lengths) - trimmed, where `trimmed`
    (< the last τ) counts tokens of the last round cut by max_new_tokens or a stop token."""

    method: str
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    acceptance_lengths: list[int]
    stage_seconds: dict[str, float]
    wall_seconds: float
    trimmed: int
    stop_reason: str               # "max_new_tokens" | "stop_token"
    settings: dict
    rounds: list[RoundTrace] = field(default_factory=list)
    prefill_seconds: float = 0.0   # the prompt's forward (counted in stage "other")
    round_budgets: list[int] = field(default_factory=list)  # each round's tree budget (DFlash, DDTree)
    # generate(round_times=True): per counted round, seconds per stage of STAGES, as the events between the
    # stages timed them ("other": the host's reads after the round; the first round also holds the host's
    # start-up); None unless asked
    round_stage_seconds: list[dict[str, float]] | None = None

    @property
    def mean_acceptance(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def seconds_per_token(self) -> float:
        return self.wall_seconds / len(self.tokens) if self.tokens else 0.0

    def to_json(self, with_rounds: bool = False) -> dict:
        d = {
            "method": self.method, "settings": self.settings, "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens, "text": self.text, "acceptance_lengths": self.acceptance_lengths,
            "mean_acceptance": self.mean_acceptance, "stage_seconds": self.stage_seconds,
            "wall_seconds": self.wall_seconds, "tokens_per_second": self.tokens_per_second,
            "trimmed": self.trimmed, "stop_reason": self.stop_reason,
            "prefill_seconds": self.prefill_seconds, "round_budgets": self.round_budgets,
        }
        if self.round_stage_seconds is not None:
            d["round_stage_seconds"] = self.round_stage_seconds
        if with_rounds:
            d["rounds"] = [r.to_json() for r in self.rounds]
        return d


class StageClock:
    """Attributes wall time to stages. On a GPU it records CUDA events (no host sync inside a round)
    and resolves them once at the end; on the CPU it reads the wall clock."""

    def __init__(self, device: torch.device, sync: bool = False):
        self.cuda = device.type == "cuda"
        self.sync = sync  # profiling: synchronise at every mark so host timelines line up
        self.marks: list[tuple[int, str, object, object]] = []  # (round, stage, start, end)
        self._last = self._now()
        self.round = -1

    def _now(self):
        if self.cuda:
            if self.sync:
                torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, stage: str) -> None:
        now = self._now()
        self.marks.append((self.round, stage, self._last, now))
        self._last = now

    def resolve(self) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
        """-> (seconds per stage in total, seconds per stage per round)."""
        if self.cuda:
            torch.cuda.synchronize()
        totals = {s: 0.0 for s in STAGES}
        per_round: dict[int, dict[str, float]] = {}
        for rnd, stage, a, b in self.marks:
            sec = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            totals[stage] = totals.get(stage, 0.0) + sec
            per_round.setdefault(rnd, {}).setdefault(stage, 0.0)
            per_round[rnd][stage] += sec
        return totals, per_round
