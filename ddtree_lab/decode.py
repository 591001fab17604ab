"""Lossless decoding: AR, DFlash (single path) and DDTree, as one round program.

State between rounds lives on the device: `n` committed tokens in the target's KV cache, the
drafter's context for those n positions (its own `ctx_len`; the last round's accepted features wait in
`ctx_hidden` until the next draft folds them in, as drafter work), and the bonus token b (the target's
choice for position n, not yet cached). A round is four fixed-shape stages over static buffers —
draft, tree_build, verify, commit — with no host synchronisation inside, so the same code runs
eagerly (CPU, or GPU without graphs) and as captured CUDA graphs (graphs.py: one per stage, replayed;
CUDA events between the stages time them without a sync). The host reads the new tokens to stream
text and stop at EOS, either after each round or one step behind (options.host_read_lag: a copy to pinned
memory is started after each round and finished after the next is queued, so the GPU need not wait
for the host, at the price of a round computed past a stop token and discarded). DFlash is the same round with topk=1
and budget = block_size-1; AR is a one-stage round of the target alone.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from . import options
from .attention import TreeMask
from .auto_budget import AutoBudget, AutoState, measure_costs, resolve_budget, source_round
from .checkpoint import Pair
from .graphs import GraphRunner, kept, padded_prefill, prefill_for, then
from .names import MAX_BUDGET, METHODS, STAGES, topk_width
from .prompts import encode_prompt
from .trace import GenerationResult, RoundTrace, StageClock
from .tree import DraftTree, accept_path, build_tree, check_budget, tree_masks, tree_size, use_triton

def host_read_lag(device, trace: bool = False, profile: bool = False) -> int:
    """Host reads in flight for this call (tracing and profiling read after every round): one keeps the
    next round queued while the host reads (faster on a GPU, docs/performance.md); see options.py."""
    if trace or profile:
        return 0
    lag = options.current().host_read_lag
    return int(torch.device(device).type == "cuda") if lag is None else lag


class Chooser:
    """The target's choice per row of logits: argmax at T = 0, else an exact sample by the
    Gumbel-max trick. The uniform noise is drawn into a static buffer by `refill`, which runs
    eagerly before the choosing stage (also between graph replays), so eager and graph rounds
    draw the same numbers from the seeded generator."""

    def __init__(self, temperature: float, device: torch.device, rows: int = 0, vocab: int = 0):
        self.temperature = temperature
        # the meta device (bench/census.py) has no generator of its own; nothing is drawn there
        self.generator = torch.Generator(device=device if torch.device(device).type != "meta" else "cpu")
        self.noise = torch.empty(rows, vocab, device=device) if temperature > 0 and rows else None

    def refill(self) -> None:
        self.noise.uniform_(generator=self.generator)

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        # logits [T, V] -> [T]
        if self.temperature == 0:
            return argmax_rows(logits)
        if noise is None:
            noise = torch.rand(logits.shape, generator=self.generator, device=logits.device)
        gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
        return argmax_rows(logits.float() / self.temperature + gumbel)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [T, V] -> [T]: one Triton launch where the tree kernels run and the rows fit (torch's generic
    reduction is slow for a few rows, kernels/row_argmax.py), torch's elsewhere; the same answer either way."""
    if use_triton(logits.device):
        from .kernels.row_argmax import MAX_VOCAB, row_argmax

        if logits.shape[1] <= MAX_VOCAB:
            return row_argmax(logits)
    return logits.argmax(-1)


