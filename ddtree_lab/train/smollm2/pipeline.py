"""Training the SmolLM2 DFlash drafter: the lab-pair recipe on a pulled, frozen instruct target.

Stages (products in --work; a rerun skips a stage whose product exists, --force redoes it):
  prepare  training prompts (train_prompts.build) rendered with the target's chat template -> prompts.jsonl
  ask      (with --set self_prompts=N) requests the target writes itself, sampled, added to prompts.jsonl
  pool     the target's greedy responses, batched and left-padded, each up to its first EOS -> pool.npz
  drafter  the DFlash recipe (ddtree_lab.train.recipe: train_drafters) on that pool -> drafter_final.safetensors
  pack     the trained drafter as files < 16 MiB (+ summaries) in --pack-dir, to carry a GPU run back
  unpack   the reverse, on the machine that exports
  export   the drafter in DFlash format (bf16) -> --out (default ddtree_lab/pairs/smollm2/drafter)
  card     engine τ per prompt set at T = 0 and 1 with the lossless check -> README.md, eval.json in --out

Why greedy responses: at T = 0 acceptance is measured against the target's greedy tokens, so the drafter
learns exactly those (the DFlash authors also train on target-generated responses). Labels stop at the
response's first EOS: the engine stops there, so later tokens would only teach noise.

    ddtree-lab train-smollm2-drafter [--preset tiny] [--stages …]   (or python -m ddtree_lab.train.smollm2)
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..common import autocast, frozen, init_weights, load_weights, log, pick_device
from ..generate import greedy_extend, left_padded
from ..pipeline import (PipelineConfig, add_pipeline_args, chosen_variant, cli_main, drafter_config,
                        make_config as _make_config, run_stages, start_run, write_config)
from ..recipe import DFlashRecipe, train_drafters
from . import DRAFTER_DIR, PROMPT_SETS, load_prompts, target_dir
from . import train_prompts


@dataclass
class SmolConfig(PipelineConfig):
    preset: str = "smollm2"
    dflash: DFlashRecipe = field(default_factory=lambda: DFlashRecipe(
        drafter_intermediate=1536, target_layer_ids=(1, 8, 14, 20, 27),  # spread over the 30 layers
        drafter_batch=128, drafter_lr=1e-3, drafter_seconds=200.0,
        soft_weight=0.5,                  # the lab pair's winning variant: half KL to the target's distribution
        eval_prompts=8,                   # per held-out set
        n_new=128))
    mask_token_id: int = 16               # <empty_output>: see docs/smollm2.md
    n_prompts: int = 32000                # distinct training user messages (a big pool: see docs/lab_pair.md)
    prompt_version: int = 1               # train_prompts template set: 1 made the shipped pool, 2 adds kinds
    # ask: requests the target writes itself (sampled), added to the template prompts; 0 = none
    self_prompts: int = 0
    ask_temperature: float = 0.7          # higher made more rambling than requests (docs/smollm2.md)
    ask_len: int = 64                     # tokens at most per written request (longer ones are dropped)
    ask_seconds: float = 120.0            # stop starting new batches after this
    ask_min_chars: int = 15
    # pool: the target's greedy responses
    gen_len: int = 192                    # new tokens at most per response (the card measures 128)
    gen_batch: int = 2048                 # rows per batched greedy generation (the KV cache grows with it)
    gen_seconds: float = 100.0            # stop starting new batches after this
    # one process per GPU: shard k of n makes batches b with b % n == k into the same work dir; then a run
    # with pool_shards=1 and gen_seconds=0 only merges the parts (docs/smollm2.md)
    pool_shards: int = 1
    pool_shard: int = 0
    temperatures: tuple = (0.0, 1.0)      # the card's


PRESETS = {
    "smollm2": {},
    # The CPU test: a tiny random Llama target (written into the work dir), every stage in seconds.
    "tiny": dict(n_prompts=24, gen_len=12, gen_batch=8, gen_seconds=60.0, drafter_layers=1,
                 drafter_intermediate=128, block_size=8, target_layer_ids=(0, 2, 3), mask_token_id=1,
                 drafter_batch=4, anchors=3, drafter_warmup=2, drafter_steps=6, eval_prompts=1, n_new=10,
                 budgets=(4, 8), card_prompts=1, save_dtype="float32"),
}
MAX_DRAFTER_MIB = 20.0
STAGES = ("prepare", "ask", "pool", "drafter", "pack", "unpack", "export", "card")


def make_config(preset: str = "smollm2", **overrides) -> SmolConfig:
    return _make_config(SmolConfig, PRESETS, preset, **overrides)


TINY_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")


def make_tiny_target(directory: Path) -> Path:
    """A random tiny Llama in HF format with a chat template (the tiny preset's stand-in for SmolLM2)."""
    from ...testing import make_tiny_pair
    if (directory / "target" / "config.json").is_file():
        return directory / "target"
    tdir, _ = make_tiny_pair(directory, arch="llama", vocab_size=300, seed=0, num_hidden_layers=4,
                             eos_token_id=[0])
    tc = json.loads((tdir / "tokenizer_config.json").read_text())
    tc["chat_template"] = TINY_TEMPLATE
    (tdir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    return tdir


def tokenizer_and_chat(tdir: Path):
    """-> (tokenizer, encode(messages) -> ids, eos id), as dl.generate renders chat prompts."""
    from ...checkpoint import _token_text, load_tokenizer
    from ...prompts import render_chat
    tok, tcfg = load_tokenizer(tdir)
    if tok is None or not tcfg.get("chat_template"):
        raise SystemExit(f"{tdir}: needs tokenizer.json and a chat template")
    special = {k: _token_text(tcfg[k]) for k in ("bos_token", "eos_token", "pad_token") if tcfg.get(k)}
    eos_id = tok.token_to_id(special["eos_token"])

    def encode(messages):
        return tok.encode(render_chat(tcfg["chat_template"], messages, special), add_special_tokens=False).ids

    def encode_many(user_texts: list[str]) -> list[list[int]]:
        """Single-turn user messages in bulk. render_chat compiles the template per call, too slow for tens
        of thousands: we render once around a marker and splice, after checking the splice on a sample."""
        mark = "\x00MSG\x00"
        pre, _, post = render_chat(tcfg["chat_template"], [{"role": "user", "content": mark}], special).partition(mark)
        texts = [pre + t + post for t in user_texts]
        sample = range(0, len(texts), max(1, len(texts) // 32))
        if any(texts[i] != render_chat(tcfg["chat_template"], [{"role": "user", "content": user_texts[i]}], special)
               for i in sample):
            texts = [render_chat(tcfg["chat_template"], [{"role": "user", "content": t}], special) for t in user_texts]
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    encode.many = encode_many
    return tok, encode, eos_id


def frozen_target(cfg: SmolConfig, tdir: Path, device):
    """The target, weights rounded to bf16 first (what the GPU study runs), frozen."""
    from ...checkpoint import load_target
    return frozen(load_target(tdir), torch.bfloat16, device)


def heldout_ids(encode, n: int) -> list[list[int]]:
    return [encode(r["messages"]) for s in PROMPT_SETS for r in load_prompts(s)[:n]]


# ----------------------------------------------------------------------------- stages

def stage_prepare(cfg: SmolConfig, tdir: Path, work: Path) -> dict:
    _, encode, _ = tokenizer_and_chat(tdir)
    rows = train_prompts.build(cfg.n_prompts, cfg.seed, cfg.prompt_version)
    lens = []
    tmp = work / "prompts.jsonl.tmp"
    ids = encode.many([r["messages"][0]["content"] for r in rows])
    with open(tmp, "w", encoding="utf-8") as f:
        for r, x in zip(rows, ids):
            r["ids"] = x
            lens.append(len(r["ids"]))
            f.write(json.dumps(r) + "\n")
    tmp.replace(work / "prompts.jsonl")
    kinds = {k: sum(r["kind"] == k for r in rows) for k, *_ in train_prompts.KINDS}
    info = {"prompts": len(rows), "prompt_version": cfg.prompt_version, "kinds": kinds, "prompt_tokens": {"min": min(lens), "mean": float(np.mean(lens)),
                                                                     "max": max(lens)}}
    (work / "prepare_summary.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"prepare: {len(rows)} prompts {kinds}, prompt tokens {info['prompt_tokens']}")
    return info


@torch.no_grad()
def stage_ask(cfg: SmolConfig, tdir: Path, work: Path, device: torch.device) -> dict:
    """The target writes user requests (sampled answers to train_prompts.ask_instructions); the clean,
    distinct ones that equal no held-out or template prompt join prompts.jsonl as rows of kind "self-<kind>"."""
    tok, encode, eos_id = tokenizer_and_chat(tdir)
    path = work / "prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    seen = train_prompts.heldout_messages() | {train_prompts.normalise(r["messages"][0]["content"]) for r in rows}
    target = frozen_target(cfg, tdir, device)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    t0, asked, kept, rejected = time.time(), 0, [], {"unfinished": 0, "length": 0, "repeat": 0}
    batch = 0
    while len(kept) < cfg.self_prompts and time.time() - t0 <= cfg.ask_seconds:
        want = train_prompts.ask_instructions(cfg.gen_batch, seed=cfg.seed * 1000 + batch)
        batch += 1
        x, plen = left_padded(encode.many([w["instruction"] for w in want]), eos_id)
        P = x.shape[1]
        with autocast(device):
            out = greedy_extend(target, x.to(device), cfg.ask_len, prompt_lens=plen.to(device), stop_id=eos_id,
                                temperature=cfg.ask_temperature, generator=g).cpu()
        asked += len(want)
        for w, gen in zip(want, out[:, P:].tolist()):
            if eos_id not in gen:
                rejected["unfinished"] += 1
                continue
            text = train_prompts.clean_request(tok.decode(gen[:gen.index(eos_id)]), cfg.ask_min_chars)
            key = text and train_prompts.normalise(text)
            if text is None:
                rejected["length"] += 1
            elif key in seen:
                rejected["repeat"] += 1
            else:
                seen.add(key)
                kept.append({"kind": "self-" + w["kind"], "text": text})
                if len(kept) == cfg.self_prompts:
                    break
        log(f"ask: {len(kept)}/{cfg.self_prompts} requests kept of {asked} asked {rejected}, {time.time() - t0:.0f}s")
    new = [{"id": f"self-{i:06d}", "kind": k["kind"], "messages": [{"role": "user", "content": k["text"]}], "ids": x}
           for i, (k, x) in enumerate(zip(kept, encode.many([k["text"] for k in kept])))]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows + new), encoding="utf-8")
    tmp.replace(path)
    info = {"asked": asked, "kept": len(new), "kinds": dict(Counter(r["kind"] for r in new)), "rejected": rejected, "temperature": cfg.ask_temperature,
            "seconds": time.time() - t0, "device": str(device), "examples": [r["messages"][0]["content"] for r in new[:8]]}
    (work / "ask_summary.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


@torch.no_grad()
def stage_pool(cfg: SmolConfig, tdir: Path, work: Path, device: torch.device) -> dict:
    """Greedy responses in left-padded batches (parts saved as they come: a rerun resumes)."""
    _, _, eos_id = tokenizer_and_chat(tdir)
    rows = [json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines() if x.strip()]
    order = np.random.default_rng(cfg.seed + 1).permutation(len(rows))  # a time cap still gets every kind
    target = frozen_target(cfg, tdir, device)
    parts = work / "pool_parts"
    parts.mkdir(exist_ok=True)
    t0, made, new_tokens, gen_s = time.time(), 0, 0, 0.0
    if not 0 <= cfg.pool_shard < cfg.pool_shards:
        raise SystemExit(f"pool: pool_shard={cfg.pool_shard} must be in 0 … pool_shards-1 ({cfg.pool_shards - 1})")
    for b, i in enumerate(range(0, len(rows), cfg.gen_batch)):
        part = parts / f"part{b:04d}.npz"
        if b % cfg.pool_shards != cfg.pool_shard:
            continue  # another shard's batch
        if part.exists():
            made += len(np.load(part)["starts"])
            continue
        if time.time() - t0 > cfg.gen_seconds:
            log(f"pool: gen_seconds={cfg.gen_seconds:g} spent, stopping before batch {b}")
            break
        ids = [rows[j]["ids"] for j in order[i:i + cfg.gen_batch]]
        x, plen = left_padded(ids, eos_id)
        P = x.shape[1]
        tb = time.time()
        with autocast(device):
            out = greedy_extend(target, x.to(device), cfg.gen_len, prompt_lens=plen.to(device), stop_id=eos_id).cpu()
        gen_s += time.time() - tb
        gen = out[:, P:]  # [B, G]
        hit = gen == eos_id
        n_gen = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full_like(plen, gen.shape[1]))
        # Right-align: prompt then response, then EOS padding (the drafter's target forward is causal).
        S = int((plen + n_gen).max())
        toks = np.full((len(ids), S), eos_id, dtype=np.uint16)
        for r in range(len(ids)):
            p, g = int(plen[r]), int(n_gen[r])
            toks[r, :p + g] = torch.cat([out[r, P - p:P], gen[r, :g]]).numpy()
        np.savez(part, tokens=toks, starts=plen.numpy(), lengths=(plen + n_gen).numpy())
        made, new_tokens = made + len(ids), new_tokens + int(n_gen.sum())
        log(f"pool: {made}/{len(rows)} responses, {new_tokens} new tokens, {time.time() - t0:.0f}s")
    if cfg.pool_shards > 1:  # the parts are merged once every shard is done
        log(f"pool: shard {cfg.pool_shard}/{cfg.pool_shards}: {made} responses, {gen_s:.0f}s of generation")
        info = {"shard": cfg.pool_shard, "shards": cfg.pool_shards, "responses": made, "generation_seconds": gen_s,
                "seconds": time.time() - t0, "device": str(device)}
        (parts / f"shard{cfg.pool_shard}.json").write_text(json.dumps(info) + "\n")  # for the merge's summary
        return info
    files = sorted(parts.glob("part*.npz"))
    if not files:
        raise SystemExit("pool: no batch was generated")
    arrs = [np.load(f) for f in files]
    S = max(a["tokens"].shape[1] for a in arrs)
    tokens = np.concatenate([np.pad(a["tokens"], ((0, 0), (0, S - a["tokens"].shape[1])), constant_values=eos_id)
                             for a in arrs])
    starts, lengths = np.concatenate([a["starts"] for a in arrs]), np.concatenate([a["lengths"] for a in arrs])
    np.savez(work / "pool.npz", tokens=tokens, starts=starts, lengths=lengths)
    resp = lengths - starts
    ended = int(sum(int(tokens[i, lengths[i] - 1]) == eos_id for i in range(len(lengths))))
    # Shards ran side by side (one per GPU): the pool took as long as the slowest, on as many devices.
    shards = [json.loads(f.read_text()) for f in sorted(parts.glob("shard*.json"))]
    wall = max((x["generation_seconds"] for x in shards), default=0.0) + gen_s
    where = f"{len(shards)} × {shards[0]['device']}" if len(shards) > 1 else str(device)
    info = {"sequences": len(lengths), "response_tokens": int(resp.sum()), "mean_response": float(resp.mean()),
            "ended_with_eos": ended, "gen_len": cfg.gen_len, "gen_batch": cfg.gen_batch,
            "generation_seconds": wall, "seconds": time.time() - t0 + max((x["seconds"] for x in shards), default=0.0),
            "device": where, **({"shards": shards} if shards else {})}
    (work / "pool_summary.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"pool: {info['sequences']} responses, {info['response_tokens']} tokens (mean {info['mean_response']:.0f}, "
        f"{ended} ended with EOS) in {gen_s:.0f}s of generation")
    return info


def stage_drafter(cfg: SmolConfig, tdir: Path, work: Path, device: torch.device) -> dict:
    from ...drafter import Drafter
    _, encode, eos_id = tokenizer_and_chat(tdir)
    target = frozen_target(cfg, tdir, device)
    z = np.load(work / "pool.npz")
    keep = (z["lengths"] - z["starts"]) >= 2  # an anchor needs a next token
    tokens = torch.from_numpy(z["tokens"][keep].astype(np.int64))
    starts, lengths = torch.from_numpy(z["starts"][keep].astype(np.int64)), torch.from_numpy(z["lengths"][keep].astype(np.int64))

    def sample(step: int, g: torch.Generator):
        rows = torch.randint(len(tokens), (cfg.dflash.drafter_batch,), generator=g)
        st, ln = starts[rows], lengths[rows]
        # Anchors p in [start, length - 2]: the first round sits right after the prompt, as in the engine.
        u = torch.rand(len(rows), cfg.dflash.anchors, generator=g)
        anchors = st[:, None] + (u * (ln - 1 - st)[:, None]).long()
        return tokens[rows, :int(ln.max())], anchors, ln

    def new_drafter(layers: int, intermediate: int):
        d = Drafter(drafter_config(cfg.dflash, target.cfg, cfg.mask_token_id, layers, intermediate))
        init_weights(d, layers)  # train_drafters draws them again; kept so that a rerun repeats the shipped draws
        return d

    return train_drafters(cfg.dflash, cfg.seed, target, new_drafter, sample, work, device, cfg.mask_token_id,
                          eval_prompts=lambda: heldout_ids(encode, cfg.dflash.eval_prompts), eos_id=eos_id,
                          pool_desc=f"pool {len(tokens)} responses, {int((lengths - starts).sum())} tokens")


def stage_export(cfg: SmolConfig, tdir: Path, work: Path, out: Path) -> Path:
    from ...checkpoint import save_drafter
    from ...drafter import Drafter
    v = chosen_variant(work)
    d = Drafter(drafter_config(cfg.dflash, _target_cfg(tdir), cfg.mask_token_id, v.get("layers"), v.get("intermediate")))
    load_weights(d, work / "drafter_final.safetensors")
    save_drafter(d, out, dtype=getattr(torch, cfg.save_dtype))
    mib = (out / "model.safetensors").stat().st_size / 2**20
    log(f"export: drafter written to {out} ({mib:.2f} MiB, {cfg.save_dtype})")
    if cfg.save_dtype == "bfloat16" and mib > MAX_DRAFTER_MIB:
        raise SystemExit(f"export: the drafter is {mib:.1f} MiB, over the {MAX_DRAFTER_MIB} MiB limit")
    return out


def _target_cfg(tdir: Path):
    from ...checkpoint import read_json
    from ...config import target_config_from_hf
    return target_config_from_hf(read_json(tdir / "config.json"), tdir / "config.json")


# ----------------------------------------------------------------------------- CLI

def add_smollm2_train_args(p):
    add_pipeline_args(p, PRESETS, "smollm2: the shipped drafter (GPU); tiny: every stage on the CPU in seconds "
                      "with a tiny random Llama target", STAGES, "prepare,pool,drafter,export,card",
                      "outputs/smollm2_train", f"export/card write the drafter here (default: {DRAFTER_DIR}; "
                      "tiny: work/drafter)", "SmolConfig", "drafter_seconds=180")
    p.add_argument("--target", default=None, help="target dir (default: the pulled SmolLM2; tiny: work/tiny/target)")
    return p


def join_processes(stages: list[str], device: torch.device) -> int | None:
    """Under torchrun (WORLD_SIZE > 1): join the process group and return this process's rank; else None.
    Only the drafter stage runs on several processes (ddtree_lab/train/recipe.py: data parallel)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if stages != ["drafter"]:
        raise SystemExit(f"--stages {','.join(stages)}: under torchrun only --stages drafter runs (one process "
                         "per GPU); run the other stages in one process")
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank()


def run_smollm2_train_cli(args) -> int:
    cfg, stages, work = start_run(args, make_config, STAGES)
    tiny = cfg.preset == "tiny"
    tdir = Path(args.target) if args.target else (make_tiny_target(work / "tiny") if tiny else target_dir())
    if not (tdir / "config.json").is_file() and any(s in stages for s in ("prepare", "pool", "drafter", "export", "card")):
        raise SystemExit(f"no target in {tdir}: run `ddtree-lab pull smollm2` (and set DDTREE_LAB_CACHE) "
                         "or give --target DIR")
    out = Path(args.out) if args.out else (work / "drafter" if tiny else DRAFTER_DIR)
    device = pick_device(args.device)
    rank = join_processes(stages, device)
    if rank is not None and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)
    if rank:  # processes other than 0 only train, as process 0 decides: they write nothing
        if args.force or not (work / "drafter_final.safetensors").exists():  # else process 0 skips it too
            torch.distributed.barrier()  # process 0 has cleared a forced rerun's checkpoint
            stage_drafter(cfg, tdir, work, device)
        torch.distributed.barrier()  # until process 0 has evaluated and written: all leave together
        torch.distributed.destroy_process_group()
        return 0
    write_config(cfg, work)
    log(f"train-smollm2-drafter: preset {cfg.preset}, stages {stages}, target {tdir}, device {device}")

    def run_stage(s: str) -> bool:
        if s == "prepare":
            stage_prepare(cfg, tdir, work)
        elif s == "ask":
            if cfg.self_prompts <= 0:
                log("ask: self_prompts is 0, nothing to ask")
                return False
            stage_ask(cfg, tdir, work, device)
        elif s == "pool":
            stage_pool(cfg, tdir, work, device)
            return cfg.pool_shards == 1  # a shard: the merge records the stage, its time and devices
        elif s == "drafter":
            if rank is not None:
                torch.distributed.barrier()
            stage_drafter(cfg, tdir, work, device)
        elif s == "export":
            stage_export(cfg, tdir, work, out)
        elif s == "card":
            from .card import stage_card
            stage_card(cfg, tdir, work, out)
        return True

    def record_time(s: str, dt: float) -> None:
        timing = json.loads((work / "timing.json").read_text()) if (work / "timing.json").exists() else {}
        if s == "pool":  # a merge also counts the slowest shard (they ran side by side) and names their devices
            pool = json.loads((work / "pool_summary.json").read_text())
            shard_s = max((x["seconds"] for x in pool.get("shards", [])), default=0.0)
            timing[s] = {"seconds": round(dt + shard_s, 1), "device": pool["device"]}
        else:
            where = str(device) if rank is None else f"{torch.distributed.get_world_size()} × {device.type} (data parallel)"
            timing[s] = {"seconds": round(dt, 1), "device": where}
        (work / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")

    t_all = time.time()
    run_stages(stages, run_stage, force=args.force, work=work, pack_dir=args.pack_dir,
               pack_weights=lambda: {"drafter": torch.float32}, on_done=record_time,
               products={"prepare": work / "prompts.jsonl", "ask": work / "ask_summary.json",
                         "pool": work / "pool.npz", "drafter": work / "drafter_final.safetensors"},
               stale={"drafter": [work / "drafter_state.pt"], "pool": (work / "pool_parts").glob("part*.npz")})
    if rank is not None:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    log(f"train-smollm2-drafter: done in {time.time() - t_all:.0f}s")
    return 0


def main(argv=None) -> int:
    return cli_main(argv, "ddtree-lab train-smollm2-drafter", "Train the SmolLM2 DFlash drafter.",
                    add_smollm2_train_args, run_smollm2_train_cli)

