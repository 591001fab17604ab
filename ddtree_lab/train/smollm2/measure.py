"""CPU figures that size the GPU training plan: batched greedy generation and one drafter step.

    DDTREE_LAB_CACHE=/tmp/ddcache python -m ddtree_lab.train.smollm2.measure [--batches 1,4,8] [--new 48]
    DDTREE_LAB_CACHE=/tmp/ddcache python -m ddtree_lab.train.smollm2.measure --tau 4 [--drafter DIR]

Generation runs `greedy_extend` (left-padded chat prompts, as the pool stage does) on the pulled target
and reports new tokens per second and seconds per 1k new tokens per batch size; it also checks that a
padded batch yields the same tokens as each prompt alone. The drafter step is the training step of the
shipped configuration at a small batch.

`--tau N` measures instead where a drafter's acceptance goes (T = 0, float32, `fast_tau`): on N held-out
prompts per set and on 3N training-style prompts (`train_prompts.build`, seed 0, as the pool stage composes
them), DFlash τ per engine round and DFlash's chain at every position of the output.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ..blocks import block_logits, block_loss, position_weights
from ..evaluate import fast_tau
from ..generate import greedy_extend, left_padded
from ..pipeline import drafter_config
from . import DRAFTER_DIR, PROMPT_SETS, load_prompts, target_dir, train_prompts
from .pipeline import frozen_target, make_config, tokenizer_and_chat


@torch.no_grad()
def measure_generation(tdir, batches=(1, 4, 8), n_new: int = 48, check: int = 3) -> dict:
    cfg = make_config("smollm2")
    _, encode, eos = tokenizer_and_chat(tdir)
    target = frozen_target(cfg, tdir, "cpu")
    rows = train_prompts.build(max(batches), seed=123)
    ids = [encode(r["messages"]) for r in rows]
    x, plen = left_padded(ids[:1], eos)
    greedy_extend(target, x, 4, prompt_lens=plen)  # warm-up: first-call allocations are not the rate
    out = {"threads": torch.get_num_threads(), "n_new": n_new, "prompt_tokens": [len(x) for x in ids], "batch": {}}
    for B in batches:
        x, plen = left_padded(ids[:B], eos)
        t = time.perf_counter()
        greedy_extend(target, x, n_new, prompt_lens=plen)  # no early stop: a fixed token count is timed
        dt = time.perf_counter() - t
        out["batch"][B] = {"seconds": round(dt, 2), "tokens_per_s": round(B * n_new / dt, 1),
                           "seconds_per_1k_tokens": round(1000 * dt / (B * n_new), 2)}
        print(f"generation: batch {B}: {B * n_new} new tokens in {dt:.1f}s = {B * n_new / dt:.1f} tok/s", flush=True)
    # Left padding changes nothing: each row equals its prompt generated alone.
    x, plen = left_padded(ids[:check], eos)
    batched = greedy_extend(target, x, 16, prompt_lens=plen)[:, x.shape[1]:]
    alone = [greedy_extend(target, torch.tensor([s]), 16)[0, len(s):] for s in ids[:check]]
    out["padded_equals_alone"] = all(torch.equal(batched[r], alone[r]) for r in range(check))
    print(f"padded batch == alone: {out['padded_equals_alone']}", flush=True)
    return out


def measure_drafter_step(tdir, batch: int = 2, seq: int = 256, anchors: int = 16) -> dict:
    from ...drafter import Drafter
    cfg = make_config("smollm2")
    target = frozen_target(cfg, tdir, "cpu")
    d = Drafter(drafter_config(cfg.dflash, target.cfg, cfg.mask_token_id))
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 40000, (batch, seq), generator=g)
    anc = torch.randint(64, seq - 2, (batch, anchors), generator=g)
    w = position_weights(cfg.dflash.block_size, cfg.dflash.gamma)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        with torch.no_grad():
            _, hid = target.forward_train(tokens, hidden_layers=list(cfg.dflash.target_layer_ids))
        t_fwd = time.perf_counter() - t
        logits, labels = block_logits(target, d, tokens, hid, anc, cfg.mask_token_id)
        loss, _, _ = block_loss(logits, labels, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append((t_fwd, time.perf_counter() - t))
    n = sum(p.numel() for p in d.parameters())
    t_fwd, t_all = times[-1]
    print(f"drafter step: batch {batch}x{seq}, {anchors} anchors: target forward {t_fwd:.2f}s, step {t_all:.2f}s; "
          f"drafter {n / 1e6:.2f}M params = {2 * n / 2**20:.1f} MiB in bf16", flush=True)
    return {"batch": batch, "seq": seq, "anchors": anchors, "target_forward_s": round(t_fwd, 2),
            "step_s": round(t_all, 2), "drafter_params": n, "drafter_bf16_mib": round(2 * n / 2**20, 2)}


def measure_tau_gap(tdir, drafter_dir=None, n_per_set: int = 4, n_new: int = 128) -> dict:
    from ...checkpoint import load_drafter
    cfg = make_config("smollm2")
    _, encode, eos = tokenizer_and_chat(tdir)
    target = frozen_target(cfg, tdir, "cpu")
    drafter = load_drafter(drafter_dir or DRAFTER_DIR).float().eval()
    sets = {"held-out": [encode(r["messages"]) for s in PROMPT_SETS for r in load_prompts(s)[:n_per_set]],
            "training-style": [encode(r["messages"]) for r in train_prompts.build(3 * n_per_set, seed=0)]}
    out = {}
    for name, prompts in sets.items():
        r = fast_tau(target, drafter, prompts, n_new, budgets=(), eos_id=eos, device=torch.device("cpu"))
        out[name] = {"prompts": len(prompts), "rounds": len(r.per_method["dflash"]),
                     "dflash_tau_per_round": round(r.mean("dflash"), 3),
                     "dflash_tau_every_position": round(r.anchor_mean(), 3)}
        print(f"{name}: {out[name]}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_lab.train.smollm2.measure", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--tau", type=int, default=0, metavar="N",
                   help="instead: DFlash τ per round vs at every position, N held-out prompts per set")
    p.add_argument("--drafter", default=None, help="--tau: drafter dir (default: the shipped one)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tdir = a.target or target_dir()
    if a.tau:
        print(json.dumps(measure_tau_gap(tdir, a.drafter, a.tau)))
        return 0
    res = {"generation": measure_generation(tdir, tuple(int(b) for b in a.batches.split(",")), a.new),
           "drafter_step": measure_drafter_step(tdir)}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
