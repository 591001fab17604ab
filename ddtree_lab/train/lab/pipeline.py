"""Training the lab pair: a small Qwen3 target on Python source, then its DFlash drafter.

Stages (each writes its product to the work dir; a rerun skips stages whose product exists):
  prepare  corpus + tokenizer + prompt sets            (CPU; cache dir: token arrays for the GPU)
  target   next-token LM on the training files         -> work/target_final.safetensors
  pool     the target's greedy continuations of training windows -> work/pool.npz
  drafter  DFlash drafter(s) distilled on the pool     -> work/drafter_<variant>.safetensors
  export   the shipped pair: target/, drafter/, prompts/ in HF / DFlash format
  card     engine evaluation (AR, DFlash, DDTree) and the README.md model card

Why the pool: acceptance is measured against the target's greedy output, so the drafter learns to
predict exactly that: the labels of a block anchored at p are the target's own greedy tokens
p+1 … p+15, and its context is the frozen target's features of positions < p.
Target and drafter loops checkpoint every few hundred steps and resume from there.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .corpus import CorpusConfig, build_corpus, default_root, load_corpus, load_tokenizer
from .dflash import block_logits, block_loss, follow_up_anchors, greedy_extend, position_weights

PACKAGE_PAIR_DIR = Path(__file__).resolve().parent.parent / "lab_pair"


@dataclass
class LabConfig:
    preset: str = "lab"
    seed: int = 0
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
    # drafter (DFlash)
    drafter_layers: int = 2
    drafter_intermediate: int = 768
    block_size: int = 16
    target_layer_ids: tuple = (1, 3, 5)
    drafter_batch: int = 64
    anchors: int = 16                     # blocks per sequence per step
    drafter_lr: float = 2e-3
    drafter_warmup: int = 100
    drafter_steps: int = 0                # 0 = fit drafter_seconds
    drafter_seconds: float = 150.0
    gamma: float = 7.0                    # loss weight of slot k: exp(-(k-1)/gamma)
    soft_weight: float = 0.0              # mix of KL to the target's distribution into the loss
    compile_loss: bool = True             # on CUDA, torch.compile the loss (see train_drafters)
    round_anchors: float = 0.0            # share of anchors (≤ 0.5) moved to where a round from another would end
    variants: str = "soft_weight=0.5"     # extra drafters trained on the same batches, ';'-separated
    drafter_init: str = ""                # warm start (every variant of main's shape): a DFlash dir or a work-dir safetensors
    target_from: str = ""                 # use this HF target dir when the work dir has no trained target
    # evaluation
    eval_prompts: int = 16                # per set, for the quick τ during training
    n_new: int = 96
    budgets: tuple = (16, 64, 256)
    card_prompts: int = 0                 # per set for the card's engine evaluation; 0 = all
    save_dtype: str = "bfloat16"
    pack_target: bool = True              # pack: also carry the target back (off when only the drafter changed)


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


def make_config(preset: str = "lab", **overrides) -> LabConfig:
    cfg = LabConfig(preset=preset, **PRESETS[preset])
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    if cfg.corpus_root and not Path(cfg.corpus_root).is_absolute():
        cfg.corpus_root = str(Path(default_root()) / cfg.corpus_root)  # a stdlib subfolder
    return cfg


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def save_weights(module: nn.Module, path: Path, dtype=torch.float32) -> None:
    from safetensors.torch import save_file
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(sd, str(tmp))
    tmp.replace(path)


def load_weights(module: nn.Module, path: Path) -> nn.Module:
    from safetensors.torch import load_file
    sd = load_file(str(path))
    module.load_state_dict({k: v.float() for k, v in sd.items()})
    return module


# ----------------------------------------------------------------------------- models

def target_config(cfg: LabConfig, vocab: int, eos_id: int):
    from ..config import RopeConfig, TargetConfig
    return TargetConfig(arch="qwen3", vocab_size=vocab, hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                        head_dim=cfg.head_dim, rms_norm_eps=1e-6,
                        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
                        rope=RopeConfig(theta=cfg.rope_theta), eos_token_id=[eos_id])


def drafter_config(cfg: LabConfig, vocab: int, mask_id: int, layers: int | None = None,
                   intermediate: int | None = None):
    from ..config import DrafterConfig, RopeConfig
    return DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=intermediate or cfg.drafter_intermediate,
                         num_hidden_layers=layers or cfg.drafter_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=1e-6,
                         vocab_size=vocab, block_size=cfg.block_size, num_target_layers=cfg.num_layers,
                         target_layer_ids=list(cfg.target_layer_ids), mask_token_id=mask_id,
                         rope=RopeConfig(theta=cfg.rope_theta),
                         max_position_embeddings=cfg.max_position_embeddings)


def init_weights(module: nn.Module, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue  # norm weights stay 1
        std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down.weight")) else 0.02
        nn.init.normal_(p, 0.0, std)


def add_residual_dropout(target: nn.Module, p: float) -> list:
    """Dropout on each block's attention and MLP outputs, via hooks (the engine's model has none)."""
    if p <= 0:
        return []
    hooks = []
    for blk in target.layers:
        for mod in (blk.o_proj, blk.mlp):
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out: F.dropout(out, p, training=m.training)))
    return hooks


def optimizer(module: nn.Module, lr: float, wd: float, device: torch.device):
    decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def new_target(cfg: LabConfig, meta: dict, device):
    from ..model import Target
    torch.manual_seed(cfg.seed)
    t = Target(target_config(cfg, meta["vocab_size"], meta["eos_token_id"]))
    init_weights(t, cfg.num_layers)
    return t.to(device)


def frozen_target(cfg: LabConfig, meta: dict, work: Path, device):
    """The trained target with weights rounded to the shipped dtype: the drafter must match what ships."""
    if not (work / "target_final.safetensors").exists() and cfg.target_from:
        from ..checkpoint import load_target
        t = load_target(cfg.target_from)
        log(f"target: using {cfg.target_from}")
    else:
        t = new_target(cfg, meta, "cpu")
        load_weights(t, work / "target_final.safetensors")
    dt = getattr(torch, cfg.save_dtype)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(p.to(dt).float())
    t.requires_grad_(False)
    return t.to(device).eval()


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

def stage_target(cfg: LabConfig, cache: Path, work: Path, device: torch.device) -> dict:
    train_ids, held_ids, meta = load_corpus(cache)
    from .evaluate import heldout_loss
    model = new_target(cfg, meta, device)
    n_params = sum(p.numel() for p in model.parameters())
    hooks = add_residual_dropout(model, cfg.dropout)
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
        step += 1
        if total == 0 and step == 30:
            # Time-budgeted run: measure steps 10..30, then fix the schedule's length.
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_mark) / (step - s_mark)
            total = max(step + 1, min(max_steps, int(cfg.target_seconds / per_step)))
            log(f"target: {per_step * 1e3:.1f} ms/step, {tokens_per_step / per_step / 1e6:.2f}M tok/s -> {total} steps "
                f"({total * tokens_per_step / len(train_ids):.1f} epochs)")
        if total == 0 and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_mark, s_mark = time.time(), step
        if step % cfg.eval_every == 0 or step == total:
            model.eval()
            hl = heldout_loss(model, held_ids, T, device, max_windows=cfg.eval_windows)
            model.train()
            tl = float(loss.detach())
            history.append({"step": step, "train_loss": round(tl, 4), "heldout_loss": round(hl, 4),
                            "lr": lr, "seconds": round(trained_s + time.time() - t0, 1)})
            mark = ""
            if hl < best:
                best, mark = hl, " *"
                save_weights(model, work / "target_best.safetensors")
            log(f"target: step {step}/{total} train {tl:.3f} held-out {hl:.3f}{mark} lr {lr:.2e} "
                f"{time.time() - t0:.0f}s")
            save_state(state_path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                    "total": total, "best": best, "history": history,
                                    "seconds": trained_s + time.time() - t0})
    for h in hooks:
        h.remove()
    shutil.copy(work / "target_best.safetensors", work / "target_final.safetensors")
    summary = {"params": n_params, "steps": step, "tokens_seen": step * tokens_per_step,
               "epochs": step * tokens_per_step / len(train_ids), "best_heldout_loss": best,
               "seconds": trained_s + time.time() - t0, "history": history}
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

def parse_variants(cfg: LabConfig) -> dict[str, dict]:
    """'main' uses the config; each extra variant 'k=v,k=v' overrides gamma/soft_weight/layers/lr/
    round_anchors (e.g. 'round_anchors=0.5' trains a second drafter on the same batches for an A/B)."""
    out = {"main": {"gamma": cfg.gamma, "soft_weight": cfg.soft_weight, "layers": cfg.drafter_layers,
                    "lr": cfg.drafter_lr, "intermediate": cfg.drafter_intermediate,
                    "round_anchors": cfg.round_anchors}}
    for spec in filter(None, (s.strip() for s in cfg.variants.split(";"))):
        v = dict(out["main"])
        for kv in spec.split(","):
            k, val = kv.split("=")
            v[k.strip()] = type(out["main"][k.strip()])(float(val)) if k.strip() != "layers" else int(val)
        out[spec.replace("=", "").replace(",", "_")] = v
    return out


def load_eval_prompts(cache: Path, tok, n: int) -> list[list[int]]:
    from .prompts import read_jsonl
    ids = []
    for name in ("code", "docstring"):
        rows = read_jsonl(cache / "prompts" / f"{name}.jsonl")[:n]
        ids += [tok.encode(r["prompt"], add_special_tokens=False).ids for r in rows]
    return ids


def stage_drafter(cfg: LabConfig, cache: Path, work: Path, device: torch.device) -> dict:
    from ..drafter import Drafter
    _, _, meta = load_corpus(cache)
    target = frozen_target(cfg, meta, work, device)
    pool = {int(k[1:]): torch.from_numpy(v.astype(np.int64)) for k, v in np.load(work / "pool.npz").items()}
    keys = sorted(pool)
    bs = cfg.block_size

    def sample(step: int, g: torch.Generator):
        P = keys[int(torch.randint(len(keys), (1,), generator=g))]
        rows = torch.randint(len(pool[P]), (cfg.drafter_batch,), generator=g)
        seq = pool[P][rows]  # [B, S]: training-file prefix of P tokens + greedy continuation
        # Anchors in the greedy part (p = P is the first round after a prompt), full blocks only.
        hi = seq.shape[1] - bs + 1
        anchors = torch.stack([torch.randperm(hi - P, generator=g)[:cfg.anchors] for _ in rows]) + P
        return seq, anchors, None

    def new_drafter(layers: int, intermediate: int):
        return Drafter(drafter_config(cfg, meta["vocab_size"], meta["mask_token_id"], layers, intermediate))

    tok = load_tokenizer(cache / "tokenizer")
    return train_drafters(cfg, target, new_drafter, sample, work, device, meta["mask_token_id"],
                          eval_prompts=lambda: load_eval_prompts(cache, tok, cfg.eval_prompts),
                          eos_id=meta["eos_token_id"], pool_desc=f"pool {sum(len(v) for v in pool.values())} seqs")


@torch.no_grad()
def soft_targets(t_logits: torch.Tensor, anchors: torch.Tensor, bs: int) -> torch.Tensor:
    """The target's logits for block slots 1 … bs-1 of each anchor: [B, S, V] -> [B, A, bs-1, V]
    (the distribution of token p+k sits at position p+k-1)."""
    B, S, V = t_logits.shape
    at = (anchors[..., None] + torch.arange(bs - 1, device=anchors.device)).flatten(1).clamp(max=S - 1)
    return torch.gather(t_logits, 1, at[..., None].expand(-1, -1, V)).view(B, anchors.shape[1], bs - 1, V)


@torch.no_grad()
def round_start_anchors(target, drafter, seq, hid, anchors, share: float, mask_id: int, lengths):
    """Train where the engine's rounds start: the last k = share·A anchors (at most half) move to where
    a round from the first k ends under this drafter, i.e. right after a token it missed."""
    k = min(int(anchors.shape[1] * share), anchors.shape[1] // 2)
    if k == 0:
        return anchors
    first = anchors[:, :k]
    with autocast(seq.device):
        lg, lb = block_logits(target, drafter, seq, hid, first, mask_id, lengths)
    end = seq.shape[1] if lengths is None else lengths.to(seq.device)
    return torch.cat([anchors[:, :-k], follow_up_anchors(lg, lb, first, end)], 1)


# ----------------------------------------------------------------------------- data parallel (one process per GPU)
# `torchrun --nproc_per_node N … --stages drafter` runs the drafter loop on N GPUs: every process draws its own
# batches, gradients are averaged before each step (so the weights stay equal everywhere), and process 0 plans the
# step count, logs, checkpoints and evaluates. One process is the ordinary loop.

def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def average_gradients(model: nn.Module) -> None:
    """All-reduce the gradients (mean over processes) in one collective."""
    import torch.distributed as dist
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def from_rank0(value: int, device: torch.device) -> int:
    """Process 0's value everywhere (the step plan must agree, or the collectives stop matching)."""
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.broadcast(t, 0)
    return int(t)


