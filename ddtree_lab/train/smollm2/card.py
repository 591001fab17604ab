"""The SmolLM2 drafter's model card: engine τ per held-out prompt set at T = 0 and 1, and README.md.

The evaluation runs `ddtree_lab.generate` (AR, DFlash, DDTree(budgets)) on the shipped prompt sets
through `engine_tau`; at T = 0 it also checks that DFlash and DDTree emit exactly the AR tokens.
It is slow on a CPU (every prompt at every temperature), so it is kept in work/card_eval.json and reused.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..card import bars_table, cached_evaluation, read_summary, slim, tau_bars, tau_table
from ..common import log
from ..evaluate import engine_tau, pooled
from . import PROMPT_SETS, load_prompts

# What docs/smollm2.md ("Training the drafter") runs; a work/card_command.txt replaces it in the card.
GPU_COMMAND = """ddtree-lab pull smollm2                                   # once, CPU
ddtree-lab train-smollm2-drafter --stages prepare,pool,drafter,pack --device cuda --pack-dir $OUT/pack   # one GPU call
ddtree-lab train-smollm2-drafter --stages unpack,export,card --pack-dir PACK --device cpu                 # CPU"""


def evaluate(cfg, tdir: Path, out: Path) -> dict:
    import torch

    import ddtree_lab as dl
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    pair = dl.load_pair(target=tdir, drafter=out, device=device)  # float32: T = 0 equality is exact
    res = {"load_seconds": time.perf_counter() - t0, "device": device, "n_new": cfg.dflash.n_new, "temperatures": {}}
    for T in cfg.temperatures:
        sets = {}
        for name in PROMPT_SETS:
            rows = load_prompts(name)[:cfg.card_prompts or None]
            rows = [{"id": r["id"], "prompt": r["messages"], "source": name} for r in rows]
            log(f"card: T={T:g}, {len(rows)} '{name}' prompts")
            sets[name] = engine_tau(pair, rows, cfg.dflash.n_new, cfg.dflash.budgets, log=log, temperature=T,
                                    seed=cfg.seed)
        res["temperatures"][f"{T:g}"] = pooled(sets)
    return res


def speed_section(bench: dict) -> str:
    """Tokens/s from a `ddtree-lab bench prompts` JSON (work/speed.json), if one was measured."""
    if not bench.get("rows"):
        return ""
    env = bench.get("environment", {})
    def name(r):
        return r["method"] if r["budget"] is None else f"{r['method']} ({r['budget']})"
    def decode(r):  # benches before the prefill split have no decode-only figure
        d = r.get("decode_tokens_per_second")
        return f"{d:.0f} | {r['decode_speedup_over_ar']:.2f}×" if d else "– | –"
    rows = "\n".join(f"| {name(r)} | {r['tokens_per_second']:.0f} | {r['speedup_over_ar']:.2f}× | {decode(r)} | "
                     f"{r['mean_tau']:.2f} | {r.get('prompts_equal_to_ar', '–')} |" for r in bench["rows"])
    return f"""
## Speed on {env.get('device', '?')}

`ddtree-lab bench prompts --pair smollm2 --prompts {bench.get('prompt_set')} --n-prompts {bench.get('n_prompts')} \
--max-new-tokens {bench.get('max_new_tokens')}{' --compile' if bench.get('compile') else ''}` ({bench.get('pair', {}).get('dtype', '?')}, \
attention `{bench.get('pair', {}).get('attention', '?')}`, CUDA graphs; torch {env.get('torch')}, commit {str(env.get('commit'))[:7]}).
Tokens/s count every new token over the wall time of `generate`, prefill included; "decode" leaves the
prefill out. τ here is in bf16, where near-tied argmaxes can flip between the tree's batched verify and AR's
one-token step, so the last column counts the prompts whose output equals AR's.

| method | tokens/s | vs AR | decode tokens/s | decode vs AR | τ | outputs = AR's |
|---|---|---|---|---|---|---|
{rows}

Best budget: {bench.get('best_budget')}.
"""


