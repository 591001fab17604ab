"""Process-wide engine choices, in one explicit place.

Each is a choice between implementations that give the same tokens (which code builds the tree, how
the host reads results, how layers compile, the verify kernel's launch, where auto's captured candidates keep
their memory), set for a whole run by the bench CLI or a test. They are read when a round program is built,
and `key()` is part of every captured program's cache key: a program captured under one choice is never
replayed under another.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

TREE_BUILDS = ("sort", "count", "fused")
TREE_KERNELS = ("triton", "torch")
TREE_TOPKS = ("torch", "triton")
DECLARED_ROUTINGS = ("torch", "triton")
DENSE_PRODUCTS = ("torch", "skinny")
CANDIDATE_POOLS = ("each", "shared")


@dataclass(frozen=True)
class Options:
    # Which code builds, masks and walks trees and compacts the KV cache: "triton" (kernels/), "torch"
    # (tree.py, Target.compact_cache), or None: Triton on CUDA devices when it is installed.
    tree_kernels: str | None = None
    # Which tree build: "sort" (torch), "count" or "fused" (kernels/tree_build.py) wherever that build takes
    # the beam (the sort elsewhere), or None: "fused" where the Triton tree kernels run, else "sort".
    tree_build: str | None = None
    # The per-depth top-K over the vocabulary: "torch" or "triton" (kernels/vocab_topk.py); None: torch.
    tree_topk: str | None = None
    # A declared MoE routing (random shapes, replayed traces), and a grouped router's choice (DeepSeek-V3): "triton"
    # (kernels/declared_route.py, one launch) or "torch" (kernels/moe_layout.py's references); None: Triton where the
    # tree kernels run.
    declared_routing: str | None = None
    # Who multiplies a few rows by a dense weight (the target's linears and a bf16 router, up to
    # kernels/skinny_gemm.MAX_ROWS rows on CUDA): "skinny" (kernels/skinny_gemm.py, the weight streamed once)
    # or "torch" (the library's matmul); None: torch.
    dense_products: str | None = None
    # An MoE layer's shared expert (DeepSeek-V3) on a CUDA stream of its own, beside the routing and the routed
    # experts, joined before their sum: two memory-bound chains of short launches overlap (faster on both Kimi
    # ranks, every round timed: docs/performance.md, Session 25). False: one after the other.
    overlap_shared: bool = True
    # Host reads of new tokens in flight before the host waits for one; None: 1 on CUDA, 0 elsewhere
    # (on the CPU nothing runs while the host reads, so a lag would only compute a round past the stop).
    host_read_lag: int | None = None
    # torch.compile keyword arguments for every compiled layer function, as sorted (key, value) pairs;
    # read when a pair's layers are compiled (load_pair(compile=True)).
    compile_options: tuple = ()
    # kernels/tree_attention.launch_config overrides for the verify kernel, as sorted (key, value) pairs.
    attention_launch: tuple = ()
    # kernels/fused_moe.launch_config overrides for every MoE block (e.g. SPLIT_K_UP), as sorted (key, value) pairs.
    moe_launch: tuple = ()
    # The MoE block's and the attention's Triton kernels (tree attention's, MLA's) launched as programmatic
    # dependents of the kernel before them (Hopper and later; kernels/pdl.py): each may start while that one
    # finishes. False: plain launches.
    launch_pdl: bool = False
    # budget="auto"'s captured candidates: "each" keeps its graphs' memory in a pool of its own, "shared" puts all
    # of them in one (they never run at once); None: each.
    candidate_pools: str | None = None

    def __post_init__(self):
        for name, allowed in (("tree_kernels", TREE_KERNELS), ("tree_build", TREE_BUILDS),
                              ("tree_topk", TREE_TOPKS), ("declared_routing", DECLARED_ROUTINGS),
                              ("dense_products", DENSE_PRODUCTS),
                              ("candidate_pools", CANDIDATE_POOLS)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)} (or None)")
        for name in ("launch_pdl", "overlap_shared"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        lag = self.host_read_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ValueError(f"host_read_lag={lag!r} must be an integer ≥ 0 (or None)")


_current = Options()


def current() -> Options:
    return _current


def _as_pairs(value) -> tuple:
    return tuple(sorted(dict(value).items())) if value else ()


def replace(**changes) -> Options:
    """Set some choices for the rest of the process; -> the previous Options (to restore)."""
    global _current
    previous = _current
    for name in ("compile_options", "attention_launch", "moe_launch"):
        if name in changes:
            changes[name] = _as_pairs(changes[name])
    _current = dataclasses.replace(_current, **changes)
    return previous


def restore(previous: Options) -> None:
    global _current
    _current = previous


@contextlib.contextmanager
def using(**changes):
    """The choices for the duration of a block (tests, one timed variant)."""
    previous = replace(**changes)
    try:
        yield _current
    finally:
        restore(previous)


def key() -> tuple:
    """The current choices as a hashable tuple, for cache keys."""
    return dataclasses.astuple(_current)
