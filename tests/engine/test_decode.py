"""Losslessness, sampling correctness, τ accounting and the drafter cache."""
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.attention import TreeMask, static_cache, tree_attention
from ddtree_lab.testing import exact_first_tokens

PROMPTS = {1: [7], 5: [3, 9, 27, 81, 243], 23: [(i * 37 + 11) % 290 for i in range(23)]}


@pytest.mark.parametrize("prompt_len", [1, 5, 23])
def test_greedy_ddtree_and_dflash_equal_ar(tiny_pair, prompt_len):
    prompt = PROMPTS[prompt_len]
    ar = dl.generate(tiny_pair, prompt, method="ar", max_new_tokens=48, stop=[])
    assert len(ar.tokens) == 48
    runs = [("dflash", 1, None)] + [("ddtree", b, k) for b in (1, 2, 7, 64, 256) for k in (None, 1, 4)]
    for method, budget, topk in runs:
        res = dl.generate(tiny_pair, prompt, method=method, budget=budget, topk=topk, max_new_tokens=48, stop=[])
        assert res.tokens == ar.tokens, (method, budget, topk)


def test_greedy_llama_and_deep_acceptance(tiny_llama_pair, small_vocab_pair):
    ar = dl.generate(tiny_llama_pair, [5, 6, 7], method="ar", max_new_tokens=40, stop=[])
    for b in (7, 64):
        assert dl.generate(tiny_llama_pair, [5, 6, 7], budget=b, max_new_tokens=40, stop=[]).tokens == ar.tokens
    # vocabulary of 8: wide trees accept several tokens per round, exercising compaction at length
    ar = dl.generate(small_vocab_pair, [1, 2, 3], method="ar", max_new_tokens=80, stop=[])
    for b, k in ((72, None), (256, None), (600, 8), (1024, None)):
        res = dl.generate(small_vocab_pair, [1, 2, 3], budget=b, topk=k, max_new_tokens=80, stop=[])
        assert res.tokens == ar.tokens, b
        assert min(res.acceptance_lengths[:-1]) >= 2 and res.mean_acceptance >= 3.0


@pytest.mark.parametrize("method,budget", [("ar", 1), ("dflash", 1), ("ddtree", 7), ("ddtree", 300)])
def test_tau_accounting_and_paths(small_vocab_pair, method, budget):
    for max_new in (1, 2, 17, 50):
        res = dl.generate(small_vocab_pair, [4, 4, 2], method=method, budget=budget, max_new_tokens=max_new,
                          stop=[])
        assert len(res.tokens) == max_new
        assert 1 + sum(res.acceptance_lengths) - res.trimmed == len(res.tokens)
        assert 0 <= res.trimmed < max(res.acceptance_lengths, default=1)
        emitted = [res.tokens[0]]
        for r in res.rounds:
            assert r.accepted[0] == 0 and r.root_token == emitted[-1]
            if r.tree is not None:  # a root path: each accepted node's parent is the previous one
                for prev, node in zip(r.accepted, r.accepted[1:]):
                    assert int(r.tree.parents[node - 1]) == prev
                assert r.accepted_tokens == [int(r.tree.tokens[i - 1]) for i in r.accepted[1:]]
            emitted += r.accepted_tokens + [r.next_token]
        assert emitted[:max_new] == res.tokens


def test_stop_token_ends_generation(tiny_pair):
    ar = dl.generate(tiny_pair, [3, 4, 5], method="ar", max_new_tokens=30, stop=[])
    stop_tok = ar.tokens[10]
    first = ar.tokens.index(stop_tok)
    for method in ("ar", "ddtree"):
        res = dl.generate(tiny_pair, [3, 4, 5], method=method, max_new_tokens=30, stop=[stop_tok])
        assert res.tokens == ar.tokens[: first + 1] and res.stop_reason == "stop_token"


