"""The lab pair: its training pipeline (tiny, on the CPU), its batched helpers, and the shipped files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree_lab.config import DrafterConfig, TargetConfig
from ddtree_lab.drafter import Drafter
from ddtree_lab.lab.corpus import MASK_TOKEN, is_heldout
from ddtree_lab.lab.dflash import block_inputs, block_loss, block_mask, greedy_extend, position_weights
from ddtree_lab.model import Target

LAB = Path(__file__).resolve().parents[2] / "ddtree_lab" / "pairs" / "lab"


def _tiny_target(seed=0, vocab=64):
    torch.manual_seed(seed)
    cfg = TargetConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return Target(cfg).eval()


def test_greedy_extend_matches_forward_train():
    t = _tiny_target()
    x = torch.randint(0, 64, (3, 7))
    out = greedy_extend(t, x, 9)
    ref = x
    for _ in range(9):
        logits, _ = t.forward_train(ref)
        ref = torch.cat([ref, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_block_mask_and_inputs():
    tokens = torch.arange(20)[None]
    anchors = torch.tensor([[3, 10]])
    blk, pos, labels = block_inputs(tokens, anchors, 4, mask_token_id=99)
    assert blk.tolist() == [[[3, 99, 99, 99], [10, 99, 99, 99]]]
    assert pos.tolist() == [[[3, 4, 5, 6], [10, 11, 12, 13]]]
    assert labels.tolist() == [[[4, 5, 6], [11, 12, 13]]]
    m = block_mask(anchors, 20, 4)  # [1, 8, 28]
    assert m.shape == (1, 8, 28)
    assert m[0, 0, :20].tolist() == [i < 3 for i in range(20)]          # context before the anchor only
    assert m[0, 5, :20].tolist() == [i < 10 for i in range(20)]
    assert m[0, 0, 20:].tolist() == [True] * 4 + [False] * 4             # its own block, non-causally
    assert m[0, 7, 20:].tolist() == [False] * 4 + [True] * 4
    # Labels past the sequence end are ignored.
    _, _, lab = block_inputs(tokens, torch.tensor([[18]]), 4, 99)
    assert lab.tolist() == [[[19, -100, -100]]]


def test_block_loss_weights_and_chain_tau():
    V = 10
    labels = torch.tensor([[[1, 2, 3]]])
    logits = torch.full((1, 1, 3, V), -5.0)
    logits[0, 0, 0, 1] = 5.0   # slot 1 right
    logits[0, 0, 1, 7] = 5.0   # slot 2 wrong -> chain stops
    logits[0, 0, 2, 3] = 5.0   # slot 3 right, but after a miss
    loss, acc, tau = block_loss(logits, labels, position_weights(4, 7.0))
    assert acc.tolist() == [1.0, 0.0, 1.0]
    assert float(tau) == 2.0
    assert float(loss) > 0


def test_follow_up_anchors_start_where_a_round_would():
    from ddtree_lab.lab.dflash import follow_up_anchors
    V = 10
    labels = torch.tensor([[[1, 2, 3], [4, 5, 6], [7, 8, 9]]])  # [B=1, A=3, L=3]
    logits = torch.zeros(1, 3, 3, V)
    logits[0, 0, 0, 1] = logits[0, 0, 1, 7] = 1.0  # anchor 0: slot 1 right, slot 2 wrong -> accepts 2
    logits[0, 1, :, 0] = 1.0                         # anchor 1: nothing right -> accepts 1 (the bonus)
    logits[0, 2, 0, 7] = logits[0, 2, 1, 8] = logits[0, 2, 2, 9] = 1.0  # all right -> 4, past the end
    anchors = torch.tensor([[3, 10, 20]])
    assert follow_up_anchors(logits, labels, anchors, 24).tolist() == [[5, 11, 20]]
    assert follow_up_anchors(logits, labels, anchors, torch.tensor([12])).tolist() == [[5, 10, 20]]


def test_compiled_block_loss_matches_eager():
    """Training compiles the loss on CUDA; the compiled loss and its gradient must equal the eager ones."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 15, 257, requires_grad=True)
    labels = torch.randint(0, 257, (2, 3, 15))
    labels[0, 1, 4:] = -100  # past a response's end
    soft = torch.randn(2, 3, 15, 257)
    w = position_weights(16, 7.0)
    eager = block_loss(logits, labels, w, soft, 0.5)
    compiled = torch.compile(block_loss)(logits, labels, w, soft, 0.5)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (ge,) = torch.autograd.grad(eager[0], logits)
    (gc,) = torch.autograd.grad(compiled[0], logits)
    torch.testing.assert_close(ge, gc, rtol=1e-5, atol=1e-7)
    assert ge.abs().sum() > 0