class RoundProgram:
    """One speculative round on static buffers. Stages read and write attributes of `self`."""

    def __init__(self, pair: Pair, method: str, budget: int, topk: int | None, temperature: float,
                 out_capacity: int, max_rounds: int, share: "RoundProgram | None" = None,
                 auto: AutoState | None = None, auto_index: int = 0):
        """share: a program whose decoding state (and sampler) this one uses, so that either may run the next
        round (budget="auto": one program per candidate, the largest first); auto: the choice's state."""
        self.pair, self.method = pair, method
        self.auto, self.auto_index = auto, auto_index
        self.target, self.drafter = pair.target, pair.drafter
        device = self.device = pair.device
        self.L = self.drafter.cfg.block_size - 1 if method != "ar" else 0
        self.budget, self.topk = budget, topk
        self.layers = self.drafter.cfg.target_layer_ids if method != "ar" else []
        self.mask_id = self.drafter.cfg.mask_token_id if method != "ar" else 0
        rows = 1 if method == "ar" else None  # set below once the tree size is known
        long = dict(dtype=torch.long, device=device)
        self.n = torch.zeros(1, **long)              # committed tokens in the target cache
        self.bonus = torch.zeros(1, **long)          # the target's choice for position n
        # What the host reads, in one copy: [out_len, out (the emitted tokens, the first from prefill) …, and
        # under budget="auto" the proposals (AutoState.place_proposals)]; the state's owner (share=None) keeps it.
        tail = auto.proposals.shape[0] if auto is not None and share is None else 0
        self.readback = torch.zeros(1 + out_capacity + tail, **long)
        self.out_len, self.out = self.readback[:1], self.readback[1:1 + out_capacity]
        if tail:
            auto.place_proposals(self.readback[1 + out_capacity:])
        self.taus = torch.zeros(max_rounds, **long)  # acceptance length per round
        self.round_idx = torch.zeros(1, **long)
        self.a = torch.ones(1, **long)
        span = self.L + 1
        self.block_offsets = torch.arange(span, **long)
        self.block_root = self.block_offsets == 0  # the bonus token's slot in a draft block
        self.ar_mask = TreeMask.causal(1, device)  # one token sees the cache (same mask every step)
        if self.target.attention == "triton":
            self.ar_mask.bits  # packed now, once, outside any graph capture
        if self.target.attention == "invariant":
            self.ar_mask.chain  # its ancestor lists, likewise
        if method != "ar":
            self.T = 1 + tree_size(self.L, topk_width(topk, budget, self.target.cfg.vocab_size), budget)
            # The accepted nodes' target features, for the drafter's context at the next draft.
            feat = len(self.layers) * self.target.cfg.hidden_size
            self.ctx_hidden = torch.zeros(span, feat, device=device, dtype=pair.dtype)
            self.ctx_pos = torch.zeros(span, **long)
            self.ctx_count = torch.zeros(1, **long)
            rows = self.T
        self.choose = Chooser(temperature, device, rows, self.target.cfg.vocab_size)
        if share is not None:  # one state for all the candidates' programs
            for name in self.SHARED:
                if hasattr(share, name):
                    setattr(self, name, getattr(share, name))
            assert share.choose.noise is None or share.choose.noise.shape[0] >= rows, "share the largest program"
        refill = self.choose.refill if temperature > 0 else None
        # (stage name, fixed-shape function, eager pre-step kept outside any graph)
        self.stages = [("verify", self.ar_step, refill)] if method == "ar" else [
            ("draft", self.draft, None), ("tree_build", self.tree_build, None), ("verify", self.verify, None),
            ("commit", self.commit, refill)]

    # ------------------------------------------------------------------ state
    # what programs sharing one decoding state have in common (the noise rows are cut to each tree)
    SHARED = ("n", "bonus", "readback", "out", "out_len", "taus", "round_idx", "ctx_hidden", "ctx_pos", "ctx_count",
              "choose")

    def state_scalars(self) -> list[torch.Tensor]:
        """The counters a warm-up or a timing run advances; saved and put back around them."""
        out = [self.n, self.bonus, self.out_len, self.round_idx]
        if self.drafter is not None and self.method != "ar":
            out += [self.drafter.ctx_len, self.ctx_count]
        return out + (self.auto.tensors() if self.auto is not None else [])

    def save_state(self):
        """What a warm-up or a timing run changes: the state's counters and the sampler's generator (its draws
        must not shift a call's samples). restore_state puts them back."""
        return [t.clone() for t in self.state_scalars()], self.choose.generator.get_state()

    def restore_state(self, saved) -> None:
        scalars, rng = saved
        for t, v in zip(self.state_scalars(), scalars):
            t.copy_(v)
        self.choose.generator.set_state(rng)

    def reset(self, n: int, bonus: torch.Tensor) -> None:
        self.n.fill_(n)
        self.bonus.copy_(bonus.view(1))
        self.out[:1].copy_(bonus.view(1))
        self.out_len.fill_(1)
        self.round_idx.zero_()
        if self.method != "ar":
            self.ctx_count.zero_()  # the prefill appended its context itself

    def _emit(self, tokens: torch.Tensor, a) -> None:
        """Append tokens[:a] (a fixed-width buffer) to `out`; the rest is overwritten later."""
        self.out.index_copy_(0, self.out_len + torch.arange(tokens.shape[0], device=self.device), tokens)
        self.out_len += a
        self.taus.index_copy_(0, self.round_idx, a if torch.is_tensor(a) else self.a.fill_(a))
        self.round_idx += 1

    # ------------------------------------------------------------------ AR: one target step
    def ar_step(self) -> None:
        logits, _ = self.target(self.bonus, self.n, self.n, self.ar_mask.fresh())
        self.bonus.copy_(self.choose(logits, self.choose.noise))
        self.n += 1
        self._emit(self.bonus, 1)

    # ------------------------------------------------------------------ DDTree / DFlash stages
    def draft(self) -> None:
        # The drafter's forward: the last round's accepted features into its context cache, then
        # [b, MASK × L] at positions n … n+L -> per-depth logits q_1 … q_L  [L, V]
        self.drafter.append_context(self.ctx_hidden, self.ctx_pos, self.ctx_count)
        block = torch.where(self.block_root, self.bonus, self.mask_id)
        h = self.drafter.draft(self.target.embed(block), self.n + self.block_offsets)
        self.draft_logits = self.target.lm_head_logits(h[1:])

    def tree_build(self) -> None:
        self.tree = build_tree(self.draft_logits, self.budget, self.topk, check_finite=False)  # no sync in a round
        self.tokens = torch.cat([self.bonus, self.tree.tokens])                   # [T], root first
        self.parents = torch.cat([self.tree.parents.new_zeros(1), self.tree.parents])
        self.depths = torch.cat([self.tree.depths.new_zeros(1), self.tree.depths])
        self.anc, self.mask_bits = tree_masks(self.parents, self.L)               # [T, T], packed or None

    def verify(self) -> None:
        # one target forward over the tree at positions n + depth, ancestor-only attention
        self.logits, self.hidden = self.target(self.tokens, self.n + self.depths, self.n,
                                               TreeMask(self.anc, _bits=self.mask_bits), self.layers)

    def commit(self) -> None:
        # Walk: a node is accepted iff every node on its root path carries its parent's target choice.
        noise = None if self.choose.noise is None else self.choose.noise[:self.logits.shape[0]]
        choice = self.choose(self.logits, noise)                                  # [T]
        self.path, self.a = accept_path(self.tokens, self.parents, self.depths, choice, self.anc, self.L)
        # budget="auto": credit this round and propose the next budget beside the compaction and the gather (the
        # update reads the round index, so the round is counted after them)
        with (self.auto.update_beside(self.path, self.a, self.round_idx, self.tree.scores, self.auto_index)
              if self.auto is not None else contextlib.nullcontext()):
            # Commit: accepted KV to positions n … n+a-1; their features wait for the next draft.
            self.target.compact_cache(self.n, self.path, self.a)
            # gather, not index_select, whose CUDA kernel walks the path's 16 rows one after another
            torch.gather(self.hidden, 0, self.path[:, None].expand(-1, self.hidden.shape[1]), out=self.ctx_hidden)
        if use_triton(self.device):
            from .kernels.commit import advance_round

            advance_round(self.tokens, self.path, self.a, choice, self.n, self.bonus, self.out, self.out_len,
                          self.taus, self.round_idx, self.ctx_pos, self.ctx_count, self.L)
        else:
            self.advance_reference(choice)

    def advance_reference(self, choice: torch.Tensor) -> None:
        """Emit the matched chain, then the next bonus (the target's choice at the deepest accepted
        node); hand the drafter positions n … n+L, of which a are new context; advance n."""
        deepest = self.path.index_select(0, self.a - 1)                           # [1]
        self.ctx_pos.copy_(self.n + self.block_offsets)
        self.ctx_count.copy_(self.a)
        self.bonus.copy_(choice.index_select(0, deepest))
        chain = self.tokens[self.path[1:]]                                        # [L]
        emit = torch.cat([chain, chain.new_zeros(1)])
        emit = torch.where(self.block_offsets == self.a - 1, self.bonus, emit)    # [L+1]
        self.n += self.a
        self._emit(emit, self.a)

    def trace_round(self, index: int, position: int, root: int) -> RoundTrace:
        a = int(self.a)
        path = self.path[:a].tolist()
        tree = DraftTree(*(getattr(self.tree, f).to("cpu") for f in DraftTree.__dataclass_fields__))
        accepted_tokens = self.tokens[self.path[1:a]].tolist()
        return RoundTrace(index, position, root, tree, path, accepted_tokens, int(self.bonus),
                          **routing_fields(self.target), budget=self.budget)