def test_host_read_lag_defaults_to_one_on_cuda_only(monkeypatch, use_options):
    from ddtree_lab import decode
    use_options(host_read_lag=None)
    assert decode.host_read_lag("cuda") == 1 and decode.host_read_lag("cpu") == 0
    assert decode.host_read_lag("cuda", trace=True) == 0 == decode.host_read_lag("cuda", profile=True)
    use_options(host_read_lag=2)
    assert decode.host_read_lag("cpu") == 2 == decode.host_read_lag("cuda:0")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (the pinned asynchronous read); the cpu case runs the loop"))])
@pytest.mark.parametrize("lag,sync_every", [(1, 1), (2, 1), (1, 3), (0, 3)])
def test_lagged_host_reads_give_the_same_result(tiny_dirs, monkeypatch, lag, sync_every, device, use_options):
    """On a GPU the host reads the tokens one step behind while the next round runs; the rounds
    queued past the stop are computed and discarded. Same tokens, same counted rounds and τ."""
    from ddtree_lab import decode

    tiny_pair = dl.load_pair(target=tiny_dirs[0], drafter=tiny_dirs[1], device=device)

    ar = dl.generate(tiny_pair, [3, 4, 5], method="ar", max_new_tokens=30, stop=[])
    stop_tok = ar.tokens[10]
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 6)):
        for max_new, stop in ((1, []), (9, []), (30, [stop_tok])):
            use_options(host_read_lag=0)
            want = dl.generate(tiny_pair, [3, 4, 5], method=method, budget=budget, max_new_tokens=max_new,
                               stop=stop, trace=False)
            use_options(host_read_lag=lag)
            got = dl.generate(tiny_pair, [3, 4, 5], method=method, budget=budget, max_new_tokens=max_new,
                              stop=stop, trace=False, sync_every=sync_every)
            assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
            assert got.acceptance_lengths == want.acceptance_lengths, (method, max_new, stop)
            assert 1 + sum(got.acceptance_lengths) - got.trimmed == len(got.tokens)
            assert got.stage_seconds["verify"] > 0 or max_new == 1
    # the length limit is foreseen (a round adds one token at least): AR queues no round past it.
    # Counted on the eager loop: a replayed CUDA graph never calls ar_step.
    calls = []
    monkeypatch.setattr(decode.RoundProgram, "ar_step", lambda self, _real=decode.RoundProgram.ar_step:
                        calls.append(1) or _real(self))
    dl.generate(tiny_pair, [3, 4, 5], method="ar", max_new_tokens=9, stop=[], trace=False, sync_every=sync_every,
                cuda_graphs=False)
    assert len(calls) == -(-8 // sync_every) * sync_every


def chi2_pvalue(counts, expected_probs):
    from scipy.stats import chisquare

    n = counts.sum()
    return chisquare(counts.double().numpy(), (expected_probs * n).numpy()).pvalue


@pytest.mark.parametrize("method,budget", [("ddtree", 12), ("ddtree", 200), ("dflash", 1), ("ar", 1),
                                           ("ddtree", dl.AutoBudget((2, 12, 200), costs=(1.0, 1.05, 1.1)))])
def test_sampling_matches_target_distribution(small_vocab_pair, method, budget):
    torch.manual_seed(0)
    prompt = [1, 5, 2]
    joint, p3 = exact_first_tokens(small_vocab_pair, prompt)
    N = 1200
    c12, c3 = torch.zeros(64), torch.zeros(8)
    with torch.inference_mode():
        for seed in range(N):
            t = dl.generate(small_vocab_pair, prompt, method=method, budget=budget, max_new_tokens=3,
                            temperature=1.0, seed=seed, trace=False, stop=[]).tokens
            c12[t[0] * 8 + t[1]] += 1
            c3[t[2]] += 1
    assert chi2_pvalue(c12, joint.flatten()) > 1e-3
    assert chi2_pvalue(c3, p3) > 1e-3


def test_sampling_reproducible_for_a_seed(tiny_pair):
    a = dl.generate(tiny_pair, [3, 4], budget=16, max_new_tokens=24, temperature=0.8, seed=11, stop=[])
    b = dl.generate(tiny_pair, [3, 4], budget=16, max_new_tokens=24, temperature=0.8, seed=11, stop=[])
    c = dl.generate(tiny_pair, [3, 4], budget=16, max_new_tokens=24, temperature=0.8, seed=12, stop=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens


@pytest.mark.parametrize("window", [None, 6])
def test_cached_drafter_equals_recomputed(small_vocab_pair, window):
    """Every round, the cached drafter's block equals a from-scratch pass over all committed context."""
    drafter = small_vocab_pair.drafter
    features, checked = [], []
    append, draft = drafter.append_context, drafter.draft

    def append_spy(hidden, positions, count=None):
        keep = positions.shape[0] if count is None else int(count)
        features.append((hidden[:keep].clone(), positions[:keep].clone()))
        return append(hidden, positions, count)

    def draft_spy(x, positions):
        got = draft(x, positions)
        hidden = torch.cat([f for f, _ in features])
        pos = torch.cat([p for _, p in features])
        if window is not None:
            hidden, pos = hidden[-window:], pos[-window:]
        ctx = drafter.project_context(hidden)[None]
        want = drafter(x[None], positions[None], ctx, pos[None])[0]
        assert torch.allclose(got, want, atol=1e-5)
        checked.append(1)
        return got

    drafter.append_context, drafter.draft = append_spy, draft_spy
    try:
        dl.generate(small_vocab_pair, [1, 2, 3, 4], budget=100, max_new_tokens=40, stop=[], draft_window=window)
    finally:
        drafter.append_context, drafter.draft = append, draft
    assert len(checked) >= 5


def test_text_prompt_and_trace_json(tiny_pair):
    res = dl.generate(tiny_pair, "def add(a, b):", budget=8, max_new_tokens=12, stop=[])
    assert res.prompt_tokens == tiny_pair.encode("def add(a, b):")
    assert isinstance(res.text, str) and len(res.tokens) == 12
    import json

    line = json.dumps(res.rounds[0].to_json())
    back = dl.RoundTrace.from_json(json.loads(line))
    assert back.accepted == res.rounds[0].accepted and torch.equal(back.tree.tokens, res.rounds[0].tree.tokens)
    assert set(res.stage_seconds) == {"draft", "tree_build", "verify", "commit", "other"}
    assert sum(res.stage_seconds.values()) == pytest.approx(res.wall_seconds, rel=0.05)


@pytest.mark.parametrize("prompt_len", [1, 5, 63, 64, 65])
def test_padded_prefill_gives_the_same_tokens(tiny_dirs, monkeypatch, prompt_len):
    """On a GPU the prompt runs padded to a multiple of PREFILL_BUCKET (one graph per length where graphs run).
    Here the padded forward runs eagerly: the padding's K/V and drafter context must never be read."""
    from ddtree_lab import decode, graphs

    pair = dl.load_pair(target=tiny_dirs[0], drafter=tiny_dirs[1])
    prompt = [(7 * i + 3) % 50 + 2 for i in range(prompt_len)]
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 9)):
        want = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=20, stop=[])
        with monkeypatch.context() as m:
            m.setattr(decode, "padded_prefill", lambda device, target: True)
            got = dl.generate(pair, prompt, method=method, budget=budget, max_new_tokens=20, stop=[])
        assert got.tokens == want.tokens, method
        assert got.acceptance_lengths == want.acceptance_lengths, method
    # the state the rounds start from: logits of the last prompt token, target K/V and drafter context of
    # the prompt's n positions (the rest are scratch)
    with torch.inference_mode():  # as generate runs
        layers = pair.drafter.cfg.target_layer_ids
        pair.target.setup_cache(256)
        pair.drafter.setup_cache(256)
        n, ids = prompt_len, torch.tensor(prompt)
        logits, hidden = pair.target(ids, torch.arange(n), 0, TreeMask.causal(n, "cpu"), layers,
                                     logits_rows=torch.tensor([n - 1]))
        pair.drafter.append_context(hidden, torch.arange(n))
        want_state = (logits.clone(), pair.target.kv[..., :n, :].clone(), pair.drafter.kv[..., :n, :].clone(),
                      int(pair.drafter.ctx_len))
        pair.target.kv.normal_()  # the padded prefill must overwrite what it needs
        pair.drafter.kv.normal_()
        pair.drafter.ctx_len.zero_()
        padded = graphs.prefill_for(pair, n, layers, True)
        assert padded.tokens.shape[0] == -(-n // graphs.PREFILL_BUCKET) * graphs.PREFILL_BUCKET
        got_state = (padded.run(prompt), pair.target.kv[..., :n, :], pair.drafter.kv[..., :n, :], int(pair.drafter.ctx_len))
        for want_t, got_t in zip(want_state[:3], got_state[:3]):
            torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5)
        assert got_state[3] == want_state[3] == n


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_reused_pair_samples_at_the_temperature_asked(tiny_dirs, method):
    """A kept round program must not carry the last call's temperature: T = 5, then T = 0.01 on one
    pair equals T = 0.01 on a fresh pair (the cache once keyed on `temperature > 0`)."""
    t, d = tiny_dirs
    reused = dl.load_pair(target=t, drafter=d)
    kw = dict(method=method, budget=8, max_new_tokens=24, seed=3, stop=[], trace=False)
    hot = dl.generate(reused, [3, 4, 5], temperature=5.0, **kw)
    cold = dl.generate(reused, [3, 4, 5], temperature=0.01, **kw)
    fresh = dl.generate(dl.load_pair(target=t, drafter=d), [3, 4, 5], temperature=0.01, **kw)
    assert cold.tokens == fresh.tokens and cold.settings["temperature"] == 0.01
    assert hot.tokens != fresh.tokens  # T = 5 really sampled otherwise: the check above can fail


