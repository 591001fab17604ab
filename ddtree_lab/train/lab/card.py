"""The lab pair's model card: engine evaluation of the exported pair and README.md."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..card import bars_table, cached_evaluation, read_summary, slim, tau_bars, tau_table
from ..evaluate import engine_tau, pooled
from . import LAB_PAIR_DIR
from .prompts import read_jsonl


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def evaluate_pair(out: Path, n_new: int, budgets, log=print, n_prompts: int | None = None) -> dict:
    """Load the exported pair (timed) and run the engine on every prompt of every shipped set."""
    import ddtree_lab as dl

    t0 = time.perf_counter()
    if out.resolve() == LAB_PAIR_DIR.resolve():
        pair = dl.load_pair("lab")
    else:
        pair = dl.load_pair(target=out / "target", drafter=out / "drafter")
    load_s = time.perf_counter() - t0
    log(f"card: pair loaded in {load_s:.2f}s")
    return {"load_seconds": load_s, **evaluate_sets(pair, out / "prompts", n_new, budgets, log, n_prompts)}


def evaluate_sets(pair, prompt_dir: Path, n_new: int, budgets, log=print, n_prompts: int | None = None,
                  temperature: float = 0.0, seed: int = 0) -> dict:
    """The engine on the first n_prompts (None: all) of every prompt set in prompt_dir, at `temperature`, pooled."""
    sets = {}
    for f in sorted(prompt_dir.glob("*.jsonl")):
        rows = read_jsonl(f)[:n_prompts] if n_prompts else read_jsonl(f)
        log(f"card: engine evaluation on {len(rows)} '{f.stem}' prompts, T = {temperature:g}")
        sets[f.stem] = engine_tau(pair, rows, n_new, budgets, log=log, temperature=temperature, seed=seed)
    return pooled(sets)


def _phases(dsum: dict) -> str:
    ph = dsum.get("phases")
    if not ph:
        return ""
    rows = ["", "| phase | steps | GPU seconds | batch | pool | peak LR | note |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {p['name']} | {p['steps']} | {p['train_seconds']:.0f} | {p['batch']} | {p['pool']} | {p['lr']:g} | {p['note']} |"
             for p in ph]
    return "\n".join(rows) + "\n"


def write_card(cfg, meta: dict, tsum: dict, dsum: dict, ev: dict, out: Path, command: str,
               notes: str = "") -> str:
    budgets = tuple(cfg.dflash.budgets)
    tgt = json.loads((out / "target" / "config.json").read_text())
    drf = json.loads((out / "drafter" / "config.json").read_text())
    n_t = tsum.get("params", 0)
    n_d = dsum.get("variants", {}).get(dsum.get("chosen", ""), {}).get("params", 0)
    samples = []
    for name, s in ev["sets"].items():
        for smp in s["samples"][:2]:
            samples.append(f"**{smp['id']}** (`{smp['source']}`)\n\nPrompt (end):\n\n```python\n"
                           + "\n".join(smp["prompt"].rstrip("\n").split("\n")[-8:])
                           + "\n```\n\nTarget greedy continuation (96 tokens):\n\n```python\n" + smp["output"] + "\n```\n")
    variants = "\n".join(
        f"| {n} | {v['config']} | " + " | ".join(f"{v['tau'].get(m, float('nan')):.2f}" for m in ["dflash"] + [f"ddtree{b}" for b in budgets]) + " |"
        for n, v in dsum.get("variants", {}).items())
    hist = tsum.get("history", [])
    ov = ev["overall_tau"]
    bars = tau_bars(ov, ev["lossless"], "DFlash and DDTree output == AR output") + [
        ("`load_pair(\"lab\")` < 3 s on the CPU", ev["load_seconds"] < 3.0, f"{ev['load_seconds']:.2f} s")]
    text = f"""# The ddtree_lab lab pair

A small **Qwen3-architecture target** and its **DFlash drafter** (block size {drf['block_size']}), trained
here on Python source code so that every study of the workbench runs offline, on a laptop CPU or a GPU.
Both are stored in the formats real checkpoints use (`target/`: Hugging Face `Qwen3ForCausalLM`;
`drafter/`: `DFlashDraftModel`), so the same loading code serves them and real pairs.

