"""budget="auto": each round's budget chosen on the device among captured budgets, losslessly.

Every candidate budget has its own captured round; all of them share one decoding state, so any may run
next. After each round the device credits the round to a table (per confidence bin: τ at the smallest
candidate and each larger one's gain over the next smaller, both known from the round's own tree) and
proposes the next budget: the highest expected τ(B) − λ·cost(B), where λ is the tokens per second achieved
so far (maximising that per round maximises tokens/s overall at λ's fixed point) and cost(B) the round cost,
timed at capture and then taken from each call's own round timings. The confidence is the draft's own: its
expected accepted nodes, Σ exp(score) over the smallest candidate's tree. The host reads proposals with the tokens it reads anyway, so a round runs at
the budget proposed after round `source_round(r)` (one or two rounds earlier): nothing waits inside a
round, and the choice only selects which captured round runs next, so the output is the target's own
(lossless as any budget is). The table is kept on the pair per setting and keeps learning across calls.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

from .names import AUTO, AUTO_CANDIDATES, AUTO_MAX_CANDIDATES, AUTO_MAX_EDGES, MAX_BUDGET, is_budget
from .tree import use_triton


@dataclass(frozen=True)
class AutoBudget:
    """budget="auto" and its settings; `AutoBudget()` is what "auto" means."""

    budgets: tuple[int, ...] = AUTO_CANDIDATES  # the captured budgets it chooses among (AUTO_MAX_CANDIDATES)
    costs: tuple[float, ...] | None = None      # seconds per round of each; None: measured when captured
    edges: tuple[float, ...] = (1.5, 3.0)       # confidence bins: expected accepted nodes by the draft
    explore: float = 1.0     # tokens an untried budget is assumed to add over the next smaller candidate
    weight: float = 2.0      # rounds' worth of that assumption in each table cell
    memory: int = 2048       # rounds: older outcomes fade by 1 - 1/memory per round

    def __post_init__(self):
        budgets = tuple(self.budgets)
        if not 1 <= len(budgets) <= AUTO_MAX_CANDIDATES or len(set(budgets)) != len(budgets) or any(
                not is_budget(b) for b in budgets):
            raise ValueError(f"auto budgets={self.budgets!r}: give 1 to {AUTO_MAX_CANDIDATES} distinct integers in "
                             f"1..{MAX_BUDGET}")
        object.__setattr__(self, "budgets", tuple(sorted(budgets)))
        if self.costs is not None:
            costs = tuple(float(c) for c in self.costs)
            if len(costs) != len(budgets) or not all(c > 0 and c < float("inf") for c in costs):
                raise ValueError(f"auto costs={self.costs!r}: give one positive number of seconds per budget")
            order = sorted(range(len(budgets)), key=lambda i: budgets[i])
            object.__setattr__(self, "costs", tuple(costs[i] for i in order))
        if len(self.edges) > AUTO_MAX_EDGES or list(self.edges) != sorted(self.edges):
            raise ValueError(f"auto edges={self.edges!r}: at most {AUTO_MAX_EDGES}, ascending")
        if self.memory < 1 or self.weight <= 0 or self.explore < 0:
            raise ValueError("auto memory must be ≥ 1, weight > 0 and explore ≥ 0")

    def key(self) -> tuple:
        return (self.budgets, self.costs, tuple(self.edges), self.explore, self.weight, self.memory)


LABEL_SETTINGS = {"explore": float, "weight": float, "memory": int}  # what a label "auto:key=value,…" may set


def is_auto_label(budget) -> bool:
    """Whether `budget` is "auto" or "auto:key=value,…" (a bench's auto with settings of its own)."""
    return isinstance(budget, str) and (budget == AUTO or budget.startswith(AUTO + ":"))


def auto_label_settings(label: str) -> dict:
    """"auto:memory=8192,explore=0.5" -> {"memory": 8192, "explore": 0.5}; "auto" -> {}. Refused by name."""
    settings = {}
    for item in filter(None, label.partition(":")[2].split(",")):
        key, eq, value = (x.strip() for x in item.partition("="))
        if key not in LABEL_SETTINGS or not eq:
            raise ValueError(f"{label!r}: {item!r} is not key=value with key one of {', '.join(LABEL_SETTINGS)}")
        try:
            settings[key] = LABEL_SETTINGS[key](value)
        except ValueError:
            raise ValueError(f"{label!r}: {key} wants {LABEL_SETTINGS[key].__name__}, not {value!r}") from None
    return settings


def resolve_budget(budget):
    """An int stays; "auto" -> AutoBudget(); an AutoBudget stays. Anything else is refused."""
    if isinstance(budget, AutoBudget):
        return budget
    if isinstance(budget, str) and budget.strip().lower() == AUTO:
        return AutoBudget()
    return budget


def source_round(r: int, lag: int, every: int) -> int:
    """The round whose proposal the host has read when it queues round r (host reads every `every` rounds,
    `lag` reads in flight); -1: none yet, the call's first proposal is used. The kernel uses the same rule."""
    return (r // every - lag) * every - 1


class AutoState:
    """The device tensors of the choice: the learned table, the running totals and per-round rings."""

    def __init__(self, auto: AutoBudget, L: int, max_rounds: int, device):
        self.auto = auto
        J, rows = len(auto.budgets), len(auto.edges) + 2   # bin 0: no proposal read yet
        f32 = dict(dtype=torch.float32, device=device)
        self.budgets = torch.tensor(auto.budgets, dtype=torch.long, device=device)
        self.costs = torch.tensor(auto.costs or [1.0] * J, **f32)
        self.edges = torch.tensor(list(auto.edges), **f32)
        self.table_sum = torch.zeros(rows, J, **f32)
        self.table_count = torch.zeros(rows, J, **f32)
        self.totals = torch.zeros(2, **f32)
        self.bin_ring = torch.zeros(max_rounds, dtype=torch.long, device=device)
        # [bin 0's proposal (for a call's rounds before any read), then round r's at 1 + r]: one copy reads both
        self.proposals = torch.zeros(1 + max_rounds, dtype=torch.long, device=device)
        self.schedule = torch.tensor([0, 1], dtype=torch.long, device=device)  # host read lag, rounds per read
        self.max_tau = float(L + 1)
        self.decay = 1.0 - 1.0 / auto.memory
        self.timing = self.learned()["timing"]
        self.side = None  # the CUDA stream the update runs on beside the commit (update_beside)

    def place_proposals(self, buffer: torch.Tensor) -> None:
        """Keep the proposals in `buffer` (the round program's read-back, after its tokens, so that one copy
        reads both); before anything is captured."""
        buffer.copy_(self.proposals)
        self.proposals = buffer

    LEARNED = ("table_sum", "table_count", "totals", "costs")
    PRIOR_ROUNDS = 4.0  # rounds' worth of the capture-time timing in a candidate's cost

    def learned(self) -> dict:
        """What later programs of the same setting take over: the table, the totals, the costs and the
        timings they come from."""
        J = len(self.auto.budgets)
        return {"tensors": {name: getattr(self, name) for name in self.LEARNED},
                "timing": {"given": self.auto.costs is not None, "capture": None, "sums": [0.0] * J,
                           "counts": [0.0] * J, "first": J - 1, "schedule": None}}

    def adopt(self, learned: dict) -> None:
        for name, t in learned["tensors"].items():
            setattr(self, name, t)
        self.timing = learned["timing"]

    @property
    def measured(self) -> bool:
        """Whether the costs are known: given, or timed at capture."""
        return self.timing["given"] or self.timing["capture"] is not None

    def set_capture_costs(self, seconds: list[float]) -> None:
        self.timing["capture"] = list(seconds)
        self.costs.copy_(torch.tensor(seconds))

    def observe(self, picks: list[int], seconds: list[float]) -> None:
        """A call's rounds, timed by the events between its stages (nothing waits for them inside the call):
        each candidate's cost becomes the running mean of its rounds, starting from the capture timing. Given
        costs stay as given."""
        if self.timing["given"] or self.timing["capture"] is None:
            return
        t = self.timing
        for j, sec in zip(picks, seconds):
            t["sums"][j] = t["sums"][j] * self.decay + sec
            t["counts"][j] = t["counts"][j] * self.decay + 1.0
        w = self.PRIOR_ROUNDS
        self.costs.copy_(torch.tensor([(w * c + s) / (w + n) for c, s, n in zip(t["capture"], t["sums"], t["counts"])]))

    def tensors(self) -> list[torch.Tensor]:
        return [self.table_sum, self.table_count, self.totals, self.bin_ring, self.proposals]

    def start(self, lag: int, every: int) -> int:
        """Before a call's first round: its read schedule (copied only when it changes), and the proposal for
        its rounds before any read, as the last call read it (before anything is learned: the largest budget,
        which every untried gain favours). Nothing here waits for the device."""
        if self.timing["schedule"] != (lag, every):
            self.schedule.copy_(torch.tensor([lag, every]))
            self.timing["schedule"] = (lag, every)
        return self.timing["first"]

    def finish(self, first: int | None) -> None:
        """After a call: bin 0's proposal as its last read saw it."""
        if first is not None:
            self.timing["first"] = first

    def update_args(self, scores, j: int) -> tuple:
        """The update's arguments after the round's (path, a, round_idx): round j's draft scores, the state."""
        n_conf = min(self.auto.budgets[0], scores.shape[0])
        return (scores, j, self.budgets, self.costs, self.edges, self.table_sum, self.table_count, self.totals,
                self.bin_ring, self.proposals, self.schedule, n_conf, self.auto.explore, self.auto.weight, self.decay,
                self.max_tau)

    def update(self, path, a, round_idx, scores, j: int) -> None:
        """After round j's walk, before its commit counts it: credit and propose, in one Triton launch where the
        tree kernels run in Triton (kernels/auto_budget.py), else in torch."""
        if use_triton(path.device):
            from .kernels.auto_budget import auto_update

            auto_update(path, a, round_idx, *self.update_args(scores, j))
        else:
            auto_update_reference(path, a, round_idx, *self.update_args(scores, j))

    @contextlib.contextmanager
    def update_beside(self, path, a, round_idx, scores, j: int):
        """`with update_beside(...): work` runs `update` on a CUDA stream of its own, forked on entry (after the
        walk has written path and a), beside `work`, and joins it on exit (in a captured graph the fork's branch
        joins there). `work` must not write what the update reads: the KV compaction does not, and the round is
        counted after the block. Elsewhere the update simply runs first."""
        if path.device.type != "cuda":
            self.update(path, a, round_idx, scores, j)
            yield
            return
        if self.side is None:
            self.side = torch.cuda.Stream(path.device)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.update(path, a, round_idx, scores, j)
        yield
        torch.cuda.current_stream().wait_stream(self.side)


def propose_reference(s_row, n_row, costs, lam, explore: float, weight: float, max_tau: float) -> torch.Tensor:
    """The proposal for one bin: argmax_i m_i − λ·cost_i, where m_0 is the smallest budget's mean τ and each
    m_i adds the mean gain of budget i over the one below it, each shrunk towards `explore`; -> [] long."""
    m = weight / (n_row[0] + weight)   # τ_0's prior: the bonus token alone
    best = torch.full((), -float("inf"), device=costs.device)
    pick = torch.zeros((), dtype=torch.long, device=costs.device)
    for i in range(costs.shape[0]):
        m = (m + (s_row[i] + weight * explore) / (n_row[i] + weight)).clamp(max=max_tau)
        score = m - lam * costs[i]
        take = score > best                                                    # ties keep the smaller budget
        best = torch.where(take, score, best)
        pick = torch.where(take, torch.full_like(pick, i), pick)
    return pick


def confidence_bin(scores: torch.Tensor, n_conf: int, edges: torch.Tensor) -> torch.Tensor:
    """A round's bin: 1 + the edges its confidence reaches, the confidence being the draft's expected accepted
    nodes, Σ exp(score) over its first n_conf nodes (bin 0 stands for "no proposal read yet"); -> [] long."""
    return 1 + (scores[:n_conf].float().exp().sum() >= edges).sum()


def auto_update_reference(path, a, round_idx, scores, j: int, budgets, costs, edges, table_sum, table_count, totals,
                          bin_ring, proposals, schedule, n_conf: int, explore: float, weight: float, decay: float,
                          max_tau: float) -> None:
    """After round r = round_idx (not yet counted) ran at candidate j: credit the round, then propose (the
    contract of kernels/auto_budget.py). Tensor ops only (no host reads, so it also runs inside a captured graph);
    the Triton kernel does the same in one launch."""
    r = round_idx                                                              # [1]
    lag, every = schedule[0], schedule[1]
    src = (torch.div(r, every, rounding_mode="floor") - lag) * every - 1
    src_bin = torch.where(src >= 0, bin_ring.index_select(0, src.clamp(min=0)), torch.zeros_like(src))
    k = torch.arange(path.shape[0], device=path.device)
    nodes = torch.where((k >= 1) & (k < a), path, budgets[-1] + 1)             # masked: past every budget
    below = torch.cat([budgets.new_zeros(1), budgets[:-1]])                    # the next smaller candidate
    gain = ((nodes[None, :] > below[:, None]) & (nodes[None, :] <= budgets[:, None])).sum(1).float()
    gain[0] += 1.0                                                             # [J]: τ_0, then τ_i − τ_{i-1}
    rows = torch.arange(table_sum.shape[0], device=path.device)[:, None]
    credit = (rows == src_bin) & (torch.arange(budgets.shape[0], device=path.device)[None, :] <= j)
    table_sum.mul_(decay).add_(torch.where(credit, gain[None, :], 0.0))
    table_count.mul_(decay).add_(credit.float())
    totals.mul_(decay).add_(torch.stack([a[0].float(), costs[j]]))
    bin_ = confidence_bin(scores, n_conf, edges)
    lam = torch.where(totals[1] > 0, totals[0] / totals[1].clamp(min=1e-30), torch.zeros_like(totals[0]))
    row = bin_.view(1)  # index_select: a tensor index would read its value on the host, which a capture forbids
    pick = propose_reference(table_sum.index_select(0, row)[0], table_count.index_select(0, row)[0], costs, lam,
                             explore, weight, max_tau)
    first = propose_reference(table_sum[0], table_count[0], costs, lam, explore, weight, max_tau)
    bin_ring.index_copy_(0, r, bin_.view(1))
    proposals.index_copy_(0, r + 1, pick.view(1))
    proposals[:1].copy_(first.view(1))


def measure_costs(stage_sets, save, restore, device, repeats: int = 5) -> list[float]:
    """Seconds per round of each candidate: the median of `repeats` runs of its stages (replayed graphs on a
    GPU) from the same saved state, which is put back after each, so nothing a caller sees changes."""
    cuda = torch.device(device).type == "cuda"
    saved = save()
    costs = []
    for stages in stage_sets:
        times = []
        for _ in range(repeats + 1):  # the first run is a warm-up
            restore(saved)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _, fn in stages:
                fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times[1:]))
    restore(saved)
    return costs
