"""Training the lab pair: a small Qwen3 target on Python source, then its DFlash drafter.

Stages (each writes its product to the work dir; a rerun skips stages whose product exists):
  prepare  corpus + tokenizer + prompt sets            (CPU; cache dir: token arrays for the GPU)
  target   next-token LM on the training files         -> work/target_final.safetensors
  pool     the target's greedy continuations of training windows -> work/pool.npz
  drafter  DFlash drafter(s) distilled on the pool     -> work/drafter_<variant>.safetensors
  pack     the trained weights as files < 16 MiB (+ summaries) in --pack-dir, to carry a GPU run back
  unpack   the reverse, on the machine that exports
  export   the shipped pair: target/, drafter/, prompts/ in HF / DFlash format
  card     engine evaluation (AR, DFlash, DDTree) and the README.md model card

Why the pool: acceptance is measured against the target's greedy output, so the drafter learns to
predict exactly that: the labels of a block anchored at p are the target's own greedy tokens
p+1 … p+15, and its context is the frozen target's features of positions < p.
Target and drafter loops checkpoint every few hundred steps and resume from there.

    ddtree-lab train-lab-pair [--preset tiny] [--stages …]   (or python -m ddtree_lab.train.lab)
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..common import (autocast, frozen, init_weights, load_weights, log, lr_at, optimizer, pick_device, save_state,
                      save_weights, synchronize)
from ..generate import greedy_extend
from ..pipeline import (PipelineConfig, add_pipeline_args, chosen_variant, cli_main, drafter_config,
                        make_config as _make_config, run_stages, start_run, write_config)
from ..recipe import DFlashRecipe, train_drafters
from . import LAB_PAIR_DIR
from .corpus import CorpusConfig, build_corpus, default_root, load_corpus, load_tokenizer


@dataclass
class LabConfig(PipelineConfig):
    preset: str = "lab"
    dflash: DFlashRecipe = field(default_factory=lambda: DFlashRecipe(variants="soft_weight=0.5"))
    # corpus
    vocab_size: int = 4096
    corpus_root: str = ""                 # "" = this interpreter's standard library
    heldout_per_mille: int = 40
    max_files: int = 0
    n_prompts: int = 32                   # per prompt set
    # target (Qwen3 architecture)
    hidden_size: int = 384
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    dropout: float = 0.1                  # residual dropout: the corpus is small, we train many epochs
    target_steps: int = 0                 # 0 = fit target_seconds (capped by max_epochs)
    target_seconds: float = 150.0
    max_epochs: float = 20.0
    eval_every: int = 250
    eval_windows: int = 256               # held-out windows of seq_len for the held-out loss
    # pool of greedy continuations
    gen_sequences: int = 32768
    gen_seconds: float = 25.0
    gen_batch: int = 2048
    gen_len: int = 256
    gen_prefix_lens: tuple = (32, 64, 128, 192, 256)
    target_from: str = ""                 # use this HF target dir when the work dir has no trained target
    pack_target: bool = True              # pack: also carry the target back (off when only the drafter changed)

    def target_config(self, vocab: int, eos_id: int):
        """The target's architecture and sizes (a pipeline training another architecture overrides this)."""
        from ...config import RopeConfig, TargetConfig
        return TargetConfig(arch="qwen3", vocab_size=vocab, hidden_size=self.hidden_size,
                            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                            head_dim=self.head_dim, rms_norm_eps=1e-6,
                            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=True,
                            rope=RopeConfig(theta=self.rope_theta), eos_token_id=[eos_id])


