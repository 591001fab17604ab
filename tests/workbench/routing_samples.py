"""Routing dumps in the engines' formats (field names and encodings as vLLM and SGLang write them) and our
own trace rows, built from routed expert ids so each test says what it varies."""
from __future__ import annotations

import base64
import io
import json

import numpy as np


def routed(tokens: int, layers: int, k: int, experts: int, seed: int = 0, dense=(),
           pool: int | None = None) -> np.ndarray:
    """[tokens, layers, k] int32 ids, k distinct per token and layer; `dense` layers hold the engines' zero
    placeholder; with `pool`, each layer routes among a sticky few experts (a trained router's locality)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens, layers, k), dtype=np.int32)
    for layer in range(layers):
        if layer in dense:
            continue
        choices = rng.choice(experts, size=pool, replace=False) if pool else np.arange(experts)
        keys = rng.random((tokens, len(choices)))
        out[:, layer, :] = choices[np.argsort(keys, axis=1)[:, :k]]
    return out


def npy_b64(ids: np.ndarray) -> str:
    """What the vLLM server puts in a choice's routed_experts: base64 of the array saved as .npy."""
    buf = io.BytesIO()
    np.save(buf, ids)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def int32_b64(ids: np.ndarray) -> str:
    """What SGLang puts in meta_info.routed_experts: base64 of the int32 ids laid flat."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode("ascii")


def vllm_chat(*sequences, encoding: str = "npy", model: str = "Qwen/Qwen3-30B-A3B", prompt_tokens: int = 5,
              content: str = "def parse(line):\n    return line.split()") -> dict:
    """A chat completion of vLLM's OpenAI server, one choice per sequence."""
    def enc(ids):
        return npy_b64(ids) if encoding == "npy" else (ids.tolist() if isinstance(ids, np.ndarray) else ids)
    choices = [{"index": i, "message": {"role": "assistant", "content": content, "refusal": None,
                                        "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
                                        "reasoning": None},
                "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None,
                "routed_experts": enc(ids)} for i, ids in enumerate(sequences)]
    completion = sum(len(ids) for ids in sequences)
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1767225600, "model": model,
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}


def sglang_generate(ids: np.ndarray, prompt_tokens: int | None = None) -> dict:
    """A /generate response of SGLang with return_routed_experts: [prompt + completion − 1] tokens of ids."""
    prompt = prompt_tokens if prompt_tokens is not None else max(1, len(ids) // 2)
    completion = len(ids) + 1 - prompt
    return {"text": " the tree", "output_ids": list(range(completion)),
            "meta_info": {"id": "a1b2", "finish_reason": {"type": "length", "length": completion},
                          "prompt_tokens": prompt, "weight_version": "default", "completion_tokens": completion,
                          "cached_tokens": 0, "e2e_latency": 0.42, "routed_experts": int32_b64(ids)}}


def trace_row(index: int, touched: list[int] | None, nodes: int, accepted: int = 2) -> dict:
    """A traces.jsonl row as a study writes it (RoundTrace.to_json with the prompt's id)."""
    tree = None if nodes == 0 else {"tokens": list(range(nodes)), "depths": [1] * nodes, "parents": [0] * nodes,
                                    "scores": [-0.5] * nodes, "logprobs": [-0.5] * nodes, "ranks": [0] * nodes}
    return {"prompt_id": "p0", "index": index, "position": 10 + index, "root_token": 7, "acceptance_length": accepted,
            "accepted": list(range(accepted)), "accepted_tokens": [3] * (accepted - 1), "next_token": 4,
            "stage_seconds": {"draft": 0.001}, "experts_touched": touched, "expert_tokens_max": None,
            "expert_row_blocks": None, "budget": nodes or None, "tree": tree}


def recorder_per_token(passes: list[tuple[np.ndarray, list[int] | None, list[int]]], to_logical: np.ndarray,
                       slots: int = 8):
    """The expert-distribution recorder's per_token dump: per pass (ids [tokens, layers, k] as physical slots,
    extend_seq_lens, positions); unused slots and dense layers hold −1."""
    import torch
    records = []
    for i, (ids, lens, positions) in enumerate(passes):
        n, layers, k = ids.shape
        topk = np.full((layers, n, slots), -1, dtype=np.int32)
        topk[:, :, :k] = ids.transpose(1, 0, 2)
        records.append({"forward_pass_id": i, "rank": 0, "gatherer_key": "primary", "input_ids": list(range(n)),
                        "positions": positions, "extend_seq_lens": lens, "forward_mode": 1,
                        "topk_ids_of_layer": torch.from_numpy(topk), "misc_objects": [],
                        "global_physical_count": torch.zeros((layers, to_logical.shape[1]), dtype=torch.int32)})
    return {"records": records, "last_physical_to_logical_map": torch.from_numpy(to_logical.astype(np.int64))}


def recorder_stat(counts: np.ndarray):
    """The recorder's stat dump: [passes, layers, E] tokens per logical expert."""
    import torch
    return {"rank": 0, "logical_count": torch.from_numpy(counts.astype(np.int32)),
            "average_utilization_rate_over_window": None}


def jsonl(*values) -> str:
    return "".join(json.dumps(v) + "\n" for v in values)
