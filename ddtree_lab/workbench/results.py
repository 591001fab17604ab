"""Per-run results: generate a run's prompts, record `results.json` + `traces.jsonl`, and compare
runs against the AR run of the same study (speedup, losslessness).

The first per-run notebook calls `ensure_results(RunParams)`; later notebooks of the same run load
what it wrote. The report recomputes the comparisons from all results.json files (`compare`), so a
run's verdict never depends on the order runs were executed in.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_json, atomic_write_jsonl, changed_files, read_jsonl
from ..auto_budget import AutoBudget
from ..bench.e2e import weight_bytes_per_step
from ..decode import generate
from ..environment import device_info, git_commit, versions
from ..metrics import summarize_taus
from ..names import AUTO, RESULTS_FILE, RUN_FILE, STUDY_FILE, TRACES_FILE
from ..pairs import load_pair
from ..prompts import prompt_text, read_prompt_set
from .advisor.trace_stats import row_blocks_at_height
from .measurement import conditions, load_average, timing_caveats, timing_record, timing_text
from .runs import RunParams, auto_candidates, input_digests, is_fixed, read_run_status, run_name

SCHEMA = "ddtree_lab.results/1"


def finite(x) -> float | None:
    """x as a float, or None when it is missing, NaN or infinite: no figure is built from NaN."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def timing_summary(pass_seconds: list[float], new_tokens: int) -> dict:
    """Tokens/s of each timed pass over the prompt set -> median, [min, max] spread and the passes."""
    rates = [new_tokens / w for w in pass_seconds if w > 0]
    if not rates:
        return {}
    return {"tokens_per_second": statistics.median(rates), "tokens_per_second_spread": [min(rates), max(rates)],
            "tokens_per_second_passes": rates, "timing_repeats": len(rates),
            "wall_seconds": statistics.median(pass_seconds), "seconds_per_token": 1 / statistics.median(rates)}


def summarize(prompts: list[dict], max_depth: int | None = None, pass_seconds: list[float] | None = None) -> dict:
    """Run totals from per-prompt records (tokens, acceptance_lengths, wall/stage seconds).
    max_depth: the drafter's L (block_size - 1), so runs of a study share their depth axis.
    pass_seconds: the wall time of each timed pass over all prompts; tokens/s is then their median."""
    taus = [t for p in prompts for t in p.get("acceptance_lengths", [])]
    figures = summarize_taus(taus, max_depth)
    new_tokens = sum(len(p.get("tokens", [])) for p in prompts)
    wall = sum(p.get("wall_seconds", 0.0) for p in prompts)
    stages: dict[str, float] = {}
    for p in prompts:
        for k, v in (p.get("stage_seconds") or {}).items():
            stages[k] = stages.get(k, 0.0) + float(v)
    out = {
        "new_tokens": new_tokens,
        **figures,
        "stage_seconds": stages,
        "wall_seconds": wall,
        "tokens_per_second": new_tokens / wall if wall > 0 else None,
        "tokens_per_second_spread": None,
        "timing_repeats": 1 if wall > 0 else 0,
        "seconds_per_token": wall / new_tokens if new_tokens else None,
    }
    if pass_seconds and new_tokens:
        out.update(timing_summary(pass_seconds, new_tokens))
    return drop_non_finite(out)


FIGURE_KEYS = ("mean_tau", "tokens_per_second", "seconds_per_token", "wall_seconds")


def drop_non_finite(summary: dict) -> dict:
    """NaN / inf figures become None and are named in summary["non_finite"] (the run is then suspect)."""
    bad = [k for k in FIGURE_KEYS if summary.get(k) is not None and finite(summary[k]) is None]
    if bad:
        summary = {**summary, **{k: None for k in bad},
                   "non_finite": sorted(set(summary.get("non_finite") or []) | set(bad))}
    return summary