def test_drafter_block_attends_only_to_past_context():
    """Changing context features at or after the anchor must not change the block's output."""
    t = _tiny_target()
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=64, block_size=4, num_target_layers=2,
                         target_layer_ids=[0, 1], mask_token_id=1)
    torch.manual_seed(1)
    d = Drafter(dcfg).eval()
    from ddtree_lab.lab.dflash import block_logits
    tokens = torch.randint(0, 64, (1, 12))
    _, hid = t.forward_train(tokens, hidden_layers=[0, 1])
    anchors = torch.tensor([[6]])
    a, _ = block_logits(t, d, tokens, hid, anchors, 1)
    hid2 = hid.clone()
    hid2[:, 6:] = torch.randn_like(hid2[:, 6:])
    b, _ = block_logits(t, d, tokens, hid2, anchors, 1)
    assert torch.allclose(a, b, atol=1e-5)
    hid3 = hid.clone()
    hid3[:, 2] += 1.0
    c, _ = block_logits(t, d, tokens, hid3, anchors, 1)
    assert not torch.allclose(a, c, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from ddtree_lab.lab.train import main
    root = tmp_path_factory.mktemp("lab")
    rc = main(["--preset", "tiny", "--cache", str(root / "cache"), "--work", str(root / "work"),
               "--out", str(root / "pair"), "--device", "cpu"])
    assert rc == 0
    return root


def test_train_lab_pair_tiny_end_to_end(tiny_run):
    pair_dir = tiny_run / "pair"
    tcfg = json.loads((pair_dir / "target" / "config.json").read_text())
    dcfg = json.loads((pair_dir / "drafter" / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"]
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["block_size"] == 16
    tok = json.loads((pair_dir / "target" / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert dcfg["dflash_config"]["mask_token_id"] == added[MASK_TOKEN]
    for name in ("code", "docstring"):
        rows = [json.loads(x) for x in (pair_dir / "prompts" / f"{name}.jsonl").read_text().splitlines()]
        assert rows and all({"id", "prompt", "source"} <= set(r) for r in rows)
    card = (pair_dir / "README.md").read_text()
    assert "DDTree(8)" in card and "Held-out loss" in card
    ev = json.loads((pair_dir / "eval.json").read_text())
    assert ev["lossless"] is True
    # A rerun skips finished stages (restartable) and leaves the products in place.
    from ddtree_lab.lab.train import main
    assert main(["--preset", "tiny", "--cache", str(tiny_run / "cache"), "--work", str(tiny_run / "work"),
                 "--out", str(pair_dir), "--device", "cpu", "--stages", "prepare,target,pool,drafter"]) == 0


def test_fast_tau_generates_in_padded_batches_as_alone(tmp_path):
    from ddtree_lab.checkpoint import load_target
    from ddtree_lab.lab.evaluate import _greedy_all
    from ddtree_lab.testing import make_tiny_pair
    tdir, _ = make_tiny_pair(tmp_path, arch="llama", tokenizer=False)
    target = load_target(tdir)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    for p, seq in zip(prompts, _greedy_all(target, prompts, 10, torch.device("cpu"), batch=2)):
        assert torch.equal(seq, greedy_extend(target, torch.tensor([p]), 10))


def test_fast_tau_matches_engine(tiny_run):
    """The batched τ simulation used during training agrees with the engine's decoding loop."""
    import ddtree_lab as dl
    from ddtree_lab.lab.evaluate import fast_tau
    pair = dl.load_pair(target=tiny_run / "pair" / "target", drafter=tiny_run / "pair" / "drafter")
    rows = [json.loads(x) for x in (tiny_run / "pair" / "prompts" / "code.jsonl").read_text().splitlines()][:2]
    prompts = [pair.encode(r["prompt"]) for r in rows]
    fast = fast_tau(pair.target, pair.drafter, prompts, n_new=12, budgets=(4,), eos_id=None)
    eng_d, eng_t = [], []
    for p in prompts:
        eng_d += dl.generate(pair, p, method="dflash", max_new_tokens=12, stop=[], trace=False).acceptance_lengths
        eng_t += dl.generate(pair, p, method="ddtree", budget=4, max_new_tokens=12, stop=[],
                             trace=False).acceptance_lengths
    assert fast.per_method["dflash"] == eng_d
    assert fast.per_method["ddtree4"] == eng_t
    # Every output position's chain; the rounds are the chains at the positions where rounds start.
    rounds = []
    for chain in fast.per_anchor:
        assert all(1 <= c <= 16 for c in chain)
        n = 0
        while n < len(chain):
            rounds.append(chain[n])
            n += chain[n]
    assert rounds == eng_d


# ----------------------------------------------------------------------------- the shipped pair

shipped = pytest.mark.skipif(not (LAB / "target" / "config.json").is_file(), reason="lab pair not built yet")


@shipped
def test_shipped_pair_size_and_format():
    size = sum(f.stat().st_size for f in LAB.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert size <= 25 * 2**20
    t = json.loads((LAB / "target" / "config.json").read_text())
    d = json.loads((LAB / "drafter" / "config.json").read_text())
    assert t["architectures"] == ["Qwen3ForCausalLM"] and t["torch_dtype"] in ("bfloat16", "float16")
    assert d["architectures"] == ["DFlashDraftModel"] and d["block_size"] == 16
    assert set(d["dflash_config"]) >= {"target_layer_ids", "mask_token_id"}
    tc = json.loads((LAB / "target" / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|endoftext|>" and tc["mask_token"] == "<|mask|>"
    assert (LAB / "README.md").is_file()


@shipped
def test_shipped_prompts_come_from_heldout_files():
    for name in ("code", "docstring"):
        rows = [json.loads(x) for x in (LAB / "prompts" / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) >= 24
        assert len({r["id"] for r in rows}) == len(rows)
        for r in rows:
            path = r["source"].rsplit(":", 1)[0]
            assert is_heldout(path, 40), r["source"]
            assert r["prompt"].strip() and not r["prompt"].endswith("\n")  # see lab/prompts.py


@shipped
def test_shipped_pair_is_lossless_on_a_prompt():
    import ddtree_lab as dl
    pair = dl.load_pair("lab")
    row = json.loads((LAB / "prompts" / "code.jsonl").read_text().splitlines()[0])
    ar = dl.generate(pair, row["prompt"], method="ar", max_new_tokens=24, trace=False)
    tree = dl.generate(pair, row["prompt"], method="ddtree", budget=64, max_new_tokens=24, trace=False)
    assert tree.tokens == ar.tokens
    assert sum(tree.acceptance_lengths) >= len(tree.tokens) - 1
