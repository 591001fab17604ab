"""Shared fixtures: random tiny checkpoints written in the real on-disk formats."""
import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ddtree_lab as dl
from ddtree_lab.testing import make_tiny_pair

# Tiny models gain nothing from threads, and OpenMP threads stall badly when a core is busy elsewhere.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs):
    t, d = tiny_dirs
    return dl.load_pair(target=t, drafter=d)


@pytest.fixture(scope="session")
def tiny_llama_pair(tmp_path_factory):
    t, d = make_tiny_pair(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=3)
    return dl.load_pair(target=t, drafter=d)


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """Vocabulary of 8: trees of budget ≥ 72 hold every 2-token continuation, so rounds accept deep
    paths and the walk, KV compaction and drafter context are exercised at length."""
    t, d = make_tiny_pair(tmp_path_factory.mktemp("tiny_v8"), arch="qwen3", vocab_size=8, seed=5,
                          tokenizer=False)
    return dl.load_pair(target=t, drafter=d)


@pytest.fixture
def use_options():
    """Set engine options (ddtree_lab/options.py) for one test: use_options(tree_kernels="torch"); restored after."""
    from ddtree_lab import options

    previous = options.current()
    yield lambda **choices: options.replace(**choices)
    options.restore(previous)
