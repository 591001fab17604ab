"""Tensor parallelism on the CPU: two processes (gloo), each holding half of every layer of the target, give
the tokens of the whole target (T = 0, greedy), for AR, DFlash and DDTree; sizes that do not split are refused."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import ddtree_lab as dl
from ddtree_lab import parallel
from ddtree_lab.config import CheckpointError
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
    heads = pair.target.layers[0].qkv.n_heads
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"tokens": tokens, "heads": heads, "kv": list(pair.target.kv.shape)}, f)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
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
        assert g["heads"] == whole.target.layers[0].qkv.n_heads // 2  # each holds half the heads
        assert g["kv"][2] == whole.target.kv.shape[2] // 2            # and half the KV cache


def test_sizes_that_do_not_split_are_refused():
    cfg = tiny_target_config()  # 4 query heads, 2 KV heads
    with pytest.raises(CheckpointError, match="tp=3 does not divide the target's num_attention_heads"):
        parallel.local_config(cfg, 3)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        parallel.init(2)
