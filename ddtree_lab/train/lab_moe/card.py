"""The lab-moe pair's model card: engine evaluation of the exported pair and README.md.

What it measures, with `ddtree_lab.generate` in float32 on the held-out lab prompt sets: τ at T = 0 (with the AR
equality check) and T = 1 for DFlash and DDTree(budgets); the experts each verify forward touches per MoE layer
against its tokens, for the learned router and for the same weights under declared uniform routing, beside the
expectation E·(1 − ((E − k)/E)^T) (workbench/routing.py); the shipped target's load per expert on held-out text;
the INT4 copy's τ beside bf16's on the same prompts. Each part is kept in the work dir (card_*.json) and reused.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ...pairs import TRAIN_LAB_MOE
from ..card import bars_table, read_summary, slim, tau_bars, tau_table
from ..common import log, pick_device
from ..lab.card import evaluate_sets
from ..lab.corpus import load_corpus
from ..lab.prompts import read_jsonl
from . import CACHE_DIR, LAB_PROMPT_DIR
from .balance import DEAD_SHARE, MOST_TOKENS, heldout_load, load_figures

SIZE_BUDGET_MIB = 16.0  # target + drafter (+ tokenizer, configs, card) as shipped
# What docs/lab_moe.md ("Rebuilding") runs; the card prints it under "Reproduce".
COMMANDS = f"""{TRAIN_LAB_MOE} --stages prepare --cache {CACHE_DIR}   # CPU: the lab corpus, lab tokenizer
python -m ddtree_lab.train.lab_moe --device cuda --cache {CACHE_DIR} --run-dir $OUT/lab_moe \\
    --stages prepare,target,pool,drafter,pack,export,int4,card --pack-dir $OUT/lab_moe/pack --tidy   # one H200
