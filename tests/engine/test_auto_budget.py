"""budget="auto" in the engine: lossless, the tree of each chosen budget, the device's choice followed, the
kernel path equal to the torch path, and its input refused where it cannot run."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.auto_budget import source_round  # noqa: E402
from ddtree_lab.prompts import read_prompt_set  # noqa: E402

PROMPT = [3, 9, 27, 81, 243]
CHEAP = dl.AutoBudget(budgets=(1, 7, 64), costs=(1e-3, 1.1e-3, 1.3e-3))


@pytest.mark.parametrize("trace,sync_every", [(True, 1), (False, 1), (False, 3)])
def test_auto_equals_ar_and_runs_the_proposed_budgets(tiny_pair, trace, sync_every):
    ar = dl.generate(tiny_pair, PROMPT, method="ar", max_new_tokens=48, stop=[])
    for budget in ("auto", CHEAP):
        res = dl.generate(tiny_pair, PROMPT, budget=budget, max_new_tokens=48, stop=[], trace=trace,
                          sync_every=sync_every)
        assert res.tokens == ar.tokens
        assert len(res.round_budgets) == len(res.acceptance_lengths)
        allowed = dl.AutoBudget().budgets if budget == "auto" else CHEAP.budgets
        assert set(res.round_budgets) <= set(allowed)
        assert res.settings["budget"] == "auto" and res.settings["auto"]["budgets"] == list(allowed)
        if trace:
            assert [r.budget for r in res.rounds] == res.round_budgets
            assert all(len(r.tree) <= r.budget for r in res.rounds)


def test_each_round_runs_the_proposal_read_before_it(tiny_pair):
    """The host runs, at round r, the device's proposal after round source_round(r) (the first proposal before
    any read); the proposals are read back from the device's ring."""
    res = dl.generate(tiny_pair, PROMPT, budget=CHEAP, max_new_tokens=40, stop=[], trace=True)
    emitted = 1 + sum(res.acceptance_lengths)
    programs, _, state = next(v for k, v in tiny_pair._auto_programs.items()
                              if k[1] == CHEAP.key() and int(v[0][-1].out_len) == emitted)
    ring = state.proposals[1:].tolist()
    # one copy reads the tokens and the proposals: they follow the tokens in the owner's read-back buffer,
    # which every candidate's program shares
    owner = programs[-1]
    assert state.proposals.data_ptr() == owner.readback[1 + owner.out.shape[0]:].data_ptr()
    assert all(p.readback is owner.readback and p.out_len.data_ptr() == owner.readback.data_ptr() for p in programs)
    for r, budget in enumerate(res.round_budgets):
        src = source_round(r, 0, 1)  # traced: every round read before the next
        if src >= 0:
            assert budget == CHEAP.budgets[ring[src]]


def test_cost_steers_the_choice(tiny_pair):
    """Budgets the cost table prices out are left once tried; when they cost the same as the smallest, the
    largest budget (which accepts at least as much) takes over."""
    pricey = dl.AutoBudget(budgets=(1, 64), costs=(1e-3, 1.0))
    flat = dl.AutoBudget(budgets=(1, 64), costs=(1e-3, 1e-3))
    for _ in range(3):
        a = dl.generate(tiny_pair, PROMPT, budget=pricey, max_new_tokens=40, stop=[], trace=False)
        b = dl.generate(tiny_pair, PROMPT, budget=flat, max_new_tokens=40, stop=[], trace=False)
    assert a.round_budgets.count(1) >= len(a.round_budgets) - 1
    assert b.round_budgets.count(64) >= len(b.round_budgets) - 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors reach the kernel only under the interpreter; "
                    "on a GPU, test_auto_in_cuda_graphs_equals_ar runs the compiled kernel")
def test_kernel_path_equals_torch_path(tiny_pair, use_options):
    runs = {}
    for kernels in ("torch", "triton"):
        use_options(tree_kernels=kernels)
        # the options are part of the programs' key: each path starts from its own fresh table
        res = [dl.generate(tiny_pair, PROMPT, budget=CHEAP, max_new_tokens=12, stop=[], trace=False) for _ in range(2)]
        runs[kernels] = [(r.tokens, r.round_budgets) for r in res]
    assert runs["torch"] == runs["triton"]


def test_measured_costs_grow_with_the_budget(tiny_pair):
    res = dl.generate(tiny_pair, PROMPT, budget=dl.AutoBudget(budgets=(1, 1024)), max_new_tokens=8, stop=[])
    costs = res.settings["auto"]["costs"]
    assert res.settings["auto"]["costs_measured"] and 0 < costs[0] < costs[1]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(method="ar", budget="auto"), "DDTree budgets"),
    (dict(method="dflash", budget="auto"), "DDTree budgets"),
    (dict(budget="best"), "'auto'"),
])
def test_auto_refused_where_it_cannot_run(tiny_pair, kwargs, needle):
    kwargs = dict(kwargs)
    with pytest.raises(ValueError) as err:
        budget = kwargs.pop("budget")
        dl.generate(tiny_pair, PROMPT, budget=budget, max_new_tokens=4, **kwargs)
    assert needle is None or needle in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU; the CPU twin is "
                    "test_kernel_path_equals_torch_path (the same kernel under the interpreter, eager)")
