"""The DFlash recipe: the loop that trains drafters on a pool of target sequences.

`train_drafters` is the loop (variants on the same batches, a time budget, checkpoints, data parallel
under torchrun, a quick held-out τ), configured by a `DFlashRecipe` that each pipeline's config nests.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .common import autocast, init_weights, load_weights, log, lr_at, optimizer, save_state, save_weights, synchronize
from .blocks import block_logits, block_loss, follow_up_anchors, position_weights
from .evaluate import fast_tau


@dataclass
class DFlashRecipe:
    """The drafter's shape and the knobs of its training loop. The names are the `--set` keys."""
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
    variants: str = ""                    # extra drafters trained on the same batches, ';'-separated
    drafter_init: str = ""                # warm start (every variant of main's shape): a DFlash dir or a work-dir safetensors
    # the quick held-out τ after training
    eval_prompts: int = 16                # per prompt set
    n_new: int = 96
    budgets: tuple = (16, 64, 256)


def parse_variants(cfg: DFlashRecipe) -> dict[str, dict]:
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


def train_drafters(cfg: DFlashRecipe, seed: int, target, new_drafter, sample, work: Path, device: torch.device,
                   mask_id: int, eval_prompts, eos_id: int | None, pool_desc: str = "") -> dict:
    """The DFlash loop of every pipeline: cfg is the pipeline's DFlashRecipe, seed its seed.

    new_drafter(layers, intermediate) -> Drafter; sample(step, generator) -> (seq [B, S], anchors [B, A],
    lengths [B] or None: labels at positions >= lengths are ignored); eval_prompts() -> token-id prompts for
    the quick held-out τ. Writes drafter_<variant>.safetensors, drafter_final.* and drafter_summary.json."""
    variants = parse_variants(cfg)
    drafters, opts = {}, {}
    for i, (name, v) in enumerate(variants.items()):
        torch.manual_seed(seed + 100 + i)
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
    # gradients, each as large as the logits); compiled, those passes fuse into a few kernels.
    loss_fn = torch.compile(block_loss) if device.type == "cuda" and cfg.compile_loss else block_loss
    t0, t_mark, s_mark = time.time(), time.time(), step
    run = {n: [0.0, torch.zeros(bs - 1, device=device), 0.0, 0] for n in drafters}
    while total == 0 or step < total:
        g = torch.Generator().manual_seed((seed * 7_919 + step) * n_proc + rank)  # each process its own batch
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
            synchronize(device)
            t_mark, s_mark = time.time(), step
        if total == 0 and step == 40:
            synchronize(device)
            per_step = (time.time() - t_mark) / (step - s_mark)
            total = max(step + 1, int(cfg.drafter_seconds / per_step))
            total = from_rank0(total, device) if n_proc > 1 else total
            log(f"drafter: {per_step * 1e3:.1f} ms/step -> {total} steps" + (f" on {n_proc} processes" if n_proc > 1 else ""))
        elif fit_time and total and step % max(1, total // 10) == 0 and step < total:
            # Refit to the time budget at each tenth: steps 10-40 can run slow (allocator growth, a
            # busy host), and a plan fixed then can leave much of the budget unused.
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
