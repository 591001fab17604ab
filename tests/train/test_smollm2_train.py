"""SmolLM2 drafter training: held-out prompts never trained on, padded batched generation, the whole
pipeline with --preset tiny (a tiny random Llama target) on the CPU, and pack/unpack."""
import json

import pytest
import torch

from ddtree_lab.smollm2 import PROMPT_SETS, load_prompts, train_prompts


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # OpenMP threads stall when the cores are shared


def test_training_prompts_distinct_and_not_heldout():
    rows = train_prompts.build(6000, seed=0)
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts) == 6000
    norm = {train_prompts.normalise(t) for t in texts}
    assert len(norm) == 6000
    heldout = [m["content"] for s in PROMPT_SETS for r in load_prompts(s) for m in r["messages"]]
    assert len(heldout) >= 90
    assert not set(texts) & set(heldout)
    assert not norm & {train_prompts.normalise(t) for t in heldout}
    kinds = {r["kind"] for r in rows}
    assert kinds == {"chat", "code", "math", "reasoning"}
    assert all(sum(r["kind"] == k for r in rows) >= 500 for k in kinds)
    assert train_prompts.build(50, seed=0) == rows[:50]  # deterministic, a prefix of the larger set
    assert train_prompts.build(50, seed=1) != rows[:50]


def test_prompt_versions():
    """Version 1 stays what made the shipped pool; version 2 adds kinds of request, under the same rules."""
    import hashlib
    assert hashlib.sha256(json.dumps(train_prompts.build(2000, seed=0)).encode()).hexdigest()[:16] == "f92dff371a0c9830"
    rows = train_prompts.build(8000, seed=0, version=2)
    texts = [train_prompts.normalise(r["messages"][0]["content"]) for r in rows]
    assert len(set(texts)) == 8000 and not set(texts) & train_prompts.heldout_messages()
    assert {r["kind"] for r in rows} == {"chat", "code", "math", "reasoning"}
    joined = " ".join(r["messages"][0]["content"] for r in rows)
    assert "SQL query" in joined and "email" in joined and "git " in joined  # the new kinds are drawn
    assert train_prompts.build(50, seed=0, version=2) == rows[:50]
    with pytest.raises(ValueError, match="prompt version 3"):
        train_prompts.build(5, version=3)


def test_left_padded_generation_equals_alone(tmp_path):
    from ddtree_lab.checkpoint import load_target
    from ddtree_lab.lab.dflash import greedy_extend
    from ddtree_lab.testing import make_tiny_pair
    tdir, _ = make_tiny_pair(tmp_path, arch="llama", tokenizer=False)
    t = load_target(tdir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g) for n in (5, 9, 7)]
    P = 9
    x = torch.zeros(3, P, dtype=torch.long)
    for r, p in enumerate(prompts):
        x[r, P - len(p):] = p
    out = greedy_extend(t, x, 6, prompt_lens=torch.tensor([5, 9, 7]))
    for r, p in enumerate(prompts):
        alone = greedy_extend(t, p[None], 6)
        assert torch.equal(out[r, P:], alone[0, len(p):])
    # stop_id: generation ends once every row has produced it
    first = int(out[0, P])
    short = greedy_extend(t, x[:1], 6, prompt_lens=torch.tensor([5]), stop_id=first)
    assert short.shape[1] == P + 1