# ----------------------------------------------------------------------------- recording
def _plain(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


def round_to_json(r: Any) -> dict:
    """A RoundTrace (or a dict already) -> JSON-ready dict."""
    if isinstance(r, dict):
        return r
    if hasattr(r, "to_json"):
        return r.to_json()
    tree = getattr(r, "tree", None)
    return {"tree": tree.to_json() if hasattr(tree, "to_json") else tree,
            "accepted": _plain(getattr(r, "accepted", [])), "next_token": _plain(getattr(r, "next_token", None))}


def prompt_record(prompt: dict, res: Any, n_prompt_tokens: int | None = None) -> dict:
    """One prompt's GenerationResult -> the per-prompt entry of results.json."""
    taus = [int(t) for t in (getattr(res, "acceptance_lengths", None) or [])]
    tokens = [int(t) for t in _plain(getattr(res, "tokens", []))]
    return {
        "id": prompt["id"], "prompt": prompt["prompt"],
        "n_prompt_tokens": n_prompt_tokens if n_prompt_tokens is not None
        else len(getattr(res, "prompt_tokens", None) or []) or None,
        "stop_reason": getattr(res, "stop_reason", None),
        "tokens": tokens, "text": getattr(res, "text", ""),
        "acceptance_lengths": taus, "rounds": len(taus),
        "mean_tau": sum(taus) / len(taus) if taus else None,
        "wall_seconds": float(getattr(res, "wall_seconds", 0.0) or 0.0),
        "prefill_seconds": getattr(res, "prefill_seconds", None),
        "tokens_per_second": getattr(res, "tokens_per_second", None),
        "stage_seconds": {k: float(v) for k, v in (getattr(res, "stage_seconds", None) or {}).items()},
        **({"round_budgets": [int(b) for b in getattr(res, "round_budgets", None) or []]}
           if (getattr(res, "settings", None) or {}).get("budget") == AUTO else {}),
    }


def build_results(params: RunParams, pair: Any, prompts: list[dict], gen_results: list[Any],
                  n_prompt_tokens: list[int] | None = None, extra: dict | None = None,
                  pass_seconds: list[float] | None = None) -> dict:
    """The results.json dict of one run, from its GenerationResults (one per prompt)."""
    per_prompt = [prompt_record(p, r, n_prompt_tokens[i] if n_prompt_tokens else None)
                  for i, (p, r) in enumerate(zip(prompts, gen_results))]
    describe = getattr(pair, "describe", None)
    models = describe() if callable(describe) else {}
    models.setdefault("name", getattr(pair, "name", params.pair))
    models.setdefault("target", getattr(pair, "target_id", None))
    models.setdefault("drafter", getattr(pair, "drafter_id", None))
    out = {
        "schema": SCHEMA, "study": params.study_name, "run": params.run_name, "status": "complete",
        "config": {k: v for k, v in params.to_json().items() if k not in ("run_dir", "study_dir", "budgets")},
        "models": models,
        "device": device_info(getattr(pair, "device", params.device)),
        "versions": versions(), "commit": git_commit(),
        "prompts": per_prompt,
        "summary": summarize(per_prompt, drafter_depth(pair), pass_seconds),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out.update(extra or {})
    return out


def drafter_depth(pair: Any) -> int | None:
    """L = block_size - 1: the deepest a tree can go (None without a drafter)."""
    cfg = getattr(getattr(pair, "drafter", None), "cfg", None)
    bs = getattr(cfg, "block_size", None)
    return bs - 1 if bs else None


def trace_rows(prompt: dict, res: Any) -> list[dict]:
    rows = []
    for i, r in enumerate(getattr(res, "rounds", None) or []):
        row = {"prompt_id": prompt["id"], "index": i}
        row.update(round_to_json(r))
        rows.append(row)
    return rows


def _routing(spec: str):
    """A run's routing spec as load_pair takes it (None: the pair's default)."""
    from .routing_replay import routing_model

    return routing_model(spec) if spec else None


def load_run_pair(params: RunParams):
    """The pair a run names (`lab`, `random:<shape>`, another named pair, or target/drafter dirs)."""
    device = params.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype=params.dtype, attention=params.attention, compile=params.compile,
              seed=params.seed, routing=_routing(params.routing))
    if params.pair:
        return load_pair(params.pair, **kw)
    return load_pair(target=params.target_dir, drafter=params.drafter_dir, **kw)


def prompt_input(pair: Any, prompt):
    """What generate gets: the prompt itself, or for a pair without a tokenizer (random weights)
    its UTF-8 bytes as token ids, which keeps prompt lengths realistic and runs deterministic."""
    if getattr(pair, "tokenizer", True) is None:
        return list(prompt_text(prompt).encode("utf-8"))
    return prompt


def gen_kwargs(params: RunParams) -> dict:
    kw = dict(method=params.method, max_new_tokens=params.max_new_tokens,
              temperature=params.temperature)
    if params.method == "ddtree":
        budget = AutoBudget(budgets=auto_candidates(params)) if params.budget == AUTO else params.budget
        kw.update(budget=budget, topk=params.topk or None)
    return kw


def auto_summary(gen_results: list[Any]) -> dict | None:
    """An `auto` run's choice: its candidates, the share of rounds (over all prompts) run at each, and the
    settings it ran with (costs per round, ...); None for any other run."""
    settings = next((getattr(r, "settings", None) or {} for r in gen_results), {})
    if settings.get("budget") != AUTO:
        return None
    auto = dict(settings.get("auto") or {})
    candidates = [int(b) for b in auto.pop("budgets", [])]
    chosen = [int(b) for r in gen_results for b in getattr(r, "round_budgets", None) or []]
    counts = {str(b): chosen.count(b) for b in sorted(set(candidates) | set(chosen))}
    share = {b: n / len(chosen) for b, n in counts.items()} if chosen else {}
    return {"candidates": candidates, "rounds_per_budget": counts, "budget_share": share, **auto}


def generate_run(params: RunParams, pair: Any = None, progress: bool = True) -> tuple[dict, list[dict]]:
    """Generate every prompt of the run; returns (results dict, trace rows)."""
    pair = pair if pair is not None else load_run_pair(params)
    prompts = read_prompt_set(params.prompt_set, params.n_prompts)
    kw = gen_kwargs(params)
    # On a GPU, tracing reads every round's tree back to the host, which a production loop (CUDA
    # graphs, few syncs) never does: time an untraced call and record the trees from a second one.
    # On the CPU tracing costs next to nothing, so one traced call serves both.
    separate = str(getattr(pair, "device", params.device)).startswith("cuda")
    if params.warmup:  # first calls pay for allocations, compilation, CUDA graph capture: untimed
        # CUDA graphs are captured per generation length, so the GPU warm-up uses the real one.
        warm = params.max_new_tokens if separate else min(8, params.max_new_tokens)
        generate(pair, prompt_input(pair, prompts[0]["prompt"]), **{**kw, "max_new_tokens": warm},
                    seed=params.seed, trace=False)
    # Timed passes over the whole prompt set (params.repeats): tokens/s is their median, the spread
    # their range. The first pass gives the tokens, traces and stage times; all passes give timings.
    results, rows, ntok, pass_seconds = [], [], [], []
    inputs = [prompt_input(pair, p["prompt"]) for p in prompts]
    load_before = load_average()
    for rep in range(max(1, int(params.repeats))):
        wall = 0.0
        for i, (p, x) in enumerate(zip(prompts, inputs)):
            res = generate(pair, x, seed=params.seed + i, trace=not separate and rep == 0, **kw)
            wall += res.wall_seconds
            if rep:
                continue
            traced = generate(pair, x, seed=params.seed + i, trace=True, **kw) if separate else res
            results.append(res)
            rows.extend(trace_rows(p, traced))
            ntok.append(len(getattr(res, "prompt_tokens", None) or []) or None)
            if progress:
                taus = getattr(res, "acceptance_lengths", []) or []
                print(f"{params.run_name} prompt {i + 1}/{len(prompts)}: {len(res.tokens)} tokens, "
                      f"{len(taus)} rounds, {res.wall_seconds:.2f}s", flush=True)
        pass_seconds.append(wall)
    conditions_now = timing_record(load_before, load_average())
    timing = "untraced call (trees from a second, traced call)" if separate else "traced call"
    timing += f"; median of {len(pass_seconds)} pass(es) over the prompts"
    out = build_results(params, pair, prompts, results, ntok, pass_seconds=pass_seconds,
                        extra={"timing": timing, "timing_conditions": conditions_now})
    out["summary"].update(verify_reads(pair, rows))
    auto = auto_summary(results)
    if auto is not None:
        out["summary"]["auto"] = auto
    return out, rows


def verify_reads(pair: Any, rows: list[dict]) -> dict:
    """The weight bytes one verify forward (AR: one step) reads — attention, MLP or router and the touched
    experts, one embedding row, LM head — and, for an MoE target, the experts it touched per MoE layer
    (mean over the traced rounds) and their mean: a tree reads the union of its tokens' experts; the
    busiest expert's tokens (mean over layers and rounds): how crowded that union is; and the fused kernel's
    row blocks per layer at the height it runs each round's tokens with (mean over layers and rounds): every
    block after an expert's first reads its weights again."""
    target = getattr(pair, "target", None)
    if target is None:
        return {}
    counts = [r["experts_touched"] for r in rows if r.get("experts_touched")]
    if not counts:
        return {"verify_weight_bytes": weight_bytes_per_step(target)}
    per_layer = [sum(col) / len(col) for col in zip(*counts)]
    out = {"experts_touched_per_layer": per_layer, "experts_touched_mean": sum(per_layer) / len(per_layer),
           "verify_weight_bytes": weight_bytes_per_step(target, per_layer)}
    busiest = [b for r in rows for b in (r.get("expert_tokens_max") or [])]
    if busiest:
        out["expert_tokens_max_mean"] = sum(busiest) / len(busiest)
    blocks = [statistics.fmean(per_layer) for r in rows if (per_layer := row_blocks_at_height(r))]
    if blocks:
        out["expert_row_blocks_mean"] = statistics.fmean(blocks)
    return out


def write_run(run_dir: str | os.PathLike, results: dict, rows: list[dict]) -> None:
    run_dir = Path(run_dir)
    atomic_write_jsonl(run_dir / TRACES_FILE, rows)
    atomic_write_json(run_dir / RESULTS_FILE, results)  # last: its presence means the run is whole


def ensure_results(params: RunParams, pair: Any = None, progress: bool = True) -> dict:
    """Load this run's results.json from params.run_dir, or generate and write it.

    Results written for other parameters, or timed with another thread count than this process has, are
    regenerated; results reused say when and how they were timed. If the study's AR run already exists,
    the comparison (speedup, losslessness) is added right away; the report recomputes it anyway."""
    run_dir = Path(params.run_dir or ".")
    inputs = input_digests(params)
    old, _ = read_results(run_dir)
    if old is not None and old.get("fingerprint") == params.fingerprint() and old.get("inputs") == inputs:
        threads = conditions(old)["threads"]
        if threads in (None, torch.get_num_threads()):
            print(f"{params.run_name}: stored results reused, {timing_text(old)}", flush=True)
            return old
        print(f"{params.run_name}: stored results were timed with {threads} threads, this process has "
              f"{torch.get_num_threads()}: timing it again", flush=True)
    results, rows = generate_run(params, pair, progress)
    results["fingerprint"] = params.fingerprint()
    results["inputs"] = inputs  # the prompt file and checkpoints it read: an edit in place regenerates
    ar = load_results(Path(params.study_dir) / ar_run_name(results)) if params.study_dir else None
    results["comparison"] = compare(results, ar)
    write_run(run_dir, results, rows)
    return results


def read_results(run_dir: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(results.json, None), (None, None) when absent, or (None, what is wrong with it, file and line)."""
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None, None
    try:
        res = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return None, f"{RESULTS_FILE} line {e.lineno}: not JSON ({e.msg})"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{RESULTS_FILE}: unreadable ({e})"
    if not isinstance(res, dict):
        return None, f"{RESULTS_FILE}: holds a JSON {type(res).__name__}, not an object"
    for key, kind in (("summary", dict), ("config", dict), ("prompts", list)):
        if key in res and not isinstance(res[key], kind):
            return None, f"{RESULTS_FILE}: '{key}' is not a{'n object' if kind is dict else ' list'}"
    if not all(isinstance(p, dict) for p in res.get("prompts", [])):
        return None, f"{RESULTS_FILE}: an entry of 'prompts' is not an object"
    return res, None


def load_results(run_dir: str | os.PathLike) -> dict | None:
    return read_results(run_dir)[0]


def check_traces(run_dir: str | os.PathLike) -> str | None:
    """What is wrong with a run's traces.jsonl (file and line), or None."""
    path = Path(run_dir) / TRACES_FILE
    try:
        load_traces(run_dir)
    except ValueError as e:
        return str(e).replace(str(path), TRACES_FILE)
    return None


def load_traces(run_dir: str | os.PathLike, prompt_id: str | None = None) -> list[dict]:
    """A run's trace rows; a ValueError names the file and line of a damaged one."""
    path = Path(run_dir) / TRACES_FILE
    if not path.is_file():
        return []
    rows = read_jsonl(path)
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{path}: row {i + 1} is not an object")
    return [r for r in rows if prompt_id is None or r.get("prompt_id") == prompt_id]


def tokenizer_for(results: dict | None):
    """The target's tokenizer (tokenizers only, no torch) from the checkpoint path in results."""
    tid = ((results or {}).get("models") or {}).get("target") or {}
    path = Path(tid["path"]) / "tokenizer.json" if isinstance(tid, dict) and tid.get("path") else None
    if path is None or not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - token text is a nicety
        return None


def overview(results: dict) -> str:
    """A few lines a notebook prints under a run."""
    s, c, cfg = results.get("summary", {}), results.get("comparison") or {}, results.get("config", {})
    tps, spt = s.get("tokens_per_second"), s.get("seconds_per_token")
    lines = [f"run {results.get('run')}: {cfg.get('method')} budget={cfg.get('budget')} topk={cfg.get('topk') or '-'} "
             f"T={cfg.get('temperature')} on {results.get('device', {}).get('gpu') or results.get('device', {}).get('device')}",
             f"  {s.get('new_tokens')} tokens in {s.get('rounds')} rounds, mean tau "
             f"{s.get('mean_tau') or 0:.2f}, {tps or 0:.1f} tokens/s ({(spt or 0) * 1e3:.1f} ms/token)",
             f"  speedup over AR: {c.get('speedup'):.2f}x" if c.get("speedup") else "  speedup over AR: n/a",
             f"  losslessness: {c.get('verdict')} ({c.get('detail')})",
             f"  {timing_text(results)}"]
    return "\n".join(lines)


def tree_rounds(params: RunParams, budgets: list[int] | None = None, pair: Any = None) -> dict[int, list[dict]]:
    """{budget: trace rows} for the tree explorer. For each budget: this run's own traces (an `auto` run's
    under "auto"), else the traces of the study's run at that budget, else rounds generated live (same
    prompts/settings).
    As a once-per-study notebook every budget comes from the study's runs: nothing is generated."""

    out: dict[int, list[dict]] = {}
    if params.method == "ar":
        return out  # AR rounds have no trees
    own = [r for r in load_traces(params.run_dir) if r.get("tree")]
    if params.method == "dflash":  # a single path of L nodes
        return {len(own[0]["tree"]["tokens"]): own} if own else out
    if own:
        out[params.budget] = own
    prompts = None
    for b in budgets or [params.budget]:
        if b in out:
            continue
        sibling = Path(params.study_dir) / run_name("ddtree", b, params.topk, params.temperature)
        rows = [r for r in load_traces(sibling) if r.get("tree")] if params.study_dir else []
        if not rows:
            pair = pair if pair is not None else load_run_pair(params)
            prompts = prompts or read_prompt_set(params.prompt_set, params.n_prompts)
            kw = {**gen_kwargs(params), "method": "ddtree", "budget": b, "topk": params.topk or None}
            for i, p in enumerate(prompts):
                rows += trace_rows(p, generate(pair, prompt_input(pair, p["prompt"]), seed=params.seed + i,
                                                  trace=True, **kw))
        out[b] = rows
    return out


def run_tokenizer(params: RunParams):
    """The tokenizer for token text: from this run's or any study run's results.json (no model
    load), else from the pair itself."""
    res = load_results(params.run_dir or ".")
    if res is None and params.study_dir and Path(params.study_dir).is_dir():
        res = next((r["results"] for r in collect_study(params.study_dir) if r.get("results")), None)
    tok = tokenizer_for(res)
    return tok if tok is not None else getattr(load_run_pair(params), "tokenizer", None)


def is_study_dir(study_dir: str | os.PathLike) -> bool:
    """Written by `ddtree-lab study` (it holds study.json), not by notebooks run on their own."""
    return (Path(study_dir) / STUDY_FILE).is_file()


def quick_sweep(params: RunParams, budgets: list[int], pair: Any = None) -> None:
    """Without a study runner: write AR + DDTree runs (one per budget) into params.study_dir, in the
    same layout a study uses, so the sweep and report functions read them alike."""
    pair = pair if pair is not None else load_run_pair(params)
    specs = [dataclasses.replace(params, method="ar", budget=0, topk=0)]
    specs += [dataclasses.replace(params, method="ddtree", budget=b) for b in budgets]
    for spec in specs:
        name = run_name(spec.method, spec.budget, spec.topk, spec.temperature)
        d = Path(spec.study_dir) / name
        d.mkdir(parents=True, exist_ok=True)
        res = ensure_results(dataclasses.replace(spec, run_name=name, run_dir=str(d)), pair, progress=False)
        atomic_write_json(d / RUN_FILE, {"name": name, "kind": "run", "status": "complete",
                                           "fingerprint": res.get("fingerprint"), "params": spec.to_json()})


# ----------------------------------------------------------------------------- comparison
def ar_run_name(results: dict) -> str:
    return run_name("ar", temperature=float(results.get("config", {}).get("temperature", 0.0)))


SAME_SETTINGS = ("pair", "target_dir", "drafter_dir", "device", "dtype", "prompt_set", "max_new_tokens",
                 "temperature")


def settings_differ(results: dict, ar: dict | None) -> list[str]:
    """Settings in which a run and its AR reference differ (then neither speedup nor tokens compare)."""
    a, b = results.get("config", {}), (ar or {}).get("config", {})
    return [k for k in SAME_SETTINGS if ar is not None and a.get(k) != b.get(k)]


def text_can_drift(cfg: dict) -> bool:
    """Whether a run with this config may emit other text than AR without a fault: a tree verify and a one-token
    AR step sum in different orders, and in 16-bit a near-tie can flip. The batch-invariant target sums them
    alike, and in float32 the tests hold every run to AR's text: there a mismatch is a fault."""
    return cfg.get("dtype") in ("bfloat16", "float16") and cfg.get("attention") != "invariant"


def losslessness(results: dict, ar: dict | None) -> dict:
    """At T = 0 every prompt's tokens must equal the AR run's, token for token."""
    cfg = results.get("config", {})
    if cfg.get("method") == "ar":
        return {"verdict": "reference", "detail": "the AR run is the reference"}
    if not results.get("summary", {}).get("new_tokens"):
        return {"verdict": "no tokens", "detail": "the run produced no tokens"}
    if float(cfg.get("temperature", 0.0)) > 0:
        return {"verdict": "not checked", "detail": "sampling (T > 0): outputs differ by design"}
    if ar is None:
        return {"verdict": "not checked", "detail": "no AR run at T = 0 in this study"}
    if settings_differ(results, ar):
        return {"verdict": "not checked", "detail": f"the AR run used other {', '.join(settings_differ(results, ar))}"}
    ar_tokens = {p["id"]: p["tokens"] for p in ar.get("prompts", [])}
    bad = []
    for p in results.get("prompts", []):
        ref = ar_tokens.get(p["id"])
        if ref is None:
            return {"verdict": "not checked", "detail": f"prompt {p['id']} missing from the AR run"}
        if p["tokens"] != ref:
            pos = next((i for i, (a, b) in enumerate(zip(p["tokens"], ref)) if a != b),
                       min(len(p["tokens"]), len(ref)))
            bad.append(f"{p['id']} diverges at token {pos}")
    if bad:
        detail = "; ".join(bad)
        if text_can_drift(cfg):  # not necessarily a bug (see text_can_drift)
            detail += (f" ({cfg.get('dtype')}: batched verify and one-token steps round differently; rerun with "
                       "attention: invariant to compare every run on AR's text, or dtype float32)")
        return {"verdict": "mismatch", "detail": detail}
    return {"verdict": "lossless", "detail": f"{len(ar_tokens)} prompt(s) identical to AR"}


def compare(results: dict, ar: dict | None) -> dict:
    sm, ar_sm = results.get("summary") or {}, (ar or {}).get("summary") or {}
    tps, ar_tps = finite(sm.get("tokens_per_second")), finite(ar_sm.get("tokens_per_second"))
    ok = bool(tps and ar_tps and not settings_differ(results, ar))
    speedup = tps / ar_tps if ok else None
    spread = None
    lo, hi = _spread(sm), _spread(ar_sm)
    if ok and lo and hi and hi[0] > 0:  # slowest pass over AR's fastest .. fastest over AR's slowest
        spread = [lo[0] / hi[1], lo[1] / hi[0]]
    return {"ar_run": (ar or {}).get("run"), "speedup": speedup, "speedup_spread": spread,
            **losslessness(results, ar)}


def _spread(summary: dict) -> list[float] | None:
    s = summary.get("tokens_per_second_spread")
    if isinstance(s, list) and len(s) == 2 and all(finite(x) for x in s):
        return [float(s[0]), float(s[1])]
    tps = finite(summary.get("tokens_per_second"))
    return [tps, tps] if tps else None


def collect_study(study_dir: str | os.PathLike) -> list[dict]:
    """Every run directory of a study as a row: status (run.json), results, fresh comparison."""
    study_dir = Path(study_dir)
    try:  # runs of grid points since dropped from the study file are left out
        listed = set(json.loads((study_dir / STUDY_FILE).read_text()).get("runs") or [])
    except (OSError, ValueError, AttributeError, TypeError):
        listed = set()
    rows = []
    for d in sorted(p for p in study_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        status = read_run_status(d)
        res, bad_results = read_results(d)
        if status is None and res is None and bad_results is None:
            continue
        if listed and d.name not in listed and (status or {}).get("kind", "run" if res else "study") == "run":
            continue
        kind = (status or {}).get("kind", "run" if res is not None or bad_results else "study")
        damaged = run_damage(d, status, bad_results)
        if res is not None and isinstance(res.get("summary"), dict):  # no figure is drawn from NaN
            res["summary"] = drop_non_finite(res["summary"])
        rows.append({"name": d.name, "dir": d, "kind": kind, "results": res, "run": status or {},
                     "damaged": damaged,
                     "status": "damaged" if damaged else (status or {}).get("status", "complete")})
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if r["results"] is not None:
            ar_row = by_name.get(ar_run_name(r["results"]))
            r["comparison"] = compare(r["results"], (ar_row or {}).get("results"))
    return rows


def run_damage(run_dir: Path, status: dict | None, bad_results: str | None) -> list[str]:
    """What is damaged in a finished run directory (file and line), from the digests run.json recorded
    and from reading results.json and traces.jsonl; [] when whole."""
    out = [bad_results] if bad_results else []
    if (run_dir / RUN_FILE).is_file() and status is None:
        out.append(f"{RUN_FILE}: not a readable JSON object")
    recorded = (status or {}).get("files")
    if isinstance(recorded, dict):
        out += [f"{x} (since the run finished)" for x in changed_files(run_dir, recorded)
                if not x.startswith(RESULTS_FILE) or not bad_results]
    bad_traces = check_traces(run_dir)
    if bad_traces:
        out.append(bad_traces)
    return out


def suspect_reason(row: dict) -> str | None:
    """Why a run needs a look (damaged, failed, no tokens, not lossless, NaN figures), or None."""
    if row.get("damaged"):
        return f"damaged: {'; '.join(row['damaged'])}"
    if row["status"] == "failed":
        return f"failed: {row['run'].get('error')}"
    res = row.get("results")
    if res is None:
        return "no results.json" if row["kind"] == "run" else None
    verdict = row.get("comparison", {}).get("verdict")
    if verdict in ("mismatch", "no tokens"):
        return f"{verdict}: {row['comparison'].get('detail')}"
    if any(not p.get("tokens") for p in res.get("prompts", [])):
        return "a prompt produced no tokens"
    sm = res.get("summary", {})
    nan = sorted(set(sm.get("non_finite") or []) |
                 {k for k in FIGURE_KEYS if sm.get(k) is not None and finite(sm[k]) is None})
    if nan:
        return f"summary {', '.join(nan)} not a finite number: left out of every figure"
    tau = sm.get("mean_tau")
    if tau is not None and tau < 1:
        return f"mean τ {tau} < 1"
    return None


# ----------------------------------------------------------------------------- recommendation
def _grid_config(row: dict) -> dict:
    return (row.get("results") or {}).get("config") or (row.get("run") or {}).get("params") or {}


def recommend(rows: list[dict]) -> list[dict]:
    """Per temperature: the DDTree run with the highest speedup among complete runs not found lossy,
    its speedup spread (timed passes), the runner-up, and whether its margin over AR (when it beats
    AR) or over the runner-up is within the spread of the passes (`within_noise`, `noise_against`).
    The best is a fixed budget's run; an `auto` run is set against it (`auto`, see `versus_auto`), and
    is the best itself only where no fixed budget ran. `timing_caveats` says why the timings behind it do not
    compare as they stand (measurement.py): some taken under contention, or with different thread counts."""
    by_t: dict[float, list[dict]] = {}
    autos: dict[float, list[dict]] = {}
    ar: dict[float, dict] = {}
    for r in rows:
        cfg, cmp = _grid_config(r), r.get("comparison") or {}
        if r.get("kind") != "run" or r.get("status") != "complete" or r.get("results") is None:
            continue
        t = float(cfg.get("temperature") or 0.0)
        if cfg.get("method") == "ar":
            ar[t] = r
        if cfg.get("method") != "ddtree" or finite(cmp.get("speedup")) is None:
            continue
        if cmp.get("verdict") in ("mismatch", "no tokens"):
            continue
        (by_t if is_fixed(cfg.get("budget")) else autos).setdefault(t, []).append(r)
    out = []
    for t in sorted(set(by_t) | set(autos)):
        ranked = sorted(by_t.get(t) or autos[t], key=lambda r: -r["comparison"]["speedup"])
        best, second = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        cfg, cmp, sm = _grid_config(best), best["comparison"], (best["results"].get("summary") or {})
        mine = _spread(sm)
        rec = {"temperature": t, "run": best["name"], "budget": cfg.get("budget"), "topk": cfg.get("topk"),
               "speedup": cmp["speedup"], "speedup_spread": cmp.get("speedup_spread"),
               "mean_tau": sm.get("mean_tau"), "timing_repeats": sm.get("timing_repeats"),
               "runner_up": second["name"] if second else None,
               "runner_up_budget": _grid_config(second).get("budget") if second else None,
               "runner_up_speedup": second["comparison"]["speedup"] if second else None,
               "within_noise": False, "noise_against": None}
        ar_spread = _spread((ar.get(t, {}).get("results") or {}).get("summary") or {})
        if cmp["speedup"] >= 1 and mine and ar_spread and mine[0] <= ar_spread[1]:
            rec.update(within_noise=True, noise_against="AR")  # the slowest pass is no faster than AR's best
        elif second is not None and mine:
            other = _spread(second["results"].get("summary") or {})
            if other and other[1] >= mine[0]:
                rec.update(within_noise=True, noise_against=second["name"])
        rec["auto"] = versus_auto(best, autos.get(t, [])) if t in by_t else None
        compared = [r for r in [ar.get(t), *by_t.get(t, []), *autos.get(t, [])] if r is not None]
        rec["timing_caveats"] = timing_caveats({r["name"]: r["results"] for r in compared})
        out.append(rec)
    return out


def versus_auto(best: dict, autos: list[dict]) -> dict | None:
    """The study's `auto` run (the one of the best's topk where there are several) against the best fixed
    budget's run: its tokens/s over the best's (`vs_best_fixed`), whether it won, and whether their timed
    passes overlap (`within_noise`); None without an auto run."""
    if not autos:
        return None
    topk = _grid_config(best).get("topk")
    a = max(autos, key=lambda r: (_grid_config(r).get("topk") == topk, r["comparison"]["speedup"]))
    sm, best_sm = a["results"].get("summary") or {}, best["results"].get("summary") or {}
    ratio = a["comparison"]["speedup"] / best["comparison"]["speedup"]  # the same AR: the tokens/s ratio
    mine, theirs = _spread(sm), _spread(best_sm)
    return {"run": a["name"], "speedup": a["comparison"]["speedup"], "vs_best_fixed": ratio, "won": ratio > 1,
            "within_noise": bool(mine and theirs and mine[1] >= theirs[0] and theirs[1] >= mine[0]),
            "candidates": (sm.get("auto") or {}).get("candidates"),
            "budget_share": (sm.get("auto") or {}).get("budget_share")}


def recommend_budget(rows: list[dict]) -> dict | None:
    """The single best DDTree run over all temperatures (the sweep figure's star), or None."""
    recs = recommend(rows)
    return max(recs, key=lambda r: r["speedup"]) if recs else None


def recommendation_text(rec: dict) -> str:
    """One temperature's recommendation as a sentence (plain text; the report escapes it)."""
    sp = rec.get("speedup_spread")
    spread = f" (passes {sp[0]:.2f}–{sp[1]:.2f}×, {rec.get('timing_repeats')} timed)" if sp else ""
    tau = f", mean τ {rec['mean_tau']:.2f}" if finite(rec.get("mean_tau")) is not None else ""
    where = f"T {rec['temperature']:g}: "
    if rec["speedup"] >= 1:
        text = (f"{where}Recommended budget {rec['budget']} (topk {rec['topk'] or '= budget'}): "
                f"{rec['speedup']:.2f}× over AR{spread}{tau} — run {rec['run']}.")
    else:
        text = (f"{where}No budget beat AR. The best DDTree run, budget {rec['budget']} ({rec['run']}), reached "
                f"{rec['speedup']:.2f}×{spread}{tau}: the drafter is not accepted often enough to pay for "
                "drafting and a wider verify on this hardware.")
    if rec.get("noise_against") == "AR":
        text += (" Its margin over AR is within noise: its slowest timed pass was no faster than AR's fastest; "
                 "raise grid.repeats or the prompt count before acting on it.")
    elif rec.get("noise_against"):
        text += (f" Budget {rec['runner_up_budget']} ({rec['runner_up_speedup']:.2f}×) is within noise of it: "
                 "their timed passes overlap, so either will do.")
    auto = rec.get("auto")
    if auto:
        among = ", ".join(map(str, auto.get("candidates") or [])) or "its candidates"
        won = "auto won" if auto["won"] else f"the fixed budget {rec['budget']} won"
        text += (f" Budget auto ({auto['run']}, choosing among {among}) ran at {auto['vs_best_fixed']:.2f}× the "
                 f"tokens/s of budget {rec['budget']}: {won}"
                 + (", within noise (their timed passes overlap)." if auto["within_noise"] else "."))
    if rec.get("timing_caveats"):
        text += (f" Its timings do not compare as they stand: {'; '.join(rec['timing_caveats'])}. Time the runs "
                 "again on an idle machine, with one thread count, before acting on it.")
    return text
