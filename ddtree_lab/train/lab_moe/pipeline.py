"""Training the lab-moe pair: a small DeepSeek-V3-architecture target on the lab corpus, then its DFlash drafter.

The lab pipeline's stages with another target: the same corpus and tokenizer (the lab pair's shipped tokenizer.json
encodes the corpus, so token ids and prompt sets are the lab pair's), the same LM loop (lab.pipeline.stage_target,
here with RouterBalance steering the routers), the same pool and DFlash recipe, the same export. What is its own:
the architecture (MLA, a dense first layer, routed experts with sigmoid scores, a correction bias and grouped
selection, one shared expert), the routing balance, the INT4 copy of the experts and the card.

Stages (each writes its product to the work dir; a rerun skips stages whose product exists):
  prepare  corpus token arrays with the lab tokenizer; the lab prompt sets     (CPU; --cache)
  target   next-token LM, correction biases updated after every step           -> work/target_final.safetensors
  pool     the target's greedy continuations of training windows               -> work/pool.npz
  drafter  the DFlash drafter distilled on the pool                            -> work/drafter_final.safetensors
  pack     the trained weights as files < 16 MiB (+ summaries) in --pack-dir; unpack: the reverse
  export   target/ (DeepseekV3ForCausalLM, bf16) and drafter/ (DFlashDraftModel) in --out
  int4     a copy of the exported target with its routed experts INT4 (compressed-tensors pack-quantized)
  card     engine evaluation (τ at T = 0 and 1, expert unions, load, INT4 vs bf16) and README.md

    ddtree-lab train-lab-moe [--preset smoke] [--run-dir DIR] [--stages …]   (or python -m ddtree_lab.train.lab_moe)
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...pairs import LAB_MOE_DIR, LAB_MOE_INT4_DIRNAME, TRAIN_LAB_MOE, cache_dir
from ...runtime import has_library, missing_library
from ..common import log, pick_device
from ..lab.corpus import CorpusConfig, build_corpus
from ..lab.pipeline import LabConfig, _resolve_root, stage_drafter, stage_export, stage_pool, stage_target
from ..pipeline import (add_pipeline_args, cli_main, make_config as _make_config, run_stages, start_run,
                        write_config)
from ..recipe import DFlashRecipe
from . import CACHE_DIR, LAB_PROMPT_DIR, LAB_TOKENIZER_DIR
from .balance import RouterBalance

# the routed experts' linears under the reference model's names; shared experts and everything else stay bf16
EXPERT_LINEARS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
WORK_DIR = "outputs/lab_moe_train"  # without --run-dir


@dataclass
class LabMoeConfig(LabConfig):
    """LabConfig's corpus, LM loop, pool and drafter knobs, with a DeepSeek-V3 target (its num_kv_heads and
    head_dim are unused: MLA sets them, as config.py reads a DeepSeek-V3 config)."""
    preset: str = "lab-moe"
    dflash: DFlashRecipe = field(default_factory=lambda: DFlashRecipe(
        target_layer_ids=(1, 2, 4), soft_weight=0.5, eval_prompts=8, drafter_seconds=180.0))
    # target: MLA (q_lora_rank 0 = one plain q projection)
    hidden_size: int = 256
    intermediate_size: int = 768          # the dense layers' MLP
    num_layers: int = 5
    num_heads: int = 4
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 48
    qk_rope_head_dim: int = 16
    v_head_dim: int = 64
    # routed experts: sigmoid scores + correction bias, top topk_group of n_group groups, weights renormalised
    num_experts: int = 32
    experts_per_token: int = 4
    moe_intermediate_size: int = 32
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    first_k_dense: int = 1
    routed_scaling: float = 2.5
    bias_update_rate: float = 1e-3        # γ of bias_e += γ·sign(mean load − load_e), every step (0: no update)
    target_seconds: float = 75.0
    # pool: fresh and large next to the drafter's training (docs/lab_pair.md)
    gen_len: int = 128
    gen_prefix_lens: tuple = (64, 96, 128, 160, 192)
    gen_batch: int = 4096
    gen_sequences: int = 262144
    gen_seconds: float = 25.0
    # INT4 copy and card
    int4_group: int = 32
    balance_windows: int = 64             # held-out windows of seq_len for the shipped target's load
    sampled_prompts: int = 16             # per set at T = 1
    int4_prompts: int = 8                 # per set, INT4 and bf16 side by side at T = 0
    union_prompts: int = 4                # per set, traced rounds for experts touched (router and uniform)
    card_device: str = "auto"             # where the card's engine runs (float32)

    def target_config(self, vocab: int, eos_id: int):
        from ...config import MlaConfig, RopeConfig, TargetConfig
        mla = MlaConfig(q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                        qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                        v_head_dim=self.v_head_dim)
        return TargetConfig(
            arch="deepseek_v3", vocab_size=vocab, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads, head_dim=mla.qk_head_dim,
            rms_norm_eps=1e-6, max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=True,
            rope=RopeConfig(theta=self.rope_theta), eos_token_id=[eos_id], mla=mla, num_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token, moe_intermediate_size=self.moe_intermediate_size,
            norm_topk_prob=True, scoring_func="sigmoid", n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling, n_shared_experts=self.n_shared_experts,
            first_k_dense_replace=self.first_k_dense)


PRESETS = {
    "lab-moe": {},
    # The CPU test: every stage in seconds (a stdlib subfolder, three layers, eight experts).
    "smoke": dict(corpus_root="json", heldout_per_mille=300, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                  num_experts=8, experts_per_token=2, moe_intermediate_size=32, n_group=4, topk_group=2,
                  seq_len=64, batch_size=8, warmup_steps=4, target_steps=8, eval_every=4, eval_windows=16,
                  gen_sequences=8, gen_batch=8, gen_len=32, gen_prefix_lens=(16, 24), drafter_layers=1,
                  drafter_intermediate=128, target_layer_ids=(0, 2), drafter_batch=4, anchors=4, drafter_warmup=4,
                  drafter_steps=8, eval_prompts=2, n_new=12, budgets=(4, 8), card_prompts=2, sampled_prompts=1,
                  int4_prompts=1, union_prompts=1, balance_windows=4),
}
STAGES = ("prepare", "target", "pool", "drafter", "pack", "unpack", "export", "int4", "card")


def make_config(preset: str = "lab-moe", **overrides) -> LabMoeConfig:
    return _resolve_root(_make_config(LabMoeConfig, PRESETS, preset, **overrides))


# ----------------------------------------------------------------------------- stages

def stage_prepare(cfg: LabMoeConfig, cache: Path) -> dict:
    """The lab corpus encoded with the lab pair's tokenizer, and the lab pair's prompt sets (read by the drafter's
    quick τ)."""
    ccfg = CorpusConfig(root=cfg.corpus_root, heldout_per_mille=cfg.heldout_per_mille, vocab_size=cfg.vocab_size,
                        max_files=cfg.max_files, tokenizer=str(LAB_TOKENIZER_DIR))
    meta = build_corpus(ccfg, cache, log=log)
    (cache / "prompts").mkdir(exist_ok=True)
    for f in sorted(LAB_PROMPT_DIR.glob("*.jsonl")):
        shutil.copy(f, cache / "prompts" / f.name)
    return meta


def make_int4_copy(target: Path, dest: Path, group_size: int) -> list[str]:
    """dest = target with its routed experts' linears INT4 pack-quantized (quant.write_int4_checkpoint: min-max
    scales per group of group_size along K, symmetric); -> the modules quantized."""
    from ...quant import write_int4_checkpoint
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(target, dest)
    done = write_int4_checkpoint(dest, [EXPERT_LINEARS], group_size=group_size, symmetric=True)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    log(f"int4: {len(done)} expert linears INT4 in groups of {group_size} -> {dest} ({size / 2**20:.2f} MiB)")
    return done


# ----------------------------------------------------------------------------- CLI

class _Tee:
    """stdout into a log file as well (a run folder keeps its log)."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()


