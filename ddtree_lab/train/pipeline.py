"""The shell every training pipeline shares: its config, presets and `--set`, the frozen target, the
drafter's config, the stage runner, pack/unpack of a work dir, and the command line.

A pipeline is a config dataclass deriving from `PipelineConfig` (nesting its `DFlashRecipe` as `dflash`),
a table of presets, and its stages; `run_stages` runs the stages asked for in order, skipping one whose
product exists (a rerun resumes), and carries pack/unpack itself.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path

import torch

from .common import log, save_tensors
from .recipe import DFlashRecipe

PACK_PART_BYTES = 15 * 2**20  # files coming back from a remote GPU machine must stay under 16 MiB


@dataclass
class PipelineConfig:
    preset: str = ""
    seed: int = 0
    dflash: DFlashRecipe = field(default_factory=DFlashRecipe)
    card_prompts: int = 0                 # per set for the card's engine evaluation; 0 = all
    save_dtype: str = "bfloat16"


# ----------------------------------------------------------------------------- config, presets, --set

def owners(cfg) -> dict:
    """Every settable name -> the dataclass holding it: the pipeline's own fields and its recipe's
    (`--set drafter_seconds=…` reaches cfg.dflash.drafter_seconds)."""
    out = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        inner = owners(value) if is_dataclass(value) else {f.name: cfg}
        if inner.keys() & out.keys():
            raise TypeError(f"{type(cfg).__name__}: {sorted(inner.keys() & out.keys())} declared twice")
        out.update(inner)
    return out


def set_field(cfg, key: str, value) -> None:
    where = owners(cfg)
    if key not in where:
        raise SystemExit(f"--set {key}=…: unknown field '{key}'; fields: {', '.join(sorted(where))}")
    setattr(where[key], key, value)


def make_config(cls, presets: dict, preset: str, **overrides):
    """cls(preset=preset) with the preset's values, then the overrides that are not None."""
    cfg = cls(preset=preset)
    for k, v in {**presets[preset], **overrides}.items():
        if v is not None:
            set_field(cfg, k, v)
    return cfg


def apply_overrides(cfg, items: list[str]) -> None:
    """`--set KEY=VALUE` onto a config, converting to each field's current type."""
    where = owners(cfg)
    for item in items:
        k, _, v = item.partition("=")
        if k not in where:
            raise SystemExit(f"--set {item}: unknown field '{k}'; fields: {', '.join(sorted(where))}")
        cur = getattr(where[k], k)
        if isinstance(cur, tuple):
            val = tuple(type(cur[0] if cur else 0)(x) for x in v.split(",") if x)
        elif isinstance(cur, bool):
            val = v.lower() in ("1", "true", "yes")
        else:
            val = type(cur)(v)
        setattr(where[k], k, val)


# ----------------------------------------------------------------------------- models

def drafter_config(recipe: DFlashRecipe, tcfg, mask_id: int, layers: int | None = None,
                   intermediate: int | None = None):
    """Drafter layers are the target's width and heads; its context is target_layer_ids' outputs."""
    from ..config import DrafterConfig
    return DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=intermediate or recipe.drafter_intermediate,
                         num_hidden_layers=layers or recipe.drafter_layers, num_attention_heads=tcfg.num_attention_heads,
                         num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                         rms_norm_eps=tcfg.rms_norm_eps, vocab_size=tcfg.vocab_size, block_size=recipe.block_size,
                         num_target_layers=tcfg.num_hidden_layers, target_layer_ids=list(recipe.target_layer_ids),
                         mask_token_id=mask_id, rope=tcfg.rope, max_position_embeddings=tcfg.max_position_embeddings)


def chosen_variant(work: Path) -> dict:
    """The shape of the drafter that train_drafters chose ({} when it wrote none: the config's)."""
    f = work / "drafter_final.json"
    return json.loads(f.read_text()) if f.exists() else {}


# ----------------------------------------------------------------------------- pack / unpack

def save_parts(sd: dict, pack: Path, stem: str, dtype=torch.bfloat16) -> int:
    """Write a state dict as pack/<stem>.part<i>.safetensors, each under PACK_PART_BYTES."""
    from safetensors.torch import save_file
    pack.mkdir(parents=True, exist_ok=True)
    parts, cur, size = [], {}, 0
    for k, v in sd.items():
        v = v.to(dtype).contiguous()
        if cur and size + v.numel() * v.element_size() > PACK_PART_BYTES:
            parts.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.numel() * v.element_size()
    if cur:
        parts.append(cur)
    for i, part in enumerate(parts):
        save_file(part, str(pack / f"{stem}.part{i}.safetensors"))
    return len(parts)