def _per_step(dsum: dict, cfg) -> str:
    """Responses per optimiser step: the batch, times the processes that trained data-parallel."""
    n = dsum.get("processes", 1)
    b = dsum.get("batch", cfg.dflash.drafter_batch)
    return f"{b}" if n == 1 else f"{n} processes (one per GPU, gradients averaged) × {b}"


def _ask_line(ask: dict) -> str:
    if not ask.get("kept"):
        return ""
    return (f"- {ask['kept']} more requests written by the target itself (stage `ask`: sampled at T = "
            f"{ask['temperature']:g} from instructions such as \"Write one question that a student might ask an AI "
            f"assistant about baking bread\"; {ask['asked']} asked, the unfinished, too short or long and repeated "
            f"ones dropped): {ask['kinds']}.\n")


def write_card(cfg, tdir: Path, work: Path, out: Path, ev: dict) -> str:
    drf = json.loads((out / "config.json").read_text())
    prep, pool, dsum, timing = read_summary(work, "prepare_summary"), read_summary(work, "pool_summary"), \
        read_summary(work, "drafter_summary"), read_summary(work, "timing")
    from ...checkpoint import load_tokenizer
    tok, _ = load_tokenizer(tdir)
    mask_text = tok.id_to_token(drf["dflash_config"]["mask_token_id"]) if tok else "?"
    pt = prep.get("prompt_tokens", {})
    n_d = dsum.get("variants", {}).get(dsum.get("chosen", ""), {}).get("params", 0)
    budgets = tuple(cfg.dflash.budgets)
    t0 = ev["temperatures"].get("0", {})
    ov = t0.get("overall_tau", {})
    bars = tau_bars(ov, t0["lossless"], "DFlash and DDTree output == AR output (T = 0)") if ov else []
    tables = []
    for T, e in ev["temperatures"].items():
        tps = {m: sum(s["tokens_per_s"][m] for s in e["sets"].values()) / len(e["sets"]) for m in ["ar", "dflash"]}
        tables.append(f"### T = {T}\n\n{tau_table(e, budgets, checked=T == '0')}\n\n"
                      f"({ev['device']} tokens/s, a sanity figure, not the H200 one: AR {tps['ar']:.1f}, DFlash {tps['dflash']:.1f})\n")
    hist = dsum.get("history", [])
    last = hist[-1] if hist else {}
    quick = dsum.get("variants", {}).get(dsum.get("chosen", ""), {}).get("tau", {})
    n_prompts = len(load_prompts(PROMPT_SETS[0])[:cfg.card_prompts or None])
    text = f"""# DFlash drafter for SmolLM2-135M-Instruct

A DFlash block drafter (block size {drf['block_size']}) trained here for the SmolLM2-135M-Instruct target that
`ddtree-lab pull smollm2` imports. The target is not in this folder; the drafter borrows its token
embedding and LM head.

```python
import ddtree_lab as dl
pair = dl.load_pair("smollm2")          # after `ddtree-lab pull smollm2`
res = dl.generate(pair, [{{"role": "user", "content": "Why is the sea salty?"}}], method="ddtree", budget=64)
```

## Model

`DFlashDraftModel`: {drf['num_hidden_layers']} layer(s) of the target's width {drf['hidden_size']} ({drf['num_attention_heads']} query / {drf['num_key_value_heads']} KV heads of {drf['head_dim']},
MLP {drf['intermediate_size']}), {n_d / 1e6:.2f} M parameters, {drf.get('torch_dtype')}, {(out / 'model.safetensors').stat().st_size / 2**20:.2f} MiB.
Context: outputs of target layers `{drf['dflash_config']['target_layer_ids']}` (0-based, of {drf['num_target_layers']}), concatenated,
projected by `fc`, normalised by `hidden_norm`. Mask token: id {drf['dflash_config']['mask_token_id']} (`{mask_text}`), an existing
special token that chat prompts never contain and the target never emits (for SmolLM2 one of the code-corpus
markers left untrained: its embedding row equals those of the other unused markers), so the vocabulary is unchanged.

## Data

- {prep.get('prompts', '?')} distinct single-turn user messages composed offline from templates × topics
  (`ddtree_lab/train/smollm2/train_prompts.py`, seed {cfg.seed}): {prep.get('kinds', {})}; none equals a held-out prompt.
  Rendered with the checkpoint's chat template (default system message included), {pt.get('min', '?')}–{pt.get('max', '?')} tokens (mean {pt.get('mean', 0):.0f}).
{_ask_line(read_summary(work, "ask_summary"))}- Responses: the target's own greedy output (bf16 weights, batched, left-padded) up to its first `<|im_end|>`,
  at most {pool.get('gen_len', '?')} tokens: {pool.get('sequences', '?')} responses, {pool.get('response_tokens', '?')} tokens
  (mean {pool.get('mean_response', 0):.0f}; {pool.get('ended_with_eos', '?')} ended with EOS),
  {pool.get('generation_seconds', 0):.0f} s on {pool.get('device', '?')}.

## Recipe (the lab pair's, `ddtree_lab/train/recipe.py: train_drafters`)

Target frozen. Per step {_per_step(dsum, cfg)} responses × {cfg.dflash.anchors} anchors p drawn in the response (the first at the
prompt's end, as the engine's first round); block [x_p, MASK × {drf['block_size'] - 1}] attends to itself and to the target
features of positions < p; cross-entropy of slot k against the greedy token p+k weighted exp(−(k−1)/{cfg.dflash.gamma:g}),
KL weight {cfg.dflash.soft_weight:g}; labels after the response's EOS ignored. AdamW, peak LR {cfg.dflash.drafter_lr:g}, warmup {cfg.dflash.drafter_warmup},
cosine, bf16 autocast on CUDA. {dsum.get('steps', '?')} steps in {dsum.get('seconds', 0):.0f} s; last chain τ on training batches
{last.get('chain_tau', float('nan')):.2f}{f"; quick held-out τ (simulated, {cfg.dflash.eval_prompts} prompts per set) {quick}" if quick else ""}.

Stage times: {', '.join(f"{k} {v['seconds']:.0f} s ({v['device']})" for k, v in timing.items())}.

## Acceptance (held-out prompts, {n_prompts} per set, {ev['n_new']} new tokens, `ddtree_lab.generate` on {ev['device']})

Mean τ = accepted tokens per target forward (root included), pooled over all rounds of all prompts.

""" + "\n".join(tables) + """
""" + bars_table("bar (T = 0)", bars) + f"""
{speed_section(read_summary(work, "speed"))}
## Reproduce

```
{(work / 'card_command.txt').read_text().strip() if (work / 'card_command.txt').exists() else GPU_COMMAND}
```
"""
    notes = work / "card_notes.md"  # what limited a bar, written by whoever ran the training
    if notes.exists():
        text += "\n" + notes.read_text().strip() + "\n"
    (out / "README.md").write_text(text)
    return text


def stage_card(cfg, tdir: Path, work: Path, out: Path) -> dict:
    ev = cached_evaluation(work, lambda: evaluate(cfg, tdir, out), log=log)
    (out / "eval.json").write_text(json.dumps({"n_new": ev["n_new"], "device": ev["device"], "temperatures": {
        T: slim(e) for T, e in ev["temperatures"].items()}}, indent=2) + "\n")
    write_card(cfg, tdir, work, out, ev)
    for T, e in ev["temperatures"].items():
        log(f"card: T={T} " + ", ".join(f"{m} τ {t:.2f}" for m, t in e["overall_tau"].items()) +
            f"; lossless {e['lossless']}")
    return ev