def add_train_args(p):
    add_pipeline_args(p, PRESETS, "lab-moe: the shipped pair (GPU); smoke: every stage on the CPU in seconds", STAGES,
                      "prepare,target,pool,drafter,export,int4,card", WORK_DIR,
                      f"where export/card write the pair (default: {LAB_MOE_DIR})", "LabMoeConfig",
                      "target_seconds=90")
    p.add_argument("--cache", default=None, help="corpus cache: token arrays, tokenizer, prompts "
                                                 f"(default {CACHE_DIR}, or RUN_DIR/corpus)")
    p.add_argument("--run-dir", default=None,
                   help="one folder for everything a run makes: work/, pair/ (--out), target_int4/, log.txt")
    p.add_argument("--int4-dir", default=None, help="where int4 writes the INT4 copy and card reads it (default "
                   f"RUN_DIR/target_int4, else {cache_dir() / LAB_MOE_INT4_DIRNAME}: the lab-moe-int4 pair)")
    p.add_argument("--tidy", action="store_true", help="when every stage is done, delete what only a resumed run "
                   "needs (checkpoints, the pool) and the work dir's copies of the final weights")
    return p


def _paths(args) -> tuple[Path, Path, Path]:
    """(cache, out, int4 dir) from the command line; --run-dir puts them and the work dir in one folder."""
    run = Path(args.run_dir) if args.run_dir else None
    if run is not None:
        if args.work == WORK_DIR:
            args.work = str(run / "work")
    cache = Path(args.cache or (run / "corpus" if run else CACHE_DIR))
    out = Path(args.out) if args.out else (run / "pair" if run else LAB_MOE_DIR)
    int4 = Path(args.int4_dir or (run / "target_int4" if run else cache_dir() / LAB_MOE_INT4_DIRNAME))
    return cache, out, int4