PRESETS = {
    "lab": {},
    # The CPU test: every stage, in seconds.
    "tiny": dict(vocab_size=512, corpus_root="json", heldout_per_mille=300, n_prompts=3,
                 hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                 head_dim=32, seq_len=64, batch_size=8, warmup_steps=4, target_steps=8, eval_every=4, eval_windows=16,
                 gen_sequences=8, gen_batch=8, gen_len=32, gen_prefix_lens=(16, 24),
                 drafter_layers=1, drafter_intermediate=128, target_layer_ids=(0, 1), drafter_batch=4,
                 anchors=4, drafter_warmup=4, drafter_steps=8, eval_prompts=2, n_new=12, budgets=(4, 8), card_prompts=2,
                 variants="", save_dtype="float32"),
}
STAGES = ("prepare", "target", "pool", "drafter", "pack", "unpack", "export", "card")


def make_config(preset: str = "lab", **overrides) -> LabConfig:
    return _resolve_root(_make_config(LabConfig, PRESETS, preset, **overrides))


def _resolve_root(cfg: LabConfig) -> LabConfig:
    if cfg.corpus_root and not Path(cfg.corpus_root).is_absolute():
        cfg.corpus_root = str(Path(default_root()) / cfg.corpus_root)  # a stdlib subfolder
    return cfg


# ----------------------------------------------------------------------------- models

def add_residual_dropout(target: nn.Module, p: float) -> list:
    """Dropout on each block's attention and MLP outputs, via hooks (the engine's model has none)."""
    if p <= 0:
        return []
    hooks = []
    for blk in target.layers:
        o_proj = blk.o_proj if hasattr(blk, "o_proj") else blk.self_attn.o_proj  # GQA or MLA
        for mod in (o_proj, blk.mlp):
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out: F.dropout(out, p, training=m.training)))
    return hooks


def new_target(cfg: LabConfig, meta: dict, device):
    from ...model import Target
    torch.manual_seed(cfg.seed)
    t = Target(cfg.target_config(meta["vocab_size"], meta["eos_token_id"]))
    init_weights(t, cfg.num_layers)
    return t.to(device)


def frozen_target(cfg: LabConfig, meta: dict, work: Path, device):
    """The trained target with weights rounded to the shipped dtype: the drafter must match what ships."""
    if not (work / "target_final.safetensors").exists() and cfg.target_from:
        from ...checkpoint import load_target
        t = load_target(cfg.target_from)
        log(f"target: using {cfg.target_from}")
    else:
        t = new_target(cfg, meta, "cpu")
        load_weights(t, work / "target_final.safetensors")
    return frozen(t, getattr(torch, cfg.save_dtype), device)


