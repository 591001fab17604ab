"""The engine on the real pulled SmolLM2-135M-Instruct against transformers (fp32).

Runs only where `ddtree-lab pull smollm2` has been run (cache: $DDTREE_LAB_CACHE or
~/.cache/ddtree_lab) and transformers is installed; skipped otherwise (CI has no pulled models).
"""
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import ddtree_lab as dl  # noqa: E402
from ddtree_lab.train import smollm2  # noqa: E402
from ddtree_lab.attention import TreeMask  # noqa: E402
from ddtree_lab.prompts import encode_prompt  # noqa: E402

pytestmark = pytest.mark.skipif(not (smollm2.target_dir() / "config.json").is_file(),
                                reason="SmolLM2 not pulled (ddtree-lab pull smollm2)")


@pytest.fixture(scope="module")
def models():
    d = smollm2.target_dir()
    return dl.load_pair(target=d), transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_logits_match_transformers(models):
    pair, hf = models
    msgs = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    ids = encode_prompt(pair, msgs)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2.target_dir())
    want_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ids == list(want_ids["input_ids"] if hasattr(want_ids, "keys") else want_ids)
    T = len(ids)
    pair.target.setup_cache(T + 4)
    with torch.no_grad():
        ours, _ = pair.target(torch.tensor(ids), torch.arange(T), 0, TreeMask.causal(T, "cpu"))
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_answer(models):
    pair, hf = models
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    res = dl.generate(pair, msgs, method="ar", max_new_tokens=30)
    assert "Paris" in res.text and res.stop_reason == "stop_token"
    ids = encode_prompt(pair, msgs)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)
    assert out[0, len(ids):].tolist() == res.tokens