def routing_fields(target) -> dict:
    """A traced round's MoE routing (RoundTrace.experts_touched, expert_tokens_max, expert_row_blocks,
    expert_int4); None (False) for a dense target."""
    return target.expert_routing() or {"experts_touched": None, "expert_tokens_max": None, "expert_row_blocks": None,
                                       "expert_int4": False}


def check_pair(pair) -> None:
    """A clear error for a value that is not a loaded pair (a pair's name, say) before anything reads it."""
    if not isinstance(pair, Pair):
        hint = f" (load it first: dl.load_pair({pair!r}))" if isinstance(pair, str) else ""
        raise ValueError(f"pair={pair!r} is not a loaded pair{hint}")


def _validate(pair: Pair, method, budget, topk, max_new_tokens, temperature, prompt_len, seed=0):
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}")
    if isinstance(budget, AutoBudget):
        if method != "ddtree":
            raise ValueError(f"budget='auto' chooses among DDTree budgets; method={method!r} has no budget to choose")
        for b in budget.budgets:
            check_budget(b, topk)
    elif budget is None:  # AR and DFlash have no budget (DFlash's path is the draft block)
        if method == "ddtree":
            raise ValueError(f"method='ddtree' needs a budget: an integer in 1..{MAX_BUDGET} or 'auto'")
    elif isinstance(budget, str):
        raise ValueError(f"budget={budget!r}: give an integer in 1..{MAX_BUDGET} or 'auto'")
    else:
        check_budget(budget, topk)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number ≥ 0")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"seed={seed!r} must be an integer in -2^63..2^64-1 (a generator's seed)")
    if prompt_len < 1:
        raise ValueError("prompt is empty: give at least one token")
    limit = pair.target.cfg.max_position_embeddings
    if prompt_len + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {limit} tokens (max_position_embeddings)")
    if method != "ar" and pair.drafter is None:
        raise ValueError(f"method={method!r} needs a drafter; this pair has none")


@dataclass(frozen=True)
class Plan:
    """One call's settings once checked, and the sizes of its buffers. DFlash runs as DDTree with topk=1 and
    budget=L; AR has no tree (budget 1: one program whatever budget was passed)."""

    method: str
    budget: int | AutoBudget
    topk: int | None
    auto: AutoBudget | None      # budget="auto"'s settings (DDTree only)
    temperature: float
    seed: int
    max_new_tokens: int
    stop_ids: frozenset
    draft_window: int | None
    graphs: bool                 # replay the rounds (and the prefill) as CUDA graphs
    trace: bool
    profile: bool
    round_times: bool            # keep each round's stage times on the result
    sync_every: int              # rounds queued between host reads
    lag: int                     # host reads in flight before the host waits for one
    out_capacity: int            # emitted tokens the device holds
    context_room: int            # the committed context's slots in the caches
    cache_len: int               # the context's room, then a tree's
    max_rounds: int


def plan_call(pair: Pair, prompt_len: int, method, budget, topk, max_new_tokens, temperature, seed, trace, stop,
              draft_window, profile, cuda_graphs, sync_every, round_times) -> Plan:
    """generate's arguments (validated) as the call runs them, with its buffers' sizes."""
    device = pair.device
    graphs = (device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
    if graphs and device.type != "cuda":
        raise ValueError("cuda_graphs=True needs a CUDA device")
    auto = budget if isinstance(budget, AutoBudget) and method == "ddtree" else None
    sync_every = 1 if trace else max(1, int(sync_every))
    # profiling synchronises after every stage anyway; a lagged read would only add a round to its counts
    lag = host_read_lag(device, trace, profile)
    L = pair.drafter.cfg.block_size - 1 if pair.drafter is not None else 0
    if method == "dflash":
        budget, topk = L, 1
    elif method == "ar":
        budget, topk = 1, None
    span = L + 1 if method != "ar" else 1
    max_tree = (auto.budgets[-1] if auto else budget) + 1 if method == "ddtree" else span
    # The committed context's room (the rounds queued past the last host read: up to (lag + 1) · sync_every
    # rounds of up to L+1 tokens), in 256s so graphs serve nearby prompt lengths; then a tree's room. The
    # attention kernels are bounded by the context's room alone, so a budget (or auto's largest candidate)
    # never changes how a smaller tree's verify is launched.
    ahead = (lag + 1) * sync_every
    out_capacity = max_new_tokens + ahead * span + span
    context_room = -(-(prompt_len + out_capacity + 1) // 256) * 256
    return Plan(method=method, budget=budget, topk=topk, auto=auto, temperature=temperature, seed=seed,
                max_new_tokens=max_new_tokens, stop_ids=frozenset(pair.eos_token_ids if stop is None else stop),
                draft_window=draft_window, graphs=graphs, trace=trace, profile=profile, round_times=round_times,
                sync_every=sync_every, lag=lag, out_capacity=out_capacity, context_room=context_room,
                cache_len=context_room + -(-max_tree // 64) * 64, max_rounds=max_new_tokens + ahead + 1)


def round_programs(pair: Pair, plan: Plan) -> tuple[list[RoundProgram], list, AutoState | None]:
    """The caches sized for the call, and its round programs: one, or under budget="auto" one per candidate over
    one shared state; -> (programs, each one's GraphRunner or None, the choice's state or None). The last
    program owns the decoding state."""
    pair.target.setup_cache(plan.cache_len, max_past=plan.context_room)
    if pair.drafter is not None:
        pair.drafter.setup_cache(plan.cache_len, max_past=plan.context_room)
        pair.drafter.window = plan.draft_window
    if plan.auto is not None:
        return _auto_programs_for(pair, plan)
    program, runner = _program_for(pair, plan)
    return [program], [runner], None


def _program_for(pair: Pair, plan: Plan):
    """Programs (and their graphs) are kept on the pair and reused while the caches stay the same. The key
    holds every Python value a program's kernels were built from (the temperature and the draft window
    included: a captured graph keeps the values it saw)."""
    def make():
        program = RoundProgram(pair, plan.method, plan.budget, plan.topk, plan.temperature, plan.out_capacity,
                               plan.max_rounds)
        return program, GraphRunner(program) if plan.graphs else None

    K = topk_width(plan.topk, plan.budget, pair.target.cfg.vocab_size)
    key = (plan.method, plan.budget, K, float(plan.temperature), plan.draft_window, plan.cache_len, plan.out_capacity,
           plan.max_rounds, plan.graphs, pair.target.attention)
    return kept(pair, "_programs", key, pair.drafter is not None, make,
                lambda entry: entry[1] is not None and entry[1].release())


def _auto_programs_for(pair: Pair, plan: Plan):
    """One program per candidate budget over one shared state (the largest owns it), with the choice's
    state; kept like single programs, the learned table with them."""
    auto = plan.auto

    def make():
        L = pair.drafter.cfg.block_size - 1
        state = AutoState(auto, L, plan.max_rounds, pair.device)
        # the learned table outlives the programs (a new prompt length re-captures them): one per pair and setting
        learned = pair.__dict__.setdefault("_auto_learned", {})
        state.adopt(learned.setdefault((auto.key(), plan.topk, float(plan.temperature), options.key()),
                                       state.learned()))
        programs = [None] * len(auto.budgets)
        for j in reversed(range(len(auto.budgets))):
            programs[j] = RoundProgram(pair, "ddtree", auto.budgets[j], plan.topk, plan.temperature, plan.out_capacity,
                                       plan.max_rounds, share=programs[-1], auto=state, auto_index=j)
        runners = [None] * len(programs)
        if plan.graphs:  # captured in this order (set_up_rounds): a shared pool is the first candidate's
            shared = options.current().candidate_pools == "shared"
            for j, program in enumerate(programs):
                runners[j] = GraphRunner(program, pool_of=runners[0] if shared and j else None)
        return programs, runners, state

    def release(entry):
        for runner in entry[1]:
            if runner is not None:
                runner.release()

    key = ("auto", auto.key(), plan.topk, float(plan.temperature), plan.draft_window, plan.cache_len,
           plan.out_capacity, plan.max_rounds, plan.graphs, pair.target.attention)
    return kept(pair, "_auto_programs", key, True, make, release)


def prefill_program(pair: Pair, plan: Plan, n: int, layers: list[int]):
    """On a GPU the prefill at the prompt's padded length (graphs.padded_prefill), captured now where the rounds
    are graphs and that length is new and `Prefill.capturable`; -> (it, or None for an unpadded eager prefill; the
    seconds its capture took, kept off the clock)."""
    if not padded_prefill(pair.device, pair.target):
        return None, 0.0
    prefill = prefill_for(pair, n, layers, plan.method != "ar")
    if not plan.graphs or prefill.graph is not None or not prefill.capturable:
        return prefill, 0.0
    start = time.perf_counter()
    prefill.capture()
    torch.cuda.synchronize()
    return prefill, time.perf_counter() - start


def run_prefill(pair: Pair, plan: Plan, program: RoundProgram, prefill, prompt_ids: list[int]) -> None:
    """The prompt's KV, the drafter's context, and the first new token (the program's first bonus)."""
    n, device = len(prompt_ids), pair.device
    with torch.profiler.record_function("prefill"):
        if prefill is not None:
            logits = prefill.run(prompt_ids, replay=plan.graphs)
        else:
            positions = torch.arange(n, device=device)
            logits, hidden = pair.target(torch.tensor(prompt_ids, device=device), positions, 0,
                                         TreeMask.causal(n, device), program.layers,
                                         logits_rows=torch.tensor([n - 1], device=device))
            if plan.method != "ar":
                pair.drafter.append_context(hidden, positions)
    program.reset(n, program.choose(logits)[0])


def set_up_rounds(programs: list[RoundProgram], runners: list, auto: AutoState | None, device):
    """Each program's stages as (name, fn): replayed graphs (captured on the first call of this shape) or eager;
    under budget="auto" each candidate's round cost, measured once. -> (the stage lists, the seconds the set-up
    took, or None where there was none)."""
    start, set_up = time.perf_counter(), False
    for runner in runners:
        if runner is not None and not runner.graphs:
            runner.capture()
            torch.cuda.synchronize()
            set_up = True
    stage_sets = [runner.stages() if runner is not None else [(name, then(pre, fn)) for name, fn, pre in p.stages]
                  for p, runner in zip(programs, runners)]
    if auto is not None and not auto.measured:
        owner = programs[-1]
        auto.set_capture_costs(measure_costs(stage_sets, owner.save_state, owner.restore_state, device))
        set_up = True
    return stage_sets, time.perf_counter() - start if set_up else None


@dataclass
class Decoded:
    """What the round loop leaves: the tokens (and auto's proposals) last read, and each round's candidate."""

    tokens: list[int]
    proposals: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)      # each round's program (its candidate under auto)
    traces: list[RoundTrace] = field(default_factory=list)
    rounds: int = 0                                      # rounds run, those past a stop included


def decode_rounds(plan: Plan, programs: list[RoundProgram], stage_sets: list, auto: AutoState | None,
                  clock: StageClock) -> Decoded:
    """Rounds until max_new_tokens or a stop token is read: `sync_every` rounds queued per host read, with up to
    `lag` reads in flight."""
    owner = programs[-1]
    done = Decoded(tokens=[int(owner.out[0])])
    # budget="auto": the host runs the candidate the device proposed after round source_round(r), read with
    # the tokens (proposals = [bin 0's, round 0's, …]); before any read, the last call's bin-0 proposal. A fixed
    # budget has one candidate.
    first_choice = auto.start(plan.lag, plan.sync_every) if auto is not None else 0
    reads: list = []  # host reads in flight, oldest first, each `sync_every` rounds after the last
    while len(done.tokens) < plan.max_new_tokens and not plan.stop_ids.intersection(done.tokens):
        if reads and len(done.tokens) + len(reads) * plan.sync_every >= plan.max_new_tokens:
            # every queued round adds a token at least, so these reach the limit: wait, queue no more
            done.tokens, done.proposals = _finish_read(reads[-1])
            reads.clear()
            continue
        for _ in range(plan.sync_every):
            source = source_round(done.rounds, plan.lag, plan.sync_every)
            j = first_choice if source < 0 or len(done.proposals) < 2 else \
                done.proposals[1 + min(source, len(done.proposals) - 2)]
            run_round(plan, programs, j, stage_sets[j], clock, done)
        reads.append(_start_read(owner, auto, done.rounds))
        if len(reads) > plan.lag:  # the host waits for the oldest read: one sync per `sync_every` rounds
            done.tokens, done.proposals = _finish_read(reads.pop(0))
        clock.mark("other")
    if reads:  # rounds queued past a stop token: their tokens are trimmed, their rounds not counted
        done.tokens, done.proposals = _finish_read(reads[-1])
    return done


def run_round(plan: Plan, programs: list[RoundProgram], j: int, stages: list, clock: StageClock,
              done: Decoded) -> None:
    """Round `done.rounds` on program j: its stages, each timed by the clock; its trace when tracing."""
    owner = programs[-1]
    clock.round = done.rounds
    done.chosen.append(j)
    position, root = (int(owner.n), int(owner.bonus)) if plan.trace else (0, 0)
    for name, fn in stages:
        with torch.profiler.record_function(name):  # stage spans in profiler timelines
            fn()
        clock.mark(name)
    if plan.trace:
        done.traces.append(programs[j].trace_round(done.rounds, position, root) if plan.method != "ar" else
                           RoundTrace(done.rounds, position, root, None, [0], [], int(owner.bonus),
                                      **routing_fields(owner.target)))
    done.rounds += 1


def stage_times(clock: StageClock, counted: int, wall: float) -> tuple[dict, dict]:
    """-> (seconds per stage over the call, seconds per stage per round). The captures are off the clock; rounds
    past the stop (computed, not counted) are overhead, not round time; what no stage covers is "other"."""
    totals, per_round = clock.resolve()
    totals.pop("capture", None)
    for index, spent in per_round.items():
        if index >= counted:
            for stage in (s for s in STAGES if s != "other"):
                sec = spent.get(stage, 0.0)
                totals[stage] -= sec
                totals["other"] += sec
    totals["other"] += max(0.0, wall - sum(totals.values()))
    return totals, per_round


def learn_round_costs(auto: AutoState, chosen: list[int], per_round: dict, counted: int) -> None:
    """Each counted round's time (stages and the host's read) for the next call's costs; the first round's also
    holds the host's start-up reads, so it is left out."""
    rounds = range(1, counted)
    auto.observe([chosen[i] for i in rounds], [sum(per_round.get(i, {}).values()) for i in rounds])


def finish_call(pair: Pair, plan: Plan, prompt_ids: list[int], programs: list[RoundProgram], auto: AutoState | None,
                clock: StageClock, done: Decoded, wall: float, prefill_seconds: float,
                capture_seconds: float) -> GenerationResult:
    """The tokens up to the limit or the stop, the rounds that produced them, the time per stage (and per round
    when asked), auto's learning from the call; -> the result."""
    if auto is not None:
        auto.finish(done.proposals[0] if done.proposals else None)
    out, stop_reason = _trim(done.tokens, plan.max_new_tokens, plan.stop_ids)
    acceptance = _rounds_needed(programs[-1].taus[:done.rounds].tolist(), len(out))
    totals, per_round = stage_times(clock, len(acceptance), wall)
    if auto is not None:
        learn_round_costs(auto, done.chosen, per_round, len(acceptance))
    for r in done.traces:
        r.stage_seconds = per_round.get(r.index, {})
    return GenerationResult(
        method=plan.method, prompt_tokens=prompt_ids, tokens=out, text=pair.decode(out),
        acceptance_lengths=acceptance, stage_seconds={s: totals.get(s, 0.0) for s in STAGES},
        wall_seconds=wall, trimmed=1 + sum(acceptance) - len(out), stop_reason=stop_reason,
        settings=_call_settings(pair, plan, auto, capture_seconds), rounds=done.traces,
        prefill_seconds=prefill_seconds,
        round_budgets=[programs[j].budget for j in done.chosen[:len(acceptance)]] if plan.method != "ar" else [],
        round_stage_seconds=[{s: per_round.get(i, {}).get(s, 0.0) for s in STAGES} for i in range(len(acceptance))]
        if plan.round_times else None,
    )


@torch.inference_mode()
def generate(pair: Pair, prompt, method: str = "ddtree", budget: int = 64, topk: int | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0, trace: bool = True,
             stop: list[int] | None = None, draft_window: int | None = None, profile: bool = False,
             cuda_graphs: bool | None = None, sync_every: int = 1, round_times: bool = False) -> GenerationResult:
    """Generate up to `max_new_tokens` new tokens from `prompt` (text, chat messages or token ids).

    budget: DDTree's node budget, or "auto" / an AutoBudget: each round's budget chosen on the device among
    captured ones (auto_budget.py).
    cuda_graphs: replay each round's stages as CUDA graphs (default: on for CUDA devices).
    sync_every: rounds run between host reads of the new tokens (more = fewer syncs, later EOS stop).
    round_times: keep each round's stage times (`GenerationResult.round_stage_seconds`) without tracing.
    """
    check_pair(pair)
    prompt_ids = encode_prompt(pair, prompt)
    budget = resolve_budget(budget)
    _validate(pair, method, budget, topk, max_new_tokens, temperature, len(prompt_ids), seed)
    plan = plan_call(pair, len(prompt_ids), method, budget, topk, max_new_tokens, temperature, seed, trace, stop,
                     draft_window, profile, cuda_graphs, sync_every, round_times)
    programs, runners, auto = round_programs(pair, plan)
    owner = programs[-1]  # owns the decoding state (every program when there is one)
    owner.choose.generator.manual_seed(seed)
    # graph captures happen before the clock starts, or are taken off it
    prefill, capture_seconds = prefill_program(pair, plan, len(prompt_ids), owner.layers)
    clock = StageClock(pair.device, sync=profile)
    start = time.perf_counter()
    run_prefill(pair, plan, owner, prefill, prompt_ids)
    clock.mark("other")
    prefill_seconds = time.perf_counter() - start
    stage_sets, set_up_seconds = set_up_rounds(programs, runners, auto, pair.device)
    if set_up_seconds is not None:  # a first call of this shape: its captures are not counted
        capture_seconds += set_up_seconds
        clock.mark("capture")
    done = decode_rounds(plan, programs, stage_sets, auto, clock)
    wall = time.perf_counter() - start - (set_up_seconds or 0.0)
    return finish_call(pair, plan, prompt_ids, programs, auto, clock, done, wall, prefill_seconds, capture_seconds)


def _call_settings(pair: Pair, plan: Plan, auto: AutoState | None, capture_seconds: float) -> dict:
    """The call's settings as its result records them (JSON-ready)."""
    return {"method": plan.method, "budget": ("auto" if plan.auto else plan.budget) if plan.method != "ar" else None,
            **({"auto": _auto_settings(plan.auto, auto)} if plan.auto else {}),
            "topk": plan.topk, "max_new_tokens": plan.max_new_tokens, "temperature": plan.temperature,
            "seed": plan.seed, "draft_window": plan.draft_window, "attention": pair.target.attention,
            "device": str(pair.device), "dtype": str(pair.dtype).replace("torch.", ""),
            "cuda_graphs": plan.graphs, "sync_every": plan.sync_every, "capture_seconds": capture_seconds}


def _auto_settings(auto: AutoBudget, state: AutoState) -> dict:
    return {"budgets": list(auto.budgets), "costs": state.costs.tolist(),
            "costs_measured": auto.costs is None, "cost_rounds": [round(n, 1) for n in state.timing["counts"]],
            "edges": list(auto.edges), "explore": auto.explore,
            "weight": auto.weight, "memory": auto.memory}


def _start_read(program: RoundProgram, auto: AutoState | None = None, rounds: int = 0):
    """Start copying [out_len, out …] (and budget="auto"'s proposals for the first `rounds` rounds, which follow
    them in `readback`) to the host in one copy; on a GPU asynchronously, into pinned memory."""
    part = program.readback[:1 + program.out.shape[0] + (1 + rounds if auto is not None else 0)]
    if program.device.type != "cuda":
        return part.clone(), None, program.out.shape[0]
    host = torch.empty(part.shape[0], dtype=torch.long, pin_memory=True)
    host.copy_(part, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done, program.out.shape[0]


def _finish_read(read) -> tuple[list[int], list[int]]:
    """-> (the tokens so far, the proposals read)."""
    host, done, capacity = read
    if done is not None:
        done.synchronize()
    return host[1:1 + int(host[0])].tolist(), host[1 + capacity:].tolist()


def _rounds_needed(taus: list[int], n_tokens: int) -> list[int]:
    """The rounds that produced the first n_tokens (the prefill emitted one): rounds queued past the
    stop, or past EOS inside a `sync_every` batch, are not counted."""
    total = 1
    for i, a in enumerate(taus):
        if total >= n_tokens:
            return taus[:i]
        total += a
    return taus


def _trim(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], "stop_token"
    return tokens[:max_new_tokens], "max_new_tokens"


__all__ = ["generate", "METHODS", "RoundProgram", "GraphRunner"]