@torch.no_grad()
def heldout_loss(target, ids: np.ndarray, seq_len: int, device, max_windows: int = 256,
                 batch: int = 32) -> float:
    """Mean next-token loss over non-overlapping held-out windows of seq_len + 1 tokens."""
    n = min((len(ids) - 1) // seq_len, max_windows)
    arr = torch.from_numpy(ids[: n * seq_len + 1].astype(np.int64))
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        rows = range(i, min(i + batch, n))
        x = torch.stack([arr[r * seq_len: r * seq_len + seq_len] for r in rows]).to(device)
        y = torch.stack([arr[r * seq_len + 1: r * seq_len + seq_len + 1] for r in rows]).to(device)
        with autocast(device):
            logits, _ = target.forward_train(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        tot, cnt = tot + float(loss), cnt + y.numel()
    return tot / max(cnt, 1)


# ----------------------------------------------------------------------------- stage: prepare

def stage_prepare(cfg: LabConfig, cache: Path) -> dict:
    from .prompts import build_prompt_sets
    ccfg = CorpusConfig(root=cfg.corpus_root, heldout_per_mille=cfg.heldout_per_mille,
                        vocab_size=cfg.vocab_size, max_files=cfg.max_files)
    meta = build_corpus(ccfg, cache, log=log)
    tok = load_tokenizer(cache / "tokenizer")
    build_prompt_sets(ccfg, tok, cache / "prompts", n=cfg.n_prompts, seed=cfg.seed,
                      min_tokens=64 if cfg.preset == "lab" else 8, log=log)
    return asdict(meta)


# ----------------------------------------------------------------------------- stage: target

def stage_target(cfg: LabConfig, cache: Path, work: Path, device: torch.device, monitor=None) -> dict:
    """The target's LM training. `monitor` (optional) follows and steers it: attach(model) before the optimizer
    is made, after_step(model, step) after each step, at_eval(model) -> fields of each history entry,
    summary(model) -> fields of the summary, and state_dict() / load_state_dict() with the checkpoint."""
    train_ids, held_ids, meta = load_corpus(cache)
    model = new_target(cfg, meta, device)
    n_params = sum(p.numel() for p in model.parameters())
    hooks = add_residual_dropout(model, cfg.dropout)
    if monitor is not None:
        monitor.attach(model)
    opt = optimizer(model, cfg.lr, cfg.weight_decay, device)
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    B, T = cfg.batch_size, cfg.seq_len
    tokens_per_step = B * T
    state_path = work / "target_state.pt"
    step, total, best, history, trained_s = 0, cfg.target_steps, float("inf"), [], 0.0
    if state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(st["model"]), opt.load_state_dict(st["opt"])
        step, total, best, history, trained_s = st["step"], st["total"], st["best"], st["history"], st["seconds"]
        if monitor is not None:
            monitor.load_state_dict(st["monitor"])
        log(f"target: resuming at step {step}/{total}")
    max_steps = int(cfg.max_epochs * len(train_ids) / tokens_per_step)
    log(f"target: {n_params / 1e6:.2f}M params, {len(train_ids):,} train tokens, batch {B}x{T}, "
        f"max {max_steps} steps ({cfg.max_epochs} epochs)")
    ar = torch.arange(T + 1, device=device)
    t0, t_mark, s_mark = time.time(), time.time(), step
    model.train()
    while total == 0 or step < total:
        g = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + step)
        starts = torch.randint(0, len(train_ids) - T - 1, (B,), device=device, generator=g)
        win = data[starts[:, None] + ar]  # [B, T+1]
        lr = lr_at(step, total or max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for gr in opt.param_groups:
            gr["lr"] = lr
        with autocast(device):
            logits, _ = model.forward_train(win[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if monitor is not None:
            monitor.after_step(model, step)
        step += 1
        if total == 0 and step == 30:
            # Time-budgeted run: measure steps 10..30, then fix the schedule's length.
            synchronize(device)
            per_step = (time.time() - t_mark) / (step - s_mark)
            total = max(step + 1, min(max_steps, int(cfg.target_seconds / per_step)))
            log(f"target: {per_step * 1e3:.1f} ms/step, {tokens_per_step / per_step / 1e6:.2f}M tok/s -> {total} steps "
                f"({total * tokens_per_step / len(train_ids):.1f} epochs)")
        if total == 0 and step == 10:
            synchronize(device)
            t_mark, s_mark = time.time(), step
        if step % cfg.eval_every == 0 or step == total:
            model.eval()
            hl = heldout_loss(model, held_ids, T, device, max_windows=cfg.eval_windows)
            model.train()
            tl = float(loss.detach())
            history.append({"step": step, "train_loss": round(tl, 4), "heldout_loss": round(hl, 4),
                            "lr": lr, "seconds": round(trained_s + time.time() - t0, 1),
                            **(monitor.at_eval(model) if monitor is not None else {})})
            mark = ""
            if hl < best:
                best, mark = hl, " *"
                save_weights(model, work / "target_best.safetensors")
            log(f"target: step {step}/{total} train {tl:.3f} held-out {hl:.3f}{mark} lr {lr:.2e} "
                f"{time.time() - t0:.0f}s")
            save_state(state_path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                    "total": total, "best": best, "history": history,
                                    "seconds": trained_s + time.time() - t0,
                                    "monitor": monitor.state_dict() if monitor is not None else None})
    for h in hooks:
        h.remove()
    shutil.copy(work / "target_best.safetensors", work / "target_final.safetensors")
    summary = {"params": n_params, "steps": step, "tokens_seen": step * tokens_per_step,
               "epochs": step * tokens_per_step / len(train_ids), "best_heldout_loss": best,
               "seconds": trained_s + time.time() - t0, "history": history,
               **(monitor.summary(model) if monitor is not None else {})}
    (work / "target_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"target: done, best held-out loss {best:.4f} ({math.exp(best):.2f} ppl), {summary['seconds']:.0f}s")
    return summary


# ----------------------------------------------------------------------------- stage: pool

@torch.no_grad()
def stage_pool(cfg: LabConfig, cache: Path, work: Path, device: torch.device) -> dict:
    """Greedy continuations of random training windows, grouped by prefix length."""
    train_ids, _, meta = load_corpus(cache)
    target = frozen_target(cfg, meta, work, device)
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    rng = np.random.default_rng(cfg.seed + 1)
    groups: dict[int, list[np.ndarray]] = {P: [] for P in cfg.gen_prefix_lens}
    t0, made, b = time.time(), 0, 0
    while made < cfg.gen_sequences and (b == 0 or time.time() - t0 < cfg.gen_seconds):
        P = cfg.gen_prefix_lens[b % len(cfg.gen_prefix_lens)]
        n = min(cfg.gen_batch, cfg.gen_sequences - made)
        starts = torch.from_numpy(rng.integers(0, len(train_ids) - P, n)).to(device)
        prefix = data[starts[:, None] + torch.arange(P, device=device)]
        with autocast(device):
            seq = greedy_extend(target, prefix, cfg.gen_len)
        groups[P].append(seq.cpu().numpy().astype(np.uint16))
        made, b = made + n, b + 1
        if b % 4 == 0:
            log(f"pool: {made} sequences, {time.time() - t0:.0f}s")
    arrays = {f"p{P}": np.concatenate(v) for P, v in groups.items() if v}
    np.savez(work / "pool.npz", **arrays)
    log(f"pool: {made} greedy continuations of {cfg.gen_len} tokens in {time.time() - t0:.0f}s")
    return {"sequences": made, "gen_len": cfg.gen_len, "seconds": time.time() - t0}


# ----------------------------------------------------------------------------- stage: drafter

def load_eval_prompts(cache: Path, tok, n: int) -> list[list[int]]:
    from .prompts import PROMPT_SETS, read_jsonl
    ids = []
    for name in PROMPT_SETS:
        rows = read_jsonl(cache / "prompts" / f"{name}.jsonl")[:n]
        ids += [tok.encode(r["prompt"], add_special_tokens=False).ids for r in rows]
    return ids


def stage_drafter(cfg: LabConfig, cache: Path, work: Path, device: torch.device) -> dict:
    from ...drafter import Drafter
    _, _, meta = load_corpus(cache)
    target = frozen_target(cfg, meta, work, device)
    pool = {int(k[1:]): torch.from_numpy(v.astype(np.int64)) for k, v in np.load(work / "pool.npz").items()}
    keys = sorted(pool)
    bs = cfg.dflash.block_size

    def sample(step: int, g: torch.Generator):
        P = keys[int(torch.randint(len(keys), (1,), generator=g))]
        rows = torch.randint(len(pool[P]), (cfg.dflash.drafter_batch,), generator=g)
        seq = pool[P][rows]  # [B, S]: training-file prefix of P tokens + greedy continuation
        # Anchors in the greedy part (p = P is the first round after a prompt), full blocks only.
        hi = seq.shape[1] - bs + 1
        anchors = torch.stack([torch.randperm(hi - P, generator=g)[:cfg.dflash.anchors] for _ in rows]) + P
        return seq, anchors, None

    def new_drafter(layers: int, intermediate: int):
        return Drafter(drafter_config(cfg.dflash, target.cfg, meta["mask_token_id"], layers, intermediate))

    tok = load_tokenizer(cache / "tokenizer")
    return train_drafters(cfg.dflash, cfg.seed, target, new_drafter, sample, work, device, meta["mask_token_id"],
                          eval_prompts=lambda: load_eval_prompts(cache, tok, cfg.dflash.eval_prompts),
                          eos_id=meta["eos_token_id"], pool_desc=f"pool {sum(len(v) for v in pool.values())} seqs")


# ----------------------------------------------------------------------------- stage: export

def stage_export(cfg: LabConfig, cache: Path, work: Path, out: Path, prompts: bool = True) -> Path:
    """Write the pair in HF / DFlash format, with tokenizer and (unless told not to) prompt sets."""
    from ...checkpoint import save_drafter, save_target
    from ...drafter import Drafter
    _, _, meta = load_corpus(cache)
    dt = getattr(torch, cfg.save_dtype)
    target = frozen_target(cfg, meta, work, "cpu")
    v = chosen_variant(work)
    d = Drafter(drafter_config(cfg.dflash, target.cfg, meta["mask_token_id"], v.get("layers"), v.get("intermediate")))
    load_weights(d, work / "drafter_final.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    save_target(target, out / "target", dtype=dt, tokenizer_dir=cache / "tokenizer")
    save_drafter(d, out / "drafter", dtype=dt)
    if prompts:
        (out / "prompts").mkdir(exist_ok=True)
        for f in (cache / "prompts").glob("*.jsonl"):
            shutil.copy(f, out / "prompts" / f.name)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"export: pair written to {out} ({size / 2**20:.2f} MiB)")
    return out


# ----------------------------------------------------------------------------- CLI

def add_train_args(p):
    add_pipeline_args(p, PRESETS, "lab: the shipped pair (GPU); tiny: every stage on the CPU in seconds", STAGES,
                      "prepare,target,pool,drafter,export,card", "outputs/lab_train",
                      f"where export/card write the pair (default: {LAB_PAIR_DIR})", "LabConfig",
                      "target_seconds=120")
    p.add_argument("--cache", default=".cache/lab_corpus", help="corpus cache: token arrays, tokenizer, prompts")
    return p


def run_train_cli(args) -> int:
    cfg, stages, work = start_run(args, make_config, STAGES)
    _resolve_root(cfg)  # a --set corpus_root=<stdlib subfolder>
    cache = Path(args.cache)
    out = Path(args.out) if args.out else LAB_PAIR_DIR
    device = pick_device(args.device)
    torch.manual_seed(cfg.seed)
    write_config(cfg, work)
    log(f"train-lab-pair: preset {cfg.preset}, stages {stages}, device {device}")

    def run_stage(s: str) -> bool:
        if s == "prepare":
            stage_prepare(cfg, cache)
        elif s == "target":
            stage_target(cfg, cache, work, device)
        elif s == "pool":
            stage_pool(cfg, cache, work, device)
        elif s == "drafter":
            stage_drafter(cfg, cache, work, device)
        elif s == "export":
            stage_export(cfg, cache, work, out)
        elif s == "card":
            from .card import stage_card
            stage_card(cfg, cache, work, out, log=log)
        return True

    def pack_weights() -> dict:
        # A run that continued a shipped target (target_from) trained no target: nothing to carry back.
        with_target = cfg.pack_target and (work / "target_final.safetensors").exists()
        return {**({"target": torch.bfloat16} if with_target else {}), "drafter": torch.float32}

    run_stages(stages, run_stage, force=args.force, work=work, pack_dir=args.pack_dir, pack_weights=pack_weights,
               products={"prepare": cache / "meta.json", "target": work / "target_final.safetensors",
                         "pool": work / "pool.npz", "drafter": work / "drafter_final.safetensors"},
               stale={"target": [work / "target_state.pt"], "drafter": [work / "drafter_state.pt"]})
    return 0


def main(argv=None) -> int:
    return cli_main(argv, "ddtree-lab train-lab-pair", "Train the embedded lab pair (target + DFlash drafter).",
                    add_train_args, run_train_cli)