def load_parts(pack: Path, stem: str) -> dict:
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(pack.glob(f"{stem}.part*.safetensors")):
        sd.update({k: v.float() for k, v in load_file(str(f)).items()})
    return sd


def pack_work(work: Path, pack: Path, weights: dict) -> None:
    """Carry a GPU run back in few small files: work/<stem>_final.safetensors for each stem of
    `weights` (stem -> the dtype it travels in), and every summary (work/*.json) in pack.json."""
    from safetensors.torch import load_file
    pack.mkdir(parents=True, exist_ok=True)
    n = {stem: save_parts(load_file(str(work / f"{stem}_final.safetensors")), pack, stem, dtype)
         for stem, dtype in weights.items()}
    info = {f.stem: json.loads(f.read_text()) for f in sorted(work.glob("*.json"))}
    (pack / "pack.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"pack: {', '.join(f'{k} in {v} part(s)' for k, v in n.items())} + pack.json in {pack}")


def unpack_work(work: Path, pack: Path) -> None:
    """The reverse of pack_work, on the machine that exports (this run's own config.json stays)."""
    work.mkdir(parents=True, exist_ok=True)
    stems = {f.name.split(".part")[0] for f in pack.glob("*.part*.safetensors")}
    for stem in sorted(stems):
        save_tensors(load_parts(pack, stem), work / f"{stem}_final.safetensors")
    for name, obj in json.loads((pack / "pack.json").read_text()).items():
        if name != "config":
            (work / f"{name}.json").write_text(json.dumps(obj, indent=2) + "\n")
    log(f"unpack: {pack} -> {work}")


# ----------------------------------------------------------------------------- stages and CLI

def add_pipeline_args(p: argparse.ArgumentParser, presets: dict, preset_help: str, stages: tuple,
                      default_stages: str, work: str, out_help: str, config_name: str,
                      example: str) -> argparse.ArgumentParser:
    p.add_argument("--preset", choices=sorted(presets), default=next(iter(presets)), help=preset_help)
    p.add_argument("--stages", default=default_stages,
                   help=f"comma-separated subset of {','.join(stages)}, run in that order")
    p.add_argument("--work", default=work, help="checkpoints, pools and logs; a rerun resumes from here")
    p.add_argument("--out", default=None, help=out_help)
    p.add_argument("--pack-dir", default=None, help="pack/unpack: folder of the few files that carry a GPU run back")
    p.add_argument("--device", default="auto", help="auto (CUDA when visible, else the CPU) | cuda | cpu")
    p.add_argument("--seed", type=int, default=None, help="the preset's seed unless given")
    p.add_argument("--force", action="store_true", help="rerun stages whose product already exists")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a {config_name} field, e.g. --set {example} (repeatable)")
    return p


def parse_stages(text: str, known: tuple) -> list[str]:
    stages = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in stages if s not in known]
    if bad:
        raise SystemExit(f"--stages: unknown stage(s) {bad}; stages: {', '.join(known)}")
    return stages


def start_run(args, make_config, known: tuple):
    """The command line -> (config: the preset, --seed and every --set; the stages; the work dir, created)."""
    cfg = make_config(args.preset, seed=args.seed)
    apply_overrides(cfg, args.set)
    stages = parse_stages(args.stages, known)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    return cfg, stages, work


def write_config(cfg, work: Path) -> None:
    (work / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")


def run_stages(stages: list[str], run_stage, products: dict, stale: dict, force: bool, work: Path,
               pack_dir: str | None, pack_weights, on_done=None) -> None:
    """Run each stage by run_stage(name) -> whether it ran as a stage to time (False: it had nothing to do,
    or it was one part of a stage). products: stage -> the file whose existence means done (skipped unless
    force); stale: stage -> files that a forced rerun deletes first (its checkpoints); pack/unpack are
    handled here, pack_weights() naming what pack carries (see pack_work); on_done(stage, seconds)."""
    for s in stages:
        if s in products and products[s].exists() and not force:
            log(f"{s}: {products[s]} exists, skipping (--force to redo)")
            continue
        if force:
            for f in stale.get(s, ()):
                f.unlink(missing_ok=True)
        t = time.time()
        if s in ("pack", "unpack"):
            if not pack_dir:
                raise SystemExit(f"--stages {s} needs --pack-dir")
            if s == "pack":
                pack_work(work, Path(pack_dir), pack_weights())
            else:
                unpack_work(work, Path(pack_dir))
        elif not run_stage(s):
            continue
        dt = time.time() - t
        if on_done is not None:
            on_done(s, dt)
        log(f"{s}: {dt:.1f}s")


def cli_main(argv, prog: str, description: str, add_args, run) -> int:
    return run(add_args(argparse.ArgumentParser(prog=prog, description=description)).parse_args(argv))