def test_reused_pair_follows_the_draft_window(small_vocab_pair, tiny_dirs):
    """The draft window is part of the kept program's key too (a captured graph keeps the value)."""
    t, d = tiny_dirs
    reused = dl.load_pair(target=t, drafter=d)
    kw = dict(budget=16, max_new_tokens=24, stop=[], trace=False)
    dl.generate(reused, [3, 4, 5], draft_window=2, **kw)
    again = dl.generate(reused, [3, 4, 5], draft_window=None, **kw)
    fresh = dl.generate(dl.load_pair(target=t, drafter=d), [3, 4, 5], draft_window=None, **kw)
    assert again.tokens == fresh.tokens and again.acceptance_lengths == fresh.acceptance_lengths


def test_the_cache_keeps_the_tree_room_apart_from_the_attention_bound(tiny_pair):
    # A larger budget (or auto's largest candidate) widens the cache's tree room only: the committed context's
    # room, which bounds the attention kernels' split launch, is the same, so a budget-32 verify is launched
    # alike in both and emits the same tokens (test_result_does_not_depend_on_cache_size covers the bits).
    prompt, seen = [3, 4, 5, 6, 7], {}
    for name, budget in (("32", 32), ("auto(32, 256)", dl.AutoBudget(budgets=(32, 256))), ("256", 256)):
        res = dl.generate(tiny_pair, prompt, budget=budget, max_new_tokens=40, stop=[])
        seen[name] = (tiny_pair.target.max_past, tiny_pair.target.cache_len, res.tokens)
    (room, small, tokens), (auto_room, auto_len, auto_tokens) = seen["32"], seen["auto(32, 256)"]
    assert room == auto_room == seen["256"][0] and room >= len(prompt) + 40
    assert small >= room + 33 and auto_len >= room + 257 and seen["256"][1] >= room + 257  # and the largest tree
    assert tiny_pair.drafter.max_past == room
    assert auto_tokens == tokens == seen["256"][2]  # greedy: every budget emits the target's own tokens