cp -r $OUT/lab_moe/pair/* ddtree_lab/pairs/lab_moe/    # ship target/, drafter/, README.md, eval.json
{TRAIN_LAB_MOE} --stages int4    # the lab-moe-int4 pair from the shipped target (the int4 extra)"""


def _engine(cfg) -> dict:
    """load_pair's device, dtype and attention for the card: float32 (T = 0 equality is exact), the MLA kernel on a
    GPU, the dense reference on a CPU."""
    device = pick_device(cfg.card_device)
    return {"device": str(device), "dtype": "float32", "attention": "triton" if device.type == "cuda" else "sdpa"}


class _Pairs:
    """Each pair the card measures, loaded once (its captured graphs serve every measurement of it)."""

    def __init__(self, cfg, out: Path, int4: Path):
        self.cfg, self.out, self.int4, self.loaded = cfg, out, int4, {}

    def has_int4(self) -> bool:
        return (self.int4 / "config.json").is_file()

    def __call__(self, name: str):
        """"bf16" (as shipped), "uniform" (the same weights, declared uniform routing) or "int4"."""
        import ddtree_lab as dl
        if name not in self.loaded:
            target = self.int4 if name == "int4" else self.out / "target"
            self.loaded[name] = dl.load_pair(target=target, drafter=self.out / "drafter",
                                             routing="uniform" if name == "uniform" else "router", **_engine(self.cfg))
        return self.loaded[name]


def _cached(work: Path, name: str, measure, stale=lambda value: False):
    """work/card_<name>.json, else measure() (and kept there); stale(value) says a kept value must be measured again."""
    path = work / f"card_{name}.json"
    if path.exists() and not stale(json.loads(path.read_text())):
        log(f"card: reusing {path} (delete it to measure again)")
        return json.loads(path.read_text())
    value = measure()
    path.write_text(json.dumps(value, indent=1) + "\n")
    return value


def _rows(per_set: int) -> list[dict]:
    return [r for f in sorted(LAB_PROMPT_DIR.glob("*.jsonl")) for r in read_jsonl(f)[:per_set]]


def expert_union(pair, rows: list[dict], n_new: int, budgets) -> dict:
    """Experts touched per MoE layer by each verify forward, by its tokens T (DFlash's block, DDTree's tree + root):
    {T: {"rounds", "per_layer" (mean over rounds), "mean" (over layers too)}}, from traced rounds at T = 0."""
    import ddtree_lab as dl
    per_t: dict[int, list] = {}
    for row in rows:
        for method, kw in [("dflash", {})] + [("ddtree", {"budget": b}) for b in budgets]:
            res = dl.generate(pair, row["prompt"], method=method, max_new_tokens=n_new, trace=True, **kw)
            for r in res.rounds:
                if r.tree is not None and r.experts_touched is not None:
                    per_t.setdefault(len(r.tree) + 1, []).append(r.experts_touched)
    return {str(t): {"rounds": len(v), "per_layer": np.mean(v, 0).round(3).tolist(),
                     "mean": round(float(np.mean(v)), 3)} for t, v in sorted(per_t.items())}


def measure_load(cfg, cache: Path, out: Path) -> dict:
    from ...checkpoint import load_target
    _, held, _ = load_corpus(cache)
    device = pick_device(cfg.card_device)
    target = load_target(out / "target", device=device)
    counts = heldout_load(target, held, cfg.seq_len, device, cfg.balance_windows)
    return {"counts": counts.astype(np.int64).tolist(), **load_figures(counts, target.cfg.num_experts_per_tok)}


def measure_int4(cfg, pairs: _Pairs) -> dict:
    """INT4 and bf16 weights on the same prompts at T = 0 (an empty dict when there is no INT4 copy)."""
    if not pairs.has_int4():
        log(f"card: no INT4 copy in {pairs.int4}; its τ is left out")
        return {}
    ev = {name: slim(evaluate_sets(pairs(name), LAB_PROMPT_DIR, cfg.dflash.n_new, cfg.dflash.budgets, log,
                                   cfg.int4_prompts or None, 0.0, cfg.seed)) for name in ("bf16", "int4")}
    size = sum(f.stat().st_size for f in pairs.int4.rglob("*") if f.is_file()) / 2**20
    return {"size_mib": round(size, 2), "group_size": cfg.int4_group, **ev}


def evaluate(cfg, cache: Path, work: Path, out: Path, int4: Path) -> dict:
    pairs = _Pairs(cfg, out, int4)
    budgets, n_new = cfg.dflash.budgets, cfg.dflash.n_new

    def taus(temperature: float, n: int) -> dict:
        return evaluate_sets(pairs("bf16"), LAB_PROMPT_DIR, n_new, budgets, log, n or None, temperature, cfg.seed)

    def union() -> dict:
        rows = _rows(cfg.union_prompts)
        log(f"card: experts touched on {len(rows)} prompts, learned and uniform routing")
        return {routing: expert_union(pairs(name), rows, n_new, budgets)
                for routing, name in (("router", "bf16"), ("uniform", "uniform"))}

    return {"engine": _engine(cfg), "n_new": n_new,
            "t0": _cached(work, "t0", lambda: taus(0.0, cfg.card_prompts)),
            "t1": _cached(work, "t1", lambda: taus(1.0, cfg.sampled_prompts)),
            "union": _cached(work, "union", union),
            "load": _cached(work, "load", lambda: measure_load(cfg, cache, out)),
            # a run without compressed-tensors kept {}: an INT4 copy made since is measured
            "int4": _cached(work, "int4", lambda: measure_int4(cfg, pairs), lambda v: not v and pairs.has_int4())}


# ----------------------------------------------------------------------------- README.md

def union_rows(union: dict, experts: int, top_k: int) -> list[dict]:
    """Per forward size T: learned and uniform (measured) experts touched per layer, and uniform's expectation."""
    from ...workbench.routing import uniform_union
    rows = [{"tokens": 1, "learned": float(top_k), "uniform": float(top_k), "expected": float(top_k)}]  # an AR step
    for t in sorted(int(t) for t in union.get("router", {})):
        uni = union.get("uniform", {}).get(str(t))
        rows.append({"tokens": t, "learned": union["router"][str(t)]["mean"],
                     "uniform": uni["mean"] if uni else float("nan"), "expected": uniform_union(experts, top_k, t)})
    return rows


def _union_table(rows: list[dict], budgets, block: int) -> str:
    what = {1: "AR step", block: "DFlash block", **{b + 1: f"DDTree({b})" for b in budgets}}
    out = ["| tokens in the forward | learned router | uniform routing | uniform, expected "
           "| learned ÷ uniform expected |", "|---|---|---|---|---|"]
    out += [f"| {r['tokens']} ({what.get(r['tokens'], 'tree')}) | {r['learned']:.2f} | {r['uniform']:.2f} | "
            f"{r['expected']:.2f} | {r['learned'] / r['expected']:.2f} |" for r in rows]
    return "\n".join(out)


def _load_table(tsum: dict) -> str:
    hist = tsum.get("history", [])
    pick = [h for i, h in enumerate(hist) if i % max(1, len(hist) // 6) == 0 or i == len(hist) - 1]
    rows = ["| step | held-out loss | least loaded expert (× fair share), per MoE layer | most loaded | bias spread |",
            "|---|---|---|---|---|"]
    def cells(values, fmt):
        return " ".join(format(v, fmt) for v in values)

    for h in pick:
        if "load_min_vs_fair" in h:
            rows.append(f"| {h['step']} | {h['heldout_loss']:.3f} | {cells(h['load_min_vs_fair'], '.2f')} | "
                        f"{cells(h['load_max_vs_fair'], '.2f')} | {cells(h['bias_spread'], '.3f')} |")
    return "\n".join(rows)


def _int4_section(int4: dict, budgets) -> str:
    if not int4:
        return (f"Not measured in this run (no INT4 copy: the `int4` stage needs the int4 extra). "
                f"`{TRAIN_LAB_MOE} --stages int4` makes it from the shipped target.")
    methods = ["dflash"] + [f"ddtree{b}" for b in budgets]
    head = "| weights | DFlash | " + " | ".join(f"DDTree({b})" for b in budgets) + " | output == AR |"
    rows = [head, "|" + "---|" * (len(methods) + 2)]
    for name in ("bf16", "int4"):
        ov, ok = int4[name]["overall_tau"], int4[name]["lossless"]
        rows.append(f"| {name} | " + " | ".join(f"{ov[m]:.2f}" for m in methods) + f" | {'yes' if ok else 'NO'} |")
    return (f"The routed experts INT4 (compressed-tensors `pack-quantized`, symmetric, groups of "
            f"{int4['group_size']} along K, min-max scales), everything else as shipped; {int4['size_mib']:.2f} MiB. "
            "Same prompts, T = 0:\n\n" + "\n".join(rows))


def write_card(cfg, meta: dict, tsum: dict, dsum: dict, ev: dict, out: Path) -> str:
    budgets = tuple(cfg.dflash.budgets)
    tgt = json.loads((out / "target" / "config.json").read_text())
    drf = json.loads((out / "drafter" / "config.json").read_text())
    E, k = tgt["n_routed_experts"], tgt["num_experts_per_tok"]
    n_d = dsum.get("variants", {}).get(dsum.get("chosen", ""), {}).get("params", 0)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and f.name != "README.md") / 2**20
    load = ev["load"]
    rows = union_rows(ev["union"], E, k)
    at65 = next((r for r in rows if r["tokens"] == 65), None)
    t0, t1 = ev["t0"], ev["t1"]
    bars = tau_bars(t0["overall_tau"], t0["lossless"], "DFlash and DDTree output == AR output (T = 0)") + [
        (f"no dead expert (each ≥ {DEAD_SHARE:g} × its fair share)", load["none_dead"],
         f"least loaded {min(load['min_vs_fair']):.2f}×"),
        (f"no expert takes most tokens (each ≤ {MOST_TOKENS:.0%} of them)", load["none_takes_most"],
         f"busiest {max(load['max_token_share']):.0%}"),
        (f"target + drafter ≤ {SIZE_BUDGET_MIB:g} MiB", size <= SIZE_BUDGET_MIB, f"{size:.2f} MiB")]
    per_layer = ev["union"].get("router", {}).get("65", {}).get("per_layer", [])
    union_line = (f"At 65 tokens (a DDTree(64) verify) the learned router touches {at65['learned']:.2f} experts per "
                  f"MoE layer (layers {tgt['first_k_dense_replace']}–{tgt['num_hidden_layers'] - 1}: "
                  f"{', '.join(f'{v:.1f}' for v in per_layer)}), "
                  f"{at65['learned'] / at65['expected']:.0%} of the {at65['expected']:.2f} that uniform routing is "
                  "expected to touch." if at65 else "")
    mla = f"q LoRA {tgt['q_lora_rank']}" if tgt.get("q_lora_rank") else "no q LoRA"
    text = f"""# The ddtree_lab lab-moe pair

A small **DeepSeek-V3-architecture target** (MLA, a dense first layer, {E} routed experts with learned, balanced
routing) and its **DFlash drafter** (block size {drf['block_size']}), trained here on the lab pair's corpus with the lab
pair's tokenizer, so that MoE studies run offline and the MoE code paths have a trained model to be exact on. Stored
as real checkpoints are (`target/`: `DeepseekV3ForCausalLM`; `drafter/`: `DFlashDraftModel`); the prompt sets are
the lab pair's (`lab-moe:code`, `lab-moe:docstring`).

```python
import ddtree_lab as dl
pair = dl.load_pair("lab-moe")
res = dl.generate(pair, "def fibonacci(n):", method="ddtree", budget=64, max_new_tokens=96)
```

## Files

| path | what |
|---|---|
| `target/` | config.json, model.safetensors ({tgt['torch_dtype']}), {tsum.get('params', 0) / 1e6:.2f} M parameters; the lab pair's tokenizer.json and tokenizer_config.json |
| `drafter/` | config.json, model.safetensors, {n_d / 1e6:.2f} M parameters (plus the target's embedding and LM head, which it borrows) |
| `eval.json` | this card's numbers |

Total {size:.2f} MiB without this file. The INT4 copy is not shipped (it would not fit beside the rest):
`{TRAIN_LAB_MOE} --stages int4` writes it, then `dl.load_pair("lab-moe-int4")` loads it.

## Target

`DeepseekV3ForCausalLM`: hidden {tgt['hidden_size']}, {tgt['num_hidden_layers']} layers (the first {tgt['first_k_dense_replace']} dense, MLP
{tgt['intermediate_size']}), {tgt['num_attention_heads']} heads; MLA with {mla}, kv_lora_rank {tgt['kv_lora_rank']}, qk_nope {tgt['qk_nope_head_dim']} + rope
{tgt['qk_rope_head_dim']}, v {tgt['v_head_dim']}; {E} routed experts of width {tgt['moe_intermediate_size']}, top-{k} by sigmoid scores plus a correction
bias among the best {tgt['topk_group']} of {tgt['n_group']} groups, weights renormalised × {tgt['routed_scaling_factor']:g}, {tgt['n_shared_experts']} shared expert; tied
embeddings, RoPE θ = {tgt['rope_theta']:g}, context {tgt['max_position_embeddings']}.

Trained as the lab target (`ddtree_lab/train/lab/pipeline.py`): next-token loss on random {cfg.seq_len}-token windows of
the {meta['train_tokens']:,} training tokens (the Python {meta['python_version']} standard library minus {meta['n_heldout_files']} held-out
files), batch {cfg.batch_size}, AdamW, peak LR {cfg.lr:g}, residual dropout {cfg.dropout}, bf16 autocast, the best held-out checkpoint kept.
The experts train through every token (`moe.moe_torch_dense`); routing is balanced without a loss term: after
every step each layer's correction bias moves by γ = {cfg.bias_update_rate:g} against its load, bias_e += γ·sign(mean load − load_e).

- {tsum.get('steps')} steps, {tsum.get('tokens_seen', 0) / 1e6:.0f} M tokens ({tsum.get('epochs', 0):.1f} epochs) in {tsum.get('seconds', 0):.0f} s.
- **Held-out loss {tsum.get('best_heldout_loss', float('nan')):.3f} nats/token** (perplexity {math.exp(tsum.get('best_heldout_loss', float('nan'))):.2f}).

Load over training (each eval interval's tokens per expert against the fair share, k·T/E):

{_load_table(tsum)}

The shipped target on {load['tokens']:,} held-out tokens: least loaded expert per layer
{' '.join(f'{v:.2f}' for v in load['min_vs_fair'])} × its fair share, most loaded {' '.join(f'{v:.2f}' for v in load['max_vs_fair'])} ×
(the busiest takes {' '.join(f'{v:.0%}' for v in load['max_token_share'])} of the tokens); {load['dead_experts']} dead experts.

## Drafter

`DFlashDraftModel`: {drf['num_hidden_layers']} layer(s) of the target's width (MLP {drf['intermediate_size']}, {drf['num_attention_heads']} heads of {drf['head_dim']}), context from
target layers `{drf['dflash_config']['target_layer_ids']}`, trained with train/recipe.py's DFlash loop on a pool of the frozen
target's greedy continuations (soft_weight {cfg.dflash.soft_weight:g}): {dsum.get('steps')} steps in {dsum.get('seconds', 0):.0f} s.

## Acceptance (held-out prompts, {ev['n_new']} new tokens, `ddtree_lab.generate` on {ev['engine']['device']}, float32)

Mean τ = accepted tokens per target forward (root included), pooled over all rounds of all prompts.

T = 0 ({t0['sets'][next(iter(t0['sets']))]['n_prompts']} prompts per set):

{tau_table(t0, budgets)}

T = 1 ({t1['sets'][next(iter(t1['sets']))]['n_prompts']} prompts per set, sampled):

{tau_table(t1, budgets, checked=False)}

""" + bars_table("bar", bars) + f"""

## Experts touched per verify forward

A tree's verify forward reads the union of its tokens' experts. Distinct experts per MoE layer (mean over layers and
rounds, T = 0) against the tokens in the forward, for the learned router and for the same weights with uniform routing
(each token's top-{k} drawn independently: `load_pair(..., routing="uniform")`), beside uniform routing's expectation
E·(1 − ((E − k)/E)^T):

{_union_table(rows, budgets, drf['block_size'])}

{union_line}

## INT4 experts

{_int4_section(ev['int4'], budgets)}

## Reproduce

```
{COMMANDS}
```

`prepare` encodes the corpus with the lab pair's tokenizer (on the CPU: this interpreter's standard library, which
for Python {meta['python_version']} is the lab pair's corpus); the rest runs on the GPU under `--run-dir` (every
product, the log included). `--preset smoke` runs every stage on the CPU in seconds (the test suite does).
"""
    (out / "README.md").write_text(text)
    return text


def stage_card(cfg, cache: Path, work: Path, out: Path, int4: Path) -> dict:
    _, _, meta = load_corpus(cache)
    tsum, dsum = read_summary(work, "target_summary"), read_summary(work, "drafter_summary")
    with torch.no_grad():
        ev = evaluate(cfg, cache, work, out, int4)
    (out / "eval.json").write_text(json.dumps({
        "engine": ev["engine"], "t0": slim(ev["t0"]), "t1": slim(ev["t1"]), "union": ev["union"],
        "load": {k: v for k, v in ev["load"].items() if k != "counts"}, "int4": ev["int4"]}, indent=2) + "\n")
    write_card(cfg, meta, tsum, dsum, ev, out)
    log("card: T = 0 " + ", ".join(f"{m} τ {t:.2f}" for m, t in ev["t0"]["overall_tau"].items()) +
        f"; lossless {ev['t0']['lossless']}; README.md written")
    return ev
