"""CUDA-graph capture and replay of decoding rounds and prefills, and the per-pair cache that keeps them.

A captured graph holds raw addresses and strides of the tensors it touched and every Python value that
shaped its kernels, so it may be replayed only where all of those are unchanged. The cache here (`kept`)
therefore keys each entry on everything that changes the computation — the caller's settings, the
process-wide options and the cache tensors' addresses — and everything else a round reads is a device
tensor (positions, lengths, the sampling noise).
"""
from __future__ import annotations

import contextlib
import gc

import torch

from . import options
from .attention import TreeMask

@contextlib.contextmanager
def capturing():
    """Around CUDA graph captures: collect garbage first, then keep the collector off until done. A dead
    reference cycle that holds an old graph (a round program dropped from the cache), collected in the middle
    of a capture, would free its memory pool there and invalidate the capture."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def warm_up(fn, times: int = 2) -> None:
    """Run fn on a side stream before its capture: kernels compile and workspaces are sized off the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


_captured = {"round": 0, "prefill": 0}


def captures() -> dict[str, int]:
    """Programs this process has captured, by kind: "round" (one GraphRunner's stages) and "prefill" (a padded
    prefill). A bench reads it around its timed passes: a capture there is a program made again, whose first
    replays run cold."""
    return dict(_captured)


class GraphRunner:
    """Captures each stage of a RoundProgram as a CUDA graph and replays them."""

    def __init__(self, program, pool_of: "GraphRunner | None" = None):
        """program: a decode.RoundProgram; pool_of: a runner captured before this one whose memory pool these
        graphs share (programs that never run at once, as budget="auto"'s candidates, may)."""
        self.program = program
        self.pool_of = pool_of
        self.graphs: list[tuple[str, torch.cuda.CUDAGraph, object]] = []
        self.pool = None

    def capture(self) -> None:
        p = self.program
        saved = p.save_state()

        def one_round():
            for _, fn, pre in p.stages:
                then(pre, fn)()

        warm_up(one_round)
        p.restore_state(saved)
        self.pool = self.pool_of.pool if self.pool_of is not None else None
        with capturing():
            for name, fn, pre in p.stages:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    fn()
                self.pool = self.pool or g.pool()
                self.graphs.append((name, g, pre))
        p.restore_state(saved)
        _captured["round"] += 1

    def stages(self):
        return [(name, then(pre, g.replay)) for name, g, pre in self.graphs]

    def release(self) -> None:
        """Destroy the graphs now (their memory goes back), not whenever a garbage collection finds them."""
        self.graphs.clear()
        self.pool = None


PREFILL_BUCKET = 64  # a captured prefill pads the prompt to a multiple of this many tokens (one graph each)
# Longer prompts run the same padded forward eagerly: their compute hides the host's launches, and a captured
# prefill keeps a pool of that length's activations on the device for as long as it is kept.
MAX_CAPTURED_PREFILL = 8192