def test_the_cache_only_grows_so_alternating_runs_keep_their_programs(tiny_pair):
    # A bench or a study alternates budgets (and prompt lengths): were the cache sized anew for each call, it
    # would move, and every round program kept on its address would be made (on a GPU: captured) again.
    prompts, kw = ([3, 4, 5], list(range(3, 300))), dict(max_new_tokens=24, stop=[], trace=False)
    first = {}
    for _ in range(2):
        for prompt in prompts:
            for budget in (8, 128):
                res = dl.generate(tiny_pair, prompt, budget=budget, **kw)
                assert res.tokens == first.setdefault((len(prompt), budget), res.tokens)
        kv, ctx, programs = tiny_pair.target.kv, tiny_pair.drafter.kv, dict(tiny_pair.__dict__["_programs"])
    # the first pass grew the cache to the long prompt's room and the large tree's; from then on nothing moves
    for prompt in prompts:
        for budget in (8, 128):
            dl.generate(tiny_pair, prompt, budget=budget, **kw)
    assert tiny_pair.target.kv is kv and tiny_pair.drafter.kv is ctx
    assert tiny_pair.__dict__["_programs"] == programs
    assert tiny_pair.target.cache_len >= tiny_pair.target.max_past + 129  # a short prompt keeps the long one's room


