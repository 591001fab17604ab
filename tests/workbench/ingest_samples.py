"""Sample result files in the serving benchmarks' formats (field names as those tools write them),
built from a few numbers so each test says what it varies."""
from __future__ import annotations

import json
import random

WORDS = ("the model drafts a tree of tokens and the target verifies every branch in one forward pass "
         "so that accepted paths commit several tokens per step while the output stays exact").split()


def good_texts(n: int, seed: int = 0, words: int = 80) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" #{i}" for i in range(n)]


def server_info(algo=None, budget=None, topk=None, steps=None, draft_tokens=None, window=None, tp=1, dp=1,
                model="Qwen/Qwen3-8B", seed=1234, accept=None) -> dict:
    info = {"model_path": model, "served_model_name": model, "tp_size": tp, "dp_size": dp, "ep_size": 1,
            "speculative_algorithm": algo, "speculative_num_steps": steps, "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": draft_tokens, "speculative_ddtree_budget": budget,
            "speculative_ddtree_topk": topk if algo == "DDTREE" else None,
            "speculative_draft_window_size": window, "cuda_graph_max_bs": 256, "disable_cuda_graph": False,
            "enable_nccl_nvls": False, "random_seed": seed, "port": 30000, "status": "ready", "version": "0.5"}
    info["internal_states"] = [{"avg_spec_accept_length": accept, "last_gen_throughput": 900.0}]
    return info


def details(n_sent: int, n_ok: int, texts: list[str] | None = None, error: str = "Connection reset by peer",
            out_len: int = 256) -> dict:
    texts = texts if texts is not None else good_texts(n_ok)
    return {"input_lens": [512] * n_sent,
            "output_lens": [out_len] * n_ok + [0] * (n_sent - n_ok),
            "ttfts": [0.05] * n_ok + [0.0] * (n_sent - n_ok),
            "itls": [[0.01] * 4 for _ in range(n_ok)] + [[] for _ in range(n_sent - n_ok)],
            "generated_texts": texts[:n_ok] + [""] * (n_sent - n_ok),
            "errors": [""] * n_ok + [error] * (n_sent - n_ok)}


def serving(variant: str = "newer", completed: int = 64, out_tokens: int = 16384, retok: int | None = None,
            throughput: float = 1000.0, tpot: float = 10.0, accept=None, concurrency=32, info=None,
            detail: dict | None = None, tag=None) -> dict:
    """A serving-benchmark record: `older`, `newer` (tag, server_info, total_throughput) or
    `refactored` (total_input / total_output, details nested)."""
    retok = out_tokens if retok is None else retok
    lat = {f"{s}_{m}_ms": v for m, base in (("ttft", 50.0), ("tpot", tpot), ("itl", tpot), ("e2e_latency", 3000.0))
           for s, v in (("mean", base), ("median", base), ("std", base / 10), ("p99", base * 2))}
    rec = {"backend": "sglang", "dataset_name": "random", "request_rate": float("inf"),
           "max_concurrency": concurrency, "sharegpt_output_len": None, "random_input_len": 512,
           "random_output_len": 256, "random_range_ratio": 0.0, "duration": 16.4}
    if variant == "refactored":
        rec.update({"completed": completed, "total_input": 512 * completed, "total_output": out_tokens,
                    "total_output_retokenized": retok, "request_throughput": completed / 16.4,
                    "input_throughput": 512 * completed / 16.4, "output_throughput": throughput,
                    "output_throughput_retokenized": throughput, "total_throughput": throughput * 3,
                    "total_throughput_retokenized": throughput * 3, **lat, "p95_itl_ms": tpot,
                    "max_itl_ms": tpot * 3, "concurrency": 30.5, "accept_length": accept})
        if detail is not None:
            rec["details"] = detail
        return rec
    rec.update({"completed": completed, "total_input_tokens": 512 * completed, "total_output_tokens": out_tokens,
                "total_output_tokens_retokenized": retok, "request_throughput": completed / 16.4,
                "input_throughput": 512 * completed / 16.4, "output_throughput": throughput, **lat,
                "p95_itl_ms": tpot, "concurrency": 30.5, "accept_length": accept})
    if variant == "newer":
        rec = {"tag": tag, **rec, "server_info": info, "total_throughput": throughput * 3,
               "max_output_tokens_per_s": throughput * 1.2, "max_concurrent_requests": concurrency}
    if detail is not None:
        rec.update(detail)
    return rec


def one_batch(batch_size=16, output_throughput=1200.0, acc_length=-1, run_name="default") -> dict:
    return {"run_name": run_name, "batch_size": batch_size, "input_len": 1024, "output_len": 256,
            "latency": 4.2, "input_throughput": 90000.0, "output_throughput": output_throughput,
            "overall_throughput": 5000.0, "last_ttft": 0.18, "last_gen_throughput": 1300.0,
            "acc_length": acc_length, "total_output_tokens": batch_size * 256, "cache_hit_rate": None}


def bench_serve(completed=100, failed=0, throughput=1500.0, spec: bool = True, accept=2.8, concurrency=16,
         detail: dict | None = None, **extra) -> dict:
    rec = {"date": "20260101-120000", "endpoint_type": "openai", "backend": "openai", "label": None,
           "model_id": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
           "num_prompts": completed + failed, "request_rate": "inf", "burstiness": 1.0,
           "max_concurrency": concurrency, "duration": 30.0, "completed": completed, "failed": failed,
           "total_input_tokens": 1024 * completed, "total_output_tokens": 256 * completed,
           "request_throughput": completed / 30.0, "request_goodput": None, "output_throughput": throughput,
           "total_token_throughput": throughput * 5, "max_output_tokens_per_s": throughput * 1.1,
           "max_concurrent_requests": concurrency, "rtfx": 0.0,
           "mean_ttft_ms": 40.0, "median_ttft_ms": 38.0, "std_ttft_ms": 3.0, "p99_ttft_ms": 60.0,
           "mean_tpot_ms": 8.0, "median_tpot_ms": 7.9, "std_tpot_ms": 0.5, "p99_tpot_ms": 9.0,
           "mean_itl_ms": 8.0, "median_itl_ms": 7.9, "std_itl_ms": 0.5, "p99_itl_ms": 9.0, **extra}
    if spec:
        rec.update({"spec_decode_acceptance_rate": 45.0, "spec_decode_acceptance_length": accept,
                    "spec_decode_num_drafts": 9000, "spec_decode_draft_tokens": 36000,
                    "spec_decode_accepted_tokens": 16200,
                    "spec_decode_per_position_acceptance_rates": [0.8, 0.5, 0.3, 0.2]})
    if detail is not None:
        rec.update(detail)
    return rec


def jsonl(*records) -> str:
    """What an appending tool writes: Python's json.dumps (NaN / Infinity allowed), one per line."""
    return "".join(json.dumps(r) + "\n" for r in records)