def test_tiny_pipeline_end_to_end(tmp_path, monkeypatch):
    import ddtree_lab as dl
    from ddtree_lab.smollm2.train import main
    work = tmp_path / "work"
    assert main(["--preset", "tiny", "--work", str(work), "--device", "cpu"]) == 0
    out = work / "drafter"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 1
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2, 3]
    # the pool holds prompt + greedy response per row; labels end at the response's end
    import numpy as np
    z = np.load(work / "pool.npz")
    assert len(z["starts"]) == 24 and (z["lengths"] > z["starts"]).all()
    rows = [json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines()]
    assert {len(r["ids"]) for r in rows} == set(z["starts"].tolist())
    # bulk rendering (template spliced around a marker) equals render_chat per message
    from ddtree_lab.smollm2.train import tokenizer_and_chat
    _, encode, _ = tokenizer_and_chat(work / "tiny" / "target")
    texts = [r["messages"][0]["content"] for r in rows[:5]]
    assert encode.many(texts) == [encode([{"role": "user", "content": t}]) for t in texts] == [r["ids"] for r in rows[:5]]
    # the card: τ per set at T = 0 and 1, lossless at T = 0
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev["temperatures"]) == {"0", "1"}
    assert ev["temperatures"]["0"]["lossless"]
    assert set(ev["temperatures"]["0"]["sets"]) == set(PROMPT_SETS)
    card = (out / "README.md").read_text()
    assert "### T = 0" in card and "### T = 1" in card and "| chat |" in card
    # what the registry will load: the exported drafter with its target, lossless at T = 0
    pair = dl.load_pair(target=work / "tiny" / "target", drafter=out)
    msg = load_prompts("math")[0]["messages"]
    ar = dl.generate(pair, msg, method="ar", max_new_tokens=8)
    dd = dl.generate(pair, msg, method="ddtree", budget=8, max_new_tokens=8)
    assert ar.tokens == dd.tokens
    # a rerun skips every finished stage (resumable); pack/unpack carry the drafter exactly
    assert main(["--preset", "tiny", "--work", str(work), "--device", "cpu", "--stages", "prepare,pool,drafter"]) == 0
    pack, work2 = tmp_path / "pack", tmp_path / "work2"
    main(["--preset", "tiny", "--work", str(work), "--stages", "pack", "--pack-dir", str(pack)])
    assert all(f.stat().st_size < 16 * 2**20 for f in pack.iterdir())
    main(["--preset", "tiny", "--work", str(work2), "--stages", "unpack,export", "--pack-dir", str(pack),
          "--target", str(work / "tiny" / "target")])
    from safetensors.torch import load_file
    a, b = load_file(str(work / "drafter_final.safetensors")), load_file(str(work2 / "drafter_final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (work2 / "drafter" / "model.safetensors").is_file()
    # round_anchors: part of each row's anchors move to where a round from another anchor would end
    from ddtree_lab.lab import train as lab_train
    moved = []
    real = lab_train.follow_up_anchors
    monkeypatch.setattr(lab_train, "follow_up_anchors", lambda *a: moved.append(real(*a)) or moved[-1])
    work3 = tmp_path / "work3"
    work3.mkdir()
    for f in ("prompts.jsonl", "pool.npz"):
        (work3 / f).write_bytes((work / f).read_bytes())
    loaded = []
    real_load = lab_train.load_weights
    monkeypatch.setattr(lab_train, "load_weights", lambda d, path: loaded.append(path) or real_load(d, path))
    main(["--preset", "tiny", "--work", str(work3), "--stages", "drafter", "--set", "variants=round_anchors=0.5",
          "--set", f"drafter_init={work / 'drafter_final.safetensors'}",
          "--target", str(work / "tiny" / "target")])  # an A/B: main (uniform anchors) and the variant
    assert len(loaded) == 2  # both start from the same weights
    summary = json.loads((work3 / "drafter_summary.json").read_text())
    assert summary["steps"] == 6 and set(summary["variants"]) == {"main", "round_anchors0.5"}
    assert len(moved) == 6 and all(m.shape[1] == 1 for m in moved)  # the variant's, 1 of the tiny preset's 3


def test_shipped_config_sizes():
    """The SmolLM2 drafter configuration fits the 20 MiB bf16 limit (no target needed)."""
    from ddtree_lab.config import RopeConfig, TargetConfig
    from ddtree_lab.drafter import Drafter
    from ddtree_lab.smollm2.train import drafter_config, make_config
    tcfg = TargetConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        tie_word_embeddings=True, rope=RopeConfig(theta=100000.0), eos_token_id=[2])
    cfg = make_config("smollm2")
    with torch.device("meta"):
        d = Drafter(drafter_config(cfg, tcfg))
    n = sum(p.numel() for p in d.parameters())
    assert 2 * n / 2**20 <= 20.0
    assert d.cfg.target_layer_ids == [1, 8, 14, 20, 27] and d.cfg.mask_token_id == 16


def test_ship_target_bit_exact(tmp_path):
    """pack stores Q4_1 / Q8_0-born tensors as their block codes; unpack rebuilds them bit for bit."""
    from safetensors.torch import load_file, save_file
    from ddtree_lab.smollm2 import ship
    g = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (256, 32), generator=g).float()  # 4 KiB of codes: more than a part holds
    d4, m4 = (torch.rand(256, generator=g) * 0.01).half(), (-torch.rand(256, generator=g) * 0.05).half()
    q4[:, 0], q4[:, 1] = 0, 15  # the quantizer puts the block's min and max at codes 0 and 15
    w4 = (d4.float()[:, None] * q4 + m4.float()[:, None]).reshape(128, 64)
    q8 = torch.randint(-127, 128, (16, 32), generator=g).float()
    q8[:, 0] = 127
    w8 = ((torch.rand(16, generator=g) * 0.01).half().float()[:, None] * q8).reshape(8, 64)
    src = tmp_path / "target"
    src.mkdir()
    tensors = {"a.weight": w4, "emb.weight": w8, "norm.weight": torch.randn(64, generator=g)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    info = ship.pack(src, tmp_path / "pack", part_mib=0.001)  # tiny parts: several folders
    assert info["kinds"] == {"q4_1": 1, "q8_0": 1, "raw": 1} and len(info["parts_mib"]) >= 3
    parts = sorted((tmp_path / "pack").iterdir())
    from safetensors import safe_open
    names = [k for p in parts for k in safe_open(str(p / "weights.safetensors"), "pt").keys()]
    assert "a.weight.q#0" in names and "a.weight.q#3" in names  # the big blob travels in row chunks
    out = ship.unpack(parts, tmp_path / "rebuilt")  # the parts given one by one, as they travel
    back = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        ship.unpack(parts[:-1], tmp_path / "partial")


def test_sampled_generation_is_seeded_and_greedy_in_the_cold_limit(tmp_path):
    from ddtree_lab.checkpoint import load_target
    from ddtree_lab.lab.dflash import greedy_extend
    from ddtree_lab.testing import make_tiny_pair
    tdir, _ = make_tiny_pair(tmp_path, arch="llama", tokenizer=False)
    t = load_target(tdir)
    x = torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(1))
    def sample(temp, seed):
        return greedy_extend(t, x, 8, temperature=temp, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(sample(1.0, 5), sample(1.0, 5))
    assert not torch.equal(sample(5.0, 5), sample(5.0, 6))  # hot: nearly uniform over 300 tokens
    assert torch.equal(sample(1e-4, 5), greedy_extend(t, x, 8))


def test_ask_stage_keeps_clean_distinct_new_requests(tmp_path, monkeypatch):
    """The target's written requests (faked here) are tidied, and only new, finished, well-sized ones join
    prompts.jsonl, with ids as the chat template renders them."""
    from ddtree_lab.smollm2 import train as smt
    work = tmp_path / "work"
    assert smt.main(["--preset", "tiny", "--work", str(work), "--device", "cpu", "--stages", "prepare"]) == 0
    tok, encode, eos = smt.tokenizer_and_chat(work / "tiny" / "target")
    heldout = load_prompts("chat")[0]["messages"][0]["content"]
    written = ["Question: How do tides work on the coast?", "Hi", "how do tides work on the coast", None,
               heldout, '"Write a poem about a lighthouse at night."', "Never reached."]
    calls = []

    def fake_extend(target, x, n_new, prompt_lens=None, stop_id=None, temperature=0.0, generator=None):
        calls.append(temperature)
        rows = []
        for i in range(x.shape[0]):
            text = written[i % len(written)]
            ids = [5] * n_new if text is None else (tok.encode(text, add_special_tokens=False).ids + [eos])
            assert len(ids) <= n_new
            rows.append(ids + [eos] * (n_new - len(ids)))
        return torch.cat([x, torch.tensor(rows)], 1)

    monkeypatch.setattr(smt, "greedy_extend", fake_extend)
    before = (work / "prompts.jsonl").read_text().splitlines()
    assert smt.main(["--preset", "tiny", "--work", str(work), "--device", "cpu", "--stages", "ask",
                     "--set", "self_prompts=2", "--set", "ask_temperature=0.7"]) == 0
    rows = [json.loads(x) for x in (work / "prompts.jsonl").read_text().splitlines()]
    assert rows[:len(before)] == [json.loads(x) for x in before]
    new = rows[len(before):]
    assert [r["messages"][0]["content"] for r in new] == ["How do tides work on the coast?",
                                                          "Write a poem about a lighthouse at night."]
    assert all(r["kind"].startswith("self-") and r["ids"] == encode(r["messages"]) for r in new)
    info = json.loads((work / "ask_summary.json").read_text())
    assert info["kept"] == 2 and info["rejected"] == {"unfinished": 1, "length": 1, "repeat": 2}
    assert calls == [0.7]
    # a rerun finds the stage's product and leaves the prompts alone
    assert smt.main(["--preset", "tiny", "--work", str(work), "--device", "cpu", "--stages", "ask",
                     "--set", "self_prompts=2"]) == 0
    assert len((work / "prompts.jsonl").read_text().splitlines()) == len(rows)


def test_card_names_the_self_written_requests():
    from ddtree_lab.smollm2.card import _ask_line
    assert _ask_line({}) == "" and _ask_line({"kept": 0}) == ""
    line = _ask_line({"kept": 1200, "asked": 4096, "temperature": 1.0, "kinds": {"self-chat": 700, "self-code": 500}})
    assert line.startswith("- 1200 more requests written by the target itself") and "4096 asked" in line
    assert "'self-code': 500" in line and line.endswith(".\n")


def test_card_counts_responses_per_step_over_every_process():
    from types import SimpleNamespace
    from ddtree_lab.smollm2.card import _per_step
    cfg = SimpleNamespace(drafter_batch=128)
    assert _per_step({}, cfg) == "128"
    assert _per_step({"processes": 1, "batch": 64}, cfg) == "64"
    assert _per_step({"processes": 2, "batch": 128}, cfg).startswith("2 processes") and "× 128" in _per_step(
        {"processes": 2, "batch": 128}, cfg)


@pytest.mark.parametrize("written,kept", [
    ('A data analyst might ask: "What is the best way to learn chess?"', "What is the best way to learn chess?"),
    ("A musician might ask:\n\nHow do I tune a violin quickly?", "How do I tune a violin quickly?"),
    ("A musician might ask:", None),                       # the request never came
    ("Question: How do tides work?\n\nTides are ...", "How do tides work?"),
    ("A: How do you teach a puppy to fetch?", "How do you teach a puppy to fetch?"),
    ("Hi", None), ("x" * 401, None), ("", None),
])
def test_clean_request(written, kept):
    assert train_prompts.clean_request(written) == kept


def test_card_speed_table_splits_out_the_prefill():
    from ddtree_lab.smollm2.card import speed_section

    def row(method, budget, tps, decode, tau, equal):
        return dict(method=method, budget=budget, tokens_per_second=tps, decode_tokens_per_second=decode,
                    mean_tau=tau, prompts_equal_to_ar=equal)
    rows = [row("ar", None, 800.0, 1000.0, 1.0, 12), row("ddtree", 64, 1600.0, 2500.0, 3.5, 3)]
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_second"] / 800.0
        r["decode_speedup_over_ar"] = r["decode_tokens_per_second"] / 1000.0
    text = speed_section({"rows": rows, "best_budget": 64, "environment": {"device": "GPU X"}})
    assert "| ddtree (64) | 1600 | 2.00× | 2500 | 2.50× | 3.50 | 3 |" in text
    del rows[1]["decode_tokens_per_second"]  # a bench from before the prefill split
    assert "| ddtree (64) | 1600 | 2.00× | – | – | 3.50 | 3 |" in speed_section({"rows": rows})
    assert speed_section({}) == ""


def test_pool_in_shards_equals_one_pool(tmp_path):
    """Two processes (one per GPU) each make every other batch into one work dir; a run with one shard and
    gen_seconds=0 only merges. The merged pool equals the pool one process makes."""
    import numpy as np
    from ddtree_lab.smollm2.train import main
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["--preset", "tiny", "--work", str(one), "--device", "cpu", "--stages", "prepare,pool"]) == 0
    target = ["--target", str(one / "tiny" / "target")]
    main(["--preset", "tiny", "--work", str(two), "--device", "cpu", "--stages", "prepare"] + target)
    for k in (0, 1):
        main(["--preset", "tiny", "--work", str(two), "--device", "cpu", "--stages", "pool", "--set", "pool_shards=2",
              "--set", f"pool_shard={k}"] + target)
        assert not (two / "pool.npz").exists()  # not merged by a shard
    assert len(list((two / "pool_parts").glob("part*.npz"))) == 3  # 24 prompts in batches of 8
    main(["--preset", "tiny", "--work", str(two), "--device", "cpu", "--stages", "pool", "--set", "gen_seconds=0"] + target)
    a, b = np.load(one / "pool.npz"), np.load(two / "pool.npz")
    assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "starts", "lengths"))
    # the merged summary and the stage time count the shards, which ran side by side
    shards = [json.loads((two / "pool_parts" / f"shard{k}.json").read_text()) for k in (0, 1)]
    info = json.loads((two / "pool_summary.json").read_text())
    assert info["device"] == "2 × cpu" and [x["shard"] for x in info["shards"]] == [0, 1]
    assert info["generation_seconds"] == max(x["generation_seconds"] for x in shards) > 0
    assert info["seconds"] >= max(x["seconds"] for x in shards)
    timing = json.loads((two / "timing.json").read_text())
    assert timing["pool"]["device"] == "2 × cpu" and timing["pool"]["seconds"] >= round(max(x["seconds"] for x in shards), 1)
    with pytest.raises(SystemExit, match="pool_shard=2"):
        main(["--preset", "tiny", "--work", str(tmp_path / "bad"), "--device", "cpu", "--stages", "prepare,pool",
              "--set", "pool_shards=2", "--set", "pool_shard=2"] + target)