def test_kept_entries_bound_to_a_replaced_cache_are_released():
    """Graphs pin device memory: once a cache grows (a new tensor), what was kept on the old one can never run
    again, so making the next entry releases it; entries on the caches held stay, and are found again."""
    from types import SimpleNamespace

    from ddtree_lab.graphs import kept

    pair = SimpleNamespace(target=SimpleNamespace(kv=torch.zeros(2, 8)),
                           drafter=SimpleNamespace(kv=torch.zeros(2, 4), ctx_len=torch.zeros(1)))
    released = []

    def keep(key, with_drafter=True):
        return kept(pair, "_things", (key,), with_drafter, lambda: object(), released.append)

    a, b = keep("a"), keep("b", with_drafter=False)
    assert keep("a") is a and released == []
    pair.drafter.kv = torch.zeros(2, 16)  # the drafter's cache grew: "a" was bound to the old one, "b" was not
    c = keep("c")
    assert released == [a] and keep("b", with_drafter=False) is b and keep("c") is c
    pair.target.kv = torch.zeros(2, 32)
    keep("a")
    assert released == [a, b, c] and len(pair._things) == 1


def test_release_kept_drops_every_kind_at_once(tiny_pair):
    """graphs.release_kept (between bench e2e --variants' choices): every program and prefill kept on the pair is
    released, each by its own kind's release, and the next run makes its own again with the same tokens."""
    from ddtree_lab.graphs import release_kept

    want = dl.generate(tiny_pair, [3, 1, 4], budget=6, max_new_tokens=8, stop=[]).tokens
    kinds = [k for k in tiny_pair.__dict__.get("_kept_release", {}) if tiny_pair.__dict__.get(k)]
    assert "_programs" in kinds
    release_kept(tiny_pair)
    assert all(not tiny_pair.__dict__[k] for k in kinds)
    assert dl.generate(tiny_pair, [3, 1, 4], budget=6, max_new_tokens=8, stop=[]).tokens == want
    assert tiny_pair.__dict__["_programs"]


