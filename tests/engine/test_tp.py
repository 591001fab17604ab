"""Tensor parallelism on the CPU: two processes (gloo), each holding half of every layer of the target, give
the tokens of the whole target (T = 0, greedy), for AR, DFlash and DDTree; a rank read from the checkpoint's
slices holds exactly the share of the whole target, and its load's peak memory is about that share; sizes that
do not split are refused."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import ddtree_lab as dl
from ddtree_lab import parallel
from ddtree_lab.checkpoint import load_target
from ddtree_lab.config import CheckpointError, MlaConfig
from ddtree_lab.testing import make_tiny_pair, tiny_target_config

PROMPT = [5, 17, 3, 99, 42, 7, 1, 64]
RUNS = [("ar", 1), ("dflash", 1), ("ddtree", 12), ("ddtree", 40)]


def _worker(rank: int, world: int, init_file: str, dirs, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    pair = dl.load_pair(target=dirs[0], drafter=dirs[1], tp=world)
    tokens = {f"{m}-{b}": dl.generate(pair, PROMPT, method=m, budget=b, max_new_tokens=24, stop=[]).tokens
              for m, b in RUNS}
    heads = _heads(pair.target)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"tokens": tokens, "heads": heads, "kv": list(pair.target.kv.shape)}, f)
    torch.distributed.destroy_process_group()


def _heads(target) -> int:
    blk = target.layers[0]
    return blk.qkv.n_heads if hasattr(blk, "qkv") else blk.self_attn.n_heads  # GQA or MLA


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_two_way_tensor_parallel_equals_one_process(tmp_path, arch):
    dirs = make_tiny_pair(tmp_path / "pair", arch=arch, seed=4, tokenizer=False)
    whole = dl.load_pair(target=dirs[0], drafter=dirs[1])
    want = {f"{m}-{b}": dl.generate(whole, PROMPT, method=m, budget=b, max_new_tokens=24, stop=[]).tokens
            for m, b in RUNS}
    out = str(tmp_path / "tokens")
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), dirs, out), nprocs=2, join=True,
                       start_method="spawn")
    got = [json.load(open(f"{out}.{r}")) for r in range(2)]
    for g in got:
        assert g["tokens"] == want  # every rank emits the whole target's tokens
        assert g["heads"] == _heads(whole.target) // 2  # each holds half the heads
        if arch == "deepseek_v3":  # the latent is every head's: each rank caches it whole
            assert g["kv"][2:] == [1, *whole.target.kv.shape[3:]] and whole.target.kv.shape[2] == 1
        else:
            assert g["kv"][2] == whole.target.kv.shape[2] // 2  # and half the KV cache


def test_sizes_that_do_not_split_are_refused():
    cfg = tiny_target_config()  # 4 query heads, 2 KV heads
    with pytest.raises(CheckpointError, match="tp=3 does not divide the target's num_attention_heads"):
        parallel.local_config(cfg, 3)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        parallel.init(2)


def _stack_experts(target_dir) -> None:
    """Rewrite a per-expert MoE checkpoint in transformers' stacked layout: experts.gate_up_proj [E, 2I, H]
    (each expert's gate rows, then its up rows) and experts.down_proj [E, H, I]."""
    path = target_dir / "model.safetensors"
    tensors = load_file(path)
    mlps = sorted({n.split(".experts.")[0] for n in tensors if ".experts." in n})
    for mlp in mlps:
        names = [n for n in tensors if n.startswith(mlp + ".experts.")]
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in names})
        take = [{p: tensors.pop(f"{mlp}.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")} for e in experts]
        tensors[f"{mlp}.experts.gate_up_proj"] = torch.stack([torch.cat([t["gate"], t["up"]]) for t in take])
        tensors[f"{mlp}.experts.down_proj"] = torch.stack([t["down"] for t in take])
    save_file(tensors, path)