def test_drafter_trains_on_two_processes(tmp_path):
    """torchrun --nproc_per_node 2 … --stages drafter: each process draws its own batches, gradients are
    averaged, so both end with the same weights; process 0 alone writes (here on the CPU, gloo)."""
    import os
    import subprocess
    import sys
    from ddtree_lab.smollm2.train import main
    work = tmp_path / "work"
    assert main(["--preset", "tiny", "--work", str(work), "--device", "cpu", "--stages", "prepare,pool"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "ddtree_lab.smollm2.train", "--preset", "tiny", "--work", str(work), "--device", "cpu",
           "--stages", "drafter", "--target", str(work / "tiny" / "target")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((work / "drafter_summary.json").read_text())
    assert summary["processes"] == 2 and summary["weights_in_sync"] is True and summary["steps"] == 6
    assert (work / "drafter_final.safetensors").is_file()
    assert json.loads((work / "timing.json").read_text())["drafter"]["device"] == "2 × cpu (data parallel)"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)  # both skip the done stage
    assert again.returncode == 0 and "drafter_final.safetensors exists, skipping" in again.stdout + again.stderr
    bad = subprocess.run(cmd[:-4] + ["--stages", "prepare,drafter", "--target", str(work / "tiny" / "target")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert bad.returncode != 0 and "only --stages drafter" in bad.stderr + bad.stdout
