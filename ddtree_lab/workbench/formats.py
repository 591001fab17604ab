"""Which serving benchmark wrote a record, and what the record (or, failing that, the file name)
says about the run's settings. Field names are those the tools write; see docs/workbench.md,
"Results from serving stacks". No torch, no engine.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from .advisor.machines import machine_for_device, machines_data

SETTINGS = ("model", "method", "budget", "topk", "draft_window", "concurrency", "tp")
SERVING, ONE_BATCH, VLLM_SERVE = "sglang bench_serving", "sglang bench_one_batch_server", "vllm bench serve"


def recognise(rec) -> tuple[str, str, str] | None:
    """A record's (engine, tool, field set), or None when it is no known benchmark record."""
    if not isinstance(rec, dict):
        return None
    if failed_run_record(rec):
        return "sglang", SERVING, "failed run"
    if {"run_name", "batch_size", "input_len", "output_len", "latency"} <= rec.keys():
        return "sglang", ONE_BATCH, "one batch"
    if "completed" in rec and ("total_token_throughput" in rec or "num_prompts" in rec
                               or any(k.startswith("spec_decode_") for k in rec)):
        return "vllm", VLLM_SERVE, "save-result"
    if "completed" in rec and ("total_output" in rec or "total_input" in rec):
        return "sglang", SERVING, "refactored"
    if "completed" in rec and "total_output_tokens" in rec:
        return "sglang", SERVING, "with server_info" if "server_info" in rec or "tag" in rec else "older"
    return None


def failed_run_record(rec: dict) -> bool:
    """The serving benchmark's record of a run that failed before measuring anything: the backend,
    `completed: 0` and the `error` (nothing else is needed: settings then come from the file name)."""
    return "backend" in rec and rec.get("completed") == 0 and isinstance(rec.get("error"), str)


# A cut record holding one of these got as far as the results: it is truncated, never a run that died
# before writing anything (ingest.TINY_FILE_BYTES)
RESULT_FIELDS = frozenset({"completed", "output_throughput", "request_throughput", "total_output_tokens",
                           "total_output", "latency"})

_KNOWN_FIELDS = {"completed", "total_output_tokens", "total_output", "output_throughput", "run_name",
                 "batch_size", "backend", "dataset_name", "request_rate", "max_concurrency", "num_prompts",
                 "server_info", "duration", "model_id"}


# ----------------------------------------------------------------------------- settings
_SPEC_METHOD = {"ddtree": "ddtree", "dflash": "dflash", "eagle": "eagle", "eagle3": "eagle", "nextn": "eagle"}


def hardware(name: str) -> str:
    """A GPU as the machine table names it (advisor/machines.json: 'H200', 'NVIDIA H100 PCIe' -> 'h200',
    'h100-pcie'), so runs group and price by one name; a GPU the table lacks keeps its own, lower-cased."""
    return machine_for_device(name) or str(name).lower()


def _hardware_token_rx() -> re.Pattern:
    """The GPU names a file-name token can spell whole (the table's one-word names, e.g. h200, mi300x)."""
    words = {w for key, m in machines_data()["machines"].items() for n in (key, *m.get("names", ()))
             if re.fullmatch(r"[a-z0-9]+", w := n.lower())}
    return re.compile("(" + "|".join(sorted(words)) + ")")  # a rule matches a token whole: order is free


_NAME_RULES = [  # (regex on one name token, setting, value from the match)
    (re.compile(r"b(\d+)t(\d+)"), ("budget", "topk"), lambda m: (int(m[1]), int(m[2]))),
    (re.compile(r"(?:b|budget)(\d+)"), ("budget",), lambda m: (int(m[1]),)),
    (re.compile(r"(?:k|topk)(\d+)"), ("topk",), lambda m: (int(m[1]),)),
    (re.compile(r"(?:w|window)(\d+)"), ("draft_window",), lambda m: (int(m[1]),)),
    (re.compile(r"(?:c|conc|concurrency|bs)(\d+)"), ("concurrency",), lambda m: (int(m[1]),)),
    (re.compile(r"tp(\d+)"), ("tp",), lambda m: (int(m[1]),)),
    (re.compile(r"(auto|ar|baseline|nospec)"), ("method",), lambda m: ("ar",)),
    (re.compile(r"(ddtree|dflash|eagle3?)"), ("method",), lambda m: (_SPEC_METHOD[m[1]],)),
    (re.compile(r"nvls"), ("nvls",), lambda m: (True,)),
    (_hardware_token_rx(), ("hardware",), lambda m: (hardware(m[1]),)),
]