def run_train_cli(args) -> int:
    if not args.run_dir:
        return _run(args)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    tee = sys.stdout = _Tee(sys.stdout, Path(args.run_dir) / "log.txt")
    try:
        return _run(args)
    finally:
        sys.stdout = tee.stream
        tee.file.close()


def _run(args) -> int:
    cache, out, int4 = _paths(args)
    cfg, stages, work = start_run(args, make_config, STAGES)
    _resolve_root(cfg)  # a --set corpus_root=<stdlib subfolder>
    device = pick_device(args.device)
    torch.manual_seed(cfg.seed)
    write_config(cfg, work)
    log(f"{TRAIN_LAB_MOE}: preset {cfg.preset}, stages {stages}, device {device}, work {work}, out {out}")

    def run_stage(s: str) -> bool:
        if s == "prepare":
            stage_prepare(cfg, cache)
        elif s == "target":
            stage_target(cfg, cache, work, device, monitor=RouterBalance(cfg.bias_update_rate))
        elif s == "pool":
            stage_pool(cfg, cache, work, device)
        elif s == "drafter":
            stage_drafter(cfg, cache, work, device)
        elif s == "export":
            stage_export(cfg, cache, work, out, prompts=False)  # the lab pair's prompt sets serve (pairs/__init__.py)
        elif s == "int4":
            if not has_library("compressed_tensors"):  # the run goes on: the card says the INT4 copy is missing
                log("int4: skipped, " + missing_library("the INT4 copy", "compressed-tensors"))
                return False
            make_int4_copy(out / "target", int4, cfg.int4_group)
        elif s == "card":
            from .card import stage_card
            stage_card(cfg, cache, work, out, int4)
        return True

    run_stages(stages, run_stage, force=args.force, work=work, pack_dir=args.pack_dir,
               pack_weights=lambda: {"target": torch.bfloat16, "drafter": torch.float32},
               products={"prepare": cache / "meta.json", "target": work / "target_final.safetensors",
                         "pool": work / "pool.npz", "drafter": work / "drafter_final.safetensors"},
               stale={"target": [work / "target_state.pt"], "drafter": [work / "drafter_state.pt"]})
    if args.tidy:  # resumable checkpoints, the pool, and the copies of what *_final.safetensors holds
        for f in [*(work / n for n in ("target_state.pt", "drafter_state.pt", "pool.npz", "target_best.safetensors")),
                  *work.glob("drafter_*.safetensors")]:
            if f.name != "drafter_final.safetensors":
                f.unlink(missing_ok=True)
    return 0


def main(argv=None) -> int:
    return cli_main(argv, TRAIN_LAB_MOE, "Train the lab-moe pair (DeepSeek-V3 target + DFlash drafter), its INT4 "
                    "copy and card.", add_train_args, run_train_cli)