def test_a_static_cache_grows_along_its_slots_only():
    held = static_cache(None, (2, 2, 3, 64, 8), "cpu", torch.float32)
    assert static_cache(held, (2, 2, 3, 40, 8), "cpu", torch.float32) is held      # fewer slots: kept
    grown = static_cache(held, (2, 2, 3, 65, 8), "cpu", torch.float32)
    assert grown is not held and grown.shape[3] == 65                            # more: a new one
    for other in ((2, 2, 4, 40, 8), (2, 2, 3, 40, 16), (3, 2, 3, 40, 8)):          # heads, head size, layers
        assert static_cache(grown, other, "cpu", torch.float32).shape == other
    assert static_cache(grown, (2, 2, 3, 40, 8), "cpu", torch.float64).dtype == torch.float64
    with torch.inference_mode():
        inference = static_cache(None, (1, 2, 1, 16, 4), "cpu", torch.float32)
        assert static_cache(inference, (1, 2, 1, 8, 4), "cpu", torch.float32) is inference
    again = static_cache(inference, (1, 2, 1, 8, 4), "cpu", torch.float32)      # outside: it could not be written
    assert again is not inference and not again.is_inference()


def test_fixed_shape_sdpa_reads_up_to_the_bound_only():
    # The bound leaves out slots no query can see: the same result as attending the whole (masked) cache.
    gen = torch.Generator().manual_seed(3)
    Hq, Hkv, T, D, past, S = 4, 2, 5, 16, 11, 200
    q = torch.randn(Hq, T, D, generator=gen)
    k, v = torch.randn(Hkv, S, D, generator=gen), torch.randn(Hkv, S, D, generator=gen)
    anc = torch.tril(torch.ones(T, T, dtype=torch.bool))
    anc[3, 1:3] = False
    past_t = torch.tensor([past])
    bounded = tree_attention(q, k, v, past_t, TreeMask(anc), "sdpa", max_past=past + 3)
    whole = tree_attention(q, k, v, past_t, TreeMask(anc), "sdpa")
    eager = tree_attention(q, k, v, past, TreeMask(anc), "sdpa")
    torch.testing.assert_close(bounded, whole)
    torch.testing.assert_close(bounded, eager)
    k[:, past + 3 + T:], v[:, past + 3 + T:] = float("nan"), float("nan")  # past the bound: never read
    assert not tree_attention(q, k, v, past_t, TreeMask(anc), "sdpa", max_past=past + 3).isnan().any()


def test_round_times_give_each_counted_round_its_stage_times_untraced(tiny_pair):
    """generate(round_times=True): one dict per counted round with every stage, as the clock timed the rounds;
    nothing else changes, and without it there is none."""
    from ddtree_lab.names import STAGES

    for method, budget in (("ar", None), ("ddtree", 6)):
        plain = dl.generate(tiny_pair, [3, 4, 5], method=method, budget=budget, max_new_tokens=20, stop=[], trace=False)
        timed = dl.generate(tiny_pair, [3, 4, 5], method=method, budget=budget, max_new_tokens=20, stop=[],
                            trace=False, round_times=True)
        assert plain.round_stage_seconds is None and "round_stage_seconds" not in plain.to_json()
        assert timed.tokens == plain.tokens and timed.acceptance_lengths == plain.acceptance_lengths
        per_round = timed.round_stage_seconds
        assert len(per_round) == len(timed.acceptance_lengths) and all(list(r) == list(STAGES) for r in per_round)
        assert all(r["verify"] > 0 and (r["draft"] > 0) == (method != "ar") for r in per_round)
        for stage in ("draft", "tree_build", "verify", "commit"):  # the call's stage totals are these rounds'
            assert timed.stage_seconds[stage] == pytest.approx(sum(r[stage] for r in per_round))
        assert timed.to_json()["round_stage_seconds"] == per_round
    traced = dl.generate(tiny_pair, [3, 4, 5], budget=6, max_new_tokens=20, stop=[], round_times=True)
    assert [r.stage_seconds for r in traced.rounds] == [
        {k: v for k, v in r.items() if k in t.stage_seconds} for r, t in zip(traced.round_stage_seconds, traced.rounds)]