class Prefill:
    """The prompt's forward at a fixed padded length, replayed from a CUDA graph like the rounds.

    An eager prefill of a new length is host-bound (a large share of a short generation on a GPU,
    docs/performance.md). Rows past the prompt are padding: the causal
    mask keeps them out of the prompt's attention, their K/V land in cache slots the first round writes
    before anything reads them, and the drafter commits only the prompt's `count` rows. A GPU without
    graphs runs the same padded forward eagerly: a matmul's rows can round differently at another row
    count, so only the same length gives eager and replayed runs the same bits."""

    def __init__(self, pair, length: int, layers: list[int], with_drafter: bool):
        device = pair.device
        self.pair, self.layers, self.with_drafter = pair, layers, with_drafter
        self.tokens = torch.zeros(length, dtype=torch.long, device=device)   # prompt, then padding
        self.positions = torch.arange(length, device=device)
        self.last_row = torch.zeros(1, dtype=torch.long, device=device)      # n - 1
        self.count = torch.zeros(1, dtype=torch.long, device=device)         # n
        self.mask = TreeMask.causal(length, device)
        if pair.target.attention == "triton":
            self.mask.bits  # packed now, outside the capture
        self.graph = None

    @property
    def capturable(self) -> bool:
        """Whether this length is captured where rounds are graphs (up to MAX_CAPTURED_PREFILL tokens)."""
        return self.tokens.shape[0] <= MAX_CAPTURED_PREFILL

    def forward(self) -> torch.Tensor:
        logits, hidden = self.pair.target(self.tokens, self.positions, 0, self.mask, self.layers,
                                          logits_rows=self.last_row)
        if self.with_drafter:
            self.pair.drafter.append_context(hidden, self.positions, self.count)
        return logits

    def capture(self) -> None:
        warm_up(self.forward)
        if self.with_drafter:
            self.pair.drafter.ctx_len.zero_()  # the warm-up committed context; the replay starts from none
        self.graph = torch.cuda.CUDAGraph()
        with capturing(), torch.cuda.graph(self.graph):
            self.logits = self.forward()  # the graph's own output buffer, refilled by each replay
        _captured["prefill"] += 1

    def run(self, prompt_ids: list[int], replay: bool = True) -> torch.Tensor:
        """-> logits [1, V] of the prompt's last token; caches filled as an unpadded prefill would. Replayed
        where captured and `replay`, else the same padded forward eagerly."""
        n = len(prompt_ids)
        padded = prompt_ids + [0] * (self.tokens.shape[0] - n)
        self.tokens.copy_(torch.tensor(padded, dtype=torch.long))
        self.last_row.fill_(n - 1)
        self.count.fill_(n)
        if replay and self.graph is not None:
            self.graph.replay()
            return self.logits
        return self.forward()


def padded_prefill(device: torch.device, target) -> bool:
    """On a GPU the prefill runs at the prompt's padded length, a graph where the rounds are graphs, eager where
    not (Prefill says why both pad). Flex attention builds its block mask on the host at each call, so its
    prefill stays eager and unpadded."""
    return torch.device(device).type == "cuda" and target.attention != "flex"


MAX_KEPT = 16  # entries per kind and pair; past this the kind is cleared (graphs pin device memory)


def _cache_signature(pair, with_drafter: bool) -> tuple:
    """(address, shape) of the caches a kept entry is bound to: the target's KV, and the drafter's if it drafts."""
    caches = [pair.target.kv] + ([pair.drafter.kv, pair.drafter.ctx_len] if with_drafter else [])
    return tuple((t.data_ptr(), tuple(t.shape)) for t in caches)


def kept(pair, kind: str, key: tuple, with_drafter: bool, make, release):
    """make(), kept on the pair under `kind` for this key, the current options and these exact cache tensors.
    Graphs pin device memory, so when an entry is made, the kind's entries bound to a cache the pair no longer
    holds (a cache grows by replacement, attention.static_cache: they can never run again) are dropped, and past
    MAX_KEPT entries the whole kind; each dropped entry release()d at once."""
    bound = _cache_signature(pair, with_drafter)
    key = key + options.key() + (bound,)
    cache = pair.__dict__.setdefault(kind, {})
    pair.__dict__.setdefault("_kept_release", {})[kind] = release
    if key not in cache:
        held = set(_cache_signature(pair, pair.drafter is not None))
        stale = [k for k in cache if not set(k[-1]) <= held]
        if len(cache) - len(stale) >= MAX_KEPT:
            stale = list(cache)
        for k in stale:
            release(cache.pop(k))
        cache[key] = make()
    return cache[key]


def release_kept(pair) -> None:
    """Drop every entry kept on the pair now, each release()d: a bench that switches engine choices (bench e2e
    --variants) would otherwise hold every choice's graphs at once, since the options are part of each key."""
    for kind, release in pair.__dict__.get("_kept_release", {}).items():
        cache = pair.__dict__.get(kind, {})
        while cache:
            release(cache.popitem()[1])


def prefill_for(pair, n: int, layers: list[int], with_drafter: bool) -> Prefill:
    length = -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
    return kept(pair, "_prefills", (length, tuple(layers), with_drafter, pair.target.attention), with_drafter,
                 lambda: Prefill(pair, length, list(layers), with_drafter),
                 lambda prefill: setattr(prefill, "graph", None))


def then(pre, fn):
    """fn, preceded by the eager step `pre` when there is one."""
    if pre is None:
        return fn

    def run():
        pre()
        fn()

    return run