```python
import ddtree_lab as dl
pair = dl.load_pair("lab")
res = dl.generate(pair, "def fibonacci(n):\\n", method="ddtree", budget=64, max_new_tokens=96)
```

## Files

| path | what |
|---|---|
| `target/config.json`, `target/model.safetensors` | the target, {n_t / 1e6:.2f} M parameters, {tgt.get('torch_dtype')} |
| `target/tokenizer.json`, `target/tokenizer_config.json` | byte-level BPE, {meta['vocab_size']} tokens; `<|endoftext|>` = {meta['eos_token_id']} (EOS, also between files), `<|mask|>` = {meta['mask_token_id']} (the drafter's mask) |
| `drafter/config.json`, `drafter/model.safetensors` | the DFlash drafter, {n_d / 1e6:.2f} M parameters (plus the target's embedding and LM head, which it borrows) |
| `prompts/code.jsonl` | {len(read_jsonl(out / 'prompts' / 'code.jsonl'))} code-continuation prompts: a held-out file cut at a line inside a function body |
| `prompts/docstring.jsonl` | {len(read_jsonl(out / 'prompts' / 'docstring.jsonl'))} prompts: a function's signature and docstring; the body is to be written |

Total size: {_size_mib(out):.2f} MiB. Prompt rows are `{{"id", "prompt", "source"}}`, `source` = `file:line` of the cut.

## Corpus

- The standard library of {meta['implementation']} {meta['python_version']} (`{Path(meta['root']).name}`), test suite included;
  every `.py` file that is UTF-8 and parses, at most {meta['config']['max_file_bytes']:,} bytes, outside
  {', '.join('`' + d + '`' for d in meta['config']['exclude_dirs'])} (generated tables, docs text, third-party code).
- {meta['n_files']} files, in sorted path order; sha256 over `path sha256(content)` lines: `{meta['file_list_sha256']}`.
- Held out by file: sha256(path) mod 1000 < {meta['config']['heldout_per_mille']} → {meta['n_heldout_files']} files
  ({meta['heldout_tokens']:,} tokens) for evaluation and prompts; {meta['n_train_files']} files
  ({meta['train_tokens']:,} tokens, {meta['train_bytes'] / 2**20:.1f} MiB) for training the tokenizer and both models.
- Source code of the Python standard library is © Python Software Foundation, under the PSF License.

## Target

`Qwen3ForCausalLM`: hidden {tgt['hidden_size']}, {tgt['num_hidden_layers']} layers, {tgt['num_attention_heads']} query / {tgt['num_key_value_heads']} KV heads of {tgt['head_dim']},
MLP {tgt['intermediate_size']}, q/k RMSNorm, RoPE θ = {tgt['rope_theta']:g}, tied embeddings, context {tgt['max_position_embeddings']}.
Plain next-token loss on random {cfg.seq_len}-token windows of the training stream, batch {cfg.batch_size},
AdamW (β = 0.9/0.95, weight decay {cfg.weight_decay}), peak LR {cfg.lr:g}, warmup {cfg.warmup_steps} steps then cosine to {cfg.min_lr_ratio:g}×,
residual dropout {cfg.dropout}, bf16 autocast; the checkpoint with the lowest held-out loss is kept.

- {tsum.get('steps')} steps, {tsum.get('tokens_seen', 0) / 1e6:.0f} M tokens ({tsum.get('epochs', 0):.1f} epochs) in {tsum.get('seconds', 0):.0f} s.
- **Held-out loss {tsum.get('best_heldout_loss', float('nan')):.3f} nats/token** (perplexity {math.exp(tsum.get('best_heldout_loss', float('nan'))):.2f}) on {meta['n_heldout_files']} held-out files.

| step | train loss | held-out loss |
|---|---|---|
""" + "\n".join(f"| {h['step']} | {h['train_loss']:.3f} | {h['heldout_loss']:.3f} |" for h in hist[:: max(1, len(hist) // 8)] + hist[-1:]) + f"""

## Drafter

`DFlashDraftModel`: {drf['num_hidden_layers']} layer(s) of the target's width (MLP {drf['intermediate_size']}), context from target layers
`{drf['dflash_config']['target_layer_ids']}` (outputs of those decoder layers, 0-based), concatenated, projected by `fc`
and normalised by `hidden_norm`; mask token {drf['dflash_config']['mask_token_id']}.

Training, the DFlash way, with the target frozen (and its weights rounded to the shipped dtype first):
1. **Pool.** The target's greedy continuations of random training-file windows: acceptance is
   measured against the target's greedy output, so the drafter learns to predict exactly that.
2. **Blocks.** Per sequence {cfg.dflash.anchors} random anchors p in the greedy part; block = [x_p, MASK × {drf['block_size'] - 1}] at positions
   p … p+{drf['block_size'] - 1}; the block attends to itself (no causal mask) and to the projected target features of positions < p.
3. **Loss.** Cross-entropy of block slot k against the greedy token p+k, weighted exp(−(k−1)/{cfg.dflash.gamma:g}),
   optionally mixed with KL to the target's own distribution at those positions (`soft_weight`).
   AdamW, cosine schedule, bf16 autocast; {dsum.get('steps')} steps in {dsum.get('seconds', 0):.0f} s of GPU time in all.
""" + _phases(dsum) + f"""

Variants trained on the same batches (quick τ on {2 * cfg.dflash.eval_prompts} held-out prompts, simulated on the greedy sequence);
the one with the best DFlash τ ships (`{dsum.get('chosen')}`){(' — ' + dsum['variants_note']) if dsum.get('variants_note') else ''}:

| variant | settings | DFlash | """ + " | ".join(f"DDTree({b})" for b in budgets) + """ |
|---|---|---|""" + "---|" * len(budgets) + f"""
{variants}

## Acceptance (held-out prompts, T = 0, {cfg.dflash.n_new} new tokens, `ddtree_lab.generate` on the CPU, float32)

Mean τ = accepted tokens per target forward (root included), pooled over all rounds of all prompts.

{tau_table(ev, budgets)}

""" + bars_table("bar", bars) + """

## Samples (target, greedy)

""" + "\n".join(samples) + f"""

## Reproduce

```
{command}
```
""" + (f"\n{notes}\n" if notes else "") + """

`prepare` (CPU, this interpreter's standard library) writes the token arrays, tokenizer and prompt sets to
`--cache`; `target`, `pool` and `drafter` train on a GPU (bf16) with checkpoints in `--work` (a rerun resumes);
`export` writes this folder; `card` measures it and writes this file. `--preset tiny` runs every stage on
the CPU in seconds (the test suite does).
"""
    (out / "README.md").write_text(text)
    return text


def stage_card(cfg, cache: Path, work: Path, out: Path, log=print) -> dict:
    from .corpus import load_corpus
    _, _, meta = load_corpus(cache)
    tsum, dsum = read_summary(work, "target_summary"), read_summary(work, "drafter_summary")
    ev = cached_evaluation(work, lambda: evaluate_pair(out, cfg.dflash.n_new, cfg.dflash.budgets, log=log,
                                                       n_prompts=cfg.card_prompts or None), log=log)
    (out / "eval.json").write_text(json.dumps({"overall_tau": ev["overall_tau"], "load_seconds": ev["load_seconds"],
                                               **slim(ev)}, indent=2) + "\n")
    cmd_file, notes_file = work / "card_command.txt", work / "card_notes.md"
    command = cmd_file.read_text().strip() if cmd_file.exists() else (
        "ddtree-lab train-lab-pair --stages prepare   # CPU\n"
        "ddtree-lab train-lab-pair --stages target,pool,drafter --device cuda   # GPU\n"
        "ddtree-lab train-lab-pair --stages export,card   # CPU")
    notes = notes_file.read_text().strip() if notes_file.exists() else ""
    write_card(cfg, meta, tsum, dsum, ev, out, command, notes)
    log("card: " + ", ".join(f"{m} τ {t:.2f}" for m, t in ev["overall_tau"].items()) +
        f"; lossless {ev['lossless']}; README.md written")
    return ev