def name_settings(path: Path, root: Path | None) -> dict:
    """Settings spelled in the file name and the folders between `root` and it, e.g.
    `ddtree_b8t4_w2048_c256_tp8.jsonl`. Each token must match a rule whole."""
    names = [path.stem]
    if root is not None and root != path:
        try:
            names = list(path.relative_to(root).parent.parts) + names
        except ValueError:
            pass
    out: dict = {}
    for tok in (t for n in names for t in re.split(r"[^A-Za-z0-9]+", n.lower()) if t):
        for rx, keys, get in _NAME_RULES:
            m = rx.fullmatch(tok)
            if m:
                for k, v in zip(keys, get(m)):
                    out.setdefault(k, v)
                break
    return out


def _int(x):
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _num(x):
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x) else None


def server_args(rec: dict) -> dict:
    info = rec.get("server_info")
    if not isinstance(info, dict):
        return {}
    if isinstance(info.get("decode"), list) and info["decode"] and isinstance(info["decode"][0], dict):
        info = info["decode"][0]  # disaggregated serving: the decode server runs the drafts
    return info


def field_settings(rec: dict, tool: str) -> tuple[dict, dict]:
    """Settings from the record's own fields -> (values, sources)."""
    vals, src = {}, {}

    def put(key, value, where):
        if value is not None and key not in vals:
            vals[key], src[key] = value, where

    info = server_args(rec)
    if tool == SERVING:
        put("concurrency", _int(rec.get("max_concurrency")), "fields")
        if info:
            put("model", info.get("served_model_name") or info.get("model_path"), "server_info")
            algo = info.get("speculative_algorithm")
            method = "ar" if algo in (None, "", "NONE") else _SPEC_METHOD.get(str(algo).lower(), "other")
            put("method", method, "server_info")
            steps, drafts = _int(info.get("speculative_num_steps")), _int(info.get("speculative_num_draft_tokens"))
            if method == "ddtree":
                put("budget", _int(info.get("speculative_ddtree_budget")), "server_info")
                put("topk", _int(info.get("speculative_ddtree_topk") or info.get("speculative_eagle_topk")),
                    "server_info")
            elif method == "dflash":  # one path of block_size - 1 drafted tokens
                block = _int(info.get("speculative_dflash_block_size")) or drafts
                put("budget", block - 1 if block else None, "server_info")
                put("topk", 1, "server_info")
            elif method != "ar":
                put("budget", drafts, "server_info")
                put("topk", _int(info.get("speculative_eagle_topk")), "server_info")
            put("draft_window", _int(info.get("speculative_draft_window_size")
                                     or info.get("speculative_dflash_draft_window_size")), "server_info")
            put("tp", _int(info.get("tp_size")), "server_info")
            vals["_steps"] = steps
            vals["_dp"] = _int(info.get("dp_size"))
            vals["_nvls"] = info.get("enable_nccl_nvls")
            vals["_cuda_graph"] = None if info.get("disable_cuda_graph") is None else not info["disable_cuda_graph"]
    elif tool == VLLM_SERVE:
        put("model", rec.get("model_id"), "fields")
        put("concurrency", _int(rec.get("max_concurrency")), "fields")
        # --metadata KEY=VALUE lands at the top level: honour the setting names when given
        for key in ("method", "budget", "topk", "draft_window", "tp", "hardware"):
            v = rec.get(key)
            if v is not None and key == "method":
                m = str(v).lower()
                put(key, "ar" if m in ("ar", "auto", "none", "baseline") else _SPEC_METHOD.get(m, "other"), "fields")
            elif v is not None:
                put(key, hardware(v) if key == "hardware" else _int(_float_or_none(v)), "fields")
    elif tool == ONE_BATCH:
        put("concurrency", _int(rec.get("batch_size")), "fields")
    return vals, src


def absent_means_ar(rec: dict, tool: str) -> bool:
    """No acceptance figures at all: AR, unless the file name says otherwise (older tools and
    servers that do not report them leave the same gap, hence after the name)."""
    if tool == VLLM_SERVE:
        return not any(k.startswith("spec_decode_") for k in rec)
    if tool == ONE_BATCH:
        return _num(rec.get("acc_length")) is not None and rec["acc_length"] < 0  # −1: not reported
    return False


def _float_or_none(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def recognise_partial(rec: dict) -> tuple[str, str, str]:
    """The tool of a record cut short, from the fields it got to."""
    if "run_name" in rec or "batch_size" in rec:
        return "sglang", ONE_BATCH, "one batch"
    if "num_prompts" in rec or "model_id" in rec or "endpoint_type" in rec or "date" in rec:
        return "vllm", VLLM_SERVE, "save-result"
    return "sglang", SERVING, "with server_info" if "server_info" in rec or "tag" in rec else "older"