SLICE_CASES = {  # arch, target overrides, experts stacked
    "qwen3": ("qwen3", {}, False),
    "llama-bias": ("llama", {"attention_bias": True}, False),
    "moe-per-expert": ("qwen3_moe", {}, False),
    "moe-stacked": ("qwen3_moe", {}, True),
    "deepseek": ("deepseek_v3", {}, False),
    "deepseek-plain-q": ("deepseek_v3", {"mla": MlaConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                                         qk_rope_head_dim=16, v_head_dim=24)}, False),
}


@pytest.mark.parametrize("case", list(SLICE_CASES) + ["deepseek-int4", "deepseek-int4-asymmetric"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_read_from_slices_equals_the_share_of_the_whole_target(tmp_path, case, dtype):
    arch, overrides, stacked = SLICE_CASES[case.split("-int4")[0]]
    target_dir, _ = make_tiny_pair(tmp_path, arch=arch, seed=2, tokenizer=False, **overrides)
    if stacked:
        _stack_experts(target_dir)
    if "int4" in case:  # experts written INT4 by compressed-tensors: their words, scales, zero points split too
        pytest.importorskip("compressed_tensors")
        from ddtree_lab.quant import write_int4_checkpoint

        write_int4_checkpoint(target_dir, targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"], group_size=8,
                              symmetric="asymmetric" not in case)
    whole = load_target(target_dir).to(dtype)  # the whole target in fp32, then cast: how a rank built it before
    for rank in range(2):
        want = parallel.make_parallel(whole, 2, rank)
        got = load_target(target_dir, dtype=dtype, tp=2, rank=rank)
        assert got.cfg == want.cfg and (got.tp, got.tp_rank) == (2, rank)
        assert all(blk.reduce is parallel.all_reduce_sum for blk in got.layers)
        mine, theirs = got.state_dict(), want.state_dict()
        assert list(mine) == list(theirs)
        for name, t in theirs.items():
            assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name  # bit for bit
        assert torch.equal(got.rotary.inv_freq, want.rotary.inv_freq)


def test_misshaped_split_tensor_named_with_its_whole_shape(tmp_path):
    target_dir, _ = make_tiny_pair(tmp_path, seed=2, tokenizer=False)
    path = target_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.o_proj.weight"  # [H, Hq·D] = [64, 64], split by columns
    tensors[name] = tensors[name][:, :-2].contiguous()
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(64, 62\), expected \(64, 64\)"):
        load_target(target_dir, tp=2, rank=1)


# Run in a fresh process: the growth of its peak RSS over the imports while it loads one rank's share, from the
# checkpoint's slices or by loading the whole target and sharding it. The peak is VmHWM, the high-water mark
# of this program's own memory: ru_maxrss would start from the RSS of the process that spawned it.
_PEAK_SCRIPT = """
import json, sys
import torch
from ddtree_lab import checkpoint, parallel

def peak_bytes():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

torch.set_num_threads(1)
directory, how, tp, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
baseline = peak_bytes()
if how == "slices":
    model = checkpoint.load_target(directory, tp=tp, rank=rank)
else:
    model = parallel.make_parallel(checkpoint.load_target(directory), tp, rank)
held = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak": peak_bytes() - baseline, "held": held}))
"""


def _load_peak(target_dir, how: str, tp: int, rank: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(target_dir), how, str(tp), str(rank)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc (Linux)")
def test_a_rank_peak_memory_is_about_its_share(tmp_path):
    # fp32, about 250 MB, nearly all of it in the split layers (the tied embedding is small)
    target_dir, _ = make_tiny_pair(tmp_path, seed=3, tokenizer=False, hidden_size=1024, intermediate_size=4096,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    whole_bytes = (target_dir / "model.safetensors").stat().st_size
    sliced = _load_peak(target_dir, "slices", tp=4, rank=3)
    sharded_whole = _load_peak(target_dir, "whole", tp=4, rank=3)
    assert sliced["held"] == sharded_whole["held"] < 0.3 * whole_bytes
    assert sliced["peak"] < 0.5 * whole_bytes, (sliced, whole_bytes)
    assert sharded_whole["peak"] > whole_bytes, (sharded_whole, whole_bytes)  # the bound tells the two apart