def weights_in_sync(model: nn.Module, device: torch.device) -> bool:
    """Whether every process holds the same weights (a sum of all parameters, compared across processes)."""
    import torch.distributed as dist
    total = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1).to(device)
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(lo == hi)


def train_drafters(cfg, target, new_drafter, sample, work: Path, device: torch.device, mask_id: int,
                   eval_prompts, eos_id: int | None, pool_desc: str = "") -> dict:
    """The DFlash loop shared by the lab pair and other targets (cfg: any object with LabConfig's drafter fields).

    new_drafter(layers, intermediate) -> Drafter; sample(step, generator) -> (seq [B, S], anchors [B, A],
    lengths [B] or None: labels at positions >= lengths are ignored); eval_prompts() -> token-id prompts for
    the quick held-out τ. Writes drafter_<variant>.safetensors, drafter_final.* and drafter_summary.json."""
    from .evaluate import fast_tau
    variants = parse_variants(cfg)
    drafters, opts = {}, {}
    for i, (name, v) in enumerate(variants.items()):
        torch.manual_seed(cfg.seed + 100 + i)
        d = new_drafter(v["layers"], v["intermediate"])
        init_weights(d, v["layers"])
        same_shape = (v["layers"], v["intermediate"]) == (variants["main"]["layers"], variants["main"]["intermediate"])
        if cfg.drafter_init and same_shape:  # an A/B of settings starts every drafter from the same weights
            if Path(cfg.drafter_init).is_dir():  # a DFlash checkpoint, e.g. the shipped drafter
                from ..checkpoint import load_drafter
                d.load_state_dict(load_drafter(cfg.drafter_init).state_dict())
            else:
                load_weights(d, Path(cfg.drafter_init))
            log(f"drafter: variant {name} starts from {cfg.drafter_init}")
        drafters[name] = d.to(device).train()
        opts[name] = optimizer(drafters[name], v["lr"], 0.01, device)
    rank, n_proc = world()
    if n_proc > 1:  # every process starts from process 0's weights
        import torch.distributed as dist
        for d in drafters.values():
            for t in d.state_dict().values():
                dist.broadcast(t, 0)
    state_path = work / "drafter_state.pt"
    step, total, trained_s, hist = 0, cfg.drafter_steps, 0.0, []
    fit_time = cfg.drafter_steps == 0  # the step count follows drafter_seconds (a resumed run keeps its plan)
    if state_path.exists():
        st = torch.load(state_path, map_location=device, weights_only=False)
        for n in drafters:
            drafters[n].load_state_dict(st["models"][n]), opts[n].load_state_dict(st["opts"][n])
        step, total, trained_s, hist = st["step"], st["total"], st["seconds"], st["history"]
        fit_time = False
        log(f"drafter: resuming at step {step}/{total}")
    layers = list(cfg.target_layer_ids)
    bs = cfg.block_size
    weights = position_weights(bs, cfg.gamma, device)
    n_params = {n: sum(p.numel() for p in d.parameters()) for n, d in drafters.items()}
    log(f"drafter: variants {variants}, params {n_params}, {pool_desc}")
    # The loss reads [B, A, bs-1, vocab] logits a dozen times in eager mode (log-softmax, KL, their
    # gradients: ~6 GB each at the SmolLM2 batch); compiled, those passes fuse into a few kernels.
    loss_fn = torch.compile(block_loss) if device.type == "cuda" and cfg.compile_loss else block_loss
    t0, t_mark, s_mark = time.time(), time.time(), step
    run = {n: [0.0, torch.zeros(bs - 1, device=device), 0.0, 0] for n in drafters}
    while total == 0 or step < total:
        g = torch.Generator().manual_seed((cfg.seed * 7_919 + step) * n_proc + rank)  # each process its own batch
        seq, anchors, lengths = sample(step, g)
        seq, anchors = seq.to(device), anchors.to(device)
        with torch.no_grad(), autocast(device):
            t_logits, hid = target.forward_train(seq, hidden_layers=layers)
        for name, d in drafters.items():
            v = variants[name]
            lr = lr_at(step, total or 10**9, cfg.drafter_warmup, v["lr"], 0.05)
            for gr in opts[name].param_groups:
                gr["lr"] = lr
            anc = round_start_anchors(target, d, seq, hid, anchors, v["round_anchors"], mask_id, lengths)
            soft = soft_targets(t_logits, anc, bs) if v["soft_weight"] > 0 else None
            with autocast(device):
                logits, labels = block_logits(target, d, seq, hid, anc, mask_id, lengths)
            w = weights if v["gamma"] == cfg.gamma else position_weights(bs, v["gamma"], device)
            try:
                loss, acc, tau = loss_fn(logits, labels, w, soft, v["soft_weight"])
            except Exception as e:  # a compiler failure must not cost the run: train on in eager mode
                if loss_fn is block_loss:
                    raise
                log(f"drafter: compiled loss failed ({type(e).__name__}: {e}); eager from here")
                loss_fn = block_loss
                loss, acc, tau = loss_fn(logits, labels, w, soft, v["soft_weight"])
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            if n_proc > 1:
                average_gradients(d)
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opts[name].step()
            r = run[name]
            r[0] += loss.detach()
            r[1] += acc.detach()
            r[2] += tau.detach() if torch.is_tensor(tau) else tau
            r[3] += 1
        step += 1
        if total == 0 and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_mark, s_mark = time.time(), step
        if total == 0 and step == 40:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_mark) / (step - s_mark)
            total = max(step + 1, int(cfg.drafter_seconds / per_step))
            total = from_rank0(total, device) if n_proc > 1 else total
            log(f"drafter: {per_step * 1e3:.1f} ms/step -> {total} steps" + (f" on {n_proc} processes" if n_proc > 1 else ""))
        elif fit_time and total and step % max(1, total // 10) == 0 and step < total:
            # Refit to the time budget at each tenth: steps 10-40 can run slow (allocator growth, a
            # busy host), and a plan fixed then once left 40 % of the budget unused.
            per_step = (time.time() - t_mark) / (step - s_mark)
            total = max(step + 1, s_mark + int((cfg.drafter_seconds - (t_mark - t0)) / per_step))
            total = from_rank0(total, device) if n_proc > 1 else total
        if rank == 0 and (step % max(1, (total or 100) // 10) == 0 or step == total):
            line = []
            for name, r in run.items():
                acc = (r[1] / max(r[3], 1)).tolist()
                line.append(f"{name}: loss {float(r[0]) / max(r[3], 1):.3f} chain τ {float(r[2]) / max(r[3], 1):.2f} acc@1 {acc[0]:.2f} acc@4 {acc[3]:.2f}")
                hist.append({"step": step, "variant": name, "chain_tau": float(r[2]) / max(r[3], 1),
                             "acc": [round(a, 3) for a in acc]})
                run[name] = [0.0, torch.zeros(bs - 1, device=device), 0.0, 0]
            log(f"drafter: step {step}/{total} " + " | ".join(line) + f" {time.time() - t0:.0f}s")
            save_state(state_path, {"models": {n: d.state_dict() for n, d in drafters.items()},
                                    "opts": {n: o.state_dict() for n, o in opts.items()}, "step": step,
                                    "total": total, "seconds": trained_s + time.time() - t0, "history": hist})
    train_seconds = trained_s + time.time() - t0
    if n_proc > 1:
        in_sync = all(weights_in_sync(d, device) for d in drafters.values())
        if rank != 0:  # process 0 evaluates and writes
            return {}
        log(f"drafter: {n_proc} processes, weights in sync: {in_sync}")
    # Quick τ on held-out prompts for every variant; the best DFlash τ ships.
    prompts = eval_prompts()
    results = {}
    for name, d in drafters.items():
        d.eval()
        save_weights(d, work / f"drafter_{name}.safetensors")
        if not prompts:
            results[name] = {"tau": {"dflash": 0.0}, "config": variants[name], "params": n_params[name]}
            continue
        te = time.time()
        r = fast_tau(target, d, prompts, cfg.n_new, cfg.budgets, eos_id=eos_id, device=device)
        results[name] = {"tau": r.summary(), "dflash_tau_every_position": round(r.anchor_mean(), 3),
                         "config": variants[name], "params": n_params[name]}
        log(f"drafter {name}: quick τ on {len(prompts)} held-out prompts {r.summary()}; DFlash chain at every "
            f"position {r.anchor_mean():.2f} ({time.time() - te:.0f}s)")
    best = max(results, key=lambda n: results[n]["tau"]["dflash"])
    shutil.copy(work / f"drafter_{best}.safetensors", work / "drafter_final.safetensors")
    (work / "drafter_final.json").write_text(json.dumps(variants[best]) + "\n")
    summary = {"variants": results, "chosen": best, "steps": step, "seconds": train_seconds,
               "eval_seconds": trained_s + time.time() - t0 - train_seconds,
               "history": hist, "anchors_per_seq": cfg.anchors, "batch": cfg.drafter_batch,
               "processes": n_proc, **({"weights_in_sync": in_sync} if n_proc > 1 else {})}
    (work / "drafter_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"drafter: chose '{best}'")
    return summary


# ----------------------------------------------------------------------------- stage: export

def stage_export(cfg: LabConfig, cache: Path, work: Path, out: Path) -> Path:
    """Write the pair in HF Qwen3 / DFlash format, with tokenizer and prompt sets."""
    from ..checkpoint import save_drafter, save_target
    from ..drafter import Drafter
    _, _, meta = load_corpus(cache)
    dt = getattr(torch, cfg.save_dtype)
    target = frozen_target(cfg, meta, work, "cpu")
    v = json.loads((work / "drafter_final.json").read_text()) if (work / "drafter_final.json").exists() else {}
    d = Drafter(drafter_config(cfg, meta["vocab_size"], meta["mask_token_id"], v.get("layers"), v.get("intermediate")))
    load_weights(d, work / "drafter_final.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    save_target(target, out / "target", dtype=dt, tokenizer_dir=cache / "tokenizer")
    save_drafter(d, out / "drafter", dtype=dt)
    (out / "prompts").mkdir(exist_ok=True)
    for f in (cache / "prompts").glob("*.jsonl"):
        shutil.copy(f, out / "prompts" / f.name)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"export: pair written to {out} ({size / 2**20:.2f} MiB)")
    return out


# ----------------------------------------------------------------------------- stages: pack / unpack

PACK_PART_BYTES = 15 * 2**20  # files coming back from a remote GPU machine must stay under 16 MiB


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


def stage_pack(work: Path, pack: Path, with_target: bool = True) -> None:
    """Move the trained weights in few small files: the target in bf16 (what ships), the drafter fp32."""
    from safetensors.torch import load_file
    pack.mkdir(parents=True, exist_ok=True)
    # A run that continued a shipped target (target_from) trained no target: nothing to carry back.
    with_target = with_target and (work / "target_final.safetensors").exists()
    n = save_parts(load_file(str(work / "target_final.safetensors")), pack, "target") if with_target else 0
    shutil.copy(work / "drafter_final.safetensors", pack / "drafter_final.safetensors")
    info = {f.stem: json.loads(f.read_text()) for f in sorted(work.glob("*.json"))}
    (pack / "pack.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"pack: {n} target part(s) + drafter + pack.json in {pack}")


def stage_unpack(work: Path, pack: Path) -> None:
    from safetensors.torch import save_file
    work.mkdir(parents=True, exist_ok=True)
    sd = load_parts(pack, "target")
    if sd:
        save_file(sd, str(work / "target_final.safetensors"))
    shutil.copy(pack / "drafter_final.safetensors", work / "drafter_final.safetensors")
    for name, obj in json.loads((pack / "pack.json").read_text()).items():
        (work / f"{name}.json").write_text(json.dumps(obj, indent=2) + "\n")
    log(f"unpack: {pack} -> {work}")


# ----------------------------------------------------------------------------- CLI

STAGES = ("prepare", "target", "pool", "drafter", "pack", "unpack", "export", "card")


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--preset", choices=sorted(PRESETS), default="lab",
                   help="lab: the shipped pair (GPU, ~6 min); tiny: every stage on the CPU in seconds")
    p.add_argument("--stages", default="prepare,target,pool,drafter,export,card",
                   help=f"comma-separated subset of {','.join(STAGES)}, run in that order")
    p.add_argument("--cache", default=".cache/lab_corpus", help="corpus cache: token arrays, tokenizer, prompts")
    p.add_argument("--work", default="outputs/lab_train", help="checkpoints and logs; a rerun resumes from here")
    p.add_argument("--out", default=None, help=f"where export/card write the pair (default: {PACKAGE_PAIR_DIR})")
    p.add_argument("--pack-dir", default=None, help="pack/unpack: folder of the few files that carry a GPU run back")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--force", action="store_true", help="rerun stages whose product already exists")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a LabConfig field, e.g. --set target_seconds=120 (repeatable)")
    return p


def apply_overrides(cfg, items: list[str]) -> None:
    """`--set KEY=VALUE` onto a config dataclass, converting to each field's current type."""
    types = {f.name for f in fields(type(cfg))}
    for item in items:
        k, _, v = item.partition("=")
        if k not in types:
            raise SystemExit(f"--set {item}: unknown field '{k}'; fields: {', '.join(sorted(types))}")
        cur = getattr(cfg, k)
        if isinstance(cur, tuple):
            val = tuple(type(cur[0] if cur else 0)(x) for x in v.split(",") if x)
        elif isinstance(cur, bool):
            val = v.lower() in ("1", "true", "yes")
        else:
            val = type(cur)(v)
        setattr(cfg, k, val)


def run_train_cli(args) -> int:
    cfg = make_config(args.preset, seed=args.seed)
    apply_overrides(cfg, args.set)
    if cfg.corpus_root and not Path(cfg.corpus_root).is_absolute():
        cfg.corpus_root = str(Path(default_root()) / cfg.corpus_root)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"--stages: unknown stage(s) {bad}; stages: {', '.join(STAGES)}")
    cache, work = Path(args.cache), Path(args.work)
    out = Path(args.out) if args.out else PACKAGE_PAIR_DIR
    work.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    torch.manual_seed(cfg.seed)
    (work / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    log(f"train-lab-pair: preset {cfg.preset}, stages {stages}, device {device}")
    products = {"prepare": cache / "meta.json", "target": work / "target_final.safetensors",
                "pool": work / "pool.npz", "drafter": work / "drafter_final.safetensors"}
    for s in stages:
        if s in products and products[s].exists() and not args.force:
            log(f"{s}: {products[s]} exists, skipping (--force to redo)")
            continue
        if args.force and s == "target":
            (work / "target_state.pt").unlink(missing_ok=True)
        if args.force and s == "drafter":
            (work / "drafter_state.pt").unlink(missing_ok=True)
        t = time.time()
        if s == "prepare":
            stage_prepare(cfg, cache)
        elif s == "target":
            stage_target(cfg, cache, work, device)
        elif s == "pool":
            stage_pool(cfg, cache, work, device)
        elif s == "drafter":
            stage_drafter(cfg, cache, work, device)
        elif s in ("pack", "unpack"):
            if not args.pack_dir:
                raise SystemExit(f"--stages {s} needs --pack-dir")
            if s == "pack":
                stage_pack(work, Path(args.pack_dir), cfg.pack_target)
            else:
                stage_unpack(work, Path(args.pack_dir))
        elif s == "export":
            stage_export(cfg, cache, work, out)
        elif s == "card":
            from .card import stage_card
            stage_card(cfg, cache, work, out, log=log)
        log(f"{s}: {time.time() - t:.1f}s")
    return 0


def main(argv=None) -> int:
    p = add_train_args(argparse.ArgumentParser(prog="ddtree-lab train-lab-pair",
                                               description="Train the embedded lab pair (target + DFlash drafter)."))
    return run_train_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