@pytest.mark.parametrize("trace", [True, False])
def test_auto_in_cuda_graphs_equals_ar(trace):
    pair = dl.load_pair("lab", device="cuda", dtype="float32", attention="triton")
    prompts = ["def quicksort(items):"] + [p["prompt"] for p in read_prompt_set("lab:code", 6)]
    ars = [dl.generate(pair, p, method="ar", max_new_tokens=64, stop=[]).tokens for p in prompts]
    for kept in ("_auto_programs", "_auto_learned"):  # a fresh table, which tries the larger candidates
        pair.__dict__.pop(kept, None)
    auto = dl.AutoBudget(budgets=(16, 32, 64))
    ran = set()
    for _ in range(3):  # captured once, replayed after
        for prompt, ar in zip(prompts, ars):
            res = dl.generate(pair, prompt, budget=auto, max_new_tokens=64, stop=[], trace=trace)
            assert res.tokens == ar and res.settings["cuda_graphs"]
            assert set(res.round_budgets) <= set(auto.budgets)
            ran |= set(res.round_budgets)
    assert len(ran) > 1  # the candidates' graphs alternated over one decoding state
    costs = res.settings["auto"]["costs"]
    assert res.settings["auto"]["costs_measured"] and all(0 < c < 0.1 for c in costs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph memory pools exist on a GPU only")
def test_candidates_in_one_shared_pool_equal_a_pool_each(use_options):
    """options.candidate_pools="shared": every candidate's graphs go into the first candidate's memory pool (they
    never run at once); the same tokens as a pool each, kept apart from those programs."""
    pair = dl.load_pair("lab", device="cuda", dtype="float32", attention="triton")
    prompt = "def quicksort(items):"
    auto = dl.AutoBudget(budgets=(8, 16, 32))
    ar = dl.generate(pair, prompt, method="ar", max_new_tokens=48, stop=[]).tokens
    runners = {}
    for pools in ("each", "shared"):
        use_options(candidate_pools=pools)
        kept = set(pair.__dict__.get("_auto_programs", {}))
        for _ in range(2):
            assert dl.generate(pair, prompt, budget=auto, max_new_tokens=48, stop=[]).tokens == ar
        new = [v for k, v in pair._auto_programs.items() if k not in kept]
        assert len(new) == 1  # programs of their own: the option is part of the key
        runners[pools] = new[0][1]
    each, shared = runners["each"], runners["shared"]
    assert all(r.pool_of is None for r in each) and len({r.pool for r in each}) == 3
    assert shared[0].pool_of is None and all(r.pool_of is shared[0] for r in shared[1:])
    assert len({r.pool for r in shared}) == 1 and shared[0].pool not in {r.pool for r in each}


def test_candidate_pools_is_a_checked_option():
    from ddtree_lab import options

    with pytest.raises(ValueError, match="candidate_pools='one' is not one of each, shared"):
        with options.using(candidate_pools="one"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the update's own stream exists on a GPU only; the CPU "
                    "twin is test_kernel_path_equals_torch_path (the same kernel under the interpreter, in order)")
def test_update_beside_the_commit_equals_the_torch_rule(use_options):
    """In CUDA graphs the kernel's update runs on a forked stream beside the KV compaction; the rounds it chooses
    (given costs, so no timing enters) are those of the torch rule run in order on the commit's own stream."""
    pair = dl.load_pair("lab", device="cuda", dtype="float32", attention="triton")
    prompts = [p["prompt"] for p in read_prompt_set("lab:code", 4)]
    auto = dl.AutoBudget(budgets=(16, 32, 64), costs=(1.0e-3, 1.04e-3, 1.12e-3))
    runs = {}
    for kernels in ("torch", "triton"):
        use_options(tree_kernels=kernels)  # part of the programs' and the table's key: each starts afresh
        runs[kernels] = [(r.tokens, r.round_budgets) for r in (
            dl.generate(pair, p, budget=auto, max_new_tokens=64, stop=[], trace=False) for p in prompts * 2)]
    assert runs["torch"] == runs["triton"]
    assert len({b for _, budgets in runs["triton"] for b in budgets}) > 1


def test_auto_runs_without_triton():
    """budget="auto" on a machine without Triton (`pip install -e .` alone): the torch rule, no import of the
    kernel module. A fresh process, so that Triton can be made unimportable before anything loads it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import ddtree_lab as dl\n"
            "pair = dl.load_pair('lab')\n"
            "auto = dl.generate(pair, 'def add(a, b):', budget='auto', max_new_tokens=12)\n"
            "ar = dl.generate(pair, 'def add(a, b):', method='ar', max_new_tokens=12)\n"
            "assert auto.tokens == ar.tokens and auto.round_budgets, (auto.tokens, ar.tokens)\n"
            "assert 'ddtree_lab.kernels.auto_budget' not in sys.modules\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
