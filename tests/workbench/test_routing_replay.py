"""Replaying a user's routing dump (routing_dumps.read_trace / routing_model, routing=trace:FILE): the engine's
forwards take the dump's tokens window by window, so the experts a replayed forward touches are the dump's own
union of those tokens; the spec is refused in one line where it cannot drive a run."""
import json

import numpy as np
import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.attention import TreeMask
from ddtree_lab.declared_routing import RoutingTrace
from ddtree_lab.testing import make_tiny_pair
from ddtree_lab.workbench.routing_replay import read_trace, routing_model
from ddtree_lab.workbench.spec import StudyError, parse_study

from .routing_samples import jsonl, routed, sglang_generate, trace_row, vllm_chat

E, K = 16, 2


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    # qwen3_moe tiny: 4 layers, layer 1 dense, so 3 MoE layers
    return make_tiny_pair(tmp_path_factory.mktemp("replay"), arch="qwen3_moe", seed=3, tokenizer=False,
                          num_experts=E, num_experts_per_tok=K)


def test_a_vllm_dump_replays_as_its_ids_dense_placeholders_left_out(tmp_path):
    first, second = routed(30, 4, K, E, seed=1, dense=(0,)), routed(12, 4, K, E, seed=2, dense=(0,))
    path = tmp_path / "responses.jsonl"
    path.write_text(jsonl(vllm_chat(first), vllm_chat(second)))
    ids = read_trace(path)
    assert ids.shape == (42, 3, K) and np.array_equal(ids, np.concatenate([first, second])[:, 1:])
    trace = routing_model(f"trace:{path.name}", base=tmp_path)
    assert isinstance(trace, RoutingTrace) and trace.source == "responses.jsonl"
    assert torch.equal(trace.ids, torch.from_numpy(ids))
    sg = tmp_path / "sglang.json"  # SGLang's flat int32 ids, shaped by its token counts
    sg.write_text(json.dumps(sglang_generate(routed(9, 3, K, E, seed=4), prompt_tokens=4)))
    assert read_trace(sg).shape == (9, 3, K)


def test_replay_touches_the_dumps_own_union_window_by_window(tmp_path, moe_pair):
    ids = routed(60, 3, K, E, seed=5, pool=6)  # a trained router's locality: few experts a layer
    path = tmp_path / "dump.jsonl"
    path.write_text(jsonl(vllm_chat(ids)))
    pair = dl.load_pair(target=moe_pair[0], drafter=moe_pair[1], routing=routing_model(f"trace:{path}"))
    assert pair.describe()["routing"] == "trace:dump.jsonl"
    target, start = pair.target, 0
    target.setup_cache(128)
    for T in (1, 9, 17, 33):
        target(torch.arange(T), torch.arange(T), 0, TreeMask.causal(T, "cpu"))
        window = ids[start:start + T]
        for layer, m in enumerate(target._moe()):  # as many MoE layers as the dump: layer for layer
            assert int((m.counts > 0).sum()) == len(np.unique(window[:, layer])), (T, layer)
        start += T


def test_routing_specs_refused_in_one_line(tmp_path, moe_pair):
    with pytest.raises(ValueError, match="routing 'zipf' must be router, uniform or trace:FILE"):
        routing_model("zipf")
    with pytest.raises(ValueError, match="routing trace .*nope.jsonl: no such file"):
        routing_model("trace:nope.jsonl", base=tmp_path)
    unions = tmp_path / "traces.jsonl"  # our traces hold each round's union, not which token went where
    unions.write_text(jsonl(trace_row(0, [3, 4], 8), trace_row(1, [2, 5], 8)))
    with pytest.raises(ValueError, match="no per-token routing to replay"):
        read_trace(unions)
    wide = tmp_path / "wide.jsonl"  # the dump routes top-4; the target takes top-2
    wide.write_text(jsonl(vllm_chat(routed(8, 3, 4, E))))
    with pytest.raises(ValueError, match="routes each token to 4 experts; the target takes top-2"):
        dl.load_pair(target=moe_pair[0], drafter=moe_pair[1], routing=routing_model(f"trace:{wide}"))
    dump = tmp_path / "ok.jsonl"
    dump.write_text(jsonl(vllm_chat(routed(8, 3, K, E))))
    study = {"name": "s", "models": {"pair": "lab", "routing": f"trace:{dump}"}, "prompts": {"set": "lab:code"},
             "methods": ["ar"], "grid": {"budget": [4]}}
    with pytest.raises(StudyError, match="models.routing: .* this target is dense"):
        parse_study(study)
    moe = {**study, "models": {"target": str(moe_pair[0]), "drafter": str(moe_pair[1]), "routing": "trace:ok.jsonl"}}
    parsed = parse_study(moe, path=tmp_path / "study.yaml")
    assert parsed.models.routing == f"trace:{dump.resolve()}"  # absolute: the notebooks run elsewhere
    with pytest.raises(StudyError, match="models.routing: routing trace .*unions.jsonl|no per-token"):
        parse_study({**moe, "models": {**moe["models"], "routing": f"trace:{unions}"}}, path=tmp_path / "study.yaml")
